"""The LoRA push's tensors (trainer/push/adapter.py) on one process: the merged stream equals peft's own
merge_and_unload, in the order its metadata announces; the adapter as written is peft's format (PeftModel loads it and
computes what the trained model computes)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from launcher.core.config import LoraConfig
from trainer import lora as trainer_lora


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("tiny") / "m"
    subprocess.run([sys.executable, "-m", "trainer.tiny_model", str(out)], check=True, capture_output=True)
    return str(out)


def trained(model_dir: str, lora: LoraConfig):
    """A peft model of the tiny base whose adapters are non-zero (as after training)."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = trainer_lora.apply(base, lora, torch.float32, model_dir)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in trainer_lora.adapter_params(model):
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


def test_the_merged_push_equals_peft_merge_and_unload_in_the_announced_order(tiny):
    from trainer.push.adapter import MergedPusher
    from trainer.push.pusher import PushSettings

    lora = LoraConfig(r=4, alpha=16)
    model = trained(tiny, lora)
    settings = PushSettings("gloo", 0, 1, 10.0, torch.float32, 1 << 20)
    pusher = MergedPusher(model, None, settings, torch.device("cpu"), lora)
    sent = list(pusher.params())
    assert [n for n, _ in sent] == [m.name for m in pusher.meta]  # the order the receiver cuts its chunks by
    assert [list(t.shape) for _, t in sent] == [m.shape for m in pusher.meta]
    want = dict(trained(tiny, lora).merge_and_unload().named_parameters())
    assert sorted(n for n, _ in sent) == sorted(want)
    worst = max((t - want[n]).abs().max().item() for n, t in sent)
    assert worst <= 1e-6, worst
    assert pusher.bytes_last == 4 * sum(p.numel() for p in want.values())


def test_the_written_adapter_is_peft_format_and_computes_what_the_trained_model_computes(tiny, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from trainer.push.adapter import gather_adapter, write_adapter

    lora = LoraConfig(r=4, alpha=16, target_modules=["q_proj", "v_proj", "down_proj"])
    model = trained(tiny, lora)
    tensors = gather_adapter(model, torch.float32, keep=True)
    written = write_adapter(tmp_path / "a", tensors, lora, tiny)
    assert written == sum(p.numel() * 4 for _, p in trainer_lora.adapter_params(model))
    assert sorted(x.name for x in (tmp_path / "a").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32), str(tmp_path / "a"))
    ids = torch.arange(20).reshape(1, 20) % 200
    with torch.no_grad():
        diff = (loaded(input_ids=ids).logits - model(input_ids=ids).logits).abs().max().item()
    assert diff <= 1e-5, diff
