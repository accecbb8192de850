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


QWEN25_3B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 2048,
    "num_hidden_layers": 36,
    "intermediate_size": 11008,
    "vocab_size": 151936,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "tie_word_embeddings": True,
}
"""Qwen2.5-3B's config.json fields that decide its KV cache: 36 layers x 2 KV heads x head_dim 128."""


def gpu_plan(tmp_path: Path, config: dict | None = None, trainer: dict | None = None, **vllm: object) -> Plan:
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "model" / "config.json").write_text(json.dumps(config or {"architectures": ["Qwen2ForCausalLM"]}))
    cfg = C.from_dict(
        {
            "vllm": {"model": str(tmp_path / "model"), **vllm},
            "slurm": {"gpus_per_node": 1},
            "job": {"job_dir": str(tmp_path / "j")},
            "trainer": trainer or {},
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
    start = kv_reuse.server_start(p, 0, first)
    assert (start.server, start.bytes) == (first, None), "nothing recorded: the first start measures"
    assert start.why.startswith("measured by vLLM's profile (not the work's: vllm.max_model_len 0"), start.why
    started(p, FIRST)
    size = kv_reuse.record(p, 0, first)
    assert size == int(21.38 * 2**30) - kv_reuse.SAFETY_BYTES, "the smallest worker's figure, less the rounding"
    assert json.loads(JobDir(Path(p.job_dir)).kv_cache_record(0).read_text())["gpu_mib"] == 81559

    restart = kv_reuse.server_start(p, 0, vllm_command(p, 0))
    again, got = restart.server, restart.bytes
    assert restart.why.startswith("as an earlier start measured")
    assert got == size and again.argv[-2:] == [kv_reuse.FLAG, str(size)] and again.argv[:-2] == first.argv
    assert "-i 0 --query-gpu=memory.total" in (tmp_path / "smi_args").read_text(), "the server's own GPU asked"
    # the restart (given the size) prints no measurement: the record stays the first start's
    started(p, FIXED)
    assert kv_reuse.record(p, 0, again) is None
    assert kv_reuse.server_start(p, 0, vllm_command(p, 0)).bytes == size


def test_a_changed_server_or_another_gpu_measures_again(tmp_path, nvidia_smi, monkeypatch):
    p = gpu_plan(tmp_path)
    started(p, FIRST)
    assert kv_reuse.record(p, 0, vllm_command(p, 0))
    changed = gpu_plan(tmp_path, gpu_memory_utilization=0.5)
    assert kv_reuse.server_start(changed, 0, vllm_command(changed, 0)).bytes is None, "another command line: measure"
    nvidia_smi.write_text("143771\n")  # requeued onto a node with an H200
    assert kv_reuse.server_start(p, 0, vllm_command(p, 0)).bytes is None, "another GPU: measure"
    nvidia_smi.write_text("81559\n")
    assert kv_reuse.server_start(p, 0, vllm_command(p, 0)).bytes is not None
    own = gpu_plan(tmp_path, extra_args=[kv_reuse.FLAG, "1000000000"])
    assert kv_reuse.server_start(own, 0, vllm_command(own, 0)).bytes is None, "the user's own size: nothing added"
    JobDir(Path(p.job_dir)).kv_cache_record(0).write_text("[]")
    assert kv_reuse.server_start(p, 0, vllm_command(p, 0)).bytes is None, "an unreadable record: measure"
    monkeypatch.setenv("PATH", "/nonexistent")  # no nvidia-smi: its GPU's memory unknown
    assert kv_reuse.server_start(p, 0, vllm_command(p, 0)).bytes is None


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


def test_a_first_start_takes_a_kv_cache_sized_to_the_work_and_skips_vllms_profile(tmp_path, nvidia_smi):
    """vllm.kv_cache work (the default): every sequence in flight at max_model_len, in whole blocks, plus the spare
    ones, at 2 x layers x KV heads x head_dim x 2 bytes a token; the trainer is told (it loads meanwhile), dry-run says
    how it was counted, and a restart computes the same size (nothing recorded: vLLM measured nothing)."""
    from launcher.core import vllm_start

    trainer = {"per_device_train_batch_size": 32, "max_completion_length": 256, "max_staleness": 1}
    p = gpu_plan(tmp_path, QWEN25_3B, trainer, max_model_len=500, dtype="bfloat16")
    start = kv_reuse.server_start(p, 0, vllm_command(p, 0))
    per_token = 2 * 36 * 2 * 128 * 2
    expected = (32 * 2 + vllm_start.KV_SPARE_SEQUENCES) * 512 * per_token  # 500 tokens in whole blocks of 128: 512
    assert start.bytes == expected and start.server.argv[-2:] == [kv_reuse.FLAG, str(expected)], start
    assert start.why.startswith("sized to the work: (64 sequences in flight + 2 spare) x 512 tokens x 36864 bytes")
    assert "x (max_staleness + 1) = 1 x 32 x 1 x 2 = 64" in start.why, start.why
    lines = vllm_start.derivation_lines(p, 1)
    assert any(line.startswith(f"vLLM KV cache {expected / 2**30:.2f} GiB per worker, no memory profiling") for line in lines)

    started(p, FIXED)  # vLLM given a size prints no measurement
    assert kv_reuse.record(p, 0, start.server) is None
    assert kv_reuse.server_start(p, 0, vllm_command(p, 0)).bytes == expected, "a restart: the same work, the same size"


def test_the_work_sizing_falls_back_to_vllms_profile_where_it_cannot_count_or_would_not_fit(tmp_path, nvidia_smi):
    from launcher.core import vllm_start

    def why(p: Plan) -> str:
        start = kv_reuse.server_start(p, 0, vllm_command(p, 0))
        assert start.bytes is None and kv_reuse.FLAG not in start.server.argv, start
        return start.why

    assert "vllm.kv_cache measure" in why(gpu_plan(tmp_path, QWEN25_3B, max_model_len=512, kv_cache="measure"))
    assert "vllm.max_model_len 0" in why(gpu_plan(tmp_path, QWEN25_3B))
    assert "decide the KV cache" in why(gpu_plan(tmp_path, QWEN25_3B, max_model_len=512, extra_args=["--kv-cache-dtype", "fp8"]))
    mla = {**QWEN25_3B, "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "kv_lora_rank": 512}
    mla |= {"q_lora_rank": 1536, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128}
    mla |= {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "tie_word_embeddings": False}
    assert "layers other than one kind of Llama-style attention" in why(gpu_plan(tmp_path, mla, max_model_len=512))
    # sliding-window layers beside full ones: vLLM pads its KV cache groups, a sequence costs more than counted
    gemma3 = {**QWEN25_3B, "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "head_dim": 256}
    assert "sliding-window beside full" in why(gpu_plan(tmp_path, gemma3, max_model_len=512))
    listed = {**QWEN25_3B, "layer_types": ["sliding_attention", "full_attention"] * 18}
    assert "sliding-window beside full" in why(gpu_plan(tmp_path, listed, max_model_len=512))
    one_kind = {**QWEN25_3B, "layer_types": ["full_attention"] * 36, "sliding_window": 4096}  # as Qwen2's config.json
    one = gpu_plan(tmp_path, one_kind, max_model_len=512)
    assert kv_reuse.server_start(one, 0, vllm_command(one, 0)).bytes, "sliding_window alone is not a mix"
    # 4096 sequences of 8192 tokens (4.9 TB) cannot fit an H100's 0.35: vLLM measures, as it would have
    big = gpu_plan(tmp_path, QWEN25_3B, {"per_device_train_batch_size": 4096}, max_model_len=8192)
    assert "more than the" in why(big) and "its share leaves" in why(big)
    line = [x for x in vllm_start.derivation_lines(gpu_plan(tmp_path, QWEN25_3B), 1) if "KV cache" in x]
    assert line == [
        "vLLM KV cache measured by vLLM's profile: vllm.max_model_len 0: vLLM derives the sequence length from the model"
    ]
    nvidia_smi.write_text("")  # nvidia-smi answers nothing: the share is unknown
    assert "the GPU's memory is unknown" in why(gpu_plan(tmp_path, QWEN25_3B, max_model_len=512))


def test_an_evaluation_beside_the_batches_generated_ahead_is_counted_on_top(tmp_path, nvidia_smi, monkeypatch):
    """trainer.eval with run-ahead: an evaluation's push pauses the batch generated ahead and resumes it beside the
    evaluation, so the KV cache holds both; CUDA graphs stay sized to the larger of the two (in_flight)."""
    from launcher.core import vllm_start

    monkeypatch.chdir(Path(__file__).resolve().parents[2])  # the shipped eval file, relative to the repository
    trainer = {
        "per_device_train_batch_size": 16,
        "max_completion_length": 128,
        "max_staleness": 2,
        "eval": {"dataset": "data/letters.jsonl", "every_steps": 5, "max_prompts": 20, "samples_per_prompt": 4},
    }
    p = gpu_plan(tmp_path, QWEN25_3B, trainer, max_model_len=256)
    n, why = vllm_start.kv_sequences(p, 1)
    assert n == 16 * 3 + 20 * 4 and "= 1 x 16 x 1 x 3 = 48 training + max_prompts x samples_per_prompt = 20 x 4 eval" in why
    assert vllm_start.in_flight(p, 1)[0] == 80, "the graphs: the larger of the two"
    start = kv_reuse.server_start(p, 0, vllm_command(p, 0))
    assert start.bytes == (128 + vllm_start.KV_SPARE_SEQUENCES) * 256 * 2 * 36 * 2 * 128 * 2


def test_dry_run_and_the_node_agree_where_no_size_is_given(tmp_path, nvidia_smi):
    """ROCm (vLLM's ROCm build not run with a given size here): the node passes none, and dry-run says nothing of one."""
    from launcher.core import vllm_start

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(QWEN25_3B))
    cfg = C.from_dict(
        {
            "vllm": {"model": str(tmp_path / "model"), "max_model_len": 512},
            "slurm": {"gpus_per_node": 1},
            "job": {"job_dir": str(tmp_path / "r"), "platform": "rocm"},
        }
    )
    p = plan(cfg, str(tmp_path / "r"))
    assert vllm_start.work_kv_bytes(p, 1)[0], "the work itself is countable"
    assert kv_reuse.server_start(p, 0, vllm_command(p, 0)).bytes is None
    assert not [line for line in vllm_start.derivation_lines(p, 1) if "KV cache" in line]
