"""The commands on an existing job folder (or its SLURM job id): status, logs, cancel, sync. SLURM and wandb are faked
at the process boundary (conftest's fake_slurm: commands on PATH that record their argv and answer as the real ones
do). Also scripts/as_fresh_machine.sh, which scripts/test.sh wraps the unit tier in: it must really hide SLURM."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from launcher import cli
from launcher.core import config as C
from launcher.core.jobdir import WANDB_ID_FILE, write_job_dir
from launcher.core.plan import plan
from launcher.status import q
from tests.conftest import REPO, FakeSlurm

cli_main = cli.main


def make_job(d: Path, nodes: int = 2, job_id: str | None = "77") -> Path:
    cfg = C.from_dict(
        {
            "job": {"device": "cpu", "job_dir": str(d), "name": "grpo"},
            "vllm": {"model": "/m"},
            "slurm": {"nodes": nodes, "gpus_per_node": 2},
            "trainer": {"dtype": "float32", "max_steps": 10},
        }
    )
    write_job_dir(cfg, plan(cfg, str(d)))
    if job_id:
        (d / "job_id").write_text(job_id + "\n")
    return d


def numbered(path: Path, n: int = 50) -> None:
    """A log of n numbered lines that name their file: a tail can be checked line by line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{path.name} line {i}\n" for i in range(1, n + 1)))


def sections(out: str) -> dict[str, list[str]]:
    """`slurm-grpo logs` output: file -> the lines printed under its `==> file <==` header."""
    got: dict[str, list[str]] = {}
    for ln in out.splitlines():
        if ln.startswith("==> ") and ln.endswith(" <=="):
            cur = got.setdefault(Path(ln[4:-4]).name, [])
        elif ln.strip():
            cur.append(ln.strip())
    return got


# --- status by job id -------------------------------------------------------------------------------------------------


