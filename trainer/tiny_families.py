"""The model families the project is tested with: per family, the transformers `model_type` and the config fields that
make a tiny body vLLM's CPU build serves (trainer.tiny_model builds it; tests/unit/test_families.py runs the matrix).

Shapes: head_dim 64 (vLLM's CPU attention), hidden 128 (a multiple of 32: vLLM's CPU MoE kernel), every dimension
at least 2 (transformers' expert split squeezes a size-1 dimension away), 3 experts (not a multiple of an even shard
group: FSDP2 then gives the ranks unequal expert blocks) and, for qwen3_moe, an expert width that is not a multiple
of 32 (vLLM's CPU kernel pads it). MLA (deepseek_v2/v3, glm4_moe_lite): qk_rope_head_dim = head_dim (transformers'
rotary is sized by head_dim) and as many kv heads as heads. Fields real checkpoints carry that vLLM reads and
transformers does not default: DeepSeek-V3's topk_method noaux_tc (vLLM makes e_score_correction_bias only then),
GLM-4.7-Flash's first_k_dense_replace. Each DeepSeek/GLM body has a dense layer 0 before its MoE layers. Which kind each
layer is (Qwen3.5's linear and full attention, Nemotron-H's Mamba-2, MLP and attention, ...) at any --layers:
trainer.tiny_layers; the widths that follow --hidden / --head-dim / --kv-heads: SIZED."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from launcher.core.plan import ALWAYS_TIED_FAMILIES, DEEPSEEK_ROUTER, NEVER_TIED_FAMILIES
from trainer.tiny_layers import MIN_LAYERS, layer_fields

OMIT: Any = object()
"""A family's field of this value is left out of its tiny config (Falcon computes head_dim and has no setter for it)."""

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
    "smollm3": {},
    "cohere": {"tie_word_embeddings": True},  # vLLM 0.32 drops lm_head and ties it (as every Command-R checkpoint)
    "cohere2": {"tie_word_embeddings": True},  # vLLM 0.32 drops lm_head and ties it (as every Command-R checkpoint)
    "starcoder2": {},
    "stablelm": {},
    "olmo": {},
    "olmo3": {},
    "exaone4": {},
    "ernie4_5": {},
    "seed_oss": {},
    "hunyuan_v1_dense": {},
    "apertus": {},
    "arcee": {},
    "phi": {},
    # GPT-NeoX (Pythia) has no GQA and its released configs no num_key_value_heads: transformers ignores the field,
    # vLLM's Transformers backend sizes its attention by it (1 kv head: parity 0.2 off before any training step)
    "gpt_neox": {"num_key_value_heads": OMIT},
    # Gemma 4: its per-layer input embeddings default to 262144 x 256 per layer (135 M parameters at 2 layers): sized
    # to the tokenizer (SIZED); its layers: LAYER_RULES
    "gemma4_text": {"hidden_size_per_layer_input": 16, "sliding_window": 16},
    "ministral3": {},
    "nemotron": {},
    "qwen3_5_text": {  # Qwen3.5: Gated DeltaNet (linear attention) and full attention (LAYER_RULES)
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
    },
    # LFM2: vLLM reads block_dim and conv_dim (SIZED); vLLM 0.32 always ties its lm_head (every LFM2 checkpoint is tied)
    "lfm2": {"tie_word_embeddings": True},
    # Nemotron-H (dense, as Nemotron-H-8B): a layer is one of Mamba-2, MLP or attention (LAYER_RULES)
    "nemotron_h": {
        "mamba_head_dim": 64,
        "n_groups": 2,
        "ssm_state_size": 16,
        "chunk_size": 64,
    },
    # Granite-4.0-H without experts (as the dense -H-1B/-350M): Mamba-2 then attention, a shared MLP in each
    "granitemoehybrid": {
        "num_local_experts": 0,
        "shared_intermediate_size": 256,
        "mamba_d_head": 64,
        "mamba_d_state": 16,
        "mamba_chunk_size": 64,
    },
    # Falcon-H1: attention and Mamba-2 side by side in every layer (its non-persistent mup_vector: trainer.loading)
    "falcon_h1": {"mamba_d_head": 64, "mamba_d_state": 16, "mamba_chunk_size": 64},
    # Zamba2: Mamba-2 layers and a shared attention block (on the doubled hidden: SIZED); vLLM ties its lm_head
    "zamba2": {"mamba_d_state": 16, "chunk_size": 64, "tie_word_embeddings": True},
    "minicpm3": {"kv_lora_rank": 32, "q_lora_rank": 64, "qk_nope_head_dim": 64, "qk_rope_head_dim": 64, "v_head_dim": 64},
    # Gemma-3n's text model: AltUp, LAuReL and per-layer inputs, small; no kv-shared layer
    "gemma3n_text": {"hidden_size_per_layer_input": 16, "laurel_rank": 8, "num_kv_shared_layers": 0, "sliding_window": 16},
    "falcon": {"head_dim": OMIT},  # Falcon-7B's layout: multi-query, parallel attention
    "bloom": {"tie_word_embeddings": True},  # vLLM 0.32 always ties Bloom's lm_head (as every Bloom checkpoint)
    "gpt2": {},
    "gptj": {"rotary_dim": 32, "tie_word_embeddings": False},  # vLLM 0.32 asserts GPT-J untied (as GPT-J-6B is)
    "opt": {},
    "hyperclovax": {},
    "granite_swa": {"sliding_window": 16},
    "mamba": {"state_size": 16, "time_step_rank": 8},
    "mamba2": {"state_size": 16, "n_groups": 1, "chunk_size": 64, "time_step_rank": 8},
    "falcon_mamba": {"state_size": 16, "time_step_rank": 8},
    # Jamba: Mamba and attention layers, dense and 3-expert MLPs (LAYER_RULES); here, not in MOE, with the other
    # hybrids (launcher.core.layer_kinds counts its Mamba layers and its experts)
    "jamba": {"num_experts": 3, "num_experts_per_tok": 2, "mamba_d_state": 16, "mamba_dt_rank": 8},
}
"""model_type -> fields beyond the common ones."""

