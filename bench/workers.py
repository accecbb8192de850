"""The measuring ranks, started by bench.run with torchrun (4 gloo ranks on this machine, emulating two
"nodes" of two trainer ranks each, every node with its own vLLM CPU server):

  push        ours: HSDP (2 nodes x 2 ranks), both node leaders push to their own server at the same time
              stock: FSDP over all 4 ranks, rank 0 gathers every parameter and pushes to one server
              ours, one node: node 0 pushes while node 1 idles (both "nodes" share this machine's CPUs;
              on a cluster each node has its own, so this is each node's time there)
              floors: an in-memory copy of the same bytes, and a raw gloo broadcast of them between 2 ranks
  generation  ours: gather within the node, one request per node server, scatter (both nodes at once)
              direct: each node's batch sent straight to its server (no gather/scatter)
              stock: gather of the whole batch to rank 0, one request to one server, broadcast to all
              ours, one node: node 0's half of the batch while node 1 idles (as for the push)

The same code the trainer runs (trainer.parallel.shard_model, trainer.push.pusher.NodePusher,
trainer.rollout.node.node_generate, trainer.rollout.server.VllmServer). Writes one JSON to argv[1].
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from trainer.parallel import Parallel, shard_model
from trainer.push.gather import iter_full_params
from trainer.push.pusher import NodePusher, PushSettings
from trainer.rollout.node import node_generate
from trainer.rollout.server import VllmServer

RANKS_PER_NODE = 2


class PeakRss(threading.Thread):
    """Samples this process's resident memory every 2 ms; peak - baseline is the push's extra memory."""

    def __init__(self):
        super().__init__(daemon=True)
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.base = self.peak = self.rss()
        self.stop = threading.Event()

    def rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(0.002)


def timed(fn, repeats: int) -> list[float]:
    """Wall seconds of fn() on the slowest rank, per repeat (barrier before, MAX after)."""
    out = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        out.append(dt.item())
    return out


def summary(xs: list[float], nbytes: int | None = None) -> dict:
    med = statistics.median(xs)
    d = {"median_s": round(med, 4), "runs_s": [round(x, 4) for x in xs]}
    if nbytes:
        d["gb_per_s"] = round(nbytes / med / 1e9, 3)
    return d


def parallels(rank: int, world: int) -> tuple[Parallel, Parallel]:
    """The two worlds on the same 4 ranks: ours (HSDP, 2 nodes of RANKS_PER_NODE, each node its own group and
    leader) and stock (FSDP over all ranks, one "node", rank 0 the leader). Every rank makes these collectives."""
    node = rank // RANKS_PER_NODE
    groups = [dist.new_group([n * RANKS_PER_NODE + i for i in range(RANKS_PER_NODE)], backend="gloo") for n in range(2)]
    node_ranks = [node * RANKS_PER_NODE + i for i in range(RANKS_PER_NODE)]
    hsdp = init_device_mesh("cpu", (2, RANKS_PER_NODE), mesh_dim_names=("replicate", "shard"))
    flat = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    cpu = torch.device("cpu")
    ours = Parallel(
        rank=rank,
        local_rank=rank % RANKS_PER_NODE,
        world=world,
        node=node,
        node_group=groups[node],
        node_ranks=node_ranks,
        leader=node_ranks[0],
        mesh=hsdp,
        device=cpu,
        allreduce_check={},
    )
    stock = Parallel(
        rank=rank,
        local_rank=rank,
        world=world,
        node=0,
        node_group=dist.group.WORLD,  # type: ignore[arg-type]
        node_ranks=list(range(world)),
        leader=0,
        mesh=flat,
        device=cpu,
        allreduce_check={},
    )
    return ours, stock


def load(model: str, par: Parallel) -> torch.nn.Module:
    """The benchmark model, the same initial weights on every rank, sharded for par."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return shard_model(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32), par, torch.float32)


def settings(port: int, bucket_bytes: int) -> PushSettings:
    return PushSettings(
        backend="gloo", transfer_port=port, server_world=1, timeout_s=600, dtype=torch.float32, bucket_bytes=bucket_bytes
    )


def measure_push(cfg: dict, ours: Parallel, m_ours: torch.nn.Module, m_stock: torch.nn.Module, client, params: int) -> dict:
    """push_ours, push_stock (both with rank 0's peak extra memory), the one-node pushes packed and unpacked,
    the node-local gather alone, then the floors."""
    rank, node, cpu = ours.rank, ours.node, ours.device
    nbytes, R = params * 4, cfg["repeats"]
    bucket = cfg["bucket_mb"] * 2**20
    push_ours = NodePusher(m_ours, client, settings(cfg["transfer_ports"][node], bucket), cpu)
    stock_client = client if rank == 0 else None
    push_stock = NodePusher(m_stock, stock_client, settings(cfg["transfer_ports"][0], bucket), cpu)
    res: dict = {}

    # ---------------------------------------------------------------- push
    push_ours.push(0)  # warm-up, and sets up the transfer groups
    push_stock.sender = push_ours.sender if rank == 0 else None  # the same server-0 transfer group
    rss = PeakRss() if rank == 0 else None
    if rss:
        rss.start()
    res["push_ours"] = summary(timed(lambda: push_ours.push(1), R), nbytes)
    if rss:
        res["push_ours"]["rank0_peak_extra_mb"] = round((rss.peak - rss.base) / 1e6, 1)
        rss.base = rss.peak = rss.rss()
    res["push_stock"] = summary(timed(lambda: push_stock.push(1), R), nbytes)
    if rss:
        res["push_stock"]["rank0_peak_extra_mb"] = round((rss.peak - rss.base) / 1e6, 1)
        rss.stop.set()
    # both "nodes" share this machine's cores, so ours above pays for two servers' work on the same CPUs.
    # On a cluster every node has its own: node 0 alone (node 1 idle) is what each node takes there.
    res["push_ours_one_node"] = summary(timed(lambda: push_ours.push(1) if node == 0 else None, R), nbytes)
    # the same push unpacked: a 1-byte bucket closes every chunk after one tensor (one broadcast and one
    # load_weights per parameter, what the push did before packing); the init info carries the bucket, so a
    # second transfer group (the other port) is set up for it
    per_tensor = NodePusher(m_ours, client, settings(cfg["transfer_ports_unpacked"][node], 1), cpu)
    per_tensor.push(0)
    res["push_ours_one_node_unpacked"] = summary(timed(lambda: per_tensor.push(1) if node == 0 else None, R), nbytes)
    # the node-local all-gather alone (what the push streams from), to split the push into gather and transfer
    res["gather_one_node"] = summary(
        timed(lambda: [None for _ in iter_full_params(m_ours, torch.float32)] if node == 0 else None, R), nbytes
    )
    res.update(measure_floors(rank, params, R))
    return res


