"""torch.distributed set-up from the plan: the world, one process group per node, the FSDP2 mesh
(HSDP: replicate across nodes x shard within a node), and the model sharded on it."""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from launcher.core import emulation
from launcher.core.jobdir import Env, JobDir
from launcher.core.plan import Plan
from launcher.core.platform import MASKS, cores_of
from trainer import trl_glue


@dataclass
class Parallel:
    rank: int
    local_rank: int
    world: int
    node: int
    node_group: dist.ProcessGroup
    node_ranks: list[int]
    leader: int
    """Global rank of this node's leader (local rank 0): the only rank that talks to the node's server."""
    mesh: DeviceMesh
    device: torch.device

    allreduce_check: dict[str, float]
    """An all-reduce over every rank at start-up: what it gave and what it must give."""

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader

    def log(self, *what: object) -> None:
        print(f"[trainer rank {self.rank} node {self.node}]", *what, flush=True)

    def describe(self) -> str:
        """The world as this rank sees it, with the GPUs it was given and the NCCL it loaded (a site NCCL
        shadowing torch's own shows here)."""
        mask = next((k for k in MASKS if k in os.environ), "CUDA_VISIBLE_DEVICES")  # rocm: usually none (all GPUs)
        gpus = f" ({mask}={os.environ.get(mask, '')!r}"
        lib = "RCCL" if torch.version.hip else "NCCL"  # RCCL answers torch.cuda.nccl.version() on ROCm
        gpus += f", {lib} {'.'.join(map(str, torch.cuda.nccl.version()))})" if self.device.type == "cuda" else ")"
        return (
            f"world {self.world}, node ranks {self.node_ranks}, leader {self.leader}, mesh {self.mesh}, "
            f"device {self.device}{gpus}"
        )

    def close(self) -> None:
        dist.barrier()
        dist.destroy_process_group()


FAILED_KEY = "slurm_grpo/failed"
"""The key in torchrun's rendezvous store (shared by every rank of every node) that the first failing rank sets."""
WATCH_S = 0.5
STORE_POLLS_PER_S = 1000
"""The most checks a second all ranks together make on node 0's store (which also holds the rendezvous): the poll
period grows with the world past 500 ranks (1.8 s at 256 nodes x 7 ranks) instead of the store's load."""
STOPPED_BY_PEER = "stopped by another rank's failure"
"""The line a rank prints when it stops for another's failure (launcher.node.diagnose counts it as a peer's cause)."""

_before_failure_exit: list[Callable[[], object]] = []
"""What a rank does on its way out of a failure, its own or another's (on_failure_exit): each bounded, none raises."""


def on_failure_exit(hook: Callable[[], object]) -> None:
    """Run `hook` before this rank exits on a failure (trainer.checkpoint.Checkpointer.salvage: a background
    checkpoint write completed rather than lost)."""
    _before_failure_exit.append(hook)


def run_failure_exit_hooks() -> None:
    """trainer.main's error path (after announce_failure, so the other ranks start theirs at once) and the
    FailureWatch's stop."""
    for hook in _before_failure_exit:
        try:
            hook()
        except Exception as e:  # noqa: BLE001 - best effort: the failure's own cause is what the rank reports
            print(f"on the way out of the failure: {e!r}", file=sys.stderr, flush=True)


class FailureWatch:
    """Ends every rank of the job within about WATCH_S (poll_period_s) of the first rank's failure, naming it. Why: a rank that fails
    (the node leader's push broken half way, G11 of ../shared/GPU-AUDIT.md) leaves the others inside a collective with
    it, an FSDP all-gather: NCCL between GPUs of one node never notices a peer that exited, and torch's timeout is the
    process group's (trainer.push_timeout_s + request_timeout_s, 900 s by default); torchrun's SIGTERM cannot reach the
    Python of a rank blocked in native code either. So the failing rank writes its cause into the rendezvous store
    (trainer.main, after printing its traceback) and a daemon thread in every rank, which runs while the main thread
    waits in a collective, polls for it and exits the process with that cause, its node and its log."""

    def __init__(self, store: dist.Store, rank: int, node: int, log: str, world: int = 1) -> None:
        self.store, self.rank, self.node, self.log = store, rank, node, log
        self.period_s = poll_period_s(world)
        self.me = f"trainer rank {rank} of node {node} failed"
        threading.Thread(target=self._watch, name="failure-watch", daemon=True).start()

    def announce(self, cause: BaseException) -> None:
        """Best effort (the first failure wins): a rank that cannot reach the store still exits, and torchrun and the
        bootstrap stop the rest within their own deadlines."""
        what = traceback.format_exception_only(cause)[-1].strip().splitlines()[0][:300]
        try:
            self.store.compare_set(FAILED_KEY, "", f"{self.me} ({what}); its traceback is in {self.log}")
        except Exception:  # noqa: BLE001 - the store's host (node 0's torchrun) may be gone already
            pass

    def _watch(self) -> None:
        while True:
            time.sleep(self.period_s)
            try:
                if not self.store.check([FAILED_KEY]):
                    continue
                cause = self.store.get(FAILED_KEY).decode()
            except Exception:  # noqa: BLE001 - the store is gone: the job is ending, torchrun and the bootstrap see to it
                return
            if cause.startswith(self.me):
                return  # this rank's own failure: its main thread is exiting with the traceback
            print(
                f"RuntimeError: {STOPPED_BY_PEER} (trainer rank {self.rank} of node {self.node} stops): {cause}",
                file=sys.stderr,
                flush=True,
            )
            run_failure_exit_hooks()  # while the main thread waits in a collective with the failed rank
            sys.stdout.flush()
            os._exit(1)


