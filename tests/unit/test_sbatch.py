"""Golden sbatch files (submitit renders them; we compare line by line), the header as sbatch reads it holds every
directive the config asks for, shell-special values stay quoted, control characters never reach the text, and the
launcher imports neither torch nor vLLM."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.core import config as C
from launcher.core.plan import plan
from launcher.dryrun import render_dry_run
from launcher.submit import sbatch_text
from tests.conftest import REPO, cli

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
JOB_DIR = "/shared/runs/job dir with 'quotes'"
RERECORD = "UPDATE_GOLDEN=1 pytest tests/unit/test_sbatch.py"
WEIRD = [
    "slurm.account=acme; rm -rf /",
    "slurm.constraint=$(whoami)",
    "slurm.setup_vars={venv: \"/opt/my env/'v'\"}",
    "slurm.extra_sbatch={comment: 'a \"b\" `c`'}",
]
CASES = {
    "smoke_cpu": ("configs/smoke_cpu.yaml", []),
    "gpu_4x8_hpc": ("configs/gpu_7b_4nodes.yaml", []),
    "gpu_1node": ("configs/gpu_1node.yaml", []),
    "pyxis": (
        "configs/gpu_7b_4nodes.yaml",
        [
            "slurm.container={image: 'nvcr.io#nvidia/pytorch:25.01-py3', mounts: ['/shared:/shared', '/scratch/hf:/hf:ro'], "
            "workdir: /shared/slurm-grpo}"
        ],
    ),
    "apptainer": (
        "configs/gpu_7b_4nodes.yaml",
        [
            "slurm.setup_profile=apptainer",
            "slurm.setup_vars={apptainer_module: apptainer/1.3, nccl_ifname: ib0}",
            "slurm.container={runtime: apptainer, image: /shared/images/grpo.sif, mounts: ['/shared:/shared']}",
        ],
    ),
    "weird_values": ("configs/gpu_1node.yaml", WEIRD),
    # qos and account in a header, no --requeue, and a pyxis container given with dotted --set keys
    "qos_no_requeue": (
        "configs/gpu_1node.yaml",
        [
            "slurm.account=acme",
            "slurm.qos=high",
            "slurm.requeue=false",
            "slurm.extra_sbatch.reservation=big",
            "slurm.container.image=/shared/images/grpo.sqsh",
            "slurm.container.workdir=/shared/slurm-grpo",
        ],
    ),
    # AMD: the Frontier site profile (ROCm platform, RCCL plugin and Slingshot variables, MIOpen caches, Apptainer
    # --rocm with the image staged to NVMe by sbcast) on 4 nodes and on the 256 nodes of the seed
    "frontier_4nodes": ("configs/frontier_7b_4nodes.yaml", []),
    "frontier_256nodes": ("configs/frontier_256nodes.yaml", []),
    # a packed venv staged to node-local /tmp and first on PATH (slurm.stage_env), no container
    "stage_venv": ("configs/gpu_7b_4nodes.yaml", ["slurm.stage_env=/shared/envs/slurm-grpo.tar.gz"]),
}


def load(name: str) -> C.JobConfig:
    path, sets = CASES[name]
    return C.load(REPO / path, sets + [f"job.job_dir={JOB_DIR}", "job.python=python"])


def render(name: str) -> str:
    cfg = load(name)
    return sbatch_text(cfg, plan(cfg, JOB_DIR))


def sbatch_words(rest: str) -> list[str]:
    """One #SBATCH line's words as sbatch splits them (get_argument in SLURM's src/sbatch/opt.c): whitespace
    separates; '...' or "..." groups up to the same quote (or the line's end); a backslash takes the next character
    as is, even in quotes; an unquoted # starts a comment; an empty word ends the line."""
    words: list[str] = []
    i, n = 0, len(rest)
    while True:
        while i < n and rest[i].isspace():
            i += 1
        word: list[str] = []
        quote, escape, comment = "", False, False
        while i < n and (quote or not rest[i].isspace()):
            c = rest[i]
            i += 1
            if escape:
                escape = False
                word.append(c)
            elif c == "\\":
                escape = True
            elif quote:
                if c == quote:
                    quote = ""
                else:
                    word.append(c)
            elif c in "'\"":
                quote = c
            elif c == "#":
                comment = True
                break
            else:
                word.append(c)
        if not word:
            return words
        words.append("".join(word))
        if comment:
            return words


def sbatch_header(text: str) -> dict[str, str | None]:
    """The directives sbatch reads (_opt_batch_script in src/sbatch/opt.c): lines that start with #SBATCH, up to the
    first line with anything but blanks before a # (sbatch stops reading directives there, silently); the shebang
    and other comments are skipped. --flag=value -> {--flag: value}, --flag -> {--flag: None}."""
    lines = text.split("\n")
    assert lines[0].startswith("#!"), "sbatch refuses a script without a shebang"
    out: dict[str, str | None] = {}
    for line in lines:
        if not line.startswith("#SBATCH"):
            if line.strip() and not line.strip().startswith("#"):
                break
            continue
        for word in sbatch_words(line[len("#SBATCH") :]):
            flag, eq, value = word.partition("=")
            assert flag not in out, f"{flag} given twice"
            out[flag] = value if eq else None
    return out


def expected_directives(cfg: C.JobConfig) -> dict[str, str | None]:
    """What the config asks sbatch for."""
    s = cfg.slurm
    want: dict[str, str | None] = {
        "--job-name": cfg.job.name,
        "--nodes": str(s.nodes),
        "--ntasks-per-node": "1",
        "--gpus-per-node": str(s.gpus_per_node),
        "--time": s.time,
        "--signal": f"USR2@{s.signal_seconds}",
    }
    for key in ("partition", "account", "qos", "constraint", "mem"):
        if getattr(s, key):
            want[f"--{key}"] = getattr(s, key)
    if s.cpus_per_task:
        want["--cpus-per-task"] = str(s.cpus_per_task)
    if s.exclusive:
        want["--exclusive"] = None
    if s.requeue:
        want["--requeue"] = None
    want.update({f"--{k}": v for k, v in s.extra_sbatch.items()})
    return want


def check_golden(name: str, got: list[str], folder: Path = GOLDEN) -> None:
    """got must equal the golden file line by line. A missing golden fails; UPDATE_GOLDEN=1 (re)records it."""
    f = folder / f"{name}.sbatch"
    if os.environ.get("UPDATE_GOLDEN") == "1":
        f.write_text("\n".join(got) + "\n")
        pytest.skip(f"recorded {f}")
    if not f.exists():
        pytest.fail(f"golden file {f} is missing; if the case {name!r} is new, record it with {RERECORD} and commit it")
    want = f.read_text().splitlines()
    diffs = [
        f"line {i + 1}: {a!r} -> {b!r}"
        for i, (a, b) in enumerate(itertools.zip_longest(want, got, fillvalue="(no line)"))
        if a != b
    ]
    assert not diffs, (
        f"sbatch text of {name!r} changed from {f}:\n" + "\n".join(diffs) + f"\nif intended, re-record with {RERECORD}"
    )


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_sbatch(name):
    check_golden(name, render(name).splitlines())


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_header_sbatch_reads_holds_every_directive_the_config_asks_for(name):
    cfg, text = load(name), render(name)
    header = sbatch_header(text)
    for flag, value in expected_directives(cfg).items():
        assert flag in header, f"{flag} is not in the header sbatch reads:\n{text}"
        assert header[flag] == value, (flag, header[flag], value)
    assert header["--output"].startswith(f"{JOB_DIR}/submitit/")  # type: ignore[union-attr]
    if not cfg.slurm.requeue:
        assert "--requeue" not in header and "--no-requeue" in header
    # no directive after the header's end, where sbatch would ignore it
    assert sum(ln.startswith("#SBATCH") for ln in text.splitlines()) == len(header)


def test_the_header_check_sees_a_newline_end_the_header():
    """Negative control of the check above: a config that skips validation (as before issue 23) with a newline in
    slurm.account renders a script whose header ends at the injected line, dropping every later directive."""
    cfg = load("gpu_1node")
    bad = dataclasses.replace(cfg, slurm=dataclasses.replace(cfg.slurm, account="acme\necho INJECTED-RAN\n#"))
    text = sbatch_text(bad, plan(bad, JOB_DIR))
    header = sbatch_header(text)
    assert "echo INJECTED-RAN" in text.splitlines()
    assert header == {"--account": "acme"}  # the unclosed quote runs to the line's end; sbatch stops at the echo
    missing = [f for f in expected_directives(cfg) if f not in header]
    assert {"--nodes", "--gpus-per-node", "--time", "--signal", "--requeue"} <= set(missing), missing


@pytest.mark.parametrize(
    "newline_set,key",
    [
        ('slurm.account="acme\\necho INJECTED-RAN\\n#"', "slurm.account"),
        ('slurm.partition="gpu\\necho INJECTED-RAN"', "slurm.partition"),
        ('slurm.qos="high\\necho INJECTED-RAN"', "slurm.qos"),
        ('slurm.constraint="h100\\necho INJECTED-RAN"', "slurm.constraint"),
        ('slurm.mem="200G\\necho INJECTED-RAN"', "slurm.mem"),
        ('slurm.extra_sbatch.comment="a\\necho INJECTED-RAN"', "slurm.extra_sbatch.comment"),
        ('slurm.setup_vars.venv="/v\\necho INJECTED-RAN"', "slurm.setup_vars.venv"),
        ('slurm.container.image="x.sqsh\\r"', "slurm.container.image"),
        ('job.job_dir="/shared/runs/a\\nb"', "job.job_dir"),
    ],
)
def test_weird_values_with_a_newline_are_refused(newline_set, key):
    """The weird_values case plus a newline (or CR): refused naming the key, so no sbatch text is made of it."""
    path, sets = CASES["weird_values"]
    with pytest.raises(C.ConfigError, match=rf"^{key}: contains a (newline|carriage return)"):
        C.load(REPO / path, sets + [newline_set])


def test_a_job_folder_made_from_a_directory_with_a_newline_is_refused():
    # job.job_dir empty: the folder comes from the current directory, which the config check never saw
    cfg = load("gpu_1node")
    with pytest.raises(C.ConfigError, match=r"job folder '/tmp/a\\nb/runs/x' contains a newline .*; set job.job_dir"):
        sbatch_text(cfg, plan(cfg, "/tmp/a\nb/runs/x"))


def test_a_missing_golden_fails_with_the_command_that_records_it(tmp_path, monkeypatch):
    monkeypatch.delenv("UPDATE_GOLDEN", raising=False)
    with pytest.raises(pytest.fail.Exception, match=r"golden file .*new.sbatch is missing; .*UPDATE_GOLDEN=1 pytest"):
        check_golden("new", ["a"], tmp_path)
    assert not (tmp_path / "new.sbatch").exists()
    (tmp_path / "new.sbatch").write_text("a\nb\n")
    with pytest.raises(AssertionError) as e:
        check_golden("new", ["a", "c", "d"], tmp_path)
    assert "line 2: 'b' -> 'c'" in str(e.value) and "line 3: '(no line)' -> 'd'" in str(e.value)
    assert RERECORD in str(e.value)
    monkeypatch.setenv("UPDATE_GOLDEN", "1")
    with pytest.raises(pytest.skip.Exception):
        check_golden("new", ["a", "c"], tmp_path)
    assert (tmp_path / "new.sbatch").read_text() == "a\nc\n"


def test_sbatch_shape():
    text = render("gpu_4x8_hpc")
    assert "#SBATCH --nodes=4" in text and "#SBATCH --ntasks-per-node=1" in text and "#SBATCH --gpus-per-node=8" in text
    assert "#SBATCH --signal=USR2@" in text and "#SBATCH --requeue" in text
    # the example loads no cuda/nccl module: torch 2.13's own CUDA 13 and NCCL 2.29 must not be shadowed
    assert "module purge" in text and "module load" not in text and "NCCL_SOCKET_IFNAME" in text
    # the payload is a readable command, not submitit's pickled function
    last = [ln for ln in text.splitlines() if ln.startswith("srun ")][0]
    assert "-m launcher.node.bootstrap" in last and "submitit.core._submit" not in text
    # the node's task gets every CPU of the job on its node: unbound, and no --cpus-per-task (on srun it means --exact)
    assert "#SBATCH --cpus-per-task=64" in text and "--cpu-bind=none" in shlex.split(last), last
    assert not any(w.startswith(("--cpus-per-task", "-c", "--exact")) for w in shlex.split(last)), last


def test_shell_special_values_never_reach_a_shell_unquoted():
    text = render("weird_values")
    for line in text.splitlines():
        if line.startswith("#SBATCH"):
            continue
        # every line the shell runs must parse, and the dangerous values must arrive as single words
        shlex.split(line, comments=True)
    assert "--account='acme; rm -rf /'" in text
    assert "--constraint='$(whoami)'" in text
    assert "source '/opt/my env/'\"'\"'v'\"'\"''/bin/activate" in text
    srun = [ln for ln in text.splitlines() if ln.startswith("srun ")][0]
    words = shlex.split(srun)
    assert f"{JOB_DIR}/plan.json" in words  # the job folder with spaces and quotes is one argument
    # bash -n: the whole script is valid shell
    r = subprocess.run(["bash", "-n"], input=text, text=True, capture_output=True)
    assert r.returncode == 0, r.stderr


def test_launcher_imports_neither_torch_nor_vllm():
    code = (
        "import sys, launcher.cli, launcher.submit, launcher.node.bootstrap, launcher.status, launcher.core.jobdir, launcher.simulate;"
        "bad = [m for m in ('torch', 'vllm', 'trl', 'transformers') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, f"launcher imported {r.stdout.strip()}"


MODEL_SHAPE = {  # Qwen2-0.5B's decoder shape: the memory estimate and the TP check read only config.json
    "hidden_size": 896,
    "num_hidden_layers": 24,
    "intermediate_size": 4864,
    "vocab_size": 151936,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
}


@pytest.mark.parametrize("path", sorted(str(p.relative_to(REPO)) for p in (REPO / "configs").glob("*.yaml")))
def test_every_example_config_dry_runs(path, tmp_path):
    # vllm.model pointed at a folder made here: the output must not depend on a model some earlier run left in /tmp
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(MODEL_SHAPE))
    # the folder holds only config.json, and the examples' data and venvs are on their clusters: checks skipped
    r = cli("dry-run", path, "--set", f"vllm.model={model}", "--skip-checks", "all", env={"HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr
    assert "  model    skipped" in r.stdout and "  venv     skipped" in r.stdout
    assert "# sbatch text" in r.stdout and "#SBATCH --nodes=" in r.stdout
    assert "vllm.entrypoints.openai.api_server" in r.stdout and "torch.distributed.run" in r.stdout
    assert f"--model {model}" in r.stdout
    assert "no estimate" not in r.stdout  # the memory estimate was made from the config.json above


def test_the_dry_runs_commands_hide_a_token_given_in_extra_args():
    cfg = C.load(REPO / "configs/gpu_1node.yaml", ["vllm.extra_args=[--hf-token, hf_SECRET, --api-key=k3y]", "job.job_dir=/j"])
    out = render_dry_run(cfg, plan(cfg, "/j"))
    commands = out.split("# per-node commands")[1]
    assert "--hf-token '***' '--api-key=***'" in commands
    # nowhere in the output: not in the resolved config, the table or the sbatch text either
    assert "hf_SECRET" not in out and "k3y" not in out


def test_dry_run_256_nodes_prints_the_pattern():
    cfg = C.load(REPO / "configs/gpu_7b_4nodes.yaml", ["slurm.nodes=256"])
    out = render_dry_run(cfg, plan(cfg, "/j"))
    assert "world size = ranks per node x nodes = 7 x 256 = 1792" in out
    assert "node 255 trainer" in out and "--node-rank 255" in out


def test_a_container_config_survives_the_plan_round_trip_and_the_nodes_find_the_first_host_without_scontrol(monkeypatch):
    from launcher.core.plan import Plan

    path, sets = CASES["pyxis"]
    cfg = C.load(REPO / path, sets + [f"job.job_dir={JOB_DIR}"])
    p = plan(cfg, JOB_DIR)
    back = Plan.from_dict(json.loads(p.to_json()))
    assert back == p and back.config.slurm.container.image == "nvcr.io#nvidia/pytorch:25.01-py3"
    from launcher.node.bootstrap import rendezvous_host

    monkeypatch.setenv("SLURM_GRPO_FIRST_NODE", "gpu-017")  # what the batch script exported on the host
    assert rendezvous_host(back) == "gpu-017"