def measure_floors(rank: int, params: int, R: int) -> dict:
    """floor_memcpy and floor_gloo_broadcast (only rank 0 fills the dict; every rank takes part)."""
    nbytes = params * 4
    res: dict = {}
    # floors, measured here in the same run: memcpy of the same bytes; a raw gloo broadcast rank 0 -> rank 1
    pair = dist.new_group([0, 1], backend="gloo")
    buf = torch.ones(params, dtype=torch.float32)
    if rank == 0:
        dst = torch.empty_like(buf)
        copies = []
        for _ in range(R):
            t0 = time.perf_counter()
            dst.copy_(buf)
            copies.append(time.perf_counter() - t0)
        res["floor_memcpy"] = summary(copies, nbytes)
        del dst
    bcast = []
    for _ in range(R):
        dist.barrier()
        t0 = time.perf_counter()
        if rank in (0, 1):
            dist.broadcast(buf, src=0, group=pair)
        bcast.append(time.perf_counter() - t0)
    if rank == 0:
        res["floor_gloo_broadcast"] = summary(bcast, nbytes)
    return res


def measure_generation(cfg: dict, ours: Parallel, client) -> dict:
    """gen_direct, gen_ours, gen_stock, gen_ours_one_node (median and tokens/s), and the batch's shape."""
    rank, world, node, R = ours.rank, ours.world, ours.node, cfg["repeats"]
    res: dict = {}

    # ---------------------------------------------------------------- generation
    g = cfg["generation"]
    torch.manual_seed(100 + rank)
    prompts = [torch.randint(3, cfg["vocab"], (g["prompt_tokens"],)).tolist() for _ in range(g["prompts_per_rank"])]
    kw = {"max_tokens": g["max_tokens"], "temperature": 1.0, "extra": {"ignore_eos": True}}

    def ours_gen():
        node_generate(ours, prompts, lambda flat_: client.complete(flat_, **kw))

    node_prompts = [None] * RANKS_PER_NODE if ours.is_leader else None
    dist.gather_object(prompts, node_prompts, dst=ours.leader, group=ours.node_group)
    node_batch: list[list[int]] = []
    for rank_prompts in node_prompts or []:
        node_batch += rank_prompts or []

    def direct_gen():
        if ours.is_leader:
            client.complete(node_batch, **kw)

    def stock_gen():  # TRL server mode: gather everything to rank 0, one server, broadcast back, slice
        everyone: list = [None] * world
        dist.all_gather_object(everyone, prompts)
        outs = [None]
        if rank == 0:
            outs = [client.complete([p for rp in everyone for p in rp], **kw)]
        dist.broadcast_object_list(outs, src=0)
        mine = outs[0][rank * len(prompts) : (rank + 1) * len(prompts)]
        assert len(mine) == len(prompts)

    def ours_gen_one_node():  # node 0 alone, node 1 idle: each node's time when it has its own hardware
        if node == 0:
            node_generate(ours, prompts, lambda flat_: client.complete(flat_, **kw))

    ours_gen()  # warm-up (compiles, fills caches)
    tokens = world * g["prompts_per_rank"] * g["max_tokens"]
    for name, fn, share in (
        ("gen_direct", direct_gen, 1),
        ("gen_ours", ours_gen, 1),
        ("gen_stock", stock_gen, 1),
        ("gen_ours_one_node", ours_gen_one_node, 2),
    ):
        res[name] = summary(timed(fn, R))
        res[name]["tokens_per_s"] = round(tokens / share / res[name]["median_s"], 1)
    res["generation"] = {**g, "ranks": world, "tokens_per_batch": tokens}
    return res


def main(out_path: str, cfg_path: str) -> None:
    cfg = json.loads(open(cfg_path).read())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    assert world == 2 * RANKS_PER_NODE, world
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=600))
    ours, stock = parallels(rank, world)
    m_ours, m_stock = load(cfg["model"], ours), load(cfg["model"], stock)
    params = sum(p.numel() for p in m_ours.parameters())
    nbytes = params * 4
    urls, model, R = cfg["server_urls"], cfg["model"], cfg["repeats"]
    client = VllmServer(urls[ours.node], model, ours.node, 600) if ours.is_leader else None
    res: dict = {"params": params, "bytes": nbytes, "ranks": world, "nodes": 2, "repeats": R, "bucket_mb": cfg["bucket_mb"]}
    res.update(measure_push(cfg, ours, m_ours, m_stock, client, params))
    res.update(measure_generation(cfg, ours, client))
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(res, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
