"""make-tiny-model's MoE flags (--experts, --top-k, --moe-intermediate): the body they build has those experts in the
family's own config fields, the launcher's parameter count (what dry-run's memory estimate and gpu/report.py use)
matches the built model's, and the GPU body queued for issue 35 (gpu/RESULTS.md) fits the push buffer and the budget."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from launcher.core.shape import ModelShape
from trainer.tiny_families import MOE, moe_fields

GPU_MOE = dict(hidden=2048, layers=24, head_dim=128, kv_heads=4, experts=64, experts_per_token=8, expert_intermediate=256)
"""The Qwen3-MoE body of gpu/RESULTS.md's "Issue 35's calls, queued" (its make-tiny-model flags)."""


def gpu_moe_shape() -> ModelShape:
    g = GPU_MOE
    h, hd = g["hidden"], g["head_dim"]
    return ModelShape(
        hidden=h,
        layers=g["layers"],
        intermediate=2 * h,
        vocab=544,  # the tokenizer make-tiny-model trains (--vocab 4096 asks for more than its corpus holds)
        heads=h // hd,
        kv_heads=g["kv_heads"],
        head_dim=hd,
        tied=True,
        experts=g["experts"],
        experts_per_token=g["experts_per_token"],
        expert_intermediate=g["expert_intermediate"],
        moe_layers=g["layers"],
    )


def test_the_moe_flags_build_those_experts_and_the_launcher_counts_the_built_model(tmp_path):
    from safetensors import safe_open
    from transformers import AutoConfig

    from trainer.tiny_model import main

    assert main([str(tmp_path), "--family", "qwen3_moe", "--experts", "6", "--top-k", "3", "--moe-intermediate", "64"]) == 0
    cfg = AutoConfig.from_pretrained(tmp_path)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (6, 3, 64)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:  # per-expert on disk, as the hub's checkpoints
        names = list(f.keys())
        built = sum(math.prod(f.get_slice(n).get_shape()) for n in names)
    assert sum(".mlp.experts." in n and n.endswith(".gate_proj.weight") for n in names) == 2 * 6
    shape = ModelShape.read(str(tmp_path))
    assert shape is not None and (shape.experts, shape.experts_per_token, shape.expert_intermediate) == (6, 3, 64)
    # the estimate's attention term counts q/k/v biases where Qwen3 has q/k norms: within 0.1 % of the real count
    assert shape.params == pytest.approx(built, rel=1e-3)
    per_expert = 3 * 128 * 64
    assert shape.params - shape.active_params == 2 * (6 - 3) * per_expert  # two MoE layers, 3 experts idle per token


def test_the_moe_flags_use_each_familys_field_names_and_refuse_what_cannot_be_built():
    assert moe_fields("qwen3_moe") == {}  # no flag: the tiny defaults stand
    assert moe_fields("mixtral", experts=8, expert_intermediate=96) == {
        "num_local_experts": 8,
        "num_experts_per_tok": MOE["mixtral"]["num_experts_per_tok"],
        "intermediate_size": 96,  # mixtral's experts are intermediate_size wide
    }
    assert moe_fields("olmoe", experts_per_token=1) == {"num_experts": 3, "num_experts_per_tok": 1}
    deepseek = moe_fields("deepseek_v3", experts=64, experts_per_token=6, expert_intermediate=96)
    assert deepseek == {"n_routed_experts": 64, "num_experts_per_tok": 6, "moe_intermediate_size": 96}
    assert moe_fields("ernie4_5_moe", experts_per_token=1) == {"moe_num_experts": 3, "moe_k": 1}
    with pytest.raises(ValueError, match="need an MoE family"):
        moe_fields("qwen2", experts=8)
    with pytest.raises(ValueError, match=r"--top-k \(9\) must be between 1 and --experts \(8\)"):
        moe_fields("qwen3_moe", experts=8, experts_per_token=9)


def test_the_queued_gpu_moe_body_is_a_few_billion_fits_the_ipc_buffer_and_an_h100_beside_vllm_at_a_quarter():
    from launcher.core import config as C
    from launcher.memory import Layout, Options, estimate
    from tests.conftest import REPO

    s = gpu_moe_shape()
    assert 2.5e9 < s.params < 3e9 and 0.5e9 < s.active_params < 0.7e9
    t = C.load(REPO / "configs/gpu_1gpu.yaml").trainer
    fused = s.experts * 2 * s.expert_intermediate * s.hidden * 2  # one layer's gate_up_proj in bf16, the push's largest
    assert s.largest_tensor * 2 == fused < t.ipc_buffer_mb * 2**20

    def fits(vllm_fraction: float) -> bool | None:
        lay = Layout(
            nodes=1,
            ranks_per_node=1,
            tensor_parallel_size=1,
            shard_ranks=1,
            shared_gpu=True,
            gpu_gb=80.0,  # an H100
            vllm_fraction=vllm_fraction,
            compute_bytes=2,
            completions_per_rank=t.per_device_train_batch_size,
            completion_tokens=t.max_completion_length,
            push_buffer_bytes=t.ipc_buffer_mb * 2**20,
        )
        return estimate(s, lay, Options(activation_checkpointing=t.activation_checkpointing)).fits

    # the config's vLLM share (0.35) leaves the one FSDP2 rank too little: the queued call gives vLLM 0.25, no offload
    assert (fits(0.35), fits(0.25)) == (False, True)


