"""Golden sbatch files (submitit renders them; we compare line by line), shell-special values stay
quoted, and the launcher imports neither torch nor vLLM."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from launcher import config as C
from launcher.cli import render_dry_run
from launcher.submit import sbatch_text
from launcher.topology import plan

from .conftest import REPO, cli

GOLDEN = Path(__file__).parent / "golden"
JOB_DIR = "/shared/runs/job dir with 'quotes'"
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
    "weird_values": (
        "configs/gpu_1node.yaml",
        [
            "slurm.account=acme; rm -rf /",
            "slurm.constraint=$(whoami)",
            "slurm.setup_vars={venv: \"/opt/my env/'v'\"}",
            "slurm.extra_sbatch={comment: 'a \"b\" `c`'}",
        ],
    ),
}


def render(name: str) -> str:
    path, sets = CASES[name]
    cfg = C.load(REPO / path, sets + [f"job.job_dir={JOB_DIR}", "job.python=python"])
    return sbatch_text(cfg, plan(cfg, JOB_DIR))


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_sbatch(name):
    got = render(name).splitlines()
    f = GOLDEN / f"{name}.sbatch"
    if os.environ.get("UPDATE_GOLDEN") == "1" or not f.exists():
        f.write_text("\n".join(got) + "\n")
        pytest.skip(f"recorded {f}")
    want = f.read_text().splitlines()
    diffs = [f"line {i + 1}: {a!r} -> {b!r}" for i, (a, b) in enumerate(zip(want, got)) if a != b]
    if len(want) != len(got):
        diffs.append(f"{len(want)} lines -> {len(got)} lines")
    assert not diffs, "sbatch text changed:\n" + "\n".join(diffs) + "\nre-record with UPDATE_GOLDEN=1 pytest tests/test_sbatch.py"


def test_sbatch_shape():
    text = render("gpu_4x8_hpc")
    assert "#SBATCH --nodes=4" in text and "#SBATCH --ntasks-per-node=1" in text and "#SBATCH --gpus-per-node=8" in text
    assert "#SBATCH --signal=USR2@" in text and "#SBATCH --requeue" in text
    # the example loads no cuda/nccl module: torch 2.13's own CUDA 13 and NCCL 2.29 must not be shadowed
    assert "module purge" in text and "module load" not in text and "NCCL_SOCKET_IFNAME" in text
    # the payload is a readable command, not submitit's pickled function
    last = [ln for ln in text.splitlines() if ln.startswith("srun ")][0]
    assert "-m launcher.bootstrap" in last and "submitit.core._submit" not in text


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
        "import sys, launcher.cli, launcher.submit, launcher.bootstrap, launcher.jobs, launcher.jobdir, launcher.simulate;"
        "bad = [m for m in ('torch', 'vllm', 'trl', 'transformers') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, f"launcher imported {r.stdout.strip()}"


@pytest.mark.parametrize("path", sorted(str(p.relative_to(REPO)) for p in (REPO / "configs").glob("*.yaml")))
def test_every_example_config_dry_runs(path):
    r = cli("dry-run", path)
    assert r.returncode == 0, r.stderr
    assert "# sbatch text" in r.stdout and "#SBATCH --nodes=" in r.stdout
    assert "vllm.entrypoints.openai.api_server" in r.stdout and "torch.distributed.run" in r.stdout


def test_dry_run_256_nodes_prints_the_pattern():
    cfg = C.load(REPO / "configs/gpu_7b_4nodes.yaml", ["slurm.nodes=256"])
    out = render_dry_run(cfg, plan(cfg, "/j"))
    assert "world size = ranks per node x nodes = 7 x 256 = 1792" in out
    assert "node 255 trainer" in out and "--node-rank 255" in out


def test_a_container_config_survives_the_plan_round_trip_and_the_nodes_find_the_first_host_without_scontrol():
    import json

    from launcher.topology import Plan

    path, sets = CASES["pyxis"]
    cfg = C.load(REPO / path, sets + [f"job.job_dir={JOB_DIR}"])
    p = plan(cfg, JOB_DIR)
    back = Plan.from_dict(json.loads(p.to_json()))
    assert back == p and back.config.slurm.container.image == "nvcr.io#nvidia/pytorch:25.01-py3"
    from launcher.bootstrap import rendezvous_host

    os.environ["SLURM_GRPO_FIRST_NODE"] = "gpu-017"  # what the batch script exported on the host
    try:
        assert rendezvous_host(back) == "gpu-017"
    finally:
        del os.environ["SLURM_GRPO_FIRST_NODE"]