DEEPSEEK_MOE = {
    "n_routed_experts": 3,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
}
"""DeepSeek's MoE fields (GLM-4.5 takes the same): routed and shared experts, the first layer dense."""
MLA = {"kv_lora_rank": 32, "q_lora_rank": 64, "qk_nope_head_dim": 64, "qk_rope_head_dim": 64, "v_head_dim": 64}
"""Multi-head latent attention's fields (DeepSeek-V2/V3, GLM-4.7-Flash): the rope head size is head_dim (64; their configs
set head_dim from it, whatever --head-dim says, which sizes only the head count: hidden / head_dim)."""
DSA_INDEXER = {"index_n_heads": 2, "index_head_dim": 128, "index_topk": 8}
"""DeepSeek Sparse Attention's indexer (DeepSeek-V3.2, GLM-5), small: 2 heads, each query attends to its top 8 keys."""

QWEN3_NEXT = {
    "num_experts": 3,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
}
"""Qwen3-Next's MoE with Gated DeltaNet linear attention (Qwen3.5-MoE's too)."""

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
    # the router's fields as the released config.json files carry them (launcher.core.plan.SERVED_FIELDS: vLLM reads them)
    "deepseek_v3": {**DEEPSEEK_MOE, **MLA, **DEEPSEEK_ROUTER, "n_group": 1, "topk_group": 1},
    "deepseek_v2": {**DEEPSEEK_MOE, **MLA, "q_lora_rank": None},
    "glm4_moe": DEEPSEEK_MOE,
    "glm4_moe_lite": {**DEEPSEEK_MOE, **MLA},
    "ernie4_5_moe": {  # layer 0 dense (transformers' default, written out: it sets the fewest layers)
        "moe_num_experts": 3,
        "moe_k": 2,
        "moe_intermediate_size": 32,
        "moe_num_shared_experts": 1,
        "moe_layer_start_index": 1,
    },
    "granitemoe": {"num_local_experts": 3, "num_experts_per_tok": 2, "intermediate_size": 64},
    "hunyuan_v1_moe": {"num_experts": 3, "moe_topk": 2, "intermediate_size": 64},
    "llama4_text": {"num_local_experts": 3, "num_experts_per_tok": 1, "intermediate_size": 64, "intermediate_size_mlp": 256},
    "gpt_oss": {
        "num_local_experts": 3,
        "num_experts_per_tok": 2,
        "intermediate_size": 64,
        "sliding_window": 16,  # layer 0 slides, layer 1 is full: both kinds within the tests' sequences
        # YaRN as the released models carry it, its original length scaled to the tiny max_position_embeddings (512)
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 8.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 64,
        },
    },
    "qwen3_next": QWEN3_NEXT,
    "qwen3_5_moe_text": QWEN3_NEXT,  # Qwen3.5-MoE: Qwen3-Next's layout and fields
    "minimax_m2": {
        "num_local_experts": 3,
        "num_experts_per_tok": 2,
        "intermediate_size": 64,
        # as MiniMax-M2's config.json: vLLM reads rotary_dim (transformers takes it as partial_rotary_factor), and the
        # sigmoid router with its e_score_correction_bias, which transformers always builds and vLLM only when told
        "rotary_dim": 32,
        "scoring_func": "sigmoid",
        "use_routing_bias": True,
    },
    "lfm2_moe": {
        "num_experts": 3,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "num_dense_layers": 1,
        "tie_word_embeddings": True,  # vLLM's Lfm2MoeForCausalLM always ties lm_head to the embedding, as LFM2 does
    },
    "cohere2_moe": {
        "num_experts": 3,
        "num_experts_per_tok": 2,
        "intermediate_size": 64,
        "sliding_window": 16,
    },
    "exaone_moe": {
        "num_experts": 3,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "num_shared_experts": 1,
        "first_k_dense_replace": 1,
        "sliding_window": 16,
    },
    "granitemoeshared": {
        "num_local_experts": 3,
        "num_experts_per_tok": 2,
        "intermediate_size": 64,
        "shared_intermediate_size": 64,
    },
    "granitemoe_swa": {
        "num_local_experts": 3,
        "num_experts_per_tok": 2,
        "intermediate_size": 64,
        "shared_intermediate_size": 64,
        "sliding_window": 16,
    },
    "hy_v3": {
        "num_experts": 3,
        "num_experts_per_tok": 2,
        "num_shared_experts": 1,
        "moe_intermediate_size": 32,
        # as HY-V3's config.json carries them, read by vLLM only: the expert width (expert_hidden_dim), the dense
        # first layer (transformers' default), the renormalized top-k and the q/k norms (both always on in transformers)
        "expert_hidden_dim": 32,
        "first_k_dense_replace": 1,
        "route_norm": True,
        "qk_norm": True,
    },
    "afmoe": {
        "num_experts": 3,
        "num_experts_per_tok": 2,
        "num_shared_experts": 1,
        "moe_intermediate_size": 32,
        "num_dense_layers": 1,
        "sliding_window": 16,
        # as AFMoE's config.json: transformers' router is always sigmoid with renormalized top-k; vLLM reads them
        "score_func": "sigmoid",
        "route_norm": True,
        "n_group": 1,
        "topk_group": 1,
    },
    "laguna": {
        "num_experts": 3,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
        "sliding_window": 16,
    },
    # A.X-K1: DeepSeek-V3's layout with a norm after the MoE block. Every layer MoE: vLLM 0.32 gives every layer that
    # norm (used on the MoE ones only) and wants it from the checkpoint, where transformers has it only on MoE layers
    "axk1": {**DEEPSEEK_MOE, **MLA, "first_k_dense_replace": 0, "n_group": 1, "topk_group": 1},
    # MiMo-V2-Flash: full-attention layers and sliding-window ones with attention sinks and twice the kv heads (SIZED);
    # transformers reads layer_types / mlp_layer_types and one rope per kind, vLLM the fields the released config.json
    # carries beside them (hybrid_layer_pattern, moe_layer_freq: LAYER_RULES; the swa_* sizes, layernorm_epsilon, one rope)
    "mimo_v2_flash": {
        "n_routed_experts": 3,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "sliding_window": 16,
        "sliding_window_size": 16,
        "add_swa_attention_sink_bias": True,  # launcher.core.plan.SERVED_FIELDS: without it vLLM drops the sinks
        "layernorm_epsilon": 1e-05,
        "partial_rotary_factor": 0.5,
        "rope_theta": 10000.0,
        "swa_rope_theta": 10000.0,
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        },
    },
    # DeepSeek-V3.2: V3's MLA and experts plus the sparse-attention indexer (a small one: 2 heads, the top 8 tokens)
    "deepseek_v32": {**DEEPSEEK_MOE, **MLA, **DSA_INDEXER, **DEEPSEEK_ROUTER, "n_group": 1, "topk_group": 1},
    "glm_moe_dsa": {**DEEPSEEK_MOE, **MLA, **DSA_INDEXER, **DEEPSEEK_ROUTER},  # GLM-5: the same layout, GLM's router
    "hy_v4": {**DEEPSEEK_MOE, **MLA, **DSA_INDEXER, "topk_group": 1},  # HY-V4: MLA, DSA, DeepSeek-style experts
}