def test_the_replay_bench_hands_its_overrides_to_both_runs_and_stops_a_late_run_with_sigterm(tmp_path, monkeypatch, capsys):
    """bench/routing_replay_gpu.py: --set reaches both runs (the queued call turns the final checkpoint off), both run
    on vLLM's Model Runner V2; a run past --timeout-s gets SIGTERM (the bootstrap then stops vLLM and the trainer), not
    the SIGKILL that would orphan them, and the steps it wrote are kept."""
    import subprocess
    import sys

    from bench import routing_replay_gpu

    seen: list[list[str]] = []
    envs: list[dict] = []
    real_popen = subprocess.Popen

    def fake_popen(cmd, **kw):  # the process boundary: a stand-in for `slurm-grpo local` that ignores nothing
        seen.append(cmd)
        envs.append(kw["env"])
        job = Path(cmd[cmd.index("--set") + 1].split("=", 1)[1])
        assert not job.exists()  # an earlier attempt's folder is gone: the run starts afresh, not resumed
        (job / "logs").mkdir(parents=True)
        (job / "metrics.jsonl").write_text('{"kind": "step", "step": 1, "logp_mismatch_mean": 0.1}\n')
        script = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(143)); time.sleep(30)"
        return real_popen([sys.executable, "-c", script], **kw)

    monkeypatch.setattr(routing_replay_gpu.subprocess, "Popen", fake_popen)
    (tmp_path / "job" / "logs").mkdir(parents=True)  # an earlier attempt's
    extra = ["trainer.final_checkpoint=false"]
    rows = routing_replay_gpu.run_job(tmp_path / "m", tmp_path / "job", 5, False, 1, "configs/gpu_1gpu.yaml", extra)
    assert envs[0]["VLLM_USE_V2_MODEL_RUNNER"] == "1"  # the arm without replay on the replay's model runner too
    assert seen[0][-6:] == ["--set", "trainer.max_steps=5", "--set", "trainer.routing_replay=false", "--set", extra[0]]
    assert [r["step"] for r in rows] == [1]
    assert "exit 143 after" in capsys.readouterr().out  # its SIGTERM handler ran (a SIGKILL reads -9)


