"""Shared fixtures. Tiers by marker: default (unit, no servers), integration (real vLLM CPU servers,
real torch.distributed), cluster (the real SLURM cluster of scripts/start_cluster.sh)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable


@pytest.fixture
def weird_tmp_path(tmp_path: Path) -> Path:
    """A folder whose path has spaces and quotes: job folders must still work (shlex quoting)."""
    p = tmp_path / "job dir with 'quotes' and \"double\" $(echo no)"
    p.mkdir()
    return p


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """The tiny Qwen2 built once per session with the project's own command."""
    d = tmp_path_factory.mktemp("tiny") / "model"
    subprocess.run([PY, "-m", "launcher", "make-tiny-model", str(d)], check=True, cwd=REPO, capture_output=True)
    return str(d)


@pytest.fixture(scope="session")
def vllm_cache(tmp_path_factory) -> str:
    """One vllm.cache_dir for the session's servers (vLLM's torch.compile, Inductor's and Triton's caches; a folder per
    node): a server of a model and vLLM config an earlier run of the session compiled skips most of that compile
    (about 20 s of a 75-100 s start on 2 cores), as `vllm.cache_dir` promises users; a CPU server runs eagerly unless
    its config asks for the compile (launcher.core.vllm_start.CPU_EAGER), so there the folder shares vLLM's model-class
    inspection cache. A test that checks the job folder's own cache/, or runs two servers at once (they would write one
    node's folder together), leaves it out. Under xdist each worker is its own session with its own folder."""
    return str(tmp_path_factory.mktemp("vllm-cache"))


def cpu_trainer(model_dir: str, **trainer):
    """The trainer section a test's real TRL GRPOTrainer on CPU runs with: float32, no activation checkpointing, the
    given fields (per_device_train_batch_size, num_generations, max_completion_length, grpo, ...)."""
    from launcher.core import config

    fields = {"dtype": "float32", "activation_checkpointing": False, **trainer}
    return config.from_dict({"job": {"device": "cpu"}, "vllm": {"model": model_dir}, "trainer": fields}).trainer


def cli(*args: str, env: dict | None = None, timeout: float = 120, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PY, "-m", "launcher", *args], capture_output=True, text=True, timeout=timeout, cwd=cwd, env={**os.environ, **(env or {})}
    )


def read(path: Path) -> list[dict]:
    """A JSON-lines file (metrics, events) as rows; none yet if it does not exist."""
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


SLURM_COMMANDS = ("sbatch", "srun", "scontrol", "squeue", "sacct", "scancel", "sinfo", "salloc")
"""The SLURM commands the fake answers: what submitit 1.5.4 looks for or runs (srun by shutil.which, sbatch, sacct,
scancel, scontrol) and what launcher/ runs (sacct, scancel)."""

FAKE_COMMAND = r"""# A fake SLURM (or other) command for the unit tier, run as `python fake.py NAME ARGS...` by a script NAME on PATH:
# records its argv as one JSON line in calls.jsonl and answers as the real command does, from the files the test
# wrote next to this file.
import json, os, sys

STATE = os.path.dirname(os.path.abspath(__file__))
name, args = sys.argv[1], sys.argv[2:]
call = {"cmd": name, "argv": args}
if name == "sbatch" and args and os.path.isfile(args[-1]):
    call["script"] = open(args[-1]).read()  # submitit moves the file after sbatch returns: keep what sbatch got
with open(os.path.join(STATE, "calls.jsonl"), "a") as f:
    f.write(json.dumps(call) + "\n")
# a test's canned answer (a refusal, an error): for the command with its first words ("scontrol show job"), else for it
answer = next(
    (p for k in range(min(len(args), 2), -1, -1) if os.path.exists(p := os.path.join(STATE, " ".join([name, *args[:k]]) + ".answer.json"))),
    "",
)
if answer:
    a = json.load(open(answer))
    sys.stdout.write(a["stdout"])
    sys.stderr.write(a["stderr"])
    sys.exit(a["rc"])
if name == "sbatch":
    counter = os.path.join(STATE, "next_job_id")
    jid = int(open(counter).read()) if os.path.exists(counter) else 4242
    open(counter, "w").write(str(jid + 1))
    print(f"Submitted batch job {jid}")
elif name == "sacct":
    jobs, fields, parsable, header, i = [], ["JobID", "JobName", "Partition", "Account", "AllocCPUS", "State", "ExitCode"], False, True, 0
    while i < len(args):
        a, val = args[i], (args[i + 1] if i + 1 < len(args) else "")
        if a in ("-j", "--jobs", "-o", "--format"):
            i += 1
        elif a.startswith(("--jobs=", "--format=")):
            a, val = a.split("=", 1)
        if a in ("-j", "--jobs"):
            jobs += val.split(",")
        elif a in ("-o", "--format"):
            fields = [f.split("%")[0] for f in val.split(",")]
        elif a in ("-P", "--parsable2"):
            parsable = True
        elif a in ("-n", "--noheader"):
            header = False
        i += 1
    if not parsable:
        sys.exit("fake sacct: only -P/--parsable2 output is faked (what submitit and launcher/status.py ask for)")
    rows = json.load(open(os.path.join(STATE, "sacct.json"))) if os.path.exists(os.path.join(STATE, "sacct.json")) else []
    if jobs:  # a job id selects its steps (77.batch, 77.0) and, for an array, its tasks (4242_1)
        rows = [r for r in rows if any(r["JobID"] == j or r["JobID"].startswith((j + ".", j + "_")) for j in jobs)]
    if header:
        print("|".join(fields))
    for r in rows:
        print("|".join(str(r.get(f, "")) for f in fields))
"""


