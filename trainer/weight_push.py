"""Per-node weight push: every rank of the node takes part in the FSDP2 gathers, parameter by parameter, in
the serving dtype (never a full state dict, never fp32 then cast); the node leader hands the stream to its
transport (trainer.senders), which packs it into buckets and sends them to the node's own server, then
resets the server's prefix cache (cached KV of the old weights must not be reused). All nodes push at the
same time, each on its own node's links.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from trainer.senders import GlooSender, IpcSender, NcclSender, ParamMeta, Sender
from trainer.server_client import ServerClient, ServerError


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


def settle_copies() -> None:
    """Before reshard() frees a unit's gathered storage: the copies out of it were only enqueued on the current
    CUDA stream, and the allocator may hand the freed block to the next unit's all-gather on FSDP's own stream."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()


def iter_unsharded_params(model: torch.nn.Module, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Like iter_full_params, but one all-gather per FSDP2 unit (a decoder layer) instead of one per parameter:
    `unshard()` gathers a unit's parameters in one collective, in its mixed-precision param dtype (the serving
    dtype, when trainer.dtype is), and registers them on the module; `reshard()` frees them. The root unit (the
    embedding and final norm) stays unsharded for the whole walk. Peak extra memory: the root unit plus one layer.
    Falls back to iter_full_params when the model is not FSDP2-sharded."""
    plan = owning_units(model)
    if not isinstance(model, FSDPModule) or any(unit is None for _, unit, _, _ in plan):
        yield from iter_full_params(model, dtype)
        return
    with torch.no_grad():
        model.unshard()
        current: FSDPModule | None = None
        try:
            for name, unit, holder, attr in plan:
                if unit is not model and unit is not current:
                    if current is not None:
                        settle_copies()
                        current.reshard()
                    current = unit
                    current.unshard()  # type: ignore[union-attr]
                t = getattr(holder, attr).detach()
                if isinstance(t, DTensor):  # not an unsharded view: gather it alone
                    t = t.full_tensor()
                # a copy: the unit's gathered storage is freed by reshard(), while a packer may still hold the
                # tensor (vLLM's pack_tensors keeps views until its chunk is full, across units)
                yield name, t.to(dtype, copy=True).contiguous()
        finally:
            settle_copies()
            if current is not None:
                current.reshard()
            model.reshard()


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
        a half-written model."""
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
        finally:
            if keep_in_flight:
                self.client.post("/resume", {}, step=step)
        self.pushes += 1
        return time.time() - t0


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
