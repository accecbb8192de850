"""Distributed units on CPU with gloo and several processes (one process proves little about collectives):
the completion-to-rank mapping with split and duplicate prompts, and the memory bound of the gather.
The server is faked at the process boundary (a function in place of the HTTP call)."""

from __future__ import annotations

import os
import socket
import weakref

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _worker(rank: int, world: int, port: int, q) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from trainer.generation import node_generate
    from trainer.parallel import Parallel
    from trainer.weight_push import iter_full_params

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    # two "nodes" of two ranks each
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    node = rank // 2
    par = Parallel(rank=rank, local_rank=rank % 2, world=world, node=node, node_group=groups[node],
                   node_ranks=[2 * node, 2 * node + 1], leader=2 * node, mesh=None, device=torch.device("cpu"))
    # prompt groups of 3 copies split across ranks and nodes, and the same prompt on several ranks
    same = [7, 7, 7]
    local = {0: [[1, 2], [1, 2], same], 1: [same, [3], [3]], 2: [same, same, [9, 9]], 3: [[9, 9], [9, 9], [1, 2]]}[rank]
    calls = []

    def fake_server(flat):
        calls.append(len(flat))
        # a distinct completion per entry: the node, the entry's position and its prompt, so any mix-up shows
        return [([100 * node + i] + p, [-0.5] * (1 + len(p))) for i, p in enumerate(flat)]

    mine, _ = node_generate(par, local, fake_server)
    ok_map = [c[1:] for c, _ in mine] == local and all(c[0] // 100 == node for c, _ in mine)
    positions = [c[0] % 100 for c, _ in mine]
    # memory bound of the gather: at most one full parameter alive at a time
    mesh = init_device_mesh("cpu", (world,))
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    for m in model:
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    alive, peak, full_ok = [], 0, True
    ref = {n: p for n, p in torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)]).named_parameters()}
    for name, t in iter_full_params(model):
        alive = [w for w in alive if w() is not None] + [weakref.ref(t)]
        peak = max(peak, sum(w().numel() for w in alive if w() is not None))
        full_ok &= list(t.shape) == list(ref[name].shape)
        del t
    q.put((rank, ok_map, positions, calls, peak, full_ok))
    dist.destroy_process_group()


def test_node_generation_mapping_and_gather_memory():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, 4, port, q)) for r in range(4)]
    for p in procs:
        p.start()
    res = {}
    for _ in procs:
        rank, ok, positions, calls, peak, full_ok = q.get(timeout=120)
        res[rank] = (ok, positions, calls, peak, full_ok)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    for rank, (ok, positions, _calls, peak, full_ok) in res.items():
        assert ok, f"rank {rank} got completions of other prompts or another node"
        assert positions == [3 * (rank % 2) + i for i in range(3)], positions  # its own slice, in order
        assert full_ok, "gathered tensors are not full-size"
        assert peak <= 64 * 64, f"rank {rank}: {peak} elements alive during the gather; bound is one weight (4096)"
    assert res[0][2] == [6] and res[2][2] == [6] and res[1][2] == [] and res[3][2] == []  # one request per node leader
