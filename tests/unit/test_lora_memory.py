"""The LoRA memory estimate (launcher/memory.py): its adapter count against peft's own model, the frozen base's state,
and what dry-run and simulate print for a LoRA config."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from launcher.cli import main as cli_main
from launcher.core.config import LORA_TARGETS
from launcher.core.shape import ModelShape
from launcher.memory import Layout, Options, adapter_layer_params, common_shape, estimate

REPO = Path(__file__).resolve().parents[2]


def _lay(**kw) -> Layout:
    base = dict(
        nodes=1,
        ranks_per_node=1,
        tensor_parallel_size=1,
        shard_ranks=1,
        shared_gpu=True,
        gpu_gb=141.0,
        vllm_fraction=0.3,
        compute_bytes=2,
        completions_per_rank=16,
        completion_tokens=1024,
    )
    return Layout(**{**base, **kw})  # type: ignore[arg-type]


def test_the_adapter_count_is_what_peft_builds(tmp_path):
    out = tmp_path / "m"
    subprocess.run([sys.executable, "-m", "trainer.tiny_model", str(out), "--layers", "3"], check=True, capture_output=True)
    code = (
        "import torch, sys; from transformers import AutoConfig, AutoModelForCausalLM; from peft import LoraConfig, get_peft_model\n"
        "with torch.device('meta'): m = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(sys.argv[1]))\n"
        "m = get_peft_model(m, LoraConfig(r=8, target_modules=sys.argv[2].split(',')))\n"
        "print(sum(p.numel() for n, p in m.named_parameters() if 'lora_' in n))"
    )
    targets = ("q_proj", "v_proj", "down_proj")
    got = subprocess.run([sys.executable, "-c", code, str(out), ",".join(targets)], check=True, capture_output=True, text=True)
    shape = ModelShape.read(str(out))
    assert shape is not None
    assert int(got.stdout.split()[-1]) == 3 * adapter_layer_params(shape, 8, targets)


def test_lora_keeps_the_base_in_bf16_without_gradients_or_adamw():
    shape = common_shape("Qwen2.5-7B")
    full = estimate(shape, _lay(), Options(activation_checkpointing=True))
    lora = estimate(shape, _lay(), Options(activation_checkpointing=True, lora_r=16, lora_targets=LORA_TARGETS))
    assert abs(lora.adapter_params_m - 40.370176) < 1e-6  # peft's count for Qwen2.5-7B, r=16 on all 7 projections
    assert abs(lora.state_gb - (2 * shape.params + 16 * 40.370176e6) / 1e9) < 1e-6
    assert full.state_gb > 7 * lora.state_gb and lora.activations_gb > full.activations_gb
    assert lora.load_gpu_gb < full.load_gpu_gb and lora.fits and not full.fits


def test_dry_run_and_simulate_print_the_lora_estimate(tmp_path, capsys):
    model = tmp_path / "qwen7b"
    model.mkdir()
    cfg = {"hidden_size": 3584, "num_hidden_layers": 28, "intermediate_size": 18944, "vocab_size": 152064}
    cfg |= {"num_attention_heads": 28, "num_key_value_heads": 4, "architectures": ["Qwen2ForCausalLM"]}
    (model / "config.json").write_text(json.dumps(cfg))
    argv = [str(REPO / "configs" / "gpu_1gpu.yaml"), "--set", f"vllm.model={model}", "--set", "trainer.lora.r=16"]
    assert cli_main(["dry-run", *argv, "--skip-checks", "all"]) == 0
    out = capsys.readouterr().out
    section = out.split("# memory estimate")[1].split("# sbatch")[0]
    assert "frozen base in bf16 + LoRA r=16 adapters 40.4M" in section, section
    assert "LoRA push = adapter" in out and "--enable-lora" in out
    assert cli_main(["simulate", *argv, "--nodes", "1"]) == 0
    out = capsys.readouterr().out
    assert "memory: LoRA r=16 on a frozen base, which models fit" in out, out


def test_a_merged_lora_push_keeps_the_ipc_staging_buffer_an_adapter_push_does_not(tmp_path, capsys):
    shape = common_shape("Qwen2.5-7B")
    lay = _lay(push_buffer_bytes=2048 * 2**20)  # one shared GPU, ipc push (trainer.ipc_buffer_mb 2048)
    lora = dict(activation_checkpointing=True, lora_r=16, lora_targets=LORA_TARGETS)
    adapter = estimate(shape, lay, Options(**lora))  # type: ignore[arg-type]
    merged = estimate(shape, lay, Options(**lora, lora_merged=True))  # type: ignore[arg-type]
    full = estimate(shape, lay, Options(activation_checkpointing=True))
    assert adapter.push_buffer_gb == 0 and merged.push_buffer_gb == full.push_buffer_gb == 2048 * 2**20 / 1e9
    assert abs(merged.gpu_gb - adapter.gpu_gb - merged.push_buffer_gb) < 1e-9
    # through the engine (trainer.lora.adapter_transport engine) the ipc push stages the adapter: bf16, 40.4 M parameters
    engine = estimate(shape, lay, Options(**lora, lora_adapter_staged=True))  # type: ignore[arg-type]
    assert abs(engine.push_buffer_gb - 2 * 40.37e6 / 1e9) < 0.001, engine.push_buffer_gb
    # the plan's choice reaches the estimate: dry-run of the one-GPU (ipc) config with trainer.lora.push merged
    model = tmp_path / "qwen7b"
    model.mkdir()
    cfg = {"hidden_size": 3584, "num_hidden_layers": 28, "intermediate_size": 18944, "vocab_size": 152064}
    cfg |= {"num_attention_heads": 28, "num_key_value_heads": 4, "architectures": ["Qwen2ForCausalLM"]}
    (model / "config.json").write_text(json.dumps(cfg))
    sets = ["--set", f"vllm.model={model}", "--set", "trainer.lora.r=16"]
    for push, staged in (("auto", False), ("merged", True)):
        argv = ["dry-run", str(REPO / "configs" / "gpu_1gpu.yaml"), *sets, "--set", f"trainer.lora.push={push}"]
        assert cli_main([*argv, "--skip-checks", "all"]) == 0
        out = capsys.readouterr().out
        section = out.split("# memory estimate")[1].split("# sbatch")[0]
        assert ("ipc push buffer 2.1 (trainer.ipc_buffer_mb)" in section) == staged, section
        assert f"LoRA push = {'merged' if staged else 'adapter'}" in out
