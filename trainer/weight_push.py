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
from torch.distributed.tensor import DTensor

from trainer.senders import GlooSender, IpcSender, NcclSender, ParamMeta, Sender
from trainer.server_client import ServerClient, ServerError


def param_metadata(model: torch.nn.Module, dtype: torch.dtype) -> list[ParamMeta]:
    """(name, dtype sent, full shape) of every parameter, without gathering (DTensor.shape is the global shape)."""
    return [ParamMeta(n, str(dtype).removeprefix("torch."), list(p.shape)) for n, p in model.named_parameters()]


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
    """The server's workers in the transfer group (tensor_parallel_size)."""
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

    def push(self, step: int) -> float:
        """Push all parameters; returns seconds on the leader (0.0 elsewhere). Collective over the model's mesh."""
        t0 = time.time()
        params = iter_full_params(self.model, self.settings.dtype)
        if self.client is None:
            for _ in params:  # the leader's gathers need every rank of the mesh
                pass
            return 0.0
        if self.sender is None:
            self.sender = make_sender(self.settings, self.client, self.meta, self.device)
        self.sender.push(params, self.meta, step)
        reset_prefix_cache(self.client, step)
        self.pushes += 1
        return time.time() - t0


def reset_prefix_cache(client: ServerClient, step: int) -> None:
    """KV cached for prompts under the old weights must not serve the new ones. vLLM answers 200 with
    {"success": false} when it could not reset (requests still running): retry briefly, then fail."""
    for _ in range(20):
        out = client.post("/reset_prefix_cache", {}, step=step)
        if not isinstance(out, dict) or out.get("success", True) is not False:
            return
        time.sleep(0.1)
    raise ServerError(
        f"node {client.node}: {client.base_url}/reset_prefix_cache answered success=false 20 times at "
        f"step {step}; the server would reuse KV cached under the old weights"
    )
