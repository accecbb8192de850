"""The weight push's wire format, shared by both ends: the trainer's senders (trainer.push.senders) and the server's
gloo engine (trainer.push.gloo_engine). No vLLM import, so the trainer side loads without it.

A push is a list of ParamMeta (name, dtype sent, shape) in sending order, announced as vLLM's update info, and the
parameters laid end to end as bytes into chunks cut by vLLM's own rule (chunk_metas). The gloo transport runs both
ends in a gloo group bound to 127.0.0.1 (loopback_gloo_group): the push never leaves the node.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Iterator
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist


class ParamMeta(NamedTuple):
    name: str
    dtype: str
    """The dtype sent, as vLLM names it (e.g. bfloat16)."""
    shape: list[int]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * getattr(torch, self.dtype).itemsize


def update_info(meta: list[ParamMeta]) -> dict:
    """The update info of vLLM's nccl engine (and ours): names, dtype names and shapes, in sending order."""
    return {"names": [m.name for m in meta], "dtype_names": [m.dtype for m in meta], "shapes": [list(m.shape) for m in meta]}


def chunk_metas(meta: list[ParamMeta], bucket_bytes: int) -> Iterator[list[ParamMeta]]:
    """The receiver's cut of the parameters into chunks: vLLM's rule (packed_nccl_broadcast_consumer), a chunk
    closes once it holds more than bucket_bytes. The sender's vLLM `pack_tensors` cuts the same way."""
    chunk: list[ParamMeta] = []
    size = 0
    for m in meta:
        chunk.append(m)
        size += m.nbytes
        if size > bucket_bytes:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def loopback_gloo_group(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> dist.ProcessGroupGloo:
    """A gloo group whose every member talks over 127.0.0.1 (both ends of the gloo push)."""
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    opts._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, world_size, opts)


def buffer_windows(meta: list[ParamMeta], buffer_bytes: int) -> list[list[ParamMeta]]:
    """The mapped_ipc push's cut (both ends: trainer.push.senders.MappedIpcSender, trainer.push.ipc_engine): the
    parameters laid end to end from the start of one staging buffer of buffer_bytes, a new window whenever the next one
    would overflow it (never a parameter split across windows: the buffer holds at least the largest)."""
    if meta and buffer_bytes < max(m.nbytes for m in meta):
        raise ValueError(
            f"push buffer of {buffer_bytes} bytes is smaller than the largest parameter ({max(m.nbytes for m in meta)})"
        )
    windows: list[list[ParamMeta]] = []
    window: list[ParamMeta] = []
    size = 0
    for m in meta:
        if window and size + m.nbytes > buffer_bytes:
            windows.append(window)
            window, size = [], 0
        window.append(m)
        size += m.nbytes
    if window:
        windows.append(window)
    return windows


def window_views(buffer: torch.Tensor, window: list[ParamMeta]) -> list[torch.Tensor]:
    """Each parameter's place in a mapped_ipc staging buffer (bytes), as a tensor of its dtype and shape: the trainer
    copies into these, the server loads from them."""
    out, offset = [], 0
    for m in window:
        out.append(buffer[offset : offset + m.nbytes].view(getattr(torch, m.dtype)).view(m.shape))
        offset += m.nbytes
    return out


# The mapped_ipc buffer's CUDA IPC handle crosses HTTP as JSON, never as a pickle: the server's routes are reachable by
# every process of the node, and unpickling what arrives there would run whatever a local user sends (vLLM's own ipc
# engine refuses its pickled handles unless VLLM_ALLOW_INSECURE_SERIALIZATION=1). The fields are those of torch's
# reduce_tensor for a CUDA tensor (rebuild_cuda_tensor's arguments), for the one kind of tensor the push exports: a
# flat uint8 buffer; the classes and the dtype are fixed here instead of travelling.
HANDLE_BYTES = ("storage_handle", "ref_counter_handle", "event_handle")
HANDLE_INTS = ("tensor_offset", "storage_device", "storage_size_bytes", "storage_offset_bytes", "ref_counter_offset")


def encode_cuda_handle(args: tuple) -> dict:
    """reduce_tensor(buffer)[1] of the staging buffer -> a JSON-safe dict (bytes as base64)."""
    (tensor_cls, size, stride, tensor_offset, storage_cls, dtype, device, storage_handle, storage_size_bytes,
     storage_offset_bytes, requires_grad, ref_counter_handle, ref_counter_offset, event_handle, event_sync_required) = args  # fmt: skip
    if tensor_cls is not torch.Tensor or storage_cls is not torch.storage.TypedStorage or dtype != torch.uint8:
        raise TypeError(f"the push exports a flat uint8 tensor only, not {tensor_cls.__name__} of {dtype}")
    raw = {"storage_handle": storage_handle, "ref_counter_handle": ref_counter_handle, "event_handle": event_handle}
    return {
        "size": list(size),
        "stride": list(stride),
        "tensor_offset": tensor_offset,
        "storage_device": device,
        "storage_size_bytes": storage_size_bytes,
        "storage_offset_bytes": storage_offset_bytes,
        "requires_grad": bool(requires_grad),
        "ref_counter_offset": ref_counter_offset,
        "event_sync_required": bool(event_sync_required),
        **{k: None if v is None else base64.b64encode(v).decode() for k, v in raw.items()},
    }


def decode_cuda_handle(d: dict) -> tuple:
    """The inverse of encode_cuda_handle: rebuild_cuda_tensor's arguments. Anything but the exact fields, of the
    exact types, is refused (ValueError), so no request can smuggle a class or a callable in."""
    expected = {"size", "stride", "requires_grad", "event_sync_required", *HANDLE_INTS, *HANDLE_BYTES}
    if not isinstance(d, dict) or set(d) != expected:
        raise ValueError(
            f"mapped_ipc handle: expected the fields {sorted(expected)}, got {sorted(d) if isinstance(d, dict) else type(d).__name__}"
        )
    ints = [d[k] for k in HANDLE_INTS] + list(d["size"]) + list(d["stride"])
    if not all(type(v) is int for v in ints) or not all(type(d[k]) is bool for k in ("requires_grad", "event_sync_required")):
        raise ValueError("mapped_ipc handle: offsets, sizes and the device must be integers, the flags booleans")
    raw = {k: None if d[k] is None else base64.b64decode(d[k], validate=True) for k in HANDLE_BYTES}
    return (
        torch.Tensor,
        torch.Size(d["size"]),
        tuple(d["stride"]),
        d["tensor_offset"],
        torch.storage.TypedStorage,
        torch.uint8,
        d["storage_device"],
        raw["storage_handle"],
        d["storage_size_bytes"],
        d["storage_offset_bytes"],
        d["requires_grad"],
        raw["ref_counter_handle"],
        d["ref_counter_offset"],
        raw["event_handle"],
        d["event_sync_required"],
    )
