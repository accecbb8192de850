"""Per-node weight push: every rank of the node takes part in the FSDP2 gathers, parameter by parameter, in
the serving dtype (never a full state dict, never fp32 then cast); the node leader hands the stream to its
transport (trainer.push.senders), which packs it into buckets and sends them to the node's own server, then
resets the server's prefix cache (cached KV of the old weights must not be reused). All nodes push at the
same time, each on its own node's links.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from trainer.push.senders import GlooSender, IpcSender, NcclSender, ParamMeta, Sender
from trainer.rollout.server import ServerClient, ServerError


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
    model: torch.nn.Module, dtype: torch.dtype, *, order_streams: bool = True
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
    sync before each reshard), kept only so tests/unit/test_gpu_push_order.py can show the race it fixes."""
    home = torch.cuda.current_stream() if order_streams and _live_cuda() else None
    return _walk_units(model, dtype, home)


def _walk_units(model: torch.nn.Module, dtype: torch.dtype, home: torch.cuda.Stream | None) -> Iterator[tuple[str, torch.Tensor]]:
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
                    out = t.to(dtype, copy=True).contiguous()
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


@dataclass(frozen=True)
class PushSettings:
    backend: str
    """gloo, nccl or ipc (the plan resolved auto)."""
    transfer_port: int
    server_world: int
    """The server's workers in the transfer group: tensor_parallel_size x data_parallel_size (every engine's)."""
    timeout_s: float
    dtype: torch.dtype
    bucket_bytes: int


def make_sender(s: PushSettings, client: ServerClient, meta: list[ParamMeta], device: torch.device) -> Sender:
    if s.backend == "gloo":
        return GlooSender(client, s.transfer_port, s.server_world, s.timeout_s, s.bucket_bytes)
    if s.backend == "nccl":
        return NcclSender(client, s.transfer_port, s.server_world, s.timeout_s, s.bucket_bytes, device)
    if s.backend == "ipc":
        return IpcSender(client, s.timeout_s, s.bucket_bytes, meta)
    raise ValueError(f"unknown weight transfer backend {s.backend!r}")


class NodePusher:
    """Runs on every rank; only the node leader (the rank with a client) owns a sender and talks to the server."""

    def __init__(self, model: torch.nn.Module, client: ServerClient | None, settings: PushSettings, device: torch.device):
        self.model, self.client, self.settings, self.device = model, client, settings, device
        self.sender: Sender | None = None
        self.meta = param_metadata(model, settings.dtype)
        self.pushes = 0

    def push(self, step: int, keep_in_flight: bool = False) -> float:
        """Push all parameters; returns seconds on the leader (0.0 elsewhere). Collective over the model's mesh.
        keep_in_flight (leader): requests are running on the server (generated ahead, max_staleness >= 2): freeze them
        in vLLM's queue during the push (/pause?mode=keep), then make them recompute their KV under the new weights
        and go on (/reset_prefix_cache?reset_running_requests=true, /resume): none is lost, aborted or finished on
        a half-written model. A push that fails in between raises its own error within trainer.push_timeout_s plus
        RESUME_AFTER_FAILURE_S: the /resume after it is best effort (the engine may be stuck in the transfer)."""
        t0 = time.time()
        params = iter_unsharded_params(self.model, self.settings.dtype)
        if self.client is None:
            for _ in params:  # the leader's gathers need every rank of the mesh
                pass
            return 0.0
        if self.sender is None:
            self.sender = make_sender(self.settings, self.client, self.meta, self.device)
        if keep_in_flight:
            self.client.post("/pause?mode=keep", {}, step=step)
        try:
            self.sender.push(params, self.meta, step)
            reset_prefix_cache(self.client, step, reset_running=keep_in_flight)
        except BaseException as e:
            if keep_in_flight:
                resume_after_failure(self.client, step, e)
            raise
        if keep_in_flight:
            self.client.post("/resume", {}, step=step)
        self.pushes += 1
        return time.time() - t0


RESUME_AFTER_FAILURE_S = 5.0
"""How long a failed push waits for /resume. A transfer that failed part way leaves the engine blocked in its
receive (PyNccl has no timeout; vLLM runs the update in its engine loop), so /resume cannot be served: waiting
trainer.request_timeout_s for it only delays the error that names the cause."""


def resume_after_failure(client: ServerClient, step: int, cause: BaseException) -> None:
    """Best effort, after a push failed between /pause and /resume: ask the server to resume within
    RESUME_AFTER_FAILURE_S, and never let that replace `cause` (the caller re-raises it)."""
    try:
        client.post("/resume", {}, timeout_s=RESUME_AFTER_FAILURE_S, step=step)
    except Exception as e:  # noqa: BLE001 - reported, the push's own error is the one raised
        print(
            f"node {client.node}: /resume after the failed push at step {step} did not succeed ({e}); "
            f"the push failed with: {str(cause).splitlines()[0] if str(cause) else type(cause).__name__}",
            file=sys.stderr,
            flush=True,
        )


def reset_prefix_cache(client: ServerClient, step: int, reset_running: bool = False) -> None:
    """KV cached for prompts under the old weights must not serve the new ones. vLLM answers 200 with
    {"success": false} when it could not reset (requests still running): retry briefly, then fail.
    reset_running: running requests are preempted and recompute their KV (tokens so far kept) under the new weights."""
    route = "/reset_prefix_cache" + ("?reset_running_requests=true" if reset_running else "")
    for _ in range(20):
        out = client.post(route, {}, step=step)
        if not isinstance(out, dict) or out.get("success", True) is not False:
            return
        time.sleep(0.1)
    raise ServerError(
        f"node {client.node}: {client.base_url}/reset_prefix_cache answered success=false 20 times at "
        f"step {step}; the server would reuse KV cached under the old weights"
    )
