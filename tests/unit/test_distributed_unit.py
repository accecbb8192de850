"""Distributed units on CPU with gloo and several processes (one process proves little about collectives):
the completion-to-rank mapping with split and duplicate prompts, the memory bound of the push gather, and the
packed push over a real loopback gloo group. The server is faked at the process boundary (a function in
place of the HTTP call); the transfer's receiving side is the project's own (trainer.push.gloo_engine)."""

from __future__ import annotations

import os
import time
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.support.ranks import RankError, run_ranks


def fails_on_rank_1(rank: int, _world: int, _port: int, how: str) -> int:
    """Rank 1 fails (`how`); rank 0 waits as a rank blocked in a collective would: the caller must not."""
    if rank == 1:
        if how == "raise":
            raise ValueError("bad input on rank 1")
        os._exit(3)  # dies without a word, as a killed or crashed rank does
    time.sleep(600)
    return rank


@pytest.mark.parametrize(
    "how, needles",
    [
        ("raise", ["rank 1 of 2 raised", "ValueError: bad input on rank 1", "in fails_on_rank_1"]),
        ("exit", ["rank 1 of 2 exited with code 3 without handing back a result"]),
    ],
)
def test_a_failing_rank_fails_the_call_at_once_and_says_why(how, needles):
    import functools

    t0 = time.monotonic()
    with pytest.raises(RankError) as e:
        run_ranks(2, functools.partial(fails_on_rank_1, how=how), timeout_s=600)
    msg = str(e.value)
    assert all(n in msg for n in needles), msg
    assert time.monotonic() - t0 < 120, "it waited for the deadline (600 s) instead of failing when rank 1 did"


