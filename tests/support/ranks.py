"""Spawned gloo ranks on this machine, for the distributed unit tests and the CPU benchmarks that need several
processes (one process proves little about collectives or about per-rank memory)."""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class RankError(RuntimeError):
    """A spawned rank raised (its traceback is in the message), died without handing back a result, or missed the
    deadline."""


def _entry(rank: int, world: int, port: int, q, fn: Callable[[int, int, int], Any]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result = fn(rank, world, port)
    except BaseException:  # hand the traceback to the parent, which fails at once (the other ranks may wait for us)
        q.put((rank, False, traceback.format_exc()))
        q.close()
        q.join_thread()
        os._exit(1)
    q.put((rank, True, result))
    dist.destroy_process_group()
    q.close()
    q.join_thread()  # the result is in the pipe
    # interpreter teardown of a spawned gloo rank has aborted after its work was done and handed back ("terminate
    # called without an active exception", SIGABRT: seen once in a fresh-clone unit run); leave at once, as the trainer does
    os._exit(0)


def run_ranks(world: int, fn: Callable[[int, int, int], Any], timeout_s: float = 120) -> dict[int, Any]:
    """fn(rank, world, port) on `world` spawned gloo ranks; returns each rank's result. The first rank that raises
    (or dies without a result) fails the call at once with RankError, its traceback in the message; the other
    ranks are killed."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, q, fn)) for r in range(world)]
    for p in procs:
        p.start()
    res: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s

    def take(item: tuple[int, bool, Any]) -> None:
        rank, ok, value = item
        if not ok:
            raise RankError(f"rank {rank} of {world} raised:\n{value}")
        res[rank] = value

    try:
        while len(res) < world:
            try:
                take(q.get(timeout=0.5))
                continue
            except queue.Empty:
                pass
            ended = [r for r, p in enumerate(procs) if r not in res and p.exitcode is not None]
            if ended:  # what it put before it ended may still be in the pipe
                try:
                    while True:
                        take(q.get(timeout=2))
                except queue.Empty:
                    pass
                gone = [(r, procs[r].exitcode) for r in ended if r not in res]
                if gone:
                    raise RankError(
                        "; ".join(f"rank {r} of {world} exited with code {c} without handing back a result" for r, c in gone)
                        + " (killed, crashed in native code, or its result could not be pickled: see its stderr above)"
                    )
            if time.monotonic() > deadline:
                missing = [r for r in range(world) if r not in res]
                raise RankError(f"ranks {missing} of {world} handed back nothing within {timeout_s:g} s (a hang?)")
    except BaseException:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(10)
        raise
    for p in procs:
        p.join(30)
        if p.exitcode != 0:
            raise RankError(f"rank {procs.index(p)} of {world} handed back its result, then exited with code {p.exitcode}")
    return res


def cpu_parallel(rank: int, world: int, nodes: int = 1):
    """A trainer.parallel.Parallel for a spawned CPU rank: `nodes` equal "nodes" (HSDP mesh when more than one)."""
    from torch.distributed.device_mesh import init_device_mesh

    from trainer.parallel import Parallel

    per = world // nodes
    groups = [dist.new_group(list(range(n * per, (n + 1) * per))) for n in range(nodes)]
    node = rank // per
    if nodes > 1:
        mesh = init_device_mesh("cpu", (nodes, per), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    return Parallel(
        rank=rank,
        local_rank=rank % per,
        world=world,
        node=node,
        node_group=groups[node],
        node_ranks=list(range(node * per, (node + 1) * per)),
        leader=node * per,
        mesh=mesh,
        device=torch.device("cpu"),
        allreduce_check={},
    )
