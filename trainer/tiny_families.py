"""The model families the project is tested with: per family, the transformers `model_type` and the config fields that
make a tiny body vLLM's CPU build serves (trainer.tiny_model builds it; tests/unit/test_families.py runs the matrix).

Shapes: head_dim 64 (vLLM's CPU attention), hidden 128 (a multiple of 32: vLLM's CPU MoE kernel), every dimension
at least 2 (transformers' expert split squeezes a size-1 dimension away), 3 experts (not a multiple of an even shard
group: FSDP2 then gives the ranks unequal expert blocks) and, for qwen3_moe, an expert width that is not a multiple
of 32 (vLLM's CPU kernel pads it)."""

from __future__ import annotations

from typing import Any

DENSE: dict[str, dict[str, Any]] = {
    "qwen2": {},
    "qwen3": {},
    "llama": {},
    "mistral": {},
    "gemma": {},
    "gemma2": {},
    "gemma3_text": {},
    "phi3": {},
    "olmo2": {},
    "glm4": {},
    "granite": {},
}
"""model_type -> fields beyond the common ones."""

MOE: dict[str, dict[str, Any]] = {
    "qwen3_moe": {"num_experts": 3, "num_experts_per_tok": 2, "moe_intermediate_size": 48},
    "qwen2_moe": {
        "num_experts": 3,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
    },
    "olmoe": {"num_experts": 3, "num_experts_per_tok": 2},
    "mixtral": {"num_local_experts": 3, "num_experts_per_tok": 2},
}

FAMILIES = {**DENSE, **MOE}


def config_fields(
    family: str,
    *,
    vocab: int,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    intermediate: int,
    tie: bool,
    token_id: int,
    dtype: str,
) -> dict[str, Any]:
    """Every field of the family's tiny config (the caller makes it with AutoConfig.for_model)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; known: {', '.join(FAMILIES)}")
    return {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": 512,
        "eos_token_id": token_id,
        "bos_token_id": token_id,
        "pad_token_id": token_id,
        "tie_word_embeddings": tie,
        "torch_dtype": dtype,
        **FAMILIES[family],
    }


EXPERT_WIDTH_IS_INTERMEDIATE = ("olmoe", "mixtral")
"""MoE families whose experts take `intermediate_size` as their width (no moe_intermediate_size field)."""


def moe_fields(family: str, *, experts: int = 0, experts_per_token: int = 0, expert_intermediate: int = 0) -> dict[str, Any]:
    """The config fields that resize a MoE family's experts (0 keeps the tiny default), in the family's own names:
    make-tiny-model's --experts / --top-k / --moe-intermediate, so a GPU-sized MoE body is built in one pass."""
    if not (experts or experts_per_token or expert_intermediate):
        return {}
    if family not in MOE:
        raise ValueError(f"--experts/--top-k/--moe-intermediate need an MoE family ({', '.join(MOE)}), not {family!r}")
    count = "num_local_experts" if family == "mixtral" else "num_experts"
    e = experts or MOE[family][count]
    k = experts_per_token or MOE[family]["num_experts_per_tok"]
    if not 1 <= k <= e:
        raise ValueError(f"--top-k ({k}) must be between 1 and --experts ({e})")
    out: dict[str, Any] = {count: e, "num_experts_per_tok": k}
    if expert_intermediate:
        width = "intermediate_size" if family in EXPERT_WIDTH_IS_INTERMEDIATE else "moe_intermediate_size"
        out[width] = expert_intermediate
    return out
