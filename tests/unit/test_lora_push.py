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


def test_the_plugin_reads_an_adapter_at_its_push_not_at_every_engine_step(monkeypatch):
    """vLLM gives every request naming the adapter the LoRARequest of its last /v1/load_lora_adapter, load_inplace
    included, and its per-step activation reloads such an adapter from disk (8x slower generation on the H200).
    With the plugin's patch the per-step path gets the request with the flag off, the explicit add_lora (the push)
    keeps it. The worker's adapter manager (its GPU slots) is a stand-in; the patched methods are vLLM's own."""
    pytest.importorskip("vllm")
    from vllm.lora import worker_manager as wm
    from vllm.lora.request import LoRARequest

    from trainer.push.vllm_plugin import load_adapters_once

    for cls, attr in ((wm.LRUCacheWorkerLoRAManager, "_apply_adapters"), (wm.WorkerLoRAManager, "_load_adapter")):
        monkeypatch.setattr(cls, attr, getattr(cls, attr))  # restored after the test
    seen: list[tuple[str, bool]] = []

    class Slots:  # the adapter manager's one GPU slot
        lora_slots = 1

    class Worker(wm.LRUCacheWorkerLoRAManager):
        def __init__(self) -> None:  # no model: only the per-step path and add_adapter's input are looked at
            self._adapter_manager = Slots()  # type: ignore[assignment]

        def add_adapter(self, lora_request: LoRARequest) -> bool:
            seen.append((lora_request.lora_path, lora_request.load_inplace))
            return True

    import inspect

    from vllm.entrypoints.openai.models import serving
    from vllm.v1.worker import lora_model_runner_mixin as mixin

    # the vLLM 0.32 code this patch is about: the stored request keeps the flag, the per-step path honours it
    assert "load_inplace=request.load_inplace" in inspect.getsource(serving.OpenAIServingModels.load_lora_adapter)
    assert "or lora_request.load_inplace" in inspect.getsource(wm.LRUCacheWorkerLoRAManager.add_adapter)
    assert "self.lora_manager.add_adapter(lora_request)" in inspect.getsource(mixin.LoRAModelRunnerMixin.add_lora)
    pushed = LoRARequest("slurm-grpo-policy", 1, "/n/step-000003", load_inplace=True)  # what the server stores
    Worker()._apply_adapters({pushed})
    assert seen == [("/n/step-000003", True)]  # vLLM as shipped: a reload at every engine step
    load_adapters_once()
    load_adapters_once()  # idempotent: the plugin is loaded by every vLLM process, possibly twice
    seen.clear()
    for _ in range(3):  # three engine steps
        Worker()._apply_adapters({pushed, None})
    assert seen == [("/n/step-000003", False)] * 3  # add_adapter skips an adapter it holds unless load_inplace
    assert pushed.load_inplace  # the stored request itself is untouched: the next push still replaces in place
    Worker().add_adapter(pushed)  # the push's own path (worker add_lora -> add_adapter) is not patched
    assert seen[-1] == ("/n/step-000003", True)