def test_status_finds_a_job_by_its_numeric_id_under_runs(tmp_path, monkeypatch, fake_slurm: FakeSlurm, capsys):
    monkeypatch.chdir(tmp_path)
    make_job(tmp_path / "runs" / "other", job_id="76")
    job = make_job(tmp_path / "runs" / "grpo-20261204-101500")
    fake_slurm.set_sacct({"JobID": "77", "State": "RUNNING", "NodeList": "n[1-2]", "Elapsed": "00:01:00", "ExitCode": "0:0"})
    assert cli_main(["status", "77"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"job folder: {q(job.relative_to(tmp_path))}\nSLURM job 77:\n  77  RUNNING  n[1-2]  00:01:00  0:0\n")
    assert "node 0 (?): vLLM not healthy yet; last event: none" in out and "node 1 (?)" in out, out
    assert [c["argv"][:2] for c in fake_slurm.calls()] == [["-j", "77"]]

    assert cli_main(["status", "78"]) == 2  # no folder has it: one line naming where it looked
    err = capsys.readouterr().err.strip()
    assert err == (
        f"slurm-grpo status: error: no job folder under {q(tmp_path / 'runs')}/ has job id 78 "
        "(a resumed job has its newest id there); pass the job folder instead"
    )
    assert len(fake_slurm.calls()) == 1  # sacct was not asked about a job that is not ours


def test_status_finds_a_sweep_and_its_points_by_array_id(tmp_path, monkeypatch, fake_slurm: FakeSlurm, capsys):
    """`status 4242` of a sweep is the sweep's table; `status 4242_1` is point 1's own status (it crashed before)."""
    monkeypatch.chdir(tmp_path)
    model = tmp_path / "model"
    model.mkdir()
    assert cli_main(["sweep", str(REPO / "configs/smoke_cpu.yaml"), "--set", f"vllm.model={model}",
                     "--grid", "trainer.beta=0,0.04", "--skip-path-checks"]) == 0  # fmt: skip
    (sweep,) = (tmp_path / "runs").iterdir()
    assert sweep.name.startswith("smoke-cpu-sweep-") and capsys.readouterr().out.count("point-00") == 2
    fake_slurm.set_sacct(
        {"JobID": "4242_0", "State": "RUNNING", "NodeList": "n1"}, {"JobID": "4242_1", "State": "OUT_OF_MEMORY", "NodeList": "n2"}
    )
    assert cli_main(["status", "4242"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"sweep folder: {Path('runs') / sweep.name}\nSLURM job array 4242\n"), out
    assert "point-000  RUNNING" in out and "point-001  OUT_OF_MEMORY" in out, out
    assert cli_main(["status", "4242_1"]) == 0
    out = capsys.readouterr().out
    assert f"job folder: {q(Path('runs') / sweep.name / 'point-001')}\nSLURM job 4242_1:\n  4242_1  OUT_OF_MEMORY  n2" in out, out
    # no checkpoint yet: resume would refuse, so the hint is to submit again, with more memory
    assert "next: nothing to resume (a process on a node passed the job's host memory limit" in out, out
    assert [c["argv"][:2] for c in fake_slurm.calls("sacct")] == [["-j", "4242"], ["-j", "4242_1"]]


# --- logs ---------------------------------------------------------------------------------------------------------------


@pytest.fixture
def logged_job(tmp_path) -> Path:
    job = make_job(tmp_path / "job")
    for n in (0, 1):
        for kind in ("vllm", "trainer"):
            numbered(job / "logs" / f"node{n}-{kind}.log")
        numbered(job / "submitit" / "77" / f"77_{n}_log.out")  # SLURM's output of node n's task
    numbered(job / "submitit" / "70" / "70_0_log.out")  # an earlier submission of the folder (before a resume)
    return job


def test_logs_of_one_node_with_a_line_count(logged_job, capsys):
    assert cli_main(["logs", str(logged_job), "--node", "1", "--lines", "3"]) == 0
    got = sections(capsys.readouterr().out)
    assert list(got) == ["node1-trainer.log", "node1-vllm.log", "77_1_log.out"], got
    for name, lines in got.items():
        assert lines == [f"{name} line {i}" for i in (48, 49, 50)], (name, lines)


def test_logs_default_to_every_node_and_30_lines(logged_job, capsys):
    assert cli_main(["logs", str(logged_job)]) == 0
    got = sections(capsys.readouterr().out)
    assert sorted(got) == sorted(
        [
            "node0-trainer.log",
            "node0-vllm.log",
            "node1-trainer.log",
            "node1-vllm.log",
            "70_0_log.out",
            "77_0_log.out",
            "77_1_log.out",
        ]
    )
    assert all(lines == [f"{name} line {i}" for i in range(21, 51)] for name, lines in got.items()), got


def test_logs_of_a_node_the_job_does_not_have_is_a_one_line_error(logged_job, capsys):
    assert cli_main(["logs", str(logged_job), "--node", "2"]) == 2
    assert capsys.readouterr().err == "slurm-grpo logs: error: --node 2: the job has nodes 0 to 1\n"


def test_logs_before_any_log_exists(tmp_path, capsys):
    job = make_job(tmp_path / "job")
    assert cli_main(["logs", str(job)]) == 0
    assert capsys.readouterr().out == f"no logs yet in {q(job / 'logs')}\n"


def test_logs_of_a_sweep_point_include_its_array_tasks_output(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    (sweep / "sweep.json").parent.mkdir()
    (sweep / "sweep.json").write_text(json.dumps({"grid": {}, "points": []}))
    point = make_job(sweep / "point-001", nodes=1, job_id="4242_1")
    numbered(point / "logs" / "node0-vllm.log")
    for task in ("4242_0_0", "4242_1_0"):  # <array>_<point>_<node>, all in the sweep's submitit folder
        numbered(sweep / "submitit" / f"{task}_log.out")
    assert cli_main(["logs", str(point), "--lines", "1"]) == 0
    assert sections(capsys.readouterr().out) == {
        "node0-vllm.log": ["node0-vllm.log line 50"],
        "4242_1_0_log.out": ["4242_1_0_log.out line 50"],
    }
    assert cli_main(["logs", str(sweep)]) == 2  # the sweep itself has no logs: which point?
    assert f"pass one of its points, e.g. {q(sweep / 'point-000')}" in capsys.readouterr().err


# --- cancel -------------------------------------------------------------------------------------------------------------


def test_cancel_scancels_the_job_and_status_then_says_it_was_cancelled(tmp_path, fake_slurm: FakeSlurm, capsys):
    job = make_job(tmp_path / "it's mine")
    assert cli_main(["cancel", str(job)]) == 0
    assert capsys.readouterr().out.startswith("cancelled job 77; ")
    assert fake_slurm.calls() == [{"cmd": "scancel", "argv": ["77"]}]
    fake_slurm.set_sacct(
        {"JobID": "77", "State": "CANCELLED by 0", "NodeList": "n[1-2]", "Elapsed": "00:03:00", "ExitCode": "0:0"}
    )
    assert cli_main(["status", str(job)]) == 0
    out = capsys.readouterr().out
    assert "  77  CANCELLED by 0  n[1-2]" in out and "next: nothing to resume (it was cancelled (scancel);" in out, out


def test_cancel_names_scancels_refusal_in_one_line(tmp_path, fake_slurm: FakeSlurm, capsys):
    job = make_job(tmp_path / "job")
    fake_slurm.answer("scancel", stderr="scancel: error: Kill job error on job id 77: Invalid job id specified\n", rc=1)
    assert cli_main(["cancel", str(job)]) == 1
    assert capsys.readouterr().err == (
        "slurm-grpo cancel: scancel 77 failed: scancel: error: Kill job error on job id 77: Invalid job id specified\n"
    )


def test_cancel_of_a_local_run_submits_nothing(tmp_path, fake_slurm: FakeSlurm, capsys):
    job = make_job(tmp_path / "job", job_id=None)
    assert cli_main(["cancel", str(job)]) == 2
    assert "has no job_id (a local run); stop it with Ctrl-C" in capsys.readouterr().err
    assert fake_slurm.calls() == []


def test_cancel_of_a_sweep_cancels_its_whole_array(tmp_path, fake_slurm: FakeSlurm, capsys):
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "sweep.json").write_text(json.dumps({"grid": {}, "points": []}))
    (sweep / "job_id").write_text("4242\n")
    assert cli_main(["cancel", str(sweep)]) == 0
    assert fake_slurm.calls() == [{"cmd": "scancel", "argv": ["4242"]}]


# --- sync ---------------------------------------------------------------------------------------------------------------


def wandb_job(tmp_path: Path) -> tuple[Path, list[Path]]:
    job = make_job(tmp_path / "job")
    run_id = (job / WANDB_ID_FILE).read_text().strip()
    parts = [job / "wandb" / f"offline-run-20261204_10{m}000-{run_id}" for m in (15, 42)]  # one per attempt
    for p in parts:
        p.mkdir(parents=True)
    return job, parts


def test_sync_uploads_every_attempts_part_with_the_wandb_command(tmp_path, fake_slurm: FakeSlurm, capsys):
    fake_slurm.add("wandb")
    job, parts = wandb_job(tmp_path)
    assert cli_main(["sync", str(job)]) == 0
    run_id = (job / WANDB_ID_FILE).read_text().strip()
    assert f"syncing W&B run {run_id}: 2 part(s) (one per attempt) from {q(job / 'wandb')}" in capsys.readouterr().out
    assert fake_slurm.calls() == [{"cmd": "wandb", "argv": ["sync", *map(str, parts)]}]
    fake_slurm.answer("wandb", stderr="wandb: ERROR Network error\n", rc=3)
    assert cli_main(["sync", str(job)]) == 3  # wandb's failure is the command's


def test_sync_without_an_offline_run_or_without_wandb_says_what_to_do(tmp_path, fake_slurm: FakeSlurm, capsys, monkeypatch):
    fake_slurm.add("wandb")
    job = make_job(tmp_path / "job")
    assert cli_main(["sync", str(job)]) == 2
    assert "no offline W&B run under" in capsys.readouterr().err
    job, _ = wandb_job(tmp_path / "second")
    monkeypatch.setenv("PATH", "/nonexistent")  # no wandb command on this host
    assert cli_main(["sync", str(job)]) == 2
    assert "the wandb command is not installed here: pip install wandb" in capsys.readouterr().err
    assert fake_slurm.calls() == []


# --- the unit tier's fresh machine ------------------------------------------------------------------------------------

PROBE = """
import json, os, shutil, subprocess
out = {"which": shutil.which("srun"), "env": sorted(k for k in os.environ if k.startswith("SLURM")),
       "hf_home": os.listdir(os.environ["HF_HOME"]), "tmp": sorted(os.listdir("/tmp")), "shm": os.listdir("/dev/shm")}
for how, argv in (("by_name", ["srun"]), ("by_path", [os.environ["DUMMY"]])):
    try:
        out[how] = subprocess.run(argv, capture_output=True, text=True).stdout
    except OSError as e:
        out[how] = type(e).__name__
print(json.dumps(out))
"""


def dummy_srun(tmp_path: Path) -> tuple[Path, dict]:
    """An executable named srun on PATH, as a SLURM install puts one; the run's own SLURM variables."""
    (tmp_path / "bin").mkdir()
    srun = tmp_path / "bin" / "srun"
    srun.write_text("#!/bin/sh\necho REAL-SRUN-RAN\n")
    srun.chmod(0o755)
    outer = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}  # e.g. SLURM_GRPO_TINY of the caller
    env = {**outer, "PATH": f"{srun.parent}:{os.environ['PATH']}", "DUMMY": str(srun)}
    return srun, {**env, "SLURM_JOB_ID": "5", "SLURM_CONF": "/etc/slurm/slurm.conf", "SLURM_GRPO_KEEP": "1"}


def test_the_fresh_machine_wrapper_hides_a_slurm_command_found_on_path(tmp_path):
    srun, env = dummy_srun(tmp_path)
    assert subprocess.run(["srun"], capture_output=True, text=True, env=env).stdout == "REAL-SRUN-RAN\n"  # visible here
    r = subprocess.run(["bash", str(REPO / "scripts/as_fresh_machine.sh"), shutil.which("python3") or "python3", "-c", PROBE],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.splitlines()[-1])
    assert str(srun) in r.stdout + r.stderr  # named among what it hid
    assert got["which"] is None and got["by_name"] in ("FileNotFoundError", "PermissionError"), got
    assert got["env"] == ["SLURM_GRPO_KEEP"] and got["hf_home"] == [], got
    if "no mount namespace" not in r.stderr:  # as root: even its own path runs nothing; /tmp and /dev/shm are empty
        assert got["by_path"] == "PermissionError", got
        # kept: the current folder and the checkout itself, when they live under /tmp (mounted back at their paths)
        venv = [Path(os.environ["VIRTUAL_ENV"])] if os.environ.get("VIRTUAL_ENV") else []  # kept by the wrapper too
        kept = sorted({p.relative_to("/tmp").parts[0] for p in (tmp_path, REPO, *venv) if p.is_relative_to("/tmp")})
        assert sorted(got["tmp"]) == kept and got["shm"] == [], got
    assert subprocess.run(["srun"], capture_output=True, text=True, env=env).stdout == "REAL-SRUN-RAN\n"  # untouched outside


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="the mount namespace needs root and unshare")
def test_the_fresh_machine_wrapper_refuses_to_run_when_a_slurm_command_stays_visible(tmp_path):
    """Its last check, on its own: the inner half told to hide nothing while a srun is on PATH must not run the
    command (here, one that would create a file)."""
    srun, env = dummy_srun(tmp_path)
    fresh = tmp_path / "fresh"
    (fresh / "tmp").mkdir(parents=True)
    env = {**env, "_FRESH_INNER": "1", "_FRESH": str(fresh), "_FRESH_KEEP": str(tmp_path), "_FRESH_HIDE_PATHS": ""}
    script = str(REPO / "scripts/as_fresh_machine.sh")
    r = subprocess.run(["unshare", "-m", "--propagation", "private", "bash", script, "touch", str(tmp_path / "ran")],
                       capture_output=True, text=True, env=env, timeout=60)  # fmt: skip
    (msg,) = [ln for ln in r.stderr.splitlines() if "SLURM is still reachable after hiding it:" in ln]
    assert r.returncode == 1 and f" {srun} " in msg.split("hiding it:")[1].split(";")[0] + " ", r.stderr
    assert not (tmp_path / "ran").exists()


