"""vLLM's worker under job.emulate_gpus (tests and benchmarks only; launcher.core.emulation): a server of several workers
(TP x DP > 1) on one physical GPU. vLLM starts it by name (--worker-cls) in every worker process.

Two things stop vLLM 0.32 from putting two workers on one GPU, and both are settled here, before the original
init_device creates any communicator: worker i looks for device i (gpu_worker.py, `local_rank < device_count()`, DP
engines offset by their index), and all workers inherit one NCCL_HOSTID from the server's environment, so NCCL sees
two ranks of the TP group (and of the weight-push group) on one GPU of one host and refuses ("Duplicate GPU detected").
The worker therefore names the one GPU for every logical one (assigned_physical_gpu_ids, vLLM's own mapping) and
claims a host id of its own (NCCL reads it once per process, at its first communicator)."""

from __future__ import annotations

import os

from vllm.platforms import current_platform
from vllm.v1.worker.gpu_worker import Worker

from launcher.core.emulation import HOST_ID_ENV

LOGICAL_GPUS = 64
"""More logical GPUs than any node has: vLLM indexes this list by the worker's DP-adjusted local rank."""


def worker_host_id(base: str, dp_index: int, rank: int) -> str:
    return f"{base}-dp{dp_index}-w{rank}"


class EmulatedGpuWorker(Worker):
    def init_device(self) -> None:
        pc = self.parallel_config
        # the server's mask lists the one GPU: its visible index 0, as a physical id
        pc.assigned_physical_gpu_ids = [current_platform.visible_device_id_to_physical_device_id(0)] * LOGICAL_GPUS
        os.environ[HOST_ID_ENV] = worker_host_id(os.environ.get(HOST_ID_ENV, "emulated"), pc.data_parallel_index, self.rank)
        super().init_device()
