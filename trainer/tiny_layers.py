"""Which kind each decoder layer of a tiny body is, per family: the released models' layer pattern, repeated to the layer
count make-tiny-model is asked for (`--layers N`), so a realistic-depth body (`--family qwen3_5_text --layers 24`) has
the released model's mix of layers, and a short one still holds every kind (the 2-layer CPU test bodies).

The rule, one place for every family:
- LAYER_RULES: families whose per-layer config fields the tiny body sets (below, each with the released model it follows);
- TRANSFORMERS_RULES: families whose config class derives its per-layer fields from num_hidden_layers itself;
- every other family: all layers alike, except an MoE family's first `first_k_dense_replace` / `num_dense_layers`
  layers (trainer.tiny_families: 1), which are dense.

`every(layers, period, at, ...)` is Jamba's attn_layer_period / attn_layer_offset (Qwen3.5's full_attention_interval,
Gemma's sliding_window_pattern are its `at = period - 1`): a body shorter than the period takes a period of its own
length, with the rare layer at min(at, layers - 1), so a 2-layer body is one of each kind.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

FULL, SLIDING, LINEAR = "full_attention", "sliding_attention", "linear_attention"
"""Layer kinds as transformers names them (LINEAR: Gated DeltaNet or a Mamba mixer; the legacy "mamba" remapped to it)."""


def every(layers: int, period: int, at: int, rare: str, common: str) -> list[str]:
    """`rare` at layer i where i % period == at, `common` elsewhere; a shorter body shrinks the period to its length."""
    p = min(period, layers)
    return [rare if i % p == min(at, p - 1) else common for i in range(layers)]


NEMOTRON_H_PERIOD = "M-M-M-M*-"
"""Nemotron-H-8B's first 9 layers (its hybrid_override_pattern; its later periods hold one more Mamba-2 + MLP pair):
M a Mamba-2 layer, - an MLP, * attention."""
NEMOTRON_H_KINDS = {"M": LINEAR, "-": "mlp", "*": FULL}


def _nemotron_h(layers: int) -> dict[str, Any]:
    # shorter than one period: its first layers, then attention and its MLP ("M-*-" at 4, "M*-" at 3)
    pattern = NEMOTRON_H_PERIOD * (layers // 9 + 1) if layers >= 9 else NEMOTRON_H_PERIOD[: layers - 2] + "*-"
    return {"layers_block_type": [NEMOTRON_H_KINDS[c] for c in pattern[:layers]]}


def _lfm2(layers: int) -> dict[str, Any]:
    kinds = every(layers, 3, 2, FULL, "conv")
    return {"layer_types": kinds, "full_attn_idxs": [i for i, k in enumerate(kinds) if k == FULL]}  # vLLM reads either


def _gemma4(layers: int) -> dict[str, Any]:
    kinds = every(layers, 6, 5, FULL, SLIDING)
    return {"layer_types": [*kinds[:-1], FULL]}  # the last layer is full (transformers makes it so)


def _sliding_every(period: int) -> Callable[[int], dict[str, Any]]:
    """Cohere2-MoE and EXAONE-MoE: transformers derives layer_types from sliding_window_pattern, which vLLM may read too."""
    return lambda n: {"sliding_window_pattern": min(period, n), "layer_types": every(n, period, period - 1, FULL, SLIDING)}


def _mimo_v2_flash(layers: int) -> dict[str, Any]:
    attention = [FULL if i == 0 or (i + 1) % 6 == 0 else SLIDING for i in range(layers)]
    mlp = ["dense"] + ["sparse"] * (layers - 1)
    return {
        "layer_types": attention,
        "mlp_layer_types": mlp,
        # the same, as the released config.json spells them for vLLM: 1 = sliding window, 1 = MoE
        "hybrid_layer_pattern": [int(k == SLIDING) for k in attention],
        "moe_layer_freq": [int(k == "sparse") for k in mlp],
    }


def _jamba(layers: int) -> dict[str, Any]:
    attention, experts = min(8, layers), min(2, layers)  # every()'s shrinking, in Jamba's own fields
    return {
        "attn_layer_period": attention,
        "attn_layer_offset": min(4, attention - 1),
        "expert_layer_period": experts,
        "expert_layer_offset": min(1, experts - 1),
    }


def _qwen3_next(n: int) -> dict[str, Any]:
    return {"layer_types": every(n, 4, 3, FULL, LINEAR)}


LAYER_RULES: dict[str, Callable[[int], dict[str, Any]]] = {
    # Qwen3.5 (and Qwen3-Next, Qwen3.5-MoE): 3 Gated DeltaNet layers, then full attention (full_attention_interval 4)
    "qwen3_5_text": _qwen3_next,
    "qwen3_next": _qwen3_next,
    "qwen3_5_moe_text": _qwen3_next,
    # gpt-oss: sliding window and full attention alternate
    "gpt_oss": lambda n: {"layer_types": every(n, 2, 1, FULL, SLIDING)},
    # Gemma 4: 5 sliding-window layers, then a full one; the last layer full
    "gemma4_text": _gemma4,
    # Gemma-3n (E2B, E4B): 4 sliding-window layers, then a full one
    "gemma3n_text": lambda n: {"layer_types": every(n, 5, 4, FULL, SLIDING)},
    # LFM2 (350M-1.2B attend at layers 2, 5, 8, 10, 12, 14 of 16): 2 short convolutions, then attention
    "lfm2": _lfm2,
    # LFM2-8B-A1B (attention at 2, 6, 10, 14, 18, 21 of 24): attention at layer 2 and every 4th after it
    "lfm2_moe": lambda n: {"layer_types": every(n, 4, 2, FULL, "conv")},
    # Nemotron-H-8B: "M-M-M-M*-" repeated
    "nemotron_h": _nemotron_h,
    # Granite-4.0-H: 9 Mamba-2 layers to 1 attention layer (IBM's ratio; attention at 5, 15, 25, 35 of 40)
    "granitemoehybrid": lambda n: {"layer_types": every(n, 10, 5, FULL, LINEAR)},
    # Zamba2-2.7B: the shared attention block ("hybrid") at layer 6 and every 6th after it, Mamba-2 elsewhere
    "zamba2": lambda n: {"layers_block_type": [LINEAR] + every(n - 1, 6, 5, "hybrid", LINEAR)},
    # Jamba: attention at layer 4 of every 8 (attn_layer_period 8, offset 4), experts on every 2nd layer (period 2,
    # offset 1)
    "jamba": _jamba,
    # MiMo-V2-Flash: full attention at layer 0 and every 6th layer, sliding window elsewhere; layer 0's MLP dense
    "mimo_v2_flash": _mimo_v2_flash,
    # Laguna: layer 0's MLP dense, the others MoE (transformers' default, written out: it sets the fewest layers)
    "laguna": lambda n: {"mlp_layer_types": ["dense"] + ["sparse"] * (n - 1)},
    # Cohere2-MoE (transformers' default) and K-EXAONE ("LLLG"): 3 sliding-window layers, then a full one
    "cohere2_moe": _sliding_every(4),
    "exaone_moe": _sliding_every(4),
}
"""model_type -> the per-layer config fields of a body of n layers."""

TRANSFORMERS_RULES = {
    "gemma2": "sliding window and full attention alternate",
    "gemma3_text": "5 sliding-window layers, then a full one",
    "cohere2": "3 sliding-window layers, then a full one",
    "olmo3": "3 sliding-window layers, then a full one",
    "exaone4": "3 sliding-window layers, then a full one",
    "afmoe": "3 sliding-window layers, then a full one (global_attn_every_n_layers 4)",
    "granite_swa": "full attention at layer 0 and every 4th after it, sliding window elsewhere",
    "granitemoe_swa": "full attention at layer 0 and every 4th after it, sliding window elsewhere",
    "smollm3": "no rotary embedding on every 4th layer",
    "llama4_text": "chunked attention; every 4th layer full, without rotary embedding",
    "hy_v4": "the sparse-attention indexer computed at layers 0, 1 and every 4th after 1, shared by the others",
}
"""model_type -> the layer pattern its transformers config derives from num_hidden_layers (as the released models)."""

MIN_LAYERS = {"nemotron_h": 3, **{f: 2 for f in LAYER_RULES if f != "nemotron_h"}}
"""The fewest layers that hold each of a family's layer kinds (an MoE family with a dense first layer needs 2 as well:
trainer.tiny_families.config_fields)."""

TINY_LAYERS = {"nemotron_h": 4}
"""make-tiny-model's default layer count where it is not 2: Nemotron-H's Mamba-2, MLP, attention, MLP."""


def layer_fields(family: str, layers: int) -> dict[str, Any]:
    """The config fields that fix each layer's kind in a body of `layers` layers ({} for a family of alike layers)."""
    rule = LAYER_RULES.get(family)
    return rule(layers) if rule else {}