FAMILIES = {**DENSE, **MOE}

SWEEP_ONLY = frozenset(
    {
        "cohere",
        "stablelm",
        "olmo",
        "exaone4",
        "ernie4_5",
        "seed_oss",
        "hunyuan_v1_dense",
        "apertus",
        "arcee",
        "phi",
        "deepseek_v2",
        "ernie4_5_moe",
        "granitemoe",
        "hunyuan_v1_moe",
        "nemotron",
        "nemotron_h",
        "granitemoehybrid",
        "falcon_h1",
        "zamba2",
        "minicpm3",
        "gemma3n_text",
        "falcon",
        "bloom",
        "gpt2",
        "gptj",
        "opt",
        "hyperclovax",
        "granite_swa",
        "mamba",
        "mamba2",
        "falcon_mamba",
        "jamba",
        "deepseek_v32",
        "lfm2_moe",
        "cohere2_moe",
        "exaone_moe",
        "granitemoeshared",
        "granitemoe_swa",
        "glm_moe_dsa",
        "hy_v3",
        "afmoe",
        "laguna",
        "axk1",
        "mimo_v2_flash",
        "hy_v4",
    }
)
"""Families the unit tier's matrix leaves to the full sweep (`SLURM_GRPO_TEST_ALL_FAMILIES=1 pytest
tests/unit/test_families.py`, ~20 s more on 2 cores), for the tier's time budget: each has the layout of a family that
stays (Llama-style GQA/SwiGLU, DeepSeek-V3's MLA and experts, Mixtral-style experts) with other config fields. All passed
the sweep when they were added."""


