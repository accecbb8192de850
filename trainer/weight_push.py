"""Per-node weight push: every rank gathers the FSDP2 parameters one at a time (never a full state dict);
each node leader streams them to its own server through vLLM's native protocol:

    POST /init_weight_transfer_engine   once (the leader hosts the transfer group as rank 0)
    POST /start_weight_update
    POST /update_weights {names, dtype_names, shapes}   in a thread, while the leader broadcasts
    POST /finish_weight_update
    POST /reset_prefix_cache            cached KV of the old weights must not be reused

All nodes push at the same time, each on its own node's links. Transports: `gloo` (ours, CPU),
`nccl` (vLLM's, GPU), `ipc` (vLLM's, same GPU); the version-dependent bits live in trainer.vllm_compat.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from trainer import vllm_compat
from trainer.server_client import ServerClient, ServerError


def param_metadata(model: torch.nn.Module, dtype: torch.dtype) -> list[tuple[str, str, list[int]]]:
    """(name, dtype sent, full shape) of every parameter, without gathering (DTensor.shape is the global shape)."""
    return [(n, str(dtype).removeprefix("torch."), list(p.shape)) for n, p in model.named_parameters()]


def iter_full_params(model: torch.nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, full tensor) one parameter at a time. Every rank must iterate to the end: a DTensor's
    full_tensor() is a collective over its mesh (with HSDP, only the node's shard group). Parameters that
    are not DTensors (left unsharded) are yielded as they are. The peak extra memory is one full parameter
    (plus its cast to the serving dtype, e.g. fp32 master weights sent as bf16)."""
    for name, p in model.named_parameters():
        t = p.detach()
        full = t.full_tensor() if isinstance(t, DTensor) else t
        yield name, (full if dtype is None else full.to(dtype)).contiguous()


class GlooSender:
    """Trainer side of the project's gloo engine: a TCPStore on 127.0.0.1 plus a loopback gloo group."""

    def __init__(self, client: ServerClient, port: int, server_world: int, timeout_s: float):
        from trainer.gloo_engine import loopback_gloo_group

        self.client = client
        timeout = timedelta(seconds=timeout_s)
        world = 1 + server_world
        # wait_for_workers=False: the workers join later, from inside the init request below
        self.store = loopback_store(port, world, timeout)
        err: list[BaseException] = []

        def init() -> None:
            try:
                client.post("/init_weight_transfer_engine", {"init_info": {
                    "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": world}})
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                err.append(e)

        th = threading.Thread(target=init, daemon=True)
        th.start()
        self.group = loopback_gloo_group(self.store, 0, world, timeout)
        th.join(timeout_s)
        if err:
            raise err[0]
        if th.is_alive():
            raise ServerError(f"node {client.node}: /init_weight_transfer_engine on {client.base_url} did not return "
                              f"within {timeout_s:.0f} s")

    def send(self, tensor: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        try:
            self.group.broadcast([tensor], opts).wait()
        except RuntimeError as e:  # gloo's own timeout/peer-closed errors name neither the node nor the server
            raise ServerError(f"node {self.client.node}: sending weights to the vLLM server {self.client.base_url} failed "
                              f"at step {self.client.step}: {str(e).splitlines()[0]} (see logs/node{self.client.node}-vllm.log)") from None


def loopback_store(port: int, world: int, timeout: timedelta) -> dist.TCPStore:
    """A TCPStore master that listens on 127.0.0.1 only. TCPStore("127.0.0.1", ...) alone would listen on
    every interface; handing it a socket we bound to loopback keeps the push port off the network."""
    import socket

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(128)
    # the store owns the descriptor from here on (it closes it); detach so Python does not close it too
    return dist.TCPStore("127.0.0.1", port, world, is_master=True, timeout=timeout, wait_for_workers=False,
                         master_listen_fd=sock.detach(), use_libuv=True)


def make_sender(backend: str, client: ServerClient, port: int, server_world: int, timeout_s: float, device):
    if backend == "gloo":
        return GlooSender(client, port, server_world, timeout_s)
    if backend == "nccl":
        return vllm_compat.NcclSender(client, port, server_world, timeout_s, device)
    if backend == "ipc":
        return vllm_compat.IpcSender(client, timeout_s)
    raise ValueError(f"unknown weight transfer backend {backend!r}")


class NodePusher:
    """Runs on every rank; only the node leader owns a sender and talks to the server."""

    def __init__(self, model: torch.nn.Module, client: ServerClient | None, backend: str, port: int,
                 server_world: int, push_timeout_s: float, device, push_dtype: torch.dtype):
        self.model, self.client, self.backend, self.dtype = model, client, backend, push_dtype
        self.port, self.server_world, self.timeout_s, self.device = port, server_world, push_timeout_s, device
        self.sender = None
        self.meta = param_metadata(model, push_dtype)
        self.pushes = 0

    def push(self, step: int) -> float:
        """Push all parameters; returns seconds on the leader (0.0 elsewhere). Collective over the model's mesh."""
        t0 = time.time()
        leader = self.client is not None
        if not leader:
            for _ in iter_full_params(self.model, self.dtype):
                pass
            return 0.0
        client = self.client
        client.step = step
        if self.sender is None:
            self.sender = make_sender(self.backend, client, self.port, self.server_world, self.timeout_s, self.device)
        if self.backend == "ipc":
            self.sender.push(iter_full_params(self.model, self.dtype), self.meta, step)
        else:
            client.post("/start_weight_update", {})
            names, dtypes, shapes = (list(x) for x in zip(*self.meta, strict=True))
            result: list[BaseException] = []

            def update() -> None:
                try:
                    client.post("/update_weights", {"update_info": vllm_compat.update_info(self.backend, names, dtypes, shapes)},
                                timeout_s=self.timeout_s)
                except BaseException as e:  # noqa: BLE001
                    result.append(e)

            th = threading.Thread(target=update, daemon=True)
            th.start()
            for (name, tensor), (mname, _, shape) in zip(iter_full_params(self.model, self.dtype), self.meta, strict=True):
                assert name == mname and list(tensor.shape) == shape, (name, mname, tensor.shape, shape)
                if not result:  # after a failure keep iterating: the other ranks are still in the gather
                    self.sender.send(tensor)
            th.join(max(1.0, self.timeout_s - (time.time() - t0)))
            if result:
                raise result[0]
            if th.is_alive():
                raise ServerError(f"node {client.node}: weight push to {client.base_url} at step {step} did not finish "
                                  f"within trainer.push_timeout_s={self.timeout_s:.0f} s")
            client.post("/finish_weight_update", {})
        client.post("/reset_prefix_cache", {})
        self.pushes += 1
        return time.time() - t0
