"""A restart's vLLM takes the KV cache size its first start measured (launcher.node.kv_reuse), on a GPU it shares with
the trainer: recorded from the first start's own log lines once healthy, passed as --kv-cache-memory-bytes to a later
start of the same server command on a GPU of the same memory, and never otherwise. nvidia-smi is a script on PATH (the
process boundary); vLLM's lines are those of gpu/results/2026-12-07-ds3-lora-restart/17-q3b-restart."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from launcher.core import config as C
from launcher.core.jobdir import Env, JobDir
from launcher.core.plan import Plan, plan
from launcher.node import kv_reuse
from launcher.node.commands import vllm_command

FIRST = """\
===== 2026-12-06 23:32:47 node 0 vllm: /opt/torch/.venv/bin/python3 -m vllm.entrypoints.openai.api_server --model /tmp/model-q3b
(EngineCore pid=4765) INFO 12-06 23:34:01 [gpu_worker.py:759] Available KV cache memory: 21.41 GiB
(EngineCore pid=4766) INFO 12-06 23:34:01 [gpu_worker.py:759] Available KV cache memory: 21.38 GiB
"""
FIXED = """\
===== 2026-12-06 23:36:01 node 0 vllm: /opt/torch/.venv/bin/python3 -m vllm.entrypoints.openai.api_server --model /tmp/model-q3b
(EngineCore pid=5734) INFO 12-06 23:36:40 [gpu_worker.py:657] Initial free memory 40.00 GiB, reserved 21.36 GiB memory for KV Cache
"""


@pytest.fixture
def nvidia_smi(tmp_path, monkeypatch):
    """An nvidia-smi on PATH answering a GPU's total memory (MiB) from a file the test changes; it records its args."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    answer = tmp_path / "gpu_mib"
    answer.write_text("81559\n")
    (bin_dir / "nvidia-smi").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "smi_args"}\ncat {answer}\n')
    (bin_dir / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return answer


def gpu_plan(tmp_path: Path, **vllm: object) -> Plan:
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "model" / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
    cfg = C.from_dict(
        {
            "vllm": {"model": str(tmp_path / "model"), **vllm},
            "slurm": {"gpus_per_node": 1},
            "job": {"job_dir": str(tmp_path / "j")},
        }
    )
    return plan(cfg, str(tmp_path / "j"))


def started(p: Plan, log_text: str) -> None:
    log = JobDir(Path(p.job_dir)).log(0, "vllm")
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as f:
        f.write(log_text)


def test_a_restart_takes_the_size_the_first_start_measured_and_the_trainer_is_told(tmp_path, nvidia_smi):
    p = gpu_plan(tmp_path)
    assert p.nodes[0].shared_gpu, "a one-GPU node: vLLM and the trainer share it"
    first = vllm_command(p, 0)
    assert kv_reuse.server_start(p, 0, first) == (first, None), "nothing recorded: the first start measures"
    started(p, FIRST)
    size = kv_reuse.record(p, 0, first)
    assert size == int(21.38 * 2**30) - kv_reuse.SAFETY_BYTES, "the smallest worker's figure, less the rounding"
    assert json.loads(JobDir(Path(p.job_dir)).kv_cache_record(0).read_text())["gpu_mib"] == 81559

    again, got = kv_reuse.server_start(p, 0, vllm_command(p, 0))
    assert got == size and again.argv[-2:] == [kv_reuse.FLAG, str(size)] and again.argv[:-2] == first.argv
    assert "-i 0 --query-gpu=memory.total" in (tmp_path / "smi_args").read_text(), "the server's own GPU asked"
    # the restart (given the size) prints no measurement: the record stays the first start's
    started(p, FIXED)
    assert kv_reuse.record(p, 0, again) is None
    assert kv_reuse.server_start(p, 0, vllm_command(p, 0))[1] == size


def test_a_changed_server_or_another_gpu_measures_again(tmp_path, nvidia_smi, monkeypatch):
    p = gpu_plan(tmp_path)
    started(p, FIRST)
    assert kv_reuse.record(p, 0, vllm_command(p, 0))
    changed = gpu_plan(tmp_path, gpu_memory_utilization=0.5)
    assert kv_reuse.server_start(changed, 0, vllm_command(changed, 0))[1] is None, "another command line: measure"
    nvidia_smi.write_text("143771\n")  # requeued onto a node with an H200
    assert kv_reuse.server_start(p, 0, vllm_command(p, 0))[1] is None, "another GPU: measure"
    nvidia_smi.write_text("81559\n")
    assert kv_reuse.server_start(p, 0, vllm_command(p, 0))[1] is not None
    own = gpu_plan(tmp_path, extra_args=[kv_reuse.FLAG, "1000000000"])
    assert kv_reuse.server_start(own, 0, vllm_command(own, 0))[1] is None, "the user's own size: nothing added"
    JobDir(Path(p.job_dir)).kv_cache_record(0).write_text("[]")
    assert kv_reuse.server_start(p, 0, vllm_command(p, 0))[1] is None, "an unreadable record: measure"
    monkeypatch.setenv("PATH", "/nonexistent")  # no nvidia-smi: its GPU's memory unknown
    assert kv_reuse.server_start(p, 0, vllm_command(p, 0))[1] is None


def test_nothing_is_recorded_or_reused_where_the_server_has_its_own_gpus_or_runs_on_cpu(tmp_path, nvidia_smi):
    split = plan(
        C.from_dict(
            {
                "vllm": {"model": str(tmp_path)},
                "slurm": {"gpus_per_node": 4},
                "job": {"job_dir": str(tmp_path / "s")},
            }
        ),
        str(tmp_path / "s"),
    )
    cpu = plan(
        C.from_dict(
            {
                "job": {"device": "cpu", "job_dir": str(tmp_path / "c")},
                "vllm": {"model": str(tmp_path), "dtype": "float32"},
                "slurm": {"gpus_per_node": 3},
                "trainer": {"dtype": "float32"},
            }
        ),
        str(tmp_path / "c"),
    )
    for p in (split, cpu):
        started(p, FIRST)
        assert not kv_reuse.applies(p, 0)
        assert kv_reuse.record(p, 0, vllm_command(p, 0)) is None
        assert not JobDir(Path(p.job_dir)).kv_cache_record(0).exists()


def test_the_trainer_loads_its_checkpoint_at_once_only_when_the_server_was_given_its_size(tmp_path, monkeypatch):
    import torch

    from trainer.rollout.node import GenerationSettings

    p = gpu_plan(tmp_path)
    monkeypatch.delenv(Env.KV_CACHE_FIXED, raising=False)
    assert not GenerationSettings.from_plan(p, 0, torch.bfloat16).server_kv_fixed
    monkeypatch.setenv(Env.KV_CACHE_FIXED, "1")
    assert GenerationSettings.from_plan(p, 0, torch.bfloat16).server_kv_fixed