def test_logs_line_count_below_one_is_refused(logged_job, capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["logs", str(logged_job), "--lines", "0"])
    assert e.value.code == 2
    assert "--lines: 0 is below 1; give how many lines to print, e.g. --lines 50" in capsys.readouterr().err


def test_sync_of_a_sweep_folder_names_a_point_to_sync(tmp_path, fake_slurm: FakeSlurm, capsys):
    fake_slurm.add("wandb")
    sweep = tmp_path / "sweep"
    make_job(sweep / "point-000")
    (sweep / "sweep.json").write_text(json.dumps({"grid": {}, "points": []}))
    assert cli_main(["sync", str(sweep)]) == 2
    assert f"is a sweep folder: sync one of its points, e.g. slurm-grpo sync {q(sweep / 'point-000')}" in capsys.readouterr().err
    assert fake_slurm.calls() == []


@pytest.mark.parametrize("still_queued", [False, True])
def test_a_requeued_job_cancelled_before_it_restarted_can_be_resumed(tmp_path, fake_slurm: FakeSlurm, capsys, still_queued):
    """Accounting keeps only the requeued instance of a job cancelled while it waited to start again (a node lost:
    the survivor requeued it without that node): the controller, not sacct, says whether it is still to run."""
    job = make_job(tmp_path / "job")
    (job / "checkpoints" / "step-2").mkdir(parents=True)
    (job / "checkpoints" / "step-2" / "meta.json").write_text("{}")
    fake_slurm.set_sacct({"JobID": "77", "State": "REQUEUED", "NodeList": "n[1-2]", "Elapsed": "00:03:00", "ExitCode": "0:0"})
    fake_slurm.answer("squeue", stdout="PENDING\n" if still_queued else "CANCELLED\n")
    assert cli_main(["status", str(job)]) == 0
    out = capsys.readouterr().out
    assert ("next: slurm-grpo resume" in out) != still_queued, out
    assert ["squeue", "-h", "-t", "all", "-j", "77", "-o", "%T"] in [[c["cmd"], *c["argv"]] for c in fake_slurm.calls()]