def test_the_replay_bench_run_one_arm_per_call_and_the_second_call_tables_both(tmp_path, monkeypatch):
    """--run off, then --run on on the same machine (one run per device call): the second call reads the first's rows
    from its job folder and writes the side-by-side table of both arms."""
    import json
    import subprocess
    import sys

    import torch

    from bench import routing_replay_gpu

    real_popen = subprocess.Popen
    started: list[bool] = []

    def fake_popen(cmd, **kw):  # the process boundary: `slurm-grpo local` writes its rows and ends (tar runs)
        if cmd[1:3] != ["-m", "launcher"]:
            return real_popen(cmd, **kw)
        sets = dict(cmd[i + 1].split("=", 1) for i, a in enumerate(cmd) if a == "--set")
        replay = sets["trainer.routing_replay"] == "true"
        started.append(replay)
        # the bootstrap's heartbeat folders sit among the logs (the first GPU call read one as a log: 2026-12-06)
        (Path(sets["job.job_dir"]) / "logs" / "heartbeat-local.1.2").mkdir(parents=True)
        rows = [{"kind": "step", "step": s, "logp_mismatch_mean": (0.01 if replay else 0.03) * s} for s in (1, 2)]
        (Path(sets["job.job_dir"]) / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return real_popen([sys.executable, "-c", "pass"], **kw)

    monkeypatch.setattr(routing_replay_gpu.subprocess, "Popen", fake_popen)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    (tmp_path / "model-replay-qwen3_moe").mkdir()
    (tmp_path / "model-replay-qwen3_moe" / "config.json").write_text("{}")  # built by an earlier call: not rebuilt
    args = ["--out", str(tmp_path / "out"), "--work", str(tmp_path), "--steps", "2"]
    assert routing_replay_gpu.main([*args, "--run", "off"]) == 0
    first = json.loads((tmp_path / "out" / "routing_replay.json").read_text())
    assert first["mean"] == {"false": pytest.approx(0.045), "true": None}
    assert routing_replay_gpu.main([*args, "--run", "on"]) == 0
    both = json.loads((tmp_path / "out" / "routing_replay.json").read_text())
    assert started == [False, True]  # each arm ran once, in its own call
    assert both["mean"] == {"false": pytest.approx(0.045), "true": pytest.approx(0.015)}


def test_a_refused_build_writes_nothing_and_a_rebuild_leaves_no_shard_of_the_last_one(tmp_path):
    """An unknown family or a head count kv_heads does not divide is refused before the folder exists; building into a
    folder that holds an earlier sharded build removes its shards and index (else the index beside the new
    model.safetensors would be loaded, and the model check finds its shards missing)."""
    from trainer.tiny_model import make_tiny_model

    for bad in ({"family": "llama3"}, {"kv_heads": 3}):
        with pytest.raises(ValueError):
            make_tiny_model(tmp_path / "refused", **bad)
        assert not (tmp_path / "refused").exists(), bad
    make_tiny_model(tmp_path / "m", max_shard_size="300KB")
    assert len(list((tmp_path / "m").glob("*.safetensors"))) > 1
    make_tiny_model(tmp_path / "m")
    assert sorted(f.name for f in (tmp_path / "m").glob("*.safetensors*")) == ["model.safetensors"]
    # a folder of weights it did not write (a real model, by mistake) is refused and left as it was
    real = tmp_path / "real"
    real.mkdir()
    (real / "model-00001-of-00002.safetensors").write_bytes(b"weights")
    with pytest.raises(ValueError, match="did not write"):
        make_tiny_model(real)
    assert (real / "model-00001-of-00002.safetensors").read_bytes() == b"weights"


@pytest.mark.parametrize(
    "family", ["deepseek_v3", "deepseek_v2", "glm4_moe_lite", "deepseek_v32", "glm_moe_dsa", "hy_v4", "axk1"]
)
def test_an_mla_body_of_gpu_width_has_widths_vllms_gpu_mla_prefill_serves(family):
    """At --head-dim 128 an MLA family takes its released model's MLA widths (the CPU matrix's 64/64/64 found no GPU
    prefill kernel: gpu/results/2026-12-06-moe/5-deepseek-v3-failed); transformers builds it and the launcher counts it."""
    import importlib.util
    import re

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.tiny_families import config_fields

    # the widths vLLM's FlashAttention MLA prefill takes, read from the installed source (its module imports CUDA-only
    # kernels: the CPU build cannot import it)
    vllm_dir = Path(importlib.util.find_spec("vllm").origin).parent  # type: ignore[union-attr, arg-type]
    source = (vllm_dir / "v1/attention/backends/mla/prefill/flash_attn.py").read_text()
    served = {
        tuple(map(int, m)) for m in re.findall(r"qk_nope_head_dim=(\d+),\s*qk_rope_head_dim=(\d+),\s*v_head_dim=(\d+)", source)
    }
    assert (128, 64, 128) in served, served

    def fields(head_dim: int) -> dict:
        return config_fields(
            family, vocab=300, hidden=2048, layers=2, heads=2048 // head_dim, kv_heads=1, head_dim=head_dim,
            intermediate=256, tie=True, token_id=0, dtype="bfloat16",
        )  # fmt: skip

    gpu = fields(128)
    dims = (gpu["qk_nope_head_dim"], gpu["qk_rope_head_dim"], gpu["v_head_dim"])
    assert dims in served and (64, 64, 64) not in served, (dims, served)
    assert gpu["kv_lora_rank"] == 512 and gpu["num_attention_heads"] == 16 and gpu["head_dim"] == gpu["qk_rope_head_dim"]
    cpu = fields(64)  # the CPU matrix's body keeps its small widths
    assert (cpu["qk_nope_head_dim"], cpu["v_head_dim"], cpu["kv_lora_rank"]) == (64, 64, 32)
    cfg = AutoConfig.for_model(family, **gpu)
    with torch.device("meta"):
        built = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
    shape = ModelShape.from_config(json.loads(cfg.to_json_string()))
    assert isinstance(shape, ModelShape)
    if not shape.approximate:  # HY-V4: its estimate says what it leaves out
        assert shape.params == pytest.approx(built, rel=5e-4)


def test_the_replay_bench_builds_its_body_in_a_child_process_with_its_sizes(tmp_path, monkeypatch):
    """bench/routing_replay_gpu.py builds its model with `make-tiny-model` in a child process (a CUDA context left in
    the bench's own process made the launcher refuse the GPU as in use: 2026-12-06), the bench's sizes reaching it."""
    import json

    from bench import routing_replay_gpu

    monkeypatch.setattr(
        routing_replay_gpu,
        "SHAPE",
        {**routing_replay_gpu.SHAPE, "hidden": 128, "layers": 2, "vocab": 300, "head_dim": 64, "intermediate": 64},
    )
    monkeypatch.setattr(routing_replay_gpu, "EXPERTS", {"experts": 4, "experts_per_token": 2, "expert_intermediate": 32})
    routing_replay_gpu.build_model(tmp_path / "m", "qwen3_moe", device="cpu")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    shape = ModelShape.read(str(tmp_path / "m"))  # the launcher's reading, whatever fields transformers wrote
    assert shape is not None and (shape.experts, shape.experts_per_token, shape.expert_intermediate) == (4, 2, 32)
    assert (shape.hidden, shape.layers, shape.head_dim, cfg["dtype"]) == (128, 2, 64, "bfloat16")
