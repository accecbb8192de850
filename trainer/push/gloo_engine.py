"""The worker (vLLM) side of the `gloo` weight-transfer engine: vLLM's NCCL engine with its transport
swapped for a gloo process group, so the native protocol (init / start / update / finish) runs on CPU.

The trainer side is trainer.push.senders.GlooSender: it hosts the TCPStore as rank 0 and broadcasts packed chunks
cut by vLLM's own rule (trainer.push.wire.chunk_metas, the rule of vLLM's packed NCCL consumer), so the CPU
tests run the packing the GPU path uses. Both sides bind 127.0.0.1: the push never leaves the node.

Test-only fault points (tests/integration/test_integration.py), set in the server's environment: SLURM_GRPO_TEST_PUSH_FAULT=stop@N
stops the server's whole process group (SIGSTOP) as the N-th push's chunks are due, as a hung server would;
skip@N receives the N-th push but loads none of it, as a push that did not land.

With `lora_adapter` in the init info (trainer.lora, adapter_transport engine) every push of the run is the adapter's:
the chunks go to trainer.push.adapter_receiver (a LoRAModel for vLLM's LoRA manager) instead of the model's
load_weights, and start/finish skip the layerwise reload (the base does not change).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine, NCCLWeightTransferInitInfo
from vllm.distributed.weight_transfer.packed_tensor import unpack_tensor

from trainer.push.adapter_receiver import AdapterOrWeights, receiver
from trainer.push.wire import ParamMeta, chunk_metas, loopback_gloo_group


@dataclass(kw_only=True)
class GlooWeightTransferInitInfo(NCCLWeightTransferInitInfo):
    timeout_s: float = 300.0
    """The trainer's push deadline: the worker's side of the group waits exactly as long."""
    lora_adapter: dict | None = None
    """trainer.push.adapter_receiver's target ({name, peft_config}): the pushes are a LoRA adapter's; None = weights."""


PUSH_FAULT_ENV = "SLURM_GRPO_TEST_PUSH_FAULT"


def push_fault() -> tuple[str, int] | None:
    """(stop or skip, the push it hits, counted from 1) from PUSH_FAULT_ENV; None when unset."""
    value = os.environ.get(PUSH_FAULT_ENV, "")
    if not value:
        return None
    what, _, n = value.partition("@")
    if what not in ("stop", "skip") or not n.isdigit():
        raise ValueError(f"{PUSH_FAULT_ENV}={value!r}: expected stop@N or skip@N (N: the push, from 1)")
    return what, int(n)


class GlooWeightTransferEngine(AdapterOrWeights, NCCLWeightTransferEngine):
    init_info_cls = GlooWeightTransferInitInfo  # type: ignore[assignment]
    pushes_received = 0

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:  # type: ignore[override]
        self.adapter = receiver(init_info, self)
        pc = self.parallel_config
        rank = pc.data_parallel_index * pc.world_size + pc.rank + init_info.rank_offset
        timeout = timedelta(seconds=init_info.timeout_s)
        self.packed = init_info.packed
        self.packed_buffer_size_bytes = init_info.packed_buffer_size_bytes
        store = dist.TCPStore(
            str(init_info.master_address), int(init_info.master_port or 0), init_info.world_size, is_master=False, timeout=timeout
        )
        self.model_update_group = loopback_gloo_group(store, rank, init_info.world_size, timeout)  # type: ignore[assignment]

    def update_weights(self, update_info) -> None:
        # the base class would call torch.accelerator.synchronize(), which has no CPU device to sync
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info) -> None:
        if not self.packed:
            raise RuntimeError("the gloo engine receives packed chunks only; the trainer's init info said packed=false")
        meta = [
            ParamMeta(n, d, list(s))
            for n, d, s in zip(update_info.names, update_info.dtype_names, update_info.shapes, strict=True)
        ]
        self.pushes_received += 1
        fault = push_fault()
        action = fault[0] if fault is not None and fault[1] == self.pushes_received else None
        if action == "stop":  # the API server and every engine process of this server with it
            os.killpg(os.getpgrp(), signal.SIGSTOP)
        load = self.adapter.collect if self.adapter is not None else self.model.load_weights
        for weights in receive_packed(self.model_update_group, meta, self.packed_buffer_size_bytes):  # type: ignore[arg-type]
            if action != "skip":  # skip: every chunk is received (the sender must finish), none is loaded
                load(weights)  # type: ignore[operator]

    def shutdown(self) -> None:
        self.model_update_group = None


def receive_packed(
    group: dist.ProcessGroupGloo, meta: list[ParamMeta], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The receiving side of trainer.push.senders.broadcast_packed: per chunk (cut from the metadata by the same rule),
    one broadcast into a fresh buffer, yielded as (name, tensor) views of it."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    for chunk in chunk_metas(meta, bucket_bytes):
        sizes = [m.nbytes for m in chunk]
        buf = torch.empty(sum(sizes), dtype=torch.uint8)
        group.broadcast([buf], opts).wait()  # type: ignore[attr-defined]
        yield unpack_tensor(
            buf, [m.name for m in chunk], [m.shape for m in chunk], [getattr(torch, m.dtype) for m in chunk], sizes
        )
