"""The per-node processes as argv lists plus their environment: one source for dry-run and bootstrap.

Commands are lists, never shell strings: the bootstrap runs them without a shell, and dry-run shows
them with shlex.join, so a config value with spaces, quotes or `$()` is an argument, not shell code.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from launcher.core import emulation, platform, vllm_start
from launcher.core.config import ConfigError
from launcher.core.jobdir import PLUGIN_ENV, Env, JobDir
from launcher.core.lora import ADAPTER, ENGINE, serving_rank
from launcher.core.plan import Plan, generation_steps
from launcher.core.vllm_start import START_METHOD_ENV

IN_JOB = JobDir(Path())
"""The job folder's paths relative to the folder itself (a command's log is named relative to it)."""


OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
"""Nodes never reach for the hub: a hub model name was resolved to its cached snapshot at submit (launcher.hub)."""
VLLM_LOG_ENV = {
    "VLLM_CONFIGURE_LOGGING": "1",
    "VLLM_LOGGING_LEVEL": "INFO",
    "VLLM_LOGGING_COLOR": "0",
    "VLLM_LOGGING_PREFIX": "",
}
"""vLLM's own INFO lines, plain, in node<i>-vllm.log whatever the job inherits: `slurm-grpo status` reads the start's
phases from them (launcher.vllm_log) and a user reads them after a failure. Importing TRL sets VLLM_LOGGING_LEVEL=ERROR
in that process's environment (trl/_compat.py), and any process it starts inherits it: in the test suite (a test module
imports TRL) the servers wrote not one vLLM line. Color codes or a prefix would break the reading too. A user's own:
`--log-level DEBUG` or `--logging-config` in vllm.extra_args (vLLM's flags win over these)."""

SERVER_ENGINE = {"ipc": "mapped_ipc"}
"""The server's weight-transfer engine per push backend where it is the project's own (trainer.push.vllm_plugin registers
it): ipc is trainer.push.ipc_engine (one mapping for the run, the whole model per request); gloo keeps its name."""


def server_engine(plan: Plan) -> str:
    """The server's weight-transfer engine: SERVER_ENGINE's, and with nccl the project's nccl_adapter where the LoRA
    adapter moves through the engine (trainer.push.nccl_adapter_engine: vLLM's nccl engine that can take an adapter;
    gloo and mapped_ipc take one as they are)."""
    b = plan.weight_transfer_backend
    if b == "nccl" and plan.lora_push == ADAPTER and plan.config.trainer.lora.adapter_transport == ENGINE:
        return "nccl_adapter"
    return SERVER_ENGINE.get(b, b)


@dataclass(frozen=True)
class NodeCommand:
    name: str
    argv: list[str]
    env: dict[str, str]
    log: str
    """Log file, relative to the job folder."""


def gpu_list(gpus: list[int], allocated: str | None = None) -> str:
    """CUDA_VISIBLE_DEVICES for the plan's node-local GPU indices. `allocated`: the CUDA_VISIBLE_DEVICES that
    SLURM (or the user) gave the node's bootstrap; index i means its i-th entry, so a process never lands on
    another job's GPUs on clusters without device cgroups. None or empty: the node's GPUs are 0..N-1."""
    ids = [x.strip() for x in (allocated or "").split(",") if x.strip()]
    if not ids:
        return ",".join(str(g) for g in gpus)
    if max(gpus) >= len(ids):
        raise ConfigError(
            f"the plan uses GPU index {max(gpus)} of the node, but CUDA_VISIBLE_DEVICES={allocated!r} "
            f"lists {len(ids)}; ask SLURM for slurm.gpus_per_node GPUs (--gres=gpu:N) or lower it"
        )
    return ",".join(ids[g] for g in gpus)


def visible_devices(plan: Plan, gpus: list[int], allocated: str | None) -> dict[str, str]:
    """The process's device mask: on cuda CUDA_VISIBLE_DEVICES = its GPUs; on rocm none (every process sees the
    node's GPUs, as the bootstrap left them, and picks its own by index: launcher.core.platform)."""
    if not platform.of_plan(plan).per_process_mask:
        return {}
    if plan.emulated:  # job.emulate_gpus: the plan's GPUs are logical, all of them this machine's one GPU
        return {"CUDA_VISIBLE_DEVICES": emulation.devices(gpus, allocated)}
    return {"CUDA_VISIBLE_DEVICES": gpu_list(gpus, allocated)}


def vllm_command(plan: Plan, node: int, python: str = "python", allocated: str | None = None) -> NodeCommand:
    n = plan.nodes[node]
    v = plan.config.vllm
    argv = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        v.model,
        # loopback only: the dev-mode routes (weight updates, collective_rpc) must not be reachable from other hosts
        "--host",
        "127.0.0.1",
        "--port",
        str(plan.server_port(node)),
        "--tensor-parallel-size",
        str(plan.tensor_parallel_size),
        "--gpu-memory-utilization",
        str(v.gpu_memory_utilization),
        "--dtype",
        v.dtype,
        # trainer parity checks and TRL's importance sampling want logprobs after temperature
        "--logprobs-mode",
        "processed_logprobs",
        "--weight-transfer-config",
        json.dumps({"backend": server_engine(plan)}),
        "--seed",
        str(plan.config.trainer.seed),
    ]
    if plan.data_parallel_size > 1:  # vLLM's own DP: several engines behind this one endpoint, balanced by vLLM
        argv += ["--data-parallel-size", str(plan.data_parallel_size)]
    if v.max_model_len:
        argv += ["--max-model-len", str(v.max_model_len)]
    if v.enable_expert_parallel:  # checked against the model and the server's GPUs by the plan
        argv += ["--enable-expert-parallel"]
    if plan.config.trainer.routing_replay:  # each completion's expert ids (needs prefix caching on: vLLM's default)
        argv += ["--enable-return-routed-experts"]
    if plan.lora_push == ADAPTER:  # the trainer pushes only its adapter, loaded at run time (trainer.push.adapter)
        argv += ["--enable-lora", "--max-lora-rank", str(serving_rank(plan.config.trainer.lora.r))]
    argv += vllm_start.vllm_args(plan, generation_steps(plan.config, plan.world_size))  # GPU: graphs for the work's batches
    argv += emulation.vllm_args(plan)  # job.emulate_gpus only: several workers on one GPU
    argv += list(v.extra_args)
    env = {
        **OFFLINE_ENV,
        **VLLM_LOG_ENV,
        Env.JOB_DIR: plan.job_dir,  # marks the processes as this job folder's (launcher.node.stale finds leftovers by it)
        "VLLM_SERVER_DEV_MODE": "1",
        **visible_devices(plan, n.vllm_gpus, allocated),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    # compile caches where a requeue or resume of this job finds them (default: /tmp of whichever node ran it)
    cache = JobDir(Path(plan.job_dir)).compile_cache(node, v.cache_dir)
    env.update({"VLLM_CACHE_ROOT": str(cache / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor")})
    env["TRITON_CACHE_DIR"] = str(cache / "triton")
    start_env = vllm_start.vllm_env(plan)  # GPU: the engine core forked from the API server (launcher.core.vllm_start)
    if v.engine_start == "auto" and START_METHOD_ENV in os.environ:  # a site's own choice (say spawn) wins over auto
        start_env.pop(START_METHOD_ENV, None)
    env |= start_env
    if v.inspect_in_process:  # the model class inspected in the API server, not in a fresh Python (vllm_plugin)
        env[Env.INSPECT_IN_PROCESS] = "1"
    env |= platform.process_env(plan, "vllm")
    if plan.emulated:  # job.emulate_gpus only: its own NCCL host id, loopback sockets; the node index marks the
        env |= emulation.vllm_env(plan, node) | {Env.NODE: str(node)}  # server as this node's (launcher.node.stale)
    if plan.lora_push == ADAPTER:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"  # opens /v1/load_lora_adapter (the server listens on 127.0.0.1 only)
        env[Env.LORA_LOAD_ONCE] = "1"  # else each engine step re-reads the adapter from disk (vllm_plugin.load_adapters_once)
    if vllm_start.lora_graphs(plan):  # every request names the adapter: no graphs for batches without it
        env[Env.LORA_ACTIVE_GRAPHS_ONLY] = "1"
    if plan.config.trainer.routing_replay:  # vLLM returns routed experts from Model Runner V2 only
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    if plan.device == "cpu":
        env.update({"VLLM_CPU_KVCACHE_SPACE": str(v.cpu_kvcache_gib), PLUGIN_ENV: "1", "CUDA_VISIBLE_DEVICES": ""})
    argv = platform.bind_prefix(plan.config, n.vllm_gpus) + argv
    return NodeCommand(name="vllm", argv=argv, env=env, log=str(IN_JOB.log(node, "vllm")))


def trainer_command(
    plan: Plan, node: int, rendezvous_host: str, python: str = "python", allocated: str | None = None
) -> NodeCommand:
    n = plan.nodes[node]
    # Static rendezvous (a TCPStore on the first node) rather than torchrun's c10d backend: c10d assigns
    # node ranks in arrival order, which would break the plan's rank table (rank = node x ranks_per_node + local).
    argv = [
        python,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(plan.num_nodes),
        "--nproc-per-node",
        str(plan.ranks_per_node),
        "--node-rank",
        str(node),
        "--master-addr",
        rendezvous_host,
        "--master-port",
        str(plan.rendezvous_port),
        "--max-restarts",
        "0",
        # pass preemption signals on to the ranks (which checkpoint at the next step) instead of dying
        # of them, and give the ranks time for that checkpoint before torchrun kills them
        "--signals-to-handle",
        "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2",
        "--shutdown-timeout",
        str(plan.trainer_shutdown_s),
        "-m",
        "trainer.main",
        str(JobDir(Path(plan.job_dir)).plan),
    ]
    env = {
        **OFFLINE_ENV,
        Env.JOB_DIR: plan.job_dir,
        Env.NODE: str(node),
        **visible_devices(plan, n.trainer_gpus, allocated),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "PYTHONUNBUFFERED": "1",
        **platform.process_env(plan, "trainer"),
        **emulation.trainer_env(plan),  # job.emulate_gpus only: loopback sockets (each rank sets its own host id)
    }
    if plan.device == "cpu":
        env.update({"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"})
    argv = platform.bind_prefix(plan.config, n.trainer_gpus) + argv
    return NodeCommand(name="trainer", argv=argv, env=env, log=str(IN_JOB.log(node, "trainer")))


def bootstrap_argv(plan_path: str, python: str = "python") -> list[str]:
    return [python, "-u", "-m", "launcher.node.bootstrap", plan_path]
