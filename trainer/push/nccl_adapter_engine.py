"""The worker (vLLM) side of the `nccl_adapter` weight-transfer engine: vLLM 0.32's own `nccl` engine, which a LoRA run
whose adapter moves by the engine (trainer.lora.adapter_transport engine, the nccl backend) starts the server with
instead (launcher.node.commands.server_engine). Its init info may carry `lora_adapter`; then every push of the run is
the adapter's: vLLM's packed consumer receives the chunks as for weights, and they go to trainer.push.adapter_receiver
(a LoRAModel for vLLM's LoRA manager) instead of the model's load_weights, with no layerwise reload around them (the
base does not change). Without it, it is vLLM's engine unchanged. The trainer side is trainer.push.senders.NcclSender.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine, NCCLWeightTransferInitInfo
from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_consumer

from trainer.push.adapter_receiver import AdapterOrWeights, receiver


@dataclass(kw_only=True)
class NcclAdapterInitInfo(NCCLWeightTransferInitInfo):
    lora_adapter: dict | None = None
    """trainer.push.adapter_receiver's target ({name, peft_config}): the pushes are a LoRA adapter's; None = weights."""


class NcclAdapterWeightTransferEngine(AdapterOrWeights, NCCLWeightTransferEngine):
    init_info_cls = NcclAdapterInitInfo  # type: ignore[assignment]

    def init_transfer_engine(self, init_info: NcclAdapterInitInfo) -> None:  # type: ignore[override]
        self.adapter = receiver(init_info, self)
        super().init_transfer_engine(init_info)

    def receive_weights(self, update_info) -> None:
        if self.adapter is None:
            return super().receive_weights(update_info)
        if self.model_update_group is None or not self.packed:
            raise RuntimeError("nccl_adapter: the adapter push needs init_weight_transfer_engine first, with packed=true")
        meta = (
            (n, (s, getattr(torch, d)))
            for n, d, s in zip(update_info.names, update_info.dtype_names, update_info.shapes, strict=True)
        )
        packed_nccl_broadcast_consumer(
            iterator=meta,
            group=self.model_update_group,
            src=0,
            post_unpack_func=self.adapter.collect,  # copies each chunk's views on the chunk's stream, after its broadcast
            buffer_size_bytes=self.packed_buffer_size_bytes,
            num_buffers=self.packed_num_buffers,
            device=self.device,
        )
