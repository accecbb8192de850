"""The sharded loader (trainer/loading.py) on spawned gloo ranks: bit for bit what `from_pretrained` makes (every
parameter and buffer, tied and untied embeddings, one file and an index of several, bf16 stored and fp32 master,
FSDP and HSDP meshes), and a rank's peak memory while loading bounded by its shard, not the model."""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.load_memory import measure_load, model_figures
from tests.support.ranks import cpu_parallel, run_ranks

MODELS = {
    # name: make-tiny-model arguments
    "tied-fp32-one-file": [],
    "untied-bf16-index": ["--untied", "--dtype", "bfloat16", "--max-shard-size", "200KB", "--layers", "3"],
}


def make_model(root: Path, name: str, extra: list[str]) -> str:
    out = root / name
    subprocess.run([sys.executable, "-m", "trainer.tiny_model", str(out), *extra], check=True, capture_output=True)
    return str(out)


def compare_with_from_pretrained(rank: int, world: int, _port: int, model_dirs: list[str], nodes: int) -> list[dict]:
    par = cpu_parallel(rank, world, nodes)
    return [compare_one(par, d) for d in model_dirs]


def compare_one(par, model_dir: str) -> dict:
    import torch
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    from trainer.loading import load_model

    model, _ = load_model(model_dir, par, torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    got = {k: full(v) for k, v in model.state_dict().items()}  # every name, a tied weight under both
    want = ref.state_dict()
    got_buffers = {n: b for n, b in model.named_buffers()}  # non-persistent ones too (rotary caches)
    want_buffers = {n: b for n, b in ref.named_buffers()}
    differ = [k for k in want if k in got and not (got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]))]
    differ += [k for k in want_buffers if k in got_buffers and not torch.equal(got_buffers[k], want_buffers[k])]
    return {
        "keys": sorted(got) == sorted(want),
        "buffers": sorted(got_buffers) == sorted(want_buffers) and len(want_buffers) > 0,
        "differ": differ,
        "tensors": len(want),
        "sharded": sum(isinstance(p, DTensor) for p in model.parameters()),
        "tied": model.lm_head.weight is model.model.embed_tokens.weight,
        "tied_ref": ref.lm_head.weight is ref.model.embed_tokens.weight,
        "eval_mode": model.training == ref.training,
        "generation_config": model.generation_config.to_dict() == ref.generation_config.to_dict(),
    }


@pytest.mark.parametrize("world,nodes", [(2, 1), (4, 1), (4, 2)], ids=["fsdp-2", "fsdp-4", "hsdp-2x2"])
def test_the_sharded_load_equals_from_pretrained_bit_for_bit(tmp_path, world, nodes):
    dirs = [make_model(tmp_path, name, extra) for name, extra in MODELS.items()]
    res = run_ranks(world, functools.partial(compare_with_from_pretrained, model_dirs=dirs, nodes=nodes))
    for i, (name, model_dir) in enumerate(zip(MODELS, dirs)):
        for rank, rs in res.items():
            r = rs[i]
            where = f"{name}, rank {rank} of {world} ({nodes} nodes)"
            assert r["keys"] and r["buffers"], f"{where}: parameter or buffer names differ: {r}"
            assert not r["differ"], f"{where}: not bit for bit equal to from_pretrained: {r['differ']}"
            assert r["tied"] == r["tied_ref"] == (name.startswith("tied")), f"{where}: embedding tying differs: {r}"
            assert r["sharded"] > 0 and r["eval_mode"] and r["generation_config"], f"{where}: {r}"
        if name.startswith("untied"):
            assert len(list(Path(model_dir).glob("*.safetensors"))) > 1, "the index case must span several files"


def test_a_ranks_peak_memory_while_loading_is_its_shard_not_the_model(tmp_path):
    """A 170 MB (fp32) model: on 2 and 4 ranks each rank's peak grows by its shard plus the largest tensor (and a
    fixed 32 MB of Python objects), while `from_pretrained` then shard grows by more than the whole model."""
    from trainer.procmem import peak_reset_unavailable

    if (why := peak_reset_unavailable()) is not None:  # the ranks measure the peak from a reset (trainer.procmem)
        pytest.skip(why)
    model_dir = make_model(tmp_path, "m", ["--hidden", "1024", "--layers", "4", "--intermediate", "2816", "--kv-heads", "2"])
    fig = model_figures(model_dir)
    assert fig["model_fp32_mb"] > 150, fig
    for world in (2, 4):
        bound = fig["model_fp32_mb"] / world + fig["largest_tensor_mb"] + 32
        for r in run_ranks(world, functools.partial(measure_load, model_dir=model_dir, loader="sharded")).values():
            assert r["peak_growth_mb"] <= bound, f"{world} ranks, rank {r['rank']}: grew {r['peak_growth_mb']} MB > {bound:.0f}"
    # the same measurement sees the old loader's full copy: the bound above is not one nothing could break
    for r in run_ranks(2, functools.partial(measure_load, model_dir=model_dir, loader="full")).values():
        assert r["peak_growth_mb"] >= fig["model_fp32_mb"], r


