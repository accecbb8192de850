"""The trainer's side of a push before any transport: every rank of the node takes part in the FSDP2 gathers, one
unit (a decoder layer) or one parameter at a time, in the serving dtype (never a full state dict, never fp32 then
cast), and each gathered tensor is handed over to the consumer's CUDA stream (the N1/N3/N6 fix, see
iter_unsharded_params)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from trainer.push.wire import ParamMeta


def param_metadata(model: torch.nn.Module, dtype: torch.dtype) -> list[ParamMeta]:
    """(name, dtype sent, full shape) of every parameter, without gathering (DTensor.shape is the global shape)."""
    return [ParamMeta(n, str(dtype).removeprefix("torch."), list(p.shape)) for n, p in model.named_parameters()]


def owning_units(model: torch.nn.Module) -> list[tuple[str, FSDPModule | None, torch.nn.Module, str]]:
    """(name, the FSDP2 unit that shards it, the module holding it, its attribute name) per parameter, in
    named_parameters() order. The unit is the innermost FSDPModule among the parameter's ancestors."""
    modules = dict(model.named_modules())
    out = []
    for name, _ in model.named_parameters():
        path, _, attr = name.rpartition(".")
        unit: FSDPModule | None = None
        parts = path.split(".") if path else []
        for i in range(len(parts), -1, -1):
            m = modules[".".join(parts[:i])]
            if isinstance(m, FSDPModule):
                unit = m
                break
        out.append((name, unit, modules[path], attr))
    return out


def _live_cuda() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def settle_copies() -> None:
    """order_streams=False only (the walk before streams were ordered): before reshard() frees a unit's gathered
    storage, wait for the copies out of it, enqueued on the current CUDA stream."""
    if _live_cuda():
        torch.cuda.current_stream().synchronize()


def hand_over(t: torch.Tensor, home: torch.cuda.Stream | None) -> torch.Tensor:
    """A tensor made on `home` is about to be used on the consumer's current stream (vLLM's packed producer packs
    and broadcasts each chunk on one of its own side streams): that stream waits for everything enqueued on `home`
    so far (the gather and the copy), and the allocator may not reuse the tensor's block on `home` until the
    consumer's work enqueued up to its release has run (record_stream)."""
    if home is None or not t.is_cuda:
        return t
    consumer = torch.cuda.current_stream(t.device)
    if consumer != home:
        consumer.wait_stream(home)
        t.record_stream(consumer)
    return t


