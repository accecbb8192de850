"""Per-node weight push: every rank of the node takes part in the FSDP2 gathers (trainer.push.gather); the node
leader hands the stream to its transport (trainer.push.senders), which packs it into buckets and sends them to the
node's own server, then resets the server's prefix cache (cached KV of the old weights must not be reused). All nodes
push at the same time, each on its own node's links.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from trainer.checkpoint_names import served_names
from trainer.push.gather import iter_unsharded_params, param_metadata
from trainer.push.senders import GlooSender, MappedIpcSender, NcclSender, Sender
from trainer.push.wire import ParamMeta
from trainer.rollout.server import VllmServer


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
    ipc_buffer_bytes: int = 2048 * 2**20
    """ipc only: the staging buffer the server maps once (trainer.ipc_buffer_mb)."""


def make_sender(
    s: PushSettings, client: VllmServer, meta: list[ParamMeta], device: torch.device, init_extra: dict | None = None
) -> Sender:
    """init_extra: more of the server engine's init info (trainer.push.adapter's lora_adapter: the pushes are an adapter's)."""
    if s.backend == "gloo":
        return GlooSender(client, s.transfer_port, s.server_world, s.timeout_s, s.bucket_bytes, init_extra)
    if s.backend == "nccl":
        return NcclSender(client, s.transfer_port, s.server_world, s.timeout_s, s.bucket_bytes, device, init_extra)
    if s.backend == "ipc":
        return MappedIpcSender(client, s.timeout_s, s.ipc_buffer_bytes, meta, init_extra)
    raise ValueError(f"unknown weight transfer backend {s.backend!r}")


class NodePusher:
    """Runs on every rank; only the node leader (the rank with a client) owns a sender and talks to the server."""

    def __init__(self, model: torch.nn.Module, client: VllmServer | None, settings: PushSettings, device: torch.device):
        self.model, self.client, self.settings, self.device = model, client, settings, device
        self.sender: Sender | None = None
        self.meta = self.as_served(param_metadata(model, settings.dtype))
        self.pushes = 0
        self.phases: dict[str, float] = {}
        """The last push's seconds by part, where the sender measures them (ipc): the trainer log prints them."""

    def push(self, step: int, keep_in_flight: bool = False) -> float:
        """Push all parameters; returns seconds on the leader (0.0 elsewhere). Collective over the model's mesh.
        keep_in_flight (leader): requests are running on the server (generated ahead, max_staleness >= 2): freeze them
        in vLLM's queue during the push (pause_keep), then make them recompute their KV under the new weights
        and go on (reset_prefix_cache(running=True), resume): none is lost, aborted or finished on
        a half-written model. A push that fails in between raises its own error within trainer.push_timeout_s plus
        RESUME_AFTER_FAILURE_S: the resume after it is best effort (the engine may be stuck in the transfer)."""
        t0 = time.time()
        if self.client is None:  # the leader's gathers need every rank of the mesh; nothing is kept here, so no copies
            for _ in iter_unsharded_params(self.model, self.settings.dtype, copy=False):
                pass
            return 0.0
        params = served_stream(self.params(), self.served)
        if self.sender is None:
            self.sender = make_sender(self.settings, self.client, self.meta, self.device)
        client, sender = self.client, self.sender

        def send() -> None:
            sender.push(params, self.meta, step)
            t_reset = time.time()
            client.reset_prefix_cache(step, running=keep_in_flight)
            self.phases = {**getattr(sender, "phases", {}), "reset_prefix_cache_s": time.time() - t_reset}

        with_requests_paused(client, step, keep_in_flight, send)
        self.pushes += 1
        took = time.time() - t0
        parts = ", ".join(f"{k.removesuffix('_s')} {v * 1e3:.1f}" for k, v in self.phases.items())
        print(f"[push node {self.client.node} step {step}] {took * 1e3:.1f} ms: {parts} (ms)", flush=True)
        return took

    def as_served(self, meta: list[ParamMeta]) -> list[ParamMeta]:
        """meta under the names vLLM's load_weights takes (trainer.checkpoint_names.served_names: Mixtral's experts, ...);
        sets self.served, which push() renames the stream with."""
        self.served = served_names(self.model, [m.name for m in meta])
        return [m._replace(name=self.served[m.name]) for m in meta]

    def params(self) -> Iterator[tuple[str, torch.Tensor]]:
        """What a push sends, in self.meta's order (trainer.push.adapter's merged LoRA push sends other tensors)."""
        # the ipc sender copies each tensor into its staging buffer at once (casting): no copy of the walk's own needed
        return iter_unsharded_params(self.model, self.settings.dtype, copy=self.settings.backend != "ipc")


def served_stream(params: Iterator[tuple[str, torch.Tensor]], served: dict[str, str]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, t in params:
        yield served[name], t


def with_requests_paused(client: VllmServer, step: int, keep_in_flight: bool, push: Callable[[], None]) -> None:
    """Run `push` (the transfer and the prefix-cache reset); with keep_in_flight, between pause_keep and resume, and a
    push that fails in between still asks for the resume (best effort) before its own error is raised."""
    if keep_in_flight:
        client.pause_keep(step)
    try:
        push()
    except BaseException as e:
        if keep_in_flight:
            resume_after_failure(client, step, e)
        raise
    if keep_in_flight:
        client.resume(step)


RESUME_AFTER_FAILURE_S = 5.0
"""How long a failed push waits for the resume request. A transfer that failed part way leaves the engine blocked in its
receive (PyNccl has no timeout; vLLM runs the update in its engine loop), so resume cannot be served: waiting
trainer.request_timeout_s for it only delays the error that names the cause."""


def resume_after_failure(client: VllmServer, step: int, cause: BaseException) -> None:
    """Best effort, after a push failed between pause_keep and resume: ask the server to resume within
    RESUME_AFTER_FAILURE_S, and never let that replace `cause` (the caller re-raises it)."""
    try:
        client.resume(step, timeout_s=RESUME_AFTER_FAILURE_S)
    except Exception as e:  # noqa: BLE001 - reported, the push's own error is the one raised
        print(
            f"node {client.node}: {client.RESUME} after the failed push at step {step} did not succeed ({e}); "
            f"the push failed with: {str(cause).splitlines()[0] if str(cause) else type(cause).__name__}",
            file=sys.stderr,
            flush=True,
        )