def generation_mapping(rank: int, world: int, _port: int) -> dict:
    from tests.support.ranks import cpu_parallel
    from trainer.rollout.node import node_generate

    par = cpu_parallel(rank, world, nodes=2)  # two "nodes" of two ranks each
    node = par.node
    # prompt groups of 3 copies split across ranks and nodes, and the same prompt on several ranks
    same = [7, 7, 7]
    local = {0: [[1, 2], [1, 2], same], 1: [same, [3], [3]], 2: [same, same, [9, 9]], 3: [[9, 9], [9, 9], [1, 2]]}[rank]
    calls: list[int] = []

    def fake_server(flat):
        calls.append(len(flat))
        # a distinct completion per entry: the node, the entry's position and its prompt, so any mix-up shows
        return [([100 * node + i] + p, [-0.5] * (1 + len(p))) for i, p in enumerate(flat)]

    mine, _ = node_generate(par, local, fake_server)
    return {
        "own_prompts": [c[1:] for c, _ in mine] == local,
        "own_node": all(c[0] // 100 == node for c, _ in mine),
        "positions": [c[0] % 100 for c, _ in mine],
        "server_calls": calls,
    }


def test_each_rank_gets_its_own_completions_in_order_with_one_request_per_node():
    res = run_ranks(4, generation_mapping)
    for rank, r in res.items():
        assert r["own_prompts"] and r["own_node"], f"rank {rank} got completions of other prompts or another node: {r}"
        assert r["positions"] == [3 * (rank % 2) + i for i in range(3)], r  # its own slice, in order
    assert [res[r]["server_calls"] for r in range(4)] == [[6], [], [6], []]  # one request per node leader


def sharded_mlp(world: int, param_dtype: torch.dtype) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """Four Linear layers (one FSDP2 unit each) under a root unit, as trainer.parallel.shard_model lays out a
    decoder, and the unsharded reference of every parameter."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)], torch.nn.LayerNorm(64))
    ref = {n: p.detach().clone() for n, p in model.named_parameters()}
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for m in list(model)[:4]:
        fully_shard(m, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)  # the root unit holds the LayerNorm
    return model, ref


def gather_peak(rank: int, world: int, _port: int) -> dict:
    from torch.distributed.tensor import DTensor

    from trainer.push.gather import iter_full_params, iter_unsharded_params

    out = {}
    for param_dtype in (torch.float32, torch.bfloat16):
        model, ref = sharded_mlp(world, param_dtype)
        for walk, it in (("per_parameter", iter_full_params), ("per_unit", iter_unsharded_params)):
            alive: list = []
            peak, peak_unsharded, equal, names = 0, 0, True, []
            for name, t in it(model, torch.bfloat16):
                alive = [w for w in alive if w() is not None] + [weakref.ref(t)]
                peak = max(peak, sum(w().numel() for w in alive if w() is not None))
                # what the walk holds gathered: parameters currently registered unsharded on the model
                unsharded = sum(p.numel() for p in model.parameters() if not isinstance(p, DTensor))
                peak_unsharded = max(peak_unsharded, unsharded)
                equal &= t.dtype == torch.bfloat16 and torch.equal(t, ref[name].to(torch.bfloat16))
                names.append(name)
                del t
            resharded = all(isinstance(p, DTensor) for p in model.parameters())
            out[f"{walk}/{param_dtype}"] = {
                "peak_yielded": peak,
                "peak_unsharded": peak_unsharded,
                "equal": equal,
                "order": names == list(ref),
                "resharded_after": resharded,
            }
    return out


def test_the_push_gathers_hold_one_unit_at_a_time_and_equal_the_models_cast():
    layer, norm = 64 * 64 + 64, 2 * 64
    for rank, res in run_ranks(4, gather_peak).items():
        for walk, r in res.items():
            assert r["equal"] and r["order"], f"rank {rank} {walk}: gathered tensors differ from the model's cast: {r}"
            assert r["resharded_after"], f"rank {rank} {walk}: parameters left unsharded after the push"
            if walk.startswith("per_parameter"):
                assert r["peak_yielded"] <= 64 * 64, f"rank {rank} {walk}: {r}; bound is one weight (4096)"
            else:  # the root unit (the norm) plus one layer, never the whole model (4 layers)
                assert r["peak_unsharded"] <= norm + layer, f"rank {rank} {walk}: {r}; bound is root + one layer"


def walk_without_copies(rank: int, world: int, _port: int) -> dict:
    """copy=False (the mapped ipc sender's walk): what it yields, cast the way the sender's copy casts, equals the
    model's cast; with one rank nothing is gathered (the parameters stay sharded DTensors the whole walk and each
    yielded tensor is the parameter's own fp32 master storage)."""
    from torch.distributed.tensor import DTensor

    from trainer.push.gather import iter_unsharded_params

    out = {}
    for param_dtype in (torch.float32, torch.bfloat16):
        model, ref = sharded_mlp(world, param_dtype)
        local = {n: p.to_local().data_ptr() for n, p in model.named_parameters()}  # type: ignore[attr-defined]
        equal, own_storage, gathered, names = True, True, False, []
        for name, t in iter_unsharded_params(model, torch.bfloat16, copy=False):
            staged = torch.empty(t.shape, dtype=torch.bfloat16)
            staged.copy_(t)  # what MappedIpcSender does with each tensor, at once
            equal &= torch.equal(staged, ref[name].to(torch.bfloat16))
            own_storage &= t.data_ptr() == local[name]
            gathered |= any(not isinstance(p, DTensor) for p in model.parameters())
            names.append(name)
        from trainer.push.gather import _whole_on_every_rank

        out[str(param_dtype)] = {
            "equal": equal,
            "order": names == list(ref),
            "own_storage": own_storage,
            "gathered": gathered,
            # shards in host memory on a GPU run (cpu_offload): unshard() must bring them over, not the local walk
            "host_shards_walk_locally_on_gpu": _whole_on_every_rank(model, on_gpu=True),
        }
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_the_walk_without_copies_equals_the_cast_and_gathers_nothing_on_one_rank(world):
    for rank, res in run_ranks(world, walk_without_copies).items():
        for dtype, r in res.items():
            assert r["equal"] and r["order"], f"rank {rank} of {world}, params {dtype}: {r}"
            assert not r["host_shards_walk_locally_on_gpu"], r
            if world == 1:
                assert r["own_storage"] and not r["gathered"], f"one rank: nothing to gather, yet {r}"
            else:
                assert r["gathered"] and not r["own_storage"], f"{world} ranks: the units must be gathered: {r}"


def packed_push(rank: int, world: int, port: int) -> dict:
    from datetime import timedelta

    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    from trainer.push.gather import param_metadata
    from trainer.push.gloo_engine import receive_packed
    from trainer.push.senders import broadcast_packed, loopback_store
    from trainer.push.wire import chunk_metas, loopback_gloo_group

    torch.manual_seed(0)  # the same model on both ranks: the receiver checks what it got against it
    model = torch.nn.Sequential(
        torch.nn.Embedding(50, 16), torch.nn.Linear(16, 40), torch.nn.LayerNorm(40), torch.nn.Linear(40, 50, bias=False)
    )
    params = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
    meta = param_metadata(model, torch.bfloat16)
    bucket = 3000  # bytes: several chunks, one tensor (the embedding, 1600 B) close to the bucket
    tport = port + 1
    timeout = timedelta(seconds=30)
    if rank == 0:
        store = loopback_store(tport, 2, timeout)
        group = loopback_gloo_group(store, 0, 2, timeout)
        chunks = broadcast_packed(group, iter(params.items()), bucket)
        vllm_cut = 0
        it = iter(params.items())
        while pack_tensors(it, lambda x: x[1], bucket) is not None:
            vllm_cut += 1
        return {
            "chunks_sent": chunks,
            "chunks_vllm_pack_tensors": vllm_cut,
            "chunks_receiver_rule": len(list(chunk_metas(meta, bucket))),
        }
    store = dist.TCPStore("127.0.0.1", tport, 2, is_master=False, timeout=timeout)
    group = loopback_gloo_group(store, 1, 2, timeout)
    got = [w for chunk in receive_packed(group, meta, bucket) for w in chunk]
    return {
        "names_in_order": [n for n, _ in got] == list(params),
        "bit_equal": all(torch.equal(t, params[n]) and t.dtype == torch.bfloat16 for n, t in got),
        "received": len(got),
    }


def test_the_packed_gloo_push_delivers_every_parameter_bit_for_bit_in_vllms_chunks():
    res = run_ranks(2, packed_push)
    sent, recv = res[0], res[1]
    assert recv["names_in_order"] and recv["bit_equal"] and recv["received"] == 6, recv
    assert sent["chunks_sent"] == sent["chunks_vllm_pack_tensors"] == sent["chunks_receiver_rule"] > 1, sent


def _sharded_adam(world: int, zeroed: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model, _ = sharded_mlp(world, torch.float32)
    if zeroed:  # nothing of the saved run survives: what matches afterwards came from the checkpoint
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _full_state(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    # full_state_dict + cpu_offload: the whole state on rank 0, nothing on the others
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() != 0:
        return {}
    flat = {f"model.{k}": v for k, v in msd.items()}
    state: dict[str, dict] = osd["state"]  # type: ignore[assignment]
    for fqn, st in state.items():
        for k, v in st.items():
            flat[f"optim.{fqn}.{k}"] = v
    return flat


def save_trained(rank: int, world: int, _port: int, root: str) -> None:
    from launcher.core.records import CheckpointMeta
    from trainer import checkpoint

    model, opt = _sharded_adam(world, zeroed=False)
    for _ in range(2):  # two AdamW steps: exp_avg, exp_avg_sq and step all non-trivial
        loss = model(torch.ones(3, 64)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    checkpoint.save(Path(root), model, opt, None, CheckpointMeta(step=2, world_size=dist.get_world_size()))
    full = _full_state(model, opt)
    if rank == 0:
        torch.save(full, Path(root) / "reference.pt")


def load_resharded(rank: int, world: int, _port: int, root: str) -> dict:
    from trainer import checkpoint

    model, opt = _sharded_adam(world, zeroed=True)  # and an empty optimizer
    step = checkpoint.load(Path(root) / "step-000002", model, opt, None)
    got = _full_state(model, opt)
    if rank != 0:
        return {"step": step}
    want = torch.load(Path(root) / "reference.pt", weights_only=False)
    differ = sorted(k for k in want if not torch.equal(torch.as_tensor(got.get(k)), torch.as_tensor(want[k])))
    return {"step": step, "keys_equal": sorted(got) == sorted(want), "differ": differ, "tensors": len(want)}


def test_a_checkpoint_resumes_exactly_on_another_number_of_ranks(tmp_path):
    """Elastic resume: a checkpoint of 4 ranks loads on 2 and one of 2 on 4, every full parameter and optimizer
    tensor (AdamW exp_avg, exp_avg_sq, step) equal to what was saved (DCP reshards the DTensors)."""
    import functools

    for saved, loaded in ((4, 2), (2, 4)):
        root = tmp_path / f"{saved}-to-{loaded}"
        root.mkdir()
        run_ranks(saved, functools.partial(save_trained, root=str(root)))
        res = run_ranks(loaded, functools.partial(load_resharded, root=str(root)))
        assert all(r["step"] == 2 for r in res.values()), res
        r = res[0]
        assert r["keys_equal"] and not r["differ"], f"{saved} -> {loaded} ranks: {r}"
        assert r["tensors"] == 10 + 10 * 3, r  # 10 parameters (4 Linear + LayerNorm), AdamW step/exp_avg/exp_avg_sq each


class Decoder(torch.nn.Module):
    """The layout shard_model looks for: model.model.layers."""

    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.model.layers:  # type: ignore[union-attr]
            x = layer(x)
        return x


def units_after_forward(rank: int, world: int, _port: int) -> dict:
    """trainer.parallel.shard_model: what a unit holds between the forward and the backward."""
    from types import SimpleNamespace

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from trainer.parallel import shard_model

    out = {}
    for offload in (False, True):
        torch.manual_seed(0)
        model = Decoder()
        par = SimpleNamespace(mesh=init_device_mesh("cpu", (world,)))
        shard_model(model, par, torch.float32, cpu_offload=offload)  # type: ignore[arg-type]
        model(torch.randn(2, 8)).sum().backward()
        loss = model(torch.randn(2, 8)).sum()
        out[f"offload={offload}"] = {"kept_gathered": not any(isinstance(p, DTensor) for p in model.model.layers[0].parameters())}  # type: ignore[index,union-attr]
        loss.backward()
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_one_rank_keeps_its_units_gathered_between_forward_and_backward(world):
    """With nothing to gather (a shard group of one rank) a unit keeps its compute-dtype copy from the forward to the
    backward instead of being resharded and gathered again; with 2 ranks, or with cpu_offload, units reshard."""
    for rank, res in run_ranks(world, units_after_forward).items():
        assert res["offload=False"]["kept_gathered"] == (world == 1), (rank, world, res)
        assert not res["offload=True"]["kept_gathered"], (rank, world, res)
