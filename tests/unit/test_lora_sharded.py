"""The sharded LoRA model (trainer/lora.py through trainer/loading.py) on 2 spawned gloo ranks: the base frozen in the
serving dtype (float32 as on CPU, and bfloat16 as on GPU: FSDP2 units mixing a frozen bf16 base with fp32 adapters),
only the adapters trainable and in the optimizer, the base as the checkpoint holds it, a fresh adapter changing
nothing, and optimizer steps changing the adapters only."""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.support.ranks import cpu_parallel, run_ranks


def make_model(root: Path) -> str:
    out = root / "m"
    subprocess.run([sys.executable, "-m", "trainer.tiny_model", str(out)], check=True, capture_output=True)
    return str(out)


def lora_case(par, model_dir: str, dtype_name: str) -> dict[str, Any]:
    import torch
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    from launcher.core.config import LoraConfig
    from trainer.loading import load_model
    from trainer.lora import base_name, is_adapter

    dtype = getattr(torch, dtype_name)
    lora = LoraConfig(r=4, alpha=8)
    model, _ = load_model(model_dir, par, dtype, lora=lora, seed=3)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    want = dict(ref.named_parameters())

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    params = dict(model.named_parameters())
    adapters = {n: p for n, p in params.items() if is_adapter(n)}
    base = {n: p for n, p in params.items() if not is_adapter(n)}
    base_differs = [n for n, p in base.items() if not torch.equal(full(p.detach()), want[base_name(n)].detach())]  # type: ignore[index]
    ids = torch.arange(2 * 16).reshape(2, 16) % 200
    model.eval()
    with torch.no_grad():  # a fresh adapter (B = 0) changes nothing
        fresh_diff = (model(input_ids=ids).logits.float() - ref(input_ids=ids).logits.float()).abs().max().item()
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]  # what transformers' Trainer gives the optimizer
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    before = {n: full(p.detach()).clone() for n, p in params.items()}
    for _ in range(2):  # the first step moves B only (A's gradient is B^T ... = 0), the second A too
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    after = {n: full(p.detach()) for n, p in params.items()}
    return {
        "adapters": len(adapters),
        "all_sharded": all(isinstance(p, DTensor) for p in params.values()),
        "trainable_are_adapters": sorted(n for n, p in params.items() if p.requires_grad) == sorted(adapters),
        "base_dtypes": sorted({str(p.dtype) for p in base.values()}),
        "adapter_dtypes": sorted({str(p.dtype) for p in adapters.values()}),
        "base_differs": base_differs,
        "fresh_diff": fresh_diff,
        "optimizer_params": len(opt.state),
        "optimizer_is_adapters": {id(p) for p in opt.state} == {id(p) for p in adapters.values()},
        "base_grads": sum(p.grad is not None for p in base.values()),
        "base_changed": [n for n in base if not torch.equal(before[n], after[n])],
        "adapters_unchanged": [n for n in adapters if torch.equal(before[n], after[n])],
        "lora_a0": full(next(p for n, p in adapters.items() if ".lora_A." in n).detach()).sum().item(),
    }


def lora_ranks(rank: int, world: int, _port: int, model_dir: str) -> dict[str, Any]:
    par = cpu_parallel(rank, world)
    return {d: lora_case(par, model_dir, d) for d in ("float32", "bfloat16")}


def test_the_sharded_lora_model_trains_its_adapters_only_on_a_frozen_base_in_the_serving_dtype(tmp_path):
    model_dir = make_model(tmp_path)
    res = run_ranks(2, functools.partial(lora_ranks, model_dir=model_dir), timeout_s=240)
    for rank, cases in res.items():
        for dtype, r in cases.items():
            where = f"rank {rank}, base {dtype}: {r}"
            assert r["adapters"] == 2 * 7 * 2, where  # 2 layers x 7 projections x (A, B)
            assert r["all_sharded"] and r["trainable_are_adapters"], where
            assert r["base_dtypes"] == [f"torch.{dtype}"] and r["adapter_dtypes"] == ["torch.float32"], where
            assert r["base_differs"] == [], where
            # float32: exactly the base; bfloat16: within the rounding of a bf16 forward (FSDP2 vs from_pretrained)
            assert r["fresh_diff"] <= (0.0 if dtype == "float32" else 0.02), where
            assert r["optimizer_params"] == r["adapters"] and r["optimizer_is_adapters"], where
            assert r["base_grads"] == 0 and r["base_changed"] == [], where
            assert r["adapters_unchanged"] == [], where
    # the adapters' initial values do not depend on the rank (each rank kept its rows of the same full tensor)
    assert res[0]["float32"]["lora_a0"] != 0.0