PUSH_NOT_CHECKED = {
    "qwen3_5_text": "GPU only: vLLM 0.32's qwen3_5 module imports torchvision (through qwen3_vl and transformers' Qwen2-VL image "
    "processor), which the CPU venv cannot have (scripts/install.sh); the names a push sends (the checkpoint's: "
    "model.* or model.language_model.*; in_proj_qkv/z/b/a) are those its loaders map (hf_to_vllm_mapper, read in the source)",
    "qwen3_5_moe_text": "GPU only: vLLM 0.32's qwen3_5 module imports torchvision (through transformers' Qwen2-VL image "
    "processor), which the CPU venv lacks (the PyPI wheel is a CUDA build)",
    "deepseek_v32": "GPU only: vLLM 0.32 'Sparse Attention is not supported on CPU' (the DSA indexer)",
    "glm_moe_dsa": "GPU only: vLLM 0.32 'Sparse Attention is not supported on CPU' (the DSA indexer)",
    "hy_v4": "GPU only: vLLM 0.32 'HYV4 sparse attention was requested, but no valid sparse MLA backend is available'",
    "laguna": "vLLM 0.32's Laguna never loads the router's e_score_correction_bias (checkpoint or push: its parameter "
    "is experts.routed_experts.e_score_correction_bias, the checkpoint's name falls to its ignored '_bias' suffixes), "
    "so it serves 0 there; every other parameter of a push lands as a fresh load (checked by the sweep)",
}
"""Families whose push the matrix leaves out, and why (the sharded load, and for MoE families FSDP2 train/resume, are
checked as for every family; a GPU run's parity after each push checks the push)."""


