"""Spawned gloo ranks on this machine, for the distributed unit tests and the CPU benchmarks that need several
processes (one process proves little about collectives or about per-rank memory)."""

from __future__ import annotations

import os
import socket
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


def _entry(rank: int, world: int, port: int, q, fn: Callable[[int, int, int], Any]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    q.put((rank, fn(rank, world, port)))
    dist.destroy_process_group()
    q.close()
    q.join_thread()  # the result is in the pipe
    # interpreter teardown of a spawned gloo rank has aborted after its work was done and handed back ("terminate
    # called without an active exception", SIGABRT: seen once in a fresh-clone unit run); leave at once, as the trainer does
    os._exit(0)


def run_ranks(world: int, fn: Callable[[int, int, int], Any], timeout_s: float = 120) -> dict[int, Any]:
    """fn(rank, world, port) on `world` spawned gloo ranks; returns each rank's result."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, q, fn)) for r in range(world)]
    for p in procs:
        p.start()
    res = dict(q.get(timeout=timeout_s) for _ in procs)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
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
