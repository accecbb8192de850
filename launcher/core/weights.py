"""A model folder's weight files read cheaply, without torch (the login node, a node before vLLM starts): safetensors
headers only (an 8-byte little-endian header length, then a JSON header naming each tensor's dtype, shape and byte
range in the data that follows), and the index of a sharded checkpoint (`*.safetensors.index.json`: weight_map, tensor
name -> shard file). A truncated copy, an empty file or an index whose shards are missing (an interrupted rsync or
`hf download`) fails here in a second instead of in vLLM's loader after the queue.

The tensor names are the checkpoint's, which for a dense model are the modules' own (`model.layers.0.self_attn.q_proj.
weight`): trainer.lora.target_modules is checked against them (launcher.core.lora.target_problems)."""

from __future__ import annotations

import json
import struct
from pathlib import Path


def looks_local(model: str) -> bool:
    """A hub name is `org/name` (or `name`); anything absolute, relative-dotted or home-based is a path, and so is
    anything that exists here, has more than one slash, or starts in a folder that exists here (models/qwen7b with a
    models/ folder: a missing model folder, not a hub name)."""
    if model.startswith(("/", "./", "../", "~")) or model.count("/") > 1 or Path(model).expanduser().exists():
        return True
    first = model.split("/", 1)[0]
    return "/" in model and Path(first).is_dir()


MAX_HEADER_BYTES = 100_000_000
"""safetensors' own limit on the JSON header (safetensors/src/tensor.rs MAX_HEADER_SIZE)."""


class WeightsError(ValueError):
    """A weight file that cannot load: one line naming the file and what is wrong."""


def safetensors_header(path: Path) -> dict[str, dict]:
    """Tensor name -> {dtype, shape, data_offsets} of one safetensors file; WeightsError if its header is unreadable or
    the file is shorter than the data its header describes."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            raw = f.read(n) if 0 <= n <= min(MAX_HEADER_BYTES, size - 8) else b""
    except OSError as e:
        raise WeightsError(f"{path} is unreadable ({e.strerror})") from None
    if n < 0:
        raise WeightsError(f"{path} is {size} bytes, too short for a safetensors file (an interrupted copy?)")
    if not raw:
        raise WeightsError(f"{path}: its header claims {n} bytes, the file has {size} (truncated, or not safetensors)")
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise WeightsError(f"{path}: its header is not valid JSON (truncated, or not safetensors)") from None
    if not isinstance(header, dict):
        raise WeightsError(f"{path}: its header is not a JSON object (not safetensors)")
    tensors = {k: v for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)}
    end = max((int(v.get("data_offsets", (0, 0))[1]) for v in tensors.values()), default=0)
    if 8 + n + end > size:
        raise WeightsError(
            f"{path} is {size} bytes but its header describes {8 + n + end}: truncated (an interrupted copy?); copy it again"
        )
    return tensors


def index_shards(index: Path) -> dict[str, str]:
    """weight_map of a `*.safetensors.index.json`: tensor name -> shard file name."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError):
        raise WeightsError(f"{index} is unreadable or has no weight_map") from None
    if not isinstance(weight_map, dict) or not weight_map:
        raise WeightsError(f"{index}: its weight_map is empty")
    return {str(k): str(v) for k, v in weight_map.items()}


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files vLLM and transformers load from the folder: the shards its index names, else every
    *.safetensors file (model.safetensors alone where it is there); WeightsError if a shard the index names is missing.
    [] when the folder holds none (pickled *.bin weights only)."""
    # transformers' own index first, as vLLM and transformers pick it: a Mistral repo also holds consolidated.* (Mistral's
    # format, other tensor names), which a download of the HF shards alone leaves without its shards
    own = folder / "model.safetensors.index.json"
    indexes = [own] if own.is_file() else sorted(folder.glob("*.safetensors.index.json"))
    if indexes:  # vLLM and transformers load the index's shards (a file it does not name is skipped)
        shards = sorted(set(index_shards(indexes[0]).values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise WeightsError(
                f"{indexes[0]} names {len(shards)} shards, {len(missing)} missing here ({', '.join(missing[:3])}"
                f"{', ...' if len(missing) > 3 else ''}): an interrupted copy or download? copy them again"
            )
        return [folder / s for s in shards]
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]  # as transformers and vLLM load it, beside a consolidated.safetensors
    return sorted(folder.glob("*.safetensors"))


def weight_shapes(folder: Path) -> dict[str, list[int]] | None:
    """Every tensor's shape, by name, from the folder's safetensors (weight_files): WeightsError if a file is missing or
    cannot load. None when the folder holds only pickled weights (*.bin: not readable without torch; nothing checked)."""
    files = weight_files(folder)
    if not files:
        return None
    shapes: dict[str, list[int]] = {}
    for f in files:
        for name, t in safetensors_header(f).items():
            shapes[name] = list(t.get("shape") or [])
    return shapes
