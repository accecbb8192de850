"""The worker (vLLM) side of the `gloo` weight-transfer engine: vLLM's NCCL engine with its transport
swapped for a gloo process group, so the native protocol (init / start / update / finish) runs on CPU.

The trainer side is trainer.weight_push.GlooSender: it hosts the TCPStore as rank 0 and broadcasts
tensor by tensor, in the order of the update's names. Both sides bind 127.0.0.1: the push never leaves
the node.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

TIMEOUT = timedelta(seconds=300)


def loopback_gloo_group(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> dist.ProcessGroupGloo:
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    opts._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, world_size, opts)


class GlooWeightTransferEngine(NCCLWeightTransferEngine):
    def init_transfer_engine(self, init_info) -> None:
        pc = self.parallel_config
        rank = pc.data_parallel_index * pc.world_size + pc.rank + init_info.rank_offset
        store = dist.TCPStore(init_info.master_address, init_info.master_port, init_info.world_size,
                              is_master=False, timeout=TIMEOUT)
        self.model_update_group = loopback_gloo_group(store, rank, init_info.world_size, TIMEOUT)

    def update_weights(self, update_info) -> None:
        # the base class would call torch.accelerator.synchronize(), which has no CPU device to sync
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        for name, dtype_name, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes, strict=True):
            weight = torch.empty(shape, dtype=getattr(torch, dtype_name))
            self.model_update_group.broadcast([weight], opts).wait()
            self.model.load_weights([(name, weight)])

    def shutdown(self) -> None:
        self.model_update_group = None
