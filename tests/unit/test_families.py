"""The family matrix, unit tier: a tiny random body of every family in trainer.tiny_families (dense and MoE) through
the default sharded loader on 2 gloo ranks, bit for bit what `from_pretrained` makes (Gemma's non-persistent embedding
scale, MoE per-expert checkpoints into transformers' fused experts with 3 experts on 2 ranks), each checkpoint byte
read by exactly one rank."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from tests.support.ranks import cpu_parallel, run_ranks
from trainer.tiny_families import FAMILIES, MOE


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict[str, str]:
    from trainer.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("families")
    out = {}
    for family in FAMILIES:
        make_tiny_model(root / family, family=family, tie=family.startswith("gemma"))
        out[family] = str(root / family)
    return out


def load_and_compare(rank: int, world: int, _port: int, dirs: dict[str, str]) -> dict[str, dict]:
    import torch
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    from trainer.loading import load_model

    par = cpu_parallel(rank, world)
    out = {}
    for family, d in dirs.items():
        model, report = load_model(d, par, torch.float32)
        ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)

        def full(t):
            return t.full_tensor() if isinstance(t, DTensor) else t

        got = {k: full(v) for k, v in model.state_dict().items()}
        got.update({f"buffer:{k}": full(b) for k, b in model.named_buffers()})
        want = {**ref.state_dict(), **{f"buffer:{k}": b for k, b in ref.named_buffers()}}
        out[family] = {
            "missing": sorted(set(want) ^ set(got)),
            "differ": [k for k in want if k in got and not torch.equal(got[k], want[k])],
            "fused_experts": [n for n, p in model.named_parameters() if p.dim() == 3],
            "bytes_read": report.bytes_read,
        }
    return out


def test_every_family_loads_sharded_bit_for_bit_as_from_pretrained(family_dirs):
    res = run_ranks(2, functools.partial(load_and_compare, dirs=family_dirs), timeout_s=300)
    for family, d in family_dirs.items():
        r0, r1 = res[0][family], res[1][family]
        assert not r0["missing"] and not r0["differ"], f"{family}: sharded load differs from from_pretrained: {r0}"
        assert not r1["differ"], f"{family}, rank 1: {r1['differ']}"
        on_disk = sum(f.stat().st_size for f in Path(d).glob("*.safetensors"))
        # the headers are the only bytes nobody reads; each tensor byte is read by one rank (the owner of its rows)
        assert 0 < on_disk - (r0["bytes_read"] + r1["bytes_read"]) < 32_000, f"{family}: {on_disk} on disk, read {r0}, {r1}"
        if family in MOE:
            assert r0["fused_experts"], f"{family}: no fused expert parameter was built: {r0}"
