"""The worker (vLLM) side of the project's `mapped_ipc` weight-transfer engine: one GPU shared by vLLM and the trainer.

vLLM 0.32's own `ipc` engine pays per push, not per byte: every push re-exports and re-opens the trainer's CUDA
buffer (cudaIpcOpenMemHandle), sends one request per 64 MiB chunk, and runs vLLM's layerwise reload around the update
(start_weight_update moves every layer onto the meta device, the loaders buffer the incoming tensors, and each layer is
re-materialised, processed and copied back into the kernel tensors: one allocation and two copies of the whole model).
This engine does the part of that work a bf16/fp16/fp32 model needs, once:

  init     the trainer's staging buffer is opened ONCE (its IPC handle comes with the init info) together with the
           push's layout (names, dtypes, shapes in sending order) and the buffer's size; both sides cut the layout into
           windows by one rule (trainer.push.wire.buffer_windows) and the views of every window are built here, once.
  update   {"window": k}: `model.load_weights` over window k's views (each parameter's own weight_loader copies into
           the live parameter: q/k/v and gate/up are stacked as at start-up), then a device sync, so the trainer may
           overwrite the buffer as soon as the request returns. A model that fits the buffer moves in one request.
  start / finish   no-ops for unquantized models (nothing to re-process after loading). A quantized model takes vLLM's
           layerwise reload around the update, as vLLM's own engine does.

With `lora_adapter` in the init info (trainer.lora, adapter_transport engine) the layout is the adapter's and each
window goes to trainer.push.adapter_receiver (copied out of the buffer, then a LoRAModel for vLLM's LoRA manager at
finish) instead of the model's load_weights.

The trainer side is trainer.push.senders.MappedIpcSender. The parity check after every push (trainer.rollout.parity) is
the proof that the weights landed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

from trainer.push.adapter_receiver import AdapterReceiver, receiver
from trainer.push.wire import ParamMeta, buffer_windows, decode_cuda_handle, window_views


@dataclass
class MappedIpcInitInfo(WeightTransferInitInfo):
    handles: dict[str, dict] = field(default_factory=dict)
    """{gpu uuid: the trainer's staging buffer's CUDA IPC handle}, as JSON (trainer.push.wire.encode_cuda_handle: never
    a pickle, which would run whatever a process of the node posts to the server)."""
    buffer_bytes: int = 0
    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    lora_adapter: dict | None = None
    """trainer.push.adapter_receiver's target ({name, peft_config}): the pushes are a LoRA adapter's; None = weights."""


@dataclass
class MappedIpcUpdateInfo(WeightTransferUpdateInfo):
    window: int = 0
    """Which window of the layout the buffer holds now."""
    windows: int = 0
    """How many windows the trainer cut (checked against ours: both sides must cut alike)."""


class MappedIpcWeightTransferEngine(WeightTransferEngine[MappedIpcInitInfo, MappedIpcUpdateInfo]):
    init_info_cls = MappedIpcInitInfo
    update_info_cls = MappedIpcUpdateInfo
    supports_draft_weight_update = False
    adapter: AdapterReceiver | None = None

    def init_transfer_engine(self, init_info: MappedIpcInitInfo) -> None:
        self.adapter = receiver(init_info, self)
        handles = init_info.handles
        uuid = str(torch.cuda.get_device_properties(self.device.index).uuid)
        if uuid not in handles:
            raise ValueError(
                f"the trainer's push buffer is on GPU {list(handles)} but this vLLM worker is on {uuid}: the mapped_ipc push "
                "needs vLLM and the trainer on the same GPU (use the nccl backend otherwise)"
            )
        args = list(decode_cuda_handle(handles[uuid]))
        args[6] = self.device.index  # rebuild_cuda_tensor's device index: this process's numbering
        self.buffer = rebuild_cuda_tensor(*args)
        if self.buffer.numel() < init_info.buffer_bytes:
            raise ValueError(f"push buffer: {self.buffer.numel()} bytes mapped, {init_info.buffer_bytes} announced")
        meta = [
            ParamMeta(n, d, list(s)) for n, d, s in zip(init_info.names, init_info.dtype_names, init_info.shapes, strict=True)
        ]
        self.windows = [
            [(m.name, v) for m, v in zip(w, window_views(self.buffer, w), strict=True)]
            for w in buffer_windows(meta, init_info.buffer_bytes)
        ]
        # quantized layers re-process their weights after loading: only vLLM's layerwise reload does that right
        self.layerwise = getattr(self.model_config, "quantization", None) is not None

    def start_weight_update(self) -> None:
        if self.adapter is not None:
            self.adapter.start()
        elif self.layerwise:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: MappedIpcUpdateInfo) -> None:
        if update_info.windows != len(self.windows) or not 0 <= update_info.window < len(self.windows):
            raise ValueError(
                f"mapped_ipc push: window {update_info.window} of {update_info.windows} announced, this engine cut "
                f"{len(self.windows)} windows from the init info (trainer and server disagree on the layout)"
            )
        window = self.windows[update_info.window]
        if self.adapter is not None:  # copied out: the trainer overwrites the buffer with the next window or push
            self.adapter.collect(window)
            return
        if self.layerwise:  # vLLM's reload holds the loaded tensors until a layer is whole: the next window would overwrite views
            window = [(name, view.clone()) for name, view in window]
        self.model.load_weights(window)  # type: ignore[operator]

    def finish_weight_update(self) -> None:
        if self.adapter is not None:
            self.adapter.finish()
        elif self.layerwise:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        self.windows = []
        self.buffer = None  # type: ignore[assignment]