def train_once(rank: int, world: int, _port: int, model_dir: str) -> dict:
    """One forward/backward of the same batch with each memory option; the layer forward calls and the gradients."""
    import torch

    from trainer.loading import load_model

    par = cpu_parallel(rank, world)
    ids = torch.arange(2 * 24).reshape(2, 24) % 200
    out: dict[str, Any] = {}
    options: dict[str, dict[str, Any]] = {"plain": {}, "ac": {"activation_checkpointing": True}, "offload": {"cpu_offload": True}}
    for name, kw in options.items():
        model, _ = load_model(model_dir, par, torch.float32, **kw)
        model.train()
        calls = [0]
        # a pre-hook: the recompute stops early (inside the MLP) once it has what the backward needs
        model.model.layers[0].mlp.register_forward_pre_hook(lambda *_, c=calls: c.__setitem__(0, c[0] + 1))
        model(input_ids=ids, labels=ids).loss.backward()
        out[name] = {"layer0_forwards": calls[0], "grads": {n: p.grad.full_tensor() for n, p in model.named_parameters()}}
    plain = out["plain"]["grads"]
    return {
        name: {
            "layer0_forwards": r["layer0_forwards"],
            "grads_equal": all(torch.equal(r["grads"][n], g) for n, g in plain.items()),
            "grads_nonzero": all(g.abs().sum() > 0 for g in r["grads"].values()),
        }
        for name, r in out.items()
    }


def test_activation_checkpointing_recomputes_each_layer_and_cpu_offload_gives_the_same_gradients(tmp_path):
    model_dir = make_model(tmp_path, "m", [])
    for rank, r in run_ranks(2, functools.partial(train_once, model_dir=model_dir)).items():
        assert r["plain"]["layer0_forwards"] == 1 and r["offload"]["layer0_forwards"] == 1, r
        assert r["ac"]["layer0_forwards"] == 2, f"rank {rank}: activation checkpointing did not recompute the layer: {r}"
        assert all(x["grads_equal"] and x["grads_nonzero"] for x in r.values()), f"rank {rank}: {r}"


def attention_of(rank: int, world: int, _port: int, model_dir: str) -> dict[str, str]:
    import torch

    from trainer.loading import load_model

    par = cpu_parallel(rank, world)
    out = {}
    for loader, attention in (("sharded", ""), ("sharded", "eager"), ("full", "eager")):
        model, _ = load_model(model_dir, par, torch.float32, loader=loader, attn_implementation=attention)
        out[f"{loader}:{attention}"] = model.config._attn_implementation
    return out


def test_trainer_attn_implementation_reaches_the_model_under_both_loaders(tmp_path):
    """trainer.attn_implementation is transformers' (TRL's reference model copies the policy's); unset, transformers
    picks SDPA for a family that has it."""
    model_dir = make_model(tmp_path, "m", [])
    got = run_ranks(1, functools.partial(attention_of, model_dir=model_dir))[0]
    assert got == {"sharded:": "sdpa", "sharded:eager": "eager", "full:eager": "eager"}, got


def resumed_without_reading(rank: int, world: int, _port: int, model_dir: str, root: str) -> dict:
    """A trained step checkpointed; then a resume's load (read_weights False: the shards allocated, not filled)
    followed by checkpoint.load: every parameter and buffer the trained model's, and nothing read from the model folder."""
    import torch
    from torch.distributed.tensor import DTensor

    from launcher.core.records import CheckpointMeta
    from trainer import checkpoint
    from trainer.loading import load_model

    par = cpu_parallel(rank, world)
    ids = torch.arange(2 * 24).reshape(2, 24) % 200

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    model, _ = load_model(model_dir, par, torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    trained = {k: full(v).clone() for k, v in model.state_dict().items()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    checkpoint.save(Path(root), model, opt, None, CheckpointMeta(step=1, world_size=world))
    fresh, report = load_model(model_dir, par, torch.float32, read_weights=False)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    step = checkpoint.load(Path(root) / "step-000001", fresh, fresh_opt, None)
    got = {k: full(v) for k, v in fresh.state_dict().items()}
    return {
        "step": step,
        "read": report.bytes_read,
        "differ": [k for k in trained if not torch.equal(trained[k], got[k])],
        "buffers_differ": [n for n, b in fresh.named_buffers() if not torch.equal(b, buffers[n])],
        "keys": sorted(got) == sorted(trained),
    }


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_resume_reads_no_weights_from_the_model_folder_and_gets_every_one_from_its_checkpoint(tmp_path, name):
    model_dir = make_model(tmp_path, name, MODELS[name])
    res = run_ranks(2, functools.partial(resumed_without_reading, model_dir=model_dir, root=str(tmp_path / "checkpoints")))
    for rank, r in res.items():
        assert r["step"] == 1 and r["read"] == 0 and r["keys"], (rank, r)
        assert r["differ"] == [] and r["buffers_differ"] == [], (rank, r)  # rotary caches (non-persistent) included
