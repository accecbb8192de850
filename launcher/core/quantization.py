"""Quantized checkpoints (config.json's quantization_config): the trainer needs full-precision weights and vLLM must
serve the same ones, so the plan refuses them; `slurm-grpo dequantize` (trainer.dequantize) writes a bf16 copy of the
methods named here. Torch-free: the plan reads it on the login node, the dequantizer on the machine that converts."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

CONVERTS = "mxfp4 (gpt-oss's releases), fp8 with weight_block_size (DeepSeek-V3, Qwen3-*-FP8)"
"""The methods `slurm-grpo dequantize` converts, as its messages name them."""


def quantization_config(config: dict) -> dict | None:
    """The quantization_config of a config.json's dict (or of its text_config: a multimodal model's); None if none."""
    for c in (config, config.get("text_config") or {}):
        q = c.get("quantization_config") if isinstance(c, dict) else None
        if isinstance(q, dict):
            return q
    return None


def method(q: dict) -> str:
    return str(q.get("quant_method") or "unknown")


def dequantizable(q: dict) -> bool:
    """Whether trainer.dequantize converts this quantization_config: mxfp4 (the *_blocks/*_scales pairs of gpt-oss's
    experts) or block-wise fp8 (weight x weight_scale_inv over weight_block_size blocks)."""
    m = method(q)
    return m == "mxfp4" or (m == "fp8" and _block_size(q) is not None)


def _block_size(q: dict) -> tuple[int, int] | None:
    b = q.get("weight_block_size")
    if isinstance(b, (list, tuple)) and len(b) == 2 and all(isinstance(x, int) and x > 0 for x in b):
        return int(b[0]), int(b[1])
    return None


def block_size(q: dict) -> tuple[int, int]:
    """An fp8 quantization_config's (rows, columns) per scale; dequantizable(q) holds."""
    b = _block_size(q)
    assert b is not None, q
    return b


def read(model: str) -> dict | None:
    """The quantization_config of a local model folder's config.json; None if it has none or is not readable here
    (the model lives on the nodes only: not refused, as the plan's other checks of the model do)."""
    try:
        c = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return quantization_config(c) if isinstance(c, dict) else None


def refusal(model: str, q: dict) -> str:
    """The one line that names the quant method and the fix."""
    m = method(q)
    if dequantizable(q):
        out = model.rstrip("/") + "-bf16"
        return (
            f"vllm.model {model} is quantized ({m}); the trainer needs full-precision weights: run "
            f"`slurm-grpo dequantize {shlex.quote(model)} {shlex.quote(out)}` and set vllm.model to {out}"
        )
    return f"vllm.model {model} is quantized ({m}), which `slurm-grpo dequantize` does not convert; use the model's bf16/fp16 release"
