"""job.emulate_gpus: a cluster's nodes x GPUs laid out on the one GPU of a test machine (tests and benchmarks only).

The plan stays that of the real cluster: ranks, world, TP/DP, the push backend (nccl on a split node) and the server
world are the config's. What differs, and only here and where this module is called:
  devices     every logical GPU is the one physical GPU: each process's mask is that GPU, every trainer rank uses
              cuda:0 (launcher.core.plan, launcher.node.commands).
  host ids    NCCL refuses two ranks of one communicator on one GPU only when it sees them on one host ("Duplicate GPU
              detected"); it reads NCCL_HOSTID once per process, before its first communicator. So every process
              claims a host of its own: each trainer rank (trainer.parallel, before init_process_group), the vLLM
              server of one worker (its environment), and each worker of a bigger server (TP x DP > 1: the worker
              class trainer.emulated_worker, which also gives every worker the one GPU). NCCL then talks over its
              socket transport on loopback (NCCL_SOCKET_IFNAME=lo, no InfiniBand): wiring and correctness, not speed.
  vLLM        TP x DP > 1 on one GPU needs the mp executor (else vLLM counts GPUs), no custom all-reduce (its P2P check
              keys on the physical id) and no symmetric-memory or FlashInfer all-reduce (both assume distinct GPUs).
  CPU         with job.device cpu only the nodes part applies (several nodes of CPU slots on one host): how this
              path is run where no GPU is.
  nodes       several nodes run on one host: node i's server and weight-transfer ports are the config's + i, the
              rendezvous is 127.0.0.1, and a node's start-up cleanup stops only its own leftovers on the shared GPU
              (launcher.node.stale).
Measured (../shared/gpu/README.md): two ranks on one H200 with their own host ids formed one NCCL world, FSDP2 over
them matched a one-process reference exactly. ../shared/EMULATION-NOTES.md has the reading of vLLM and NCCL behind it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from launcher.core.config import ConfigError

if TYPE_CHECKING:
    from launcher.core.config import JobConfig
    from launcher.core.plan import Plan

WORKER_CLS = "trainer.emulated_worker.EmulatedGpuWorker"
"""vLLM's --worker-cls for a server of more than one worker (imports vLLM, so named, not imported, here)."""
HOST_ID_ENV = "NCCL_HOSTID"
NCCL_ENV = {"NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1"}
"""Every process: one host's ranks reach each other over loopback sockets (different host ids rule out P2P and SHM)."""
VLLM_ENV = {"VLLM_ALLREDUCE_USE_SYMM_MEM": "0", "VLLM_ALLREDUCE_USE_FLASHINFER": "0"}
VLLM_MULTI_WORKER_ARGS = ["--distributed-executor-backend", "mp", "--disable-custom-all-reduce"]
ANNOUNCE = (
    "EMULATION ON (job.emulate_gpus, tests and benchmarks only): every logical GPU runs on this machine's one GPU, "
    "each process with its own NCCL host id over loopback sockets; speeds are not a real node's"
)


def check(cfg: JobConfig) -> None:
    """What emulation can lay out: CUDA, one host (per-node ports that collide with nothing)."""
    j, v, t, s = cfg.job, cfg.vllm, cfg.trainer, cfg.slurm
    if j.platform != "cuda":
        raise ConfigError("job.emulate_gpus maps NVIDIA GPUs (job.platform cuda) or CPU slots (job.device cpu); remove it")
    ports = [("trainer.rendezvous_port", t.rendezvous_port)]
    for n in range(s.nodes):
        ports += [(f"vllm.port of node {n}", node_port(v.port, n, True))]
        ports += [(f"trainer.weight_transfer_port of node {n}", node_port(t.weight_transfer_port, n, True))]
    seen: dict[int, str] = {}
    for name, port in ports:
        if port in seen:
            raise ConfigError(
                f"job.emulate_gpus: {name} and {seen[port]} are both {port} (node i uses the config's ports + i); "
                "space vllm.port, trainer.rendezvous_port and trainer.weight_transfer_port further apart"
            )
        seen[port] = name


def node_port(base: int, node: int, emulated: bool) -> int:
    """A node's port: the config's on a cluster (each node its own host), + node index when all nodes share one host."""
    return base + node if emulated else base


def host_id(p: Plan, node: int, who: str) -> str:
    """NCCL_HOSTID of one process: unique per process of the job (`who`: vllm, rank<local>)."""
    return f"{p.job_name}-n{node}-{who}"


def vllm_env(p: Plan, node: int) -> dict[str, str]:
    """The server's environment under emulation (empty otherwise). Its workers inherit it; a one-worker server's host
    id is this one, a bigger server's workers each derive their own from it (trainer.emulated_worker)."""
    if not p.emulated:
        return {}
    return {**NCCL_ENV, **VLLM_ENV, HOST_ID_ENV: host_id(p, node, "vllm")}


def vllm_args(p: Plan) -> list[str]:
    """The server's extra arguments under emulation: for more than one worker, the worker class and the settings
    that let several workers share a GPU."""
    if not p.emulated or p.server_world == 1 or p.device == "cpu":  # CPU slots: vLLM's CPU workers, no GPU to share
        return []
    return ["--worker-cls", WORKER_CLS, *VLLM_MULTI_WORKER_ARGS]


def trainer_env(p: Plan) -> dict[str, str]:
    """torchrun's environment under emulation; each rank sets its own host id (trainer.parallel, rank_host_id)."""
    return dict(NCCL_ENV) if p.emulated else {}


def rank_host_id(p: Plan, node: int, local_rank: int) -> str | None:
    """The host id a trainer rank claims before init_process_group; None on a real node (NCCL's own)."""
    return host_id(p, node, f"rank{local_rank}") if p.emulated else None


def devices(gpus: list[int], allocated: str | None) -> str:
    """The mask of an emulated process: the one physical GPU (the allocation's first, else 0), whatever its plan GPUs."""
    ids = [x.strip() for x in (allocated or "").split(",") if x.strip()]
    return ids[0] if ids else "0"


def derivation_lines(p: Plan) -> list[str]:
    if not p.emulated:
        return []
    n = p.num_nodes
    ports = f"; node i's ports = the config's + i ({n} nodes on one host)" if n > 1 else ""
    return [
        f"{ANNOUNCE}; {n} node(s) x {p.gpus_per_node} logical GPUs -> 1 physical GPU, host ids = "
        f"<job>-n<node>-vllm / -rank<local>" + (" / -vllm-dp<d>-w<rank> (the worker class)" if p.server_world > 1 else "") + ports
    ]