def poll_period_s(world: int) -> float:
    """How often each rank checks for a failure: WATCH_S, or longer in a world so large that all ranks together would
    check more than STORE_POLLS_PER_S times a second."""
    return max(WATCH_S, world / STORE_POLLS_PER_S)


_watch: FailureWatch | None = None


def watch_failures(rank: int, node: int, log: str) -> FailureWatch | None:
    """Start this rank's FailureWatch on its own client of the rendezvous store (MASTER_ADDR/MASTER_PORT, as torchrun
    sets them), so it never waits behind the main thread's store calls."""
    global _watch
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        return None
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=30)
    )
    _watch = FailureWatch(store, rank, node, log, int(os.environ.get("WORLD_SIZE", "1")))
    return _watch


def announce_failure(cause: BaseException) -> None:
    """trainer.main, on any error of this rank: tell the others (FailureWatch) before exiting."""
    if _watch is not None:
        _watch.announce(cause)


def check_allreduce(rank: int, world: int, device: torch.device) -> dict[str, float]:
    """Sum of rank+1 over every rank of every node: the cheapest proof that the world is wired right."""
    probe = torch.tensor([float(rank + 1)], device=device)
    dist.all_reduce(probe)
    got, expected = probe.item(), world * (world + 1) / 2
    if got != expected:
        raise RuntimeError(f"all-reduce over {world} ranks gave {got}, expected {expected}")
    return {"got": got, "expected": expected}


def bind_cores(plan: Plan, gpu: int) -> None:
    """Run this rank on the cores nearest its GPU (slurm.gpu_cores: OLCF's -c7 binding with one task per node;
    torchrun started on the union of its ranks' cores)."""
    cores = cores_of(plan.config, [gpu])
    allowed = set(cores) & os.sched_getaffinity(0) if cores else set()
    if cores and not allowed:  # slurm.gpu_cores outside this task's cpuset: setting it would kill the rank
        print(
            f"WARNING: slurm.gpu_cores {sorted(cores)} for GPU {gpu} are outside this task's CPUs; binding left as is", flush=True
        )
    elif allowed:
        os.sched_setaffinity(0, allowed)


def init(plan: Plan) -> Parallel:
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    node = int(os.environ.get(Env.NODE, rank // plan.ranks_per_node))
    expect = plan.rank(rank)
    if world != plan.world_size or expect.node != node or expect.local_rank != local:
        raise RuntimeError(
            f"torchrun gave rank {rank}/{world} local {local} on node {node}, but the plan says "
            f"world {plan.world_size}, rank {rank} is local {expect.local_rank} on node {expect.node}"
        )
    host_id = emulation.rank_host_id(plan, node, local)
    if host_id is not None:  # job.emulate_gpus: NCCL reads it once, at this process's first communicator (just below)
        os.environ[emulation.HOST_ID_ENV] = host_id
    if plan.device == "cuda":
        device = torch.device("cuda", expect.cuda_index)
        torch.cuda.set_device(device)
        bind_cores(plan, expect.gpu)
        backend = "cpu:gloo,cuda:nccl"  # gloo for object collectives on CPU tensors, NCCL for the model
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(
        backend,
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=plan.process_group_timeout_s),
        device_id=device if plan.device == "cuda" else None,
    )
    watch_failures(rank, node, str(JobDir(Path(plan.job_dir)).log(node, "trainer")))
    groups = {}
    for n in plan.nodes:  # every rank creates every group, in the same order (new_group is collective)
        groups[n.node] = dist.new_group([r.global_rank for r in n.ranks], backend="gloo")
    node_ranks = [r.global_rank for r in plan.nodes[node].ranks]
    if plan.config.trainer.fsdp == "hsdp" and plan.num_nodes > 1:
        mesh = init_device_mesh(device.type, (plan.num_nodes, plan.ranks_per_node), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    return Parallel(
        rank=rank,
        local_rank=local,
        world=world,
        node=node,
        node_group=groups[node],
        node_ranks=node_ranks,
        leader=node_ranks[0],
        mesh=mesh,
        device=device,
        allreduce_check=check_allreduce(rank, world, device),
    )


def shard_model(model: torch.nn.Module, par: Parallel, param_dtype: torch.dtype, cpu_offload: bool = False) -> torch.nn.Module:
    """FSDP2 on every decoder layer and the root. A 2-D mesh makes it HSDP: parameters are sharded over
    the node's ranks and replicated across nodes, so the all-gather before a push stays in the node.
    cpu_offload: the sharded fp32 parameters, their gradients and so the optimizer step live in host memory;
    each unit is copied to the GPU for its forward and backward (FSDP2's CPUOffloadPolicy). Not pinned: torch's
    pinned-memory allocator rounds every block up to a power of two, which for a 7B model's MLP weights nearly
    doubles the host memory that offloading exists to make room in; the copies are slower instead."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=False) if cpu_offload else OffloadPolicy()
    # a shard group of one rank (one GPU per node) gathers nothing: keep each unit's compute-dtype copy from the forward
    # to the backward instead of casting it again there (the recompute of activation checkpointing included). Costs
    # the model once in the compute dtype; not with cpu_offload, which exists to keep the GPU free of it.
    keep = shard_group_size(par.mesh) == 1 and not cpu_offload
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # type: ignore[operator]  # peft wraps it (trainer.lora)
    layers = getattr(getattr(base, "model", base), "layers", [])
    for layer in layers:
        fully_shard(layer, mesh=par.mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=not keep)
    fully_shard(model, mesh=par.mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=not keep)
    trl_glue.mark_self_sharded(model)  # transformers' Trainer then wraps nothing around our FSDP2
    return model


def shard_group_size(mesh: DeviceMesh) -> int:
    """Ranks one parameter is sharded over: the last mesh dimension ("shard"; HSDP replicates over the first)."""
    return mesh.size(mesh.ndim - 1)