@dataclass
class FakeSlurm:
    """Fake SLURM commands on PATH (and any other command a test adds, e.g. wandb): each call is recorded."""

    bin: Path
    state: Path

    @property
    def calls_file(self) -> Path:
        return self.state / "calls.jsonl"

    def calls(self, cmd: str | None = None) -> list[dict]:
        """Every call so far, in order: {"cmd", "argv"} (and "script", the file sbatch was given)."""
        return [c for c in read(self.calls_file) if cmd is None or c["cmd"] == cmd]

    def add(self, cmd: str) -> None:
        """Put a recording fake `cmd` on PATH (rc 0, no output, unless answer() says otherwise)."""
        if not (self.state / "fake.py").is_file():
            (self.state / "fake.py").write_text(FAKE_COMMAND)
        f = self.bin / cmd
        f.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -I {shlex.quote(str(self.state / "fake.py"))} {cmd} "$@"\n')
        f.chmod(0o755)

    def answer(self, cmd: str, stdout: str = "", stderr: str = "", rc: int = 0) -> None:
        """From now on `cmd` prints this and exits with rc (instead of its default answer). cmd may hold the command's
        first words ("scontrol show job"): those calls get this answer, the command's other calls their own."""
        (self.state / f"{cmd}.answer.json").write_text(json.dumps({"stdout": stdout, "stderr": stderr, "rc": rc}))

    def set_sacct(self, *rows: dict[str, str]) -> None:
        """The accounting rows sacct knows (JobID, State, NodeList, Elapsed, ExitCode, ...); it prints the ones asked
        for with -j, in the columns asked for with -o, as `sacct -P` does."""
        (self.state / "sacct.json").write_text(json.dumps(list(rows)))


@pytest.fixture
def fake_slurm(tmp_path: Path, monkeypatch) -> FakeSlurm:
    """SLURM faked at the process boundary, for this test and every process it starts: fake commands first on PATH
    (the unit tier needs no SLURM on the machine, and scripts/test.sh hides a real one), no SLURM_* variables of a
    surrounding allocation."""
    fake = FakeSlurm(tmp_path / "fake-slurm-bin", tmp_path / "fake-slurm")
    fake.bin.mkdir()
    fake.state.mkdir()
    for cmd in SLURM_COMMANDS:
        fake.add(cmd)
    monkeypatch.setenv("PATH", f"{fake.bin}{os.pathsep}{os.environ['PATH']}")
    for k in list(os.environ):
        if k.startswith(("SLURM_", "SBATCH_", "SALLOC_", "SRUN_", "SQUEUE_", "SACCT_")) and not k.startswith("SLURM_GRPO_"):
            monkeypatch.delenv(k)
    return fake


FAULT_TIMES: list[Path] = []
"""Where report() appends: $SLURM_GRPO_FAULT_TIMES, else a file in this pytest session's temporary folder
(set by the session fixture below; a fixed /tmp file may belong to another user and grows across runs)."""


@pytest.fixture(scope="session", autouse=True)
def _fault_times_file(tmp_path_factory) -> None:
    FAULT_TIMES[:] = [Path(os.environ.get("SLURM_GRPO_FAULT_TIMES") or tmp_path_factory.getbasetemp() / "fault-times.jsonl")]


def report(what: str, seconds: float, outcome: int | str) -> None:
    """Injection-to-stop times of the fault tests, collected for the closing note (tests assert bounds,
    not speeds): printed, and appended to FAULT_TIMES[0] (named again in pytest's summary)."""
    line = json.dumps({"fault": what, "seconds": round(seconds, 1), "outcome": outcome})
    print(f"{line}  (appended to {FAULT_TIMES[0]})")
    with open(FAULT_TIMES[0], "a") as f:
        f.write(line + "\n")


def pytest_terminal_summary(terminalreporter) -> None:
    if FAULT_TIMES and FAULT_TIMES[0].is_file():
        terminalreporter.write_line(f"fault injection-to-stop times: {FAULT_TIMES[0]}")


def assert_tracked(job: Path, attempts: int, steps: int, evals: list[int] | None = None) -> None:
    """One W&B run (the id the launcher wrote into the job folder) with a part per attempt, each holding TRL's and the
    project's figures; TensorBoard events, read back with TensorBoard's own reader, for every step (and evals: the
    steps trainer.eval evaluated, under eval/)."""
    run_id = (job / "wandb_run_id").read_text().strip()
    parts = sorted((job / "wandb").glob("offline-run-*"))
    assert len(parts) == attempts and all(p.name.endswith("-" + run_id) for p in parts), (run_id, parts)
    for p in parts:
        log = (p / f"run-{run_id}.wandb").read_bytes()
        assert b"train/reward" in log and b"slurm_grpo/push_s/node0" in log and b"slurm_grpo/parity/node0" in log
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(job / "tensorboard"))
    tb.Reload()
    assert [e.step for e in tb.Scalars("train/reward")] == list(range(1, steps + 1))
    parity = tb.Scalars("train/slurm_grpo/parity/node0")
    assert len(parity) == steps and max(e.value for e in parity) <= 1e-4
    if evals is not None:
        assert all(b"eval/pass@1" in (p / f"run-{run_id}.wandb").read_bytes() for p in parts)
        assert [e.step for e in tb.Scalars("eval/pass@1")] == evals
        assert [e.step for e in tb.Scalars("eval/mean@k")] == evals