class Body(NamedTuple):
    """The sizes make-tiny-model is asked for (--layers, --hidden, ...; heads = hidden / head_dim)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int


DEEPSEEK_V3_MLA: dict[str, Any] = {"qk_nope_head_dim": 128, "v_head_dim": 128, "kv_lora_rank": 512, "q_lora_rank": 1536}
MLA_RELEASED: dict[str, dict[str, Any]] = {
    "deepseek_v3": DEEPSEEK_V3_MLA,
    "deepseek_v32": DEEPSEEK_V3_MLA,
    "deepseek_v2": {**DEEPSEEK_V3_MLA, "q_lora_rank": None},
    "glm4_moe_lite": {"qk_nope_head_dim": 192, "v_head_dim": 256, "kv_lora_rank": 512, "q_lora_rank": 768},
    "glm_moe_dsa": {"qk_nope_head_dim": 192, "v_head_dim": 256, "kv_lora_rank": 512, "q_lora_rank": 2048},
    "hy_v4": DEEPSEEK_V3_MLA,  # DeepSeek-V3's layout
    "axk1": DEEPSEEK_V3_MLA,
}
"""The released models' MLA widths (rope 64 in all), taken at --head-dim 128 and above: vLLM's GPU MLA prefill serves
only the released shapes (FlashAttention: nope/rope/v 128/64/128, 192/64/256 or 64/64/128; H100, 2026-12-06: the CPU
matrix's 64/64/64 found no backend), its decode kernels the 512-wide latent. Every family built on MLA below."""


def mla_sized(family: str) -> Callable[[Body], dict[str, Any]]:
    # transformers sizes the rotary by head_dim: it is the rope width (the head count stays hidden / --head-dim)
    return lambda b: {**MLA_RELEASED[family], "qk_rope_head_dim": 64, "head_dim": 64} if b.head_dim >= 128 else {}


SIZED: dict[str, Callable[[Body], dict[str, Any]]] = {
    **{family: mla_sized(family) for family in MLA_RELEASED},
    # Mamba-2 mixers: 2 x hidden wide (the released models' expand 2), in heads of 64 (mamba_head_dim / mamba_d_head)
    "nemotron_h": lambda b: {"mamba_num_heads": 2 * b.hidden // 64},
    "granitemoehybrid": lambda b: {"mamba_n_heads": 2 * b.hidden // 64},
    "falcon_h1": lambda b: {"mamba_d_ssm": 2 * b.hidden, "mamba_n_heads": 2 * b.hidden // 64},
    "mamba2": lambda b: {"num_heads": 2 * b.hidden // b.head_dim},  # Mamba2Config's head_dim is the mixer's
    # Zamba2's shared attention block runs on the doubled hidden (embedding and hidden state concatenated)
    "zamba2": lambda b: {
        "num_attention_heads": 2 * b.hidden // b.head_dim,
        "num_key_value_heads": 2 * b.hidden // b.head_dim,
        "n_mamba_heads": 2 * b.hidden // 64,
    },
    # LFM2's checkpoints carry block_dim and conv_dim (= hidden), which vLLM reads and transformers does not default
    "lfm2": lambda b: {"block_dim": b.hidden, "conv_dim": b.hidden, "conv_dim_out": b.hidden},
    # Gemma's per-layer input embeddings: one row per token of the tokenizer
    "gemma4_text": lambda b: {"vocab_size_per_layer_input": b.vocab},
    "gemma3n_text": lambda b: {"vocab_size_per_layer_input": b.vocab},
    "opt": lambda b: {"ffn_dim": 4 * b.hidden, "word_embed_proj_dim": b.hidden},
    "falcon": lambda b: {"ffn_hidden_size": 4 * b.hidden},
    # MiMo-V2-Flash's sliding-window layers: as many query heads, twice the kv heads
    "mimo_v2_flash": lambda b: {
        "head_dim": b.head_dim,
        "v_head_dim": b.head_dim,
        "swa_head_dim": b.head_dim,
        "swa_v_head_dim": b.head_dim,
        "swa_num_attention_heads": b.heads,
        "swa_num_key_value_heads": 2 * b.kv_heads,
    },
}
"""model_type -> the fields that follow the body's widths (the others of FAMILIES hold at every size)."""


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
    """Every field of the family's tiny config (the caller makes it with AutoConfig.for_model): its layers of the kinds
    trainer.tiny_layers gives for `layers`, its widths those of SIZED."""
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; known: {', '.join(FAMILIES)}")
    tiny = FAMILIES[family]
    dense_first = tiny.get("first_k_dense_replace") or tiny.get("num_dense_layers") or tiny.get("moe_layer_start_index") or 0
    least = max(MIN_LAYERS.get(family, 1), 1 + dense_first)  # an MoE family: one MoE layer at least
    if layers < least:
        raise ValueError(
            f"--layers {layers} is too few for {family}: its layer kinds need at least {least} (trainer.tiny_layers)"
        )
    mla = "kv_lora_rank" in tiny
    fields = {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads if mla else kv_heads,  # MLA: a latent kv per head
        "head_dim": head_dim,
        "max_position_embeddings": 512,
        "eos_token_id": token_id,
        "bos_token_id": token_id,
        "pad_token_id": token_id,
        # vLLM serves these with their own lm_head (a tied body would generate from a head never loaded), those with
        # the embedding (an untied one would be served with another head than the trainer's)
        "tie_word_embeddings": (tie or family in ALWAYS_TIED_FAMILIES) and family not in NEVER_TIED_FAMILIES,
        "torch_dtype": dtype,
        **tiny,
        **(SIZED[family](Body(layers, hidden, heads, kv_heads, head_dim, vocab)) if family in SIZED else {}),
        **layer_fields(family, layers),
    }
    return {k: v for k, v in fields.items() if v is not OMIT}


EXPERT_COUNT = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
EXPERTS_PER_TOKEN = ("num_experts_per_tok", "moe_k", "moe_topk")
"""The names transformers' MoE configs give the routed experts and the top-k (each family uses one of each)."""


def moe_fields(family: str, *, experts: int = 0, experts_per_token: int = 0, expert_intermediate: int = 0) -> dict[str, Any]:
    """The config fields that resize a MoE family's experts (0 keeps the tiny default), in the family's own names:
    make-tiny-model's --experts / --top-k / --moe-intermediate, so a GPU-sized MoE body is built in one pass. The expert
    width is moe_intermediate_size where the family has one, else intermediate_size (mixtral, olmoe, granitemoe, ...)."""
    if not (experts or experts_per_token or expert_intermediate):
        return {}
    if family not in MOE:
        raise ValueError(f"--experts/--top-k/--moe-intermediate need an MoE family ({', '.join(MOE)}), not {family!r}")
    tiny = MOE[family]
    count = next(k for k in EXPERT_COUNT if k in tiny)
    top = next(k for k in EXPERTS_PER_TOKEN if k in tiny)
    e = experts or tiny[count]
    k = experts_per_token or tiny[top]
    if not 1 <= k <= e:
        raise ValueError(f"--top-k ({k}) must be between 1 and --experts ({e})")
    out: dict[str, Any] = {count: e, top: k}
    if expert_intermediate:
        out["moe_intermediate_size" if "moe_intermediate_size" in tiny else "intermediate_size"] = expert_intermediate
    return out