def iter_unsharded_params(
    model: torch.nn.Module, dtype: torch.dtype, *, order_streams: bool = True, copy: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """Like iter_full_params, but one all-gather per FSDP2 unit (a decoder layer) instead of one per parameter:
    `unshard()` gathers a unit's parameters in one collective, in its mixed-precision param dtype (the serving
    dtype, when trainer.dtype is), and registers them on the module; `reshard()` frees them. The root unit (the
    embedding and final norm) stays unsharded for the whole walk. Peak extra memory: the root unit plus one layer.
    Falls back to iter_full_params when the model is not FSDP2-sharded.

    CUDA streams: every gather and copy runs on the stream current HERE, at the call (the caller's: the one the
    optimizer wrote the parameters on), not on whichever stream is current when the consumer pulls a parameter.
    vLLM's nccl producer pulls the parameters of one unit under two side streams in turn (one per chunk slot):
    a unit gathered under one and copied under the other raced (N1), the first gather did not wait for the
    optimizer (N3), and the gathered units were cached in side-stream pools that training cannot reuse (N6).
    Each yielded tensor is handed to the consumer's stream (`hand_over`); reshard() needs no host sync, since
    every read of the gathered storage is on the caller's stream, before the free in stream order.
    order_streams=False: the walk without this (gathers and copies on the consumer's current stream, a host
    sync before each reshard), kept only so tests/unit/test_gpu_push_order.py can show the race it fixes.
    copy=False: each parameter is yielded as a view of its unit's gathered storage (or its own tensor when nothing is
    sharded), valid until the next one is pulled (the unit may be resharded then) and not necessarily in `dtype`: for
    a consumer that copies each tensor out at once on the same stream, casting as it copies (the mapped ipc sender),
    which saves one copy (or two) of the whole model per push.
    Nothing sharded (one rank per shard group): no unshard at all, each parameter's local tensor is whole."""
    home = torch.cuda.current_stream() if order_streams and _live_cuda() else None
    if _whole_on_every_rank(model, on_gpu=_live_cuda()):
        return _walk_local(model, dtype, home, copy)
    return _walk_units(model, dtype, home, copy)


def _whole_on_every_rank(model: torch.nn.Module, on_gpu: bool) -> bool:
    """Every parameter's local tensor is the whole parameter: a shard group of one rank (one GPU per node, or
    every node replicating). Then there is nothing to gather: unshard() would only copy each unit once more.
    on_gpu: and it is on the GPU (with cpu_offload the shards live in host memory: unshard() brings them over)."""
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        if tuple(local.shape) != tuple(p.shape) or (on_gpu and not local.is_cuda):
            return False
    return True


def _walk_local(
    model: torch.nn.Module, dtype: torch.dtype, home: torch.cuda.Stream | None, copy: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """The walk when nothing is sharded: each parameter's own (master) tensor, cast on the caller's stream, or, with
    copy=False, as it is (the consumer casts while it copies: one kernel instead of a cast and a copy)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            t = p.detach()
            t = t.to_local() if isinstance(t, DTensor) else t
            if copy:
                with _stream(home):
                    t = t.to(dtype, copy=True)
            yield name, hand_over(t, home)


def _walk_units(
    model: torch.nn.Module, dtype: torch.dtype, home: torch.cuda.Stream | None, copy: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    plan = owning_units(model)
    if not isinstance(model, FSDPModule) or any(unit is None for _, unit, _, _ in plan):
        for name, t in _on(home, iter_full_params(model, dtype)):
            yield name, hand_over(t, home)
        return
    with torch.no_grad():
        with _stream(home):
            model.unshard()
        current: FSDPModule | None = None
        try:
            for name, unit, holder, attr in plan:
                with _stream(home):
                    if unit is not model and unit is not current:
                        if current is not None:
                            if home is None:
                                settle_copies()
                            current.reshard()
                        current = unit
                        current.unshard()  # type: ignore[union-attr]
                    t = getattr(holder, attr).detach()
                    if isinstance(t, DTensor):  # not an unsharded view: gather it alone
                        t = t.full_tensor()
                    # a copy: the unit's gathered storage is freed by reshard(), while a packer may still hold the
                    # tensor (vLLM's pack_tensors keeps views until its chunk is full, across units)
                    out = t.to(dtype, copy=True).contiguous() if copy else t
                yield name, hand_over(out, home)
        finally:
            with _stream(home):
                if home is None:
                    settle_copies()
                if current is not None:
                    current.reshard()
                model.reshard()


def _stream(s: torch.cuda.Stream | None) -> AbstractContextManager:
    return torch.cuda.stream(s) if s is not None else nullcontext()


def _on(home: torch.cuda.Stream | None, it: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Run each step of `it` with `home` current (never across a yield: the consumer's stream stays its own)."""
    while True:
        with _stream(home):
            item = next(it, None)
        if item is None:
            return
        yield item


def iter_full_params(model: torch.nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, full tensor) one parameter at a time, cast to `dtype` before the gather (half the bytes of
    an fp32 gather for bf16 serving). Every rank must iterate to the end: a DTensor's full_tensor() is a
    collective over its mesh (with HSDP, only the node's shard group). Parameters that are not DTensors
    (left unsharded) are yielded as they are. The peak extra memory is one full parameter in `dtype`."""
    for name, p in model.named_parameters():
        t = p.detach()
        if dtype is not None and t.dtype != dtype:
            t = t.to(dtype)  # on a DTensor: each rank casts its own shard
        full = t.full_tensor() if isinstance(t, DTensor) else t
        yield name, full.contiguous()