def train_and_save(rank: int, world: int, _port: int, model_dir: str, root: str) -> dict[str, Any]:
    """Two AdamW steps of the LoRA model, a checkpoint; returns the adapters as trained (whole) and the files written."""
    import torch
    import torch.distributed as dist

    from launcher.core.config import LoraConfig
    from launcher.core.records import CheckpointMeta
    from trainer import checkpoint
    from trainer.loading import load_model
    from trainer.lora import adapter_params

    par = cpu_parallel(rank, world)
    model, _ = load_model(model_dir, par, torch.float32, lora=LoraConfig(r=4), seed=3)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.arange(2 * 16).reshape(2, 16) % 200
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    path = checkpoint.save(Path(root), model, opt, None, CheckpointMeta(step=2, world_size=dist.get_world_size()))
    return {"adapters": {n: whole(p) for n, p in adapter_params(model)}, "path": str(path), **pushed(model)}


def load_elsewhere(rank: int, world: int, _port: int, model_dir: str, path: str) -> dict[str, Any]:
    import torch

    from launcher.core.config import LoraConfig
    from trainer import checkpoint
    from trainer.loading import load_model
    from trainer.lora import adapter_params

    par = cpu_parallel(rank, world)
    model, _ = load_model(model_dir, par, torch.float32, lora=LoraConfig(r=4), seed=99)  # other initial adapters
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    step = checkpoint.load(Path(path), model, opt, None)
    return {
        "step": step,
        "adapters": {n: whole(p) for n, p in adapter_params(model)},
        "adam_steps": sorted({float(s["step"]) for s in opt.state.values()}),
        **pushed(model),
    }


def pushed(model) -> dict[str, Any]:
    """What an adapter push gathers (trainer.push.adapter.gather_adapter, every rank): whole tensors under peft's names,
    from all-gathers when the adapters are sharded, from each rank's local tensor when a shard group is one rank."""
    import torch

    from trainer.lora import adapter_params, peft_file_name
    from trainer.push.adapter import gather_adapter, whole_locally

    got = gather_adapter(model, torch.float32, keep=True, cpu=False)
    return {
        "push_whole_locally": all(whole_locally(p) for _, p in adapter_params(model)),
        "push_equal": all(torch.equal(got[peft_file_name(n)], torch.as_tensor(whole(p))) for n, p in adapter_params(model)),
    }


def test_a_lora_checkpoint_holds_only_the_adapters_and_resumes_on_another_rank_count(tmp_path):
    import torch

    model_dir = make_model(tmp_path)
    saved = run_ranks(2, functools.partial(train_and_save, model_dir=model_dir, root=str(tmp_path / "ck")), timeout_s=240)
    path = saved[0]["path"]
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(path, str(tmp_path / "ck.pt"))
    keys = list(torch.load(tmp_path / "ck.pt", weights_only=False)["model"])
    assert keys and all(".lora_" in k for k in keys), keys[:4]  # the frozen base is the model folder's, not saved
    got = run_ranks(1, functools.partial(load_elsewhere, model_dir=model_dir, path=path), timeout_s=240)[0]
    assert got["step"] == 2 and got["adam_steps"] == [2.0]
    # the adapter push's gather: all-gathers on 2 ranks, the local tensors on 1 (no collective), whole either way
    assert [saved[r]["push_whole_locally"] for r in (0, 1)] == [False, False] and got["push_whole_locally"]
    assert saved[0]["push_equal"] and saved[1]["push_equal"] and got["push_equal"]
    want = saved[0]["adapters"]
    assert sorted(got["adapters"]) == sorted(want)
    assert all((got["adapters"][n] == want[n]).all() for n in want)  # resharded 2 -> 1 ranks, exact


def whole(p) -> Any:
    """A DTensor parameter's full value (a collective over its mesh), as a NumPy array: it leaves the spawned rank by
    value (a tensor would go by a shared-memory handle, which the rank's exit can close before the parent reads it)."""
    return p.detach().full_tensor().numpy().copy()
