"""The trainer side of a weight push, one class per transport, all behind one interface (`Sender`).

Every transport speaks vLLM 0.32's weight-transfer protocol over the node's own server (127.0.0.1), through
trainer.rollout.server.VllmServer:

    init_weight_transfer(init_info)   once, when the sender is built
    start_weight_update()
    update_weights(update_info)       gloo/nccl: once, while the leader broadcasts the chunks;
                                      ipc: once per chunk of the shared buffer
    finish_weight_update()

and all of them send packed chunks: parameters (already in the serving dtype) are laid end to end as
bytes into buckets of `trainer.bucket_mb`, with vLLM's own chunk rule (a chunk closes once it holds
more than the bucket), so one broadcast and one `load_weights` move a whole bucket, not one tensor.

  gloo  (CPU, the project's engine: trainer.push.gloo_engine) and
  nccl  (GPU, vLLM's engine) broadcast the chunks over a group of the trainer's leader (rank 0) and the
        server's workers; the gather of the next chunk overlaps the broadcast of this one.
  ipc   (one GPU shared by vLLM and the trainer): the project's mapped_ipc engine (trainer.push.ipc_engine): one
        staging buffer the server maps once, the whole model per request when it fits; built without
        torch.distributed (vLLM's own stateful ipc engine runs collectives on the default group, which here spans
        every node) and without vLLM's per-push layerwise reload.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from trainer.push.wire import ParamMeta, buffer_windows, encode_cuda_handle, loopback_gloo_group, update_info, window_views
from trainer.rollout.server import ServerError, VllmServer, server_log

Params = Iterator[tuple[str, torch.Tensor]]


class Sender(Protocol):
    def push(self, params: Params, meta: list[ParamMeta], step: int) -> None:
        """Send every parameter (consuming `params`, which yields them in `meta`'s order) and finish the update."""


def checked(params: Params, meta: list[ParamMeta]) -> Params:
    """Yield params, asserting each matches the metadata the receiver cuts its chunks by: a mismatch would
    corrupt a whole chunk, not one tensor."""
    for (name, t), m in zip(params, meta, strict=True):
        if name != m.name or list(t.shape) != list(m.shape) or str(t.dtype).removeprefix("torch.") != m.dtype:
            raise RuntimeError(f"push order broken at {name} {tuple(t.shape)} {t.dtype}: the receiver expects {m}")
        yield name, t


def call_while(
    client: VllmServer,
    route: str,
    post: Callable[[], Any],
    timeout_s: float,
    step: int,
    work: Callable[[], None],
    device: torch.device | None = None,
) -> None:
    """`post` (a request to the server's `route`, named in errors) while `work` runs (the two ends of a collective must both be in it): each in its own thread,
    while this one waits for both within timeout_s. Whichever fails first ends the wait at once with its error
    (a failed POST would leave the other end of a broadcast waiting forever: NCCL has no timeout); past the
    deadline, a ServerError naming the node, the route and the deadline. A thread left blocked is a daemon:
    the failure ends the process. device: the CUDA device `work` runs its collectives on (per thread in CUDA)."""
    done = threading.Event()
    errors: dict[str, BaseException] = {}
    finished: set[str] = set()

    def run(key: str, fn: Callable[[], None]) -> None:
        try:
            if key == "work" and device is not None and device.type == "cuda":
                torch.cuda.set_device(device)
            fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            errors[key] = e
        finally:
            finished.add(key)
            done.set()

    for key, fn in (("post", post), ("work", work)):
        threading.Thread(target=run, args=(key, fn), daemon=True, name=f"{key} {route}").start()
    deadline = time.time() + timeout_s
    while len(finished) < 2 and not errors and time.time() < deadline:
        done.wait(0.2)
        done.clear()
    if "post" in errors:  # the server's answer names the cause better than the broken transfer does
        raise errors["post"]
    if errors:
        raise errors["work"]
    if len(finished) < 2:
        raise ServerError(
            f"node {client.node}: {route} on {client.base_url} did not finish within {timeout_s:.0f} s "
            f"(trainer.push_timeout_s) at step {step}; see {server_log(client.node)}"
        )


# ----------------------------------------------------------------------------- broadcast transports


class BroadcastSender:
    """gloo and nccl: the leader is rank 0 of a group with the server's workers; one update_weights request
    runs while the leader broadcasts the packed chunks. Subclasses join the group and broadcast a chunk."""

    backend = ""
    device: torch.device | None = None

    def __init__(
        self,
        client: VllmServer,
        port: int,
        server_world: int,
        timeout_s: float,
        bucket_bytes: int,
        init_extra: dict | None = None,
    ):
        self.client, self.timeout_s, self.bucket_bytes = client, timeout_s, bucket_bytes
        world = 1 + server_world
        init_info = {
            "master_address": "127.0.0.1",
            "master_port": port,
            "rank_offset": 1,
            "world_size": world,
            "packed": True,
            "packed_buffer_size_bytes": bucket_bytes,
            "packed_num_buffers": 2,
            **self.extra_init_info(),
            **(init_extra or {}),  # trainer.push.adapter: the adapter's target (lora_adapter)
        }
        call_while(
            client,
            client.INIT_WEIGHTS,
            lambda: client.init_weight_transfer(init_info, timeout_s=timeout_s),
            timeout_s,
            0,
            lambda: self.join(port, world),
            self.device,
        )

    def extra_init_info(self) -> dict:
        return {}

    def join(self, port: int, world: int) -> None:
        raise NotImplementedError

    def broadcast_all(self, params: Params) -> None:
        raise NotImplementedError

    def push(self, params: Params, meta: list[ParamMeta], step: int) -> None:
        client = self.client
        client.start_weight_update(step=step)

        def send() -> None:
            try:
                self.broadcast_all(checked(params, meta))
            except RuntimeError as e:  # the transport's own errors name neither the node nor the server
                raise ServerError(
                    f"node {self.client.node}: sending weights ({self.backend}) to the vLLM server "
                    f"{self.client.base_url} beside its {client.UPDATE_WEIGHTS} request failed at step {step}: "
                    f"{str(e).splitlines()[0]} "
                    f"(see {server_log(self.client.node)})"
                ) from e

        info = update_info(meta)
        call_while(
            client,
            client.UPDATE_WEIGHTS,
            lambda: client.update_weights(info, timeout_s=self.timeout_s, step=step),
            self.timeout_s,
            step,
            send,
            self.device,
        )
        client.finish_weight_update(step=step)


class GlooSender(BroadcastSender):
    """The project's CPU transport: a TCPStore and a gloo group on 127.0.0.1 (trainer.push.gloo_engine is the server's side)."""

    backend = "gloo"

    def extra_init_info(self) -> dict:
        return {"timeout_s": self.timeout_s}  # the server's side of the group waits as long as we do

    def join(self, port: int, world: int) -> None:
        timeout = timedelta(seconds=self.timeout_s)
        self.store = loopback_store(port, world, timeout)  # the workers join from inside the init request
        self.group = loopback_gloo_group(self.store, 0, world, timeout)

    def broadcast_all(self, params: Params) -> None:
        broadcast_packed(self.group, params, self.bucket_bytes)


def broadcast_packed(group: dist.ProcessGroupGloo, params: Params, bucket_bytes: int) -> int:
    """Rank 0's side of a packed gloo push (trainer.push.gloo_engine.receive_packed is the other): vLLM's pack_tensors
    cuts the chunks, at most 2 broadcasts are in flight, so the gather of chunk k+1 overlaps sending chunk k.
    Returns the number of chunks."""
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    in_flight: list[tuple[dist.Work, torch.Tensor]] = []
    chunks = 0
    while (chunk := pack_tensors(params, lambda item: item[1], bucket_bytes)) is not None:
        if len(in_flight) == 2:
            in_flight.pop(0)[0].wait()
        work = group.broadcast([chunk.packed_tensor], opts)  # type: ignore[attr-defined]
        in_flight.append((work, chunk.packed_tensor))
        chunks += 1
    for pending, _ in in_flight:
        pending.wait()
    return chunks


def loopback_store(port: int, world: int, timeout: timedelta) -> dist.TCPStore:
    """A TCPStore master that listens on 127.0.0.1 only. TCPStore("127.0.0.1", ...) alone would listen on
    every interface; handing it a socket we bound to loopback keeps the push port off the network."""
    import socket

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(128)
    # the store owns the descriptor from here on (it closes it); detach so Python does not close it too
    return dist.TCPStore(
        "127.0.0.1",
        port,
        world,
        is_master=True,
        timeout=timeout,
        wait_for_workers=False,
        master_listen_fd=sock.detach(),
        use_libuv=True,
    )


LIB = "RCCL" if getattr(torch.version, "hip", None) else "NCCL"
"""The collective library the nccl sender runs on, as its errors name it (vLLM's PyNccl loads librccl on ROCm)."""


class NcclSender(BroadcastSender):
    """vLLM's `nccl` engine: its StatelessProcessGroup + PyNcclCommunicator as rank 0 (the pair the worker
    side builds) and its packed producer (2 buffers on side streams, the same geometry as the init info)."""

    backend = "nccl"

    def __init__(
        self,
        client: VllmServer,
        port: int,
        server_world: int,
        timeout_s: float,
        bucket_bytes: int,
        device: torch.device,
        init_extra: dict | None = None,
    ):
        self.device = device
        super().__init__(client, port, server_world, timeout_s, bucket_bytes, init_extra)

    def join(self, port: int, world: int) -> None:
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        pg = StatelessProcessGroup.create(
            host="127.0.0.1", port=port, rank=0, world_size=world, store_timeout=int(self.timeout_s)
        )
        assert self.device is not None
        self.comm = PyNcclCommunicator(pg, device=self.device)
        if self.comm.disabled or not getattr(self.comm, "available", True):
            # a disabled communicator's broadcast is a no-op: the server would wait for bytes that never come
            raise ServerError(
                f"node {self.client.node}: vLLM's PyNccl is disabled or {LIB} was not found in the trainer "
                f"(VLLM_DISABLE_PYNCCL, or no lib{LIB.lower()}); the nccl weight push cannot run"
            )

    def broadcast_all(self, params: Params) -> None:
        nccl_broadcast_packed(self.comm, params, self.bucket_bytes)


def nccl_broadcast_packed(group, params: Params, bucket_bytes: int) -> None:
    """The leader's side of a packed nccl push: vLLM's packed producer, with the geometry of the init info (2 buffers).
    It makes a chunk slot's side stream current around packing + broadcasting that chunk, and the parameters of the
    next chunk are pulled there too: `params` must hand each tensor over to whichever stream is current when it is
    pulled (trainer.push.gather.iter_unsharded_params does). group: PyNcclCommunicator (anything with its
    broadcast(tensor, src) on the current stream)."""
    from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

    packed_nccl_broadcast_producer(
        iterator=params,
        group=group,
        src=0,
        post_iter_func=lambda item: item[1],
        buffer_size_bytes=bucket_bytes,
        num_buffers=2,
    )


# ----------------------------------------------------------------------------- ipc


class MappedIpcSender:
    """The project's `mapped_ipc` engine (trainer.push.ipc_engine is the server's side): one staging buffer on the GPU,
    kept for the whole run and mapped by the server once, at init, with the push's layout; the parameters are copied
    into it window by window (buffer_windows: the whole model in one window when it fits ipc_buffer_bytes), casting as
    they are copied (the gather hands over master tensors as they are: trainer.push.gather, copy=False), and one
    update_weights request per window makes the server load that window's views into the live model. The request
    returning means the server has copied the window out (it syncs its device), so the next window may overwrite it.
    `phases`: the last push's seconds by part (copies, the window requests, start + finish), for the trainer's log."""

    def __init__(
        self, client: VllmServer, timeout_s: float, buffer_bytes: int, meta: list[ParamMeta], init_extra: dict | None = None
    ):
        from torch.multiprocessing.reductions import reduce_tensor

        self.client, self.timeout_s = client, timeout_s
        self.buffer_bytes = max(max(m.nbytes for m in meta), min(sum(m.nbytes for m in meta), buffer_bytes))
        self.windows = buffer_windows(meta, self.buffer_bytes)
        index = torch.cuda.current_device()
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        self.buffer = torch.empty(self.buffer_bytes, dtype=torch.uint8, device=torch.device("cuda", index))
        self.views = [window_views(self.buffer, w) for w in self.windows]  # made once: a push only copies into them
        _, handle_args = reduce_tensor(self.buffer)  # exported once: the server keeps the mapping open
        client.init_weight_transfer(
            {
                "handles": {uuid: encode_cuda_handle(handle_args)},
                "buffer_bytes": self.buffer_bytes,
                **update_info(meta),
                **(init_extra or {}),  # trainer.push.adapter: the adapter's target (lora_adapter)
            },
            timeout_s=timeout_s,
        )
        self.phases: dict[str, float] = {}

    def push(self, params: Params, meta: list[ParamMeta], step: int) -> None:
        deadline = time.time() + self.timeout_s
        copy_s = requests_s = 0.0
        t0 = time.time()
        self.client.start_weight_update(step=step)
        edges_s = time.time() - t0
        for k, (window, views) in enumerate(zip(self.windows, self.views, strict=True)):
            t0 = time.time()
            for m, view in zip(window, views, strict=True):
                name, t = next(params)
                if name != m.name or t.shape != view.shape:
                    raise RuntimeError(f"push order broken at {name} {tuple(t.shape)}: the receiver expects {m}")
                view.copy_(t)  # casts to the serving dtype as it copies
            torch.cuda.current_stream().synchronize()  # the server reads the window as soon as it gets the request
            t1 = time.time()
            self.client.update_weights(
                {"window": k, "windows": len(self.windows)}, timeout_s=self._left(deadline, step), step=step
            )
            copy_s, requests_s = copy_s + t1 - t0, requests_s + time.time() - t1
        for name, _ in params:  # every rank's gathers run to the end; the layout covers every parameter
            raise RuntimeError(f"push order broken: {name} is not in the receiver's layout")
        t0 = time.time()
        self.client.finish_weight_update(step=step, timeout_s=self._left(deadline, step))
        self.phases = {"copy_s": copy_s, "windows_s": requests_s, "start_finish_s": edges_s + time.time() - t0}

    def _left(self, deadline: float, step: int) -> float:
        left = deadline - time.time()
        if left <= 0:
            raise ServerError(
                f"node {self.client.node}: weight push (ipc) to {self.client.base_url} at step {step} "
                f"did not finish within trainer.push_timeout_s={self.timeout_s:.0f} s (see {server_log(self.client.node)})"
            )
        return left
