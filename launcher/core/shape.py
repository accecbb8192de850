"""The decoder shape of a model, read from its config.json: what the plan checks (TP divides the heads) and what
the memory estimate sizes. Torch-free and I/O-light (one small JSON file), so every process may read it."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from launcher.core.layer_kinds import MOE_AWARE, READERS, LayerKind, mla_attention

MIXED_ATTENTION_FAMILIES = ("gemma2", "gemma3", "gemma3_text", "cohere2")
"""Families that interleave sliding-window and full attention whether or not their config.json lists layer_types."""


def mixed_attention(c: dict) -> bool:
    """Whether a config.json's layers mix attention types: layer_types naming more than one, a sliding-window pattern,
    or a family that always interleaves them (MIXED_ATTENTION_FAMILIES)."""
    types = c.get("layer_types")
    listed = isinstance(types, list) and len({str(t) for t in types}) > 1
    pattern = any(c.get(k) for k in ("sliding_window_pattern", "interleaved_sliding_window"))
    return listed or pattern or c.get("model_type") in MIXED_ATTENTION_FAMILIES


@dataclass(frozen=True)
class ModelShape:
    """The decoder shape that decides memory: Llama/Qwen2/Mistral layout (GQA attention, SwiGLU MLP); with experts > 0
    a mixture of experts (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral, DeepSeek/GLM-MoE style): `moe_layers` of the layers
    hold `experts` SwiGLU experts of width `expert_intermediate` and a router, of which `experts_per_token` run per
    token, plus a shared expert of width `shared_intermediate`; the other layers a dense MLP of width `intermediate`."""

    hidden: int
    layers: int
    intermediate: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    experts: int = 0
    """Routed experts per MoE layer (0 = a dense model)."""
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0
    """The always-active shared expert's width (Qwen2-MoE's shared_expert_intermediate_size; DeepSeek's
    n_shared_experts x moe_intermediate_size); 0 = none."""
    moe_layers: int = 0
    biases: bool = False
    """gpt-oss: the experts (each row of gate_up and down), the router and the attention output carry biases, and each
    head an attention sink."""
    eager_attention: bool = False
    """transformers has no SDPA or built-in flash path for the family (gpt-oss: its attention sinks), so the trainer's
    attention is the eager one, which materializes every layer's scores (heads x L x L per sequence)."""
    kinds: tuple[LayerKind, ...] = ()
    """The decoder layers, counted per kind (launcher.core.layer_kinds), for families whose layers are not all the
    Llama-style block above (SSM and hybrid mixers, fused-qkv GELU bodies, Gemma-3n); () = every layer that block."""
    root_extra: int = 0
    """Parameters outside the decoder layers beyond the embeddings, lm_head and final norm (learned positions,
    LayerNorm biases, Gemma-3n's per-layer embeddings)."""
    mixed_attention: bool = False
    """Layers of more than one attention type (sliding-window and full, as Gemma 2/3 and gpt-oss interleave them):
    vLLM groups their KV caches and pads the groups, so a sequence can cost more than its layers count
    (launcher.core.vllm_start.work_kv_bytes leaves such a model to vLLM's profile)."""
    attention_weights: int = 0
    """The attention block's parameters (with the layer's two norms) where it is not GQA's q/k/v/o: multi-head latent
    attention (DeepSeek, MiniCPM3, GLM-4.7-Flash; with DSA's indexer), layer_kinds.mla_attention; 0 = GQA's."""
    approximate: str = ""
    """Why the count is low for this family (APPROXIMATE), for the estimate's line; '' = counted as transformers builds
    it (within ~1 %)."""
    largest_extra: int = 0
    """The family's largest tensor where the Llama/MoE layout's guess is smaller (a Mamba in_proj, Gemma-3n's
    per-layer embeddings)."""

    @classmethod
    def read(cls, model: str) -> ModelShape | None:
        """From a local model folder's config.json (a multimodal one's text_config); None if not readable or not
        countable (parse says why)."""
        shape = cls.parse(model)
        return shape if isinstance(shape, ModelShape) else None

    @classmethod
    def parse(cls, model: str) -> ModelShape | str:
        """The shape, or why there is none (one line)."""
        try:
            c = json.loads((Path(model) / "config.json").read_text())
        except (OSError, ValueError) as e:
            return f"{NO_CONFIG} in {model} ({type(e).__name__})"
        return cls.from_config(c.get("text_config", c))

    @classmethod
    def from_config(cls, c: dict) -> ModelShape | str:
        """The shape of a config.json's contents (the text model's), or why there is none (one line)."""
        shape = cls._from_config(c)
        if isinstance(shape, ModelShape) and mixed_attention(c):
            return replace(shape, mixed_attention=True)
        return shape

    @classmethod
    def _from_config(cls, c: dict) -> ModelShape | str:
        family = str(c.get("model_type", ""))
        try:
            if family in READERS:
                return cls(**READERS[family](c))
            if family in MOE_AWARE:
                moe = _moe_fields(c) if "num_hidden_layers" in c else {}
                ids = set(moe.pop("moe_layer_ids", ()))
                return cls(**{**moe, **MOE_AWARE[family](c, ids)})
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
            return f"{family}: its config.json cannot be counted ({type(e).__name__}: {e})"
        need = ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size", "num_attention_heads")
        if not all(isinstance(c.get(k), int) for k in need):
            return f"{family or 'the model'}: config.json lacks one of {', '.join(need)} as a number"
        heads = c["num_attention_heads"]
        return cls(
            hidden=c["hidden_size"],
            layers=c["num_hidden_layers"],
            intermediate=c["intermediate_size"],
            vocab=c["vocab_size"],
            heads=heads,
            kv_heads=int(c.get("num_key_value_heads") or heads),
            head_dim=int(c.get("head_dim") or c["hidden_size"] // heads),
            tied=bool(c.get("tie_word_embeddings", False)),
            eager_attention=c.get("model_type") in EAGER_ATTENTION,
            attention_weights=mla_attention(c),
            approximate=APPROXIMATE.get(family, ""),
            **{k: v for k, v in _moe_fields(c).items() if k != "moe_layer_ids"},
        )

    @property
    def attention_params(self) -> int:
        if self.attention_weights:
            return self.attention_weights
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return h * q + q + 2 * (h * kv + kv) + q * h + 2 * h + (h + self.heads if self.biases else 0)

    def moe_mlp_params(self, experts: int) -> int:
        """One MoE layer's MLP with `experts` counted: SwiGLU experts, the router (E x H), the shared expert and its
        gate (H)."""
        h = self.hidden
        shared = 3 * h * self.shared_intermediate + h if self.shared_intermediate else 0
        router = self.experts * (h + 1 if self.biases else h)
        expert = 3 * h * self.expert_intermediate + (2 * self.expert_intermediate + h if self.biases else 0)
        return experts * expert + router + shared

    @property
    def layer_params(self) -> int:
        """The largest decoder layer (what one FSDP2 unit gathers): an MoE layer gathers all its experts."""
        if self.kinds:
            return max(k.params for k in self.kinds)
        dense = 3 * self.hidden * self.intermediate
        return self.attention_params + max(dense if self.moe_layers < self.layers else 0, self.moe_mlp_params(self.experts))

    @property
    def root_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden + self.root_extra

    def _count(self, experts: int) -> int:
        if self.kinds:  # each kind knows its total and its active parameters
            active = experts < self.experts
            return sum(k.count * (k.active if active else k.params) for k in self.kinds) + self.root_params
        dense_layers = self.layers - self.moe_layers
        mlp = dense_layers * 3 * self.hidden * self.intermediate + self.moe_layers * self.moe_mlp_params(experts)
        return self.layers * self.attention_params + mlp + self.root_params

    @property
    def params(self) -> int:
        """Total parameters: every expert (what FSDP shards, the optimizer holds, a push sends and vLLM serves)."""
        return self._count(self.experts)

    @property
    def active_params(self) -> int:
        """Parameters one token runs through: experts_per_token experts of each MoE layer (what compute scales with);
        = params for a dense model."""
        return self._count(self.experts_per_token)

    @property
    def largest_tensor(self) -> int:
        fused_experts = self.experts * 2 * self.expert_intermediate * self.hidden  # gate_up_proj [E, 2I, H]
        return max(self.vocab * self.hidden, self.hidden * self.intermediate, fused_experts, self.largest_extra)

    def vllm_weight_bytes(self, tp: int, dp: int = 1, expert_parallel: bool = False, dtype_bytes: int = 2) -> float:
        """vLLM's weights on each of its GPUs: every engine holds the model / TP; with vllm.enable_expert_parallel vLLM
        splits the routed experts over all TP x DP GPUs of the server instead (the dense part still / TP)."""
        experts = self.routed_expert_params if expert_parallel else 0
        return dtype_bytes * ((self.params - experts) / tp + experts / (tp * dp))

    @property
    def routed_expert_params(self) -> int:
        """The routed experts' parameters (0 for a dense model): what expert parallelism splits; the router and a
        shared expert stay with the dense part."""
        if self.kinds:
            return sum(k.count * k.routed for k in self.kinds)
        return self.moe_layers * (self.moe_mlp_params(self.experts) - self.moe_mlp_params(0))

    @property
    def attention_layers(self) -> int:
        """Layers that run softmax attention (an SSM or short-conv layer has no scores)."""
        return sum(k.count for k in self.kinds if k.attention) if self.kinds else self.layers

    def activation_bytes(self, mlp_width: int) -> tuple[int, int]:
        """Activation bytes per token kept for the backward: (every layer, the largest layer). The Llama/MoE block:
        16 H (input, q/k/v, attention out) + 8 x its MLP width per token (launcher/memory.py); a family with kinds:
        each kind's own (launcher.core.layer_kinds)."""
        if self.kinds:
            return sum(k.count * k.act_bytes for k in self.kinds), max(k.act_bytes for k in self.kinds)
        one = 16 * self.hidden + 8 * mlp_width
        return self.layers * one, one


NO_CONFIG = "no readable config.json"
"""ModelShape.parse's reason where the folder has no config.json here (a path on the cluster only): no estimate, and
no line about it."""
APPROXIMATE = {
    "hy_v4": "its attention gate, sinks and hyper-connections are not counted",
}
"""model_types counted as the Llama/MoE layout above although their layers hold more (the count is low; measured
on the tiny bodies by tests/unit/test_shape_families.py): the estimate says so beside its figures."""
BIASED_EXPERTS = frozenset({"gpt_oss"})
"""model_types whose experts, router and attention output carry biases, with a sink per head (ModelShape.biases)."""
EAGER_ATTENTION = frozenset({"gpt_oss"})
"""model_types whose transformers class supports neither SDPA nor a flash kernel shipped with torch (gpt-oss's
`_supports_sdpa = False`: the sinks); the trainer runs their eager attention."""


def _first(value: object) -> int:
    """A config number that some families give per modality as a list (ERNIE-4.5-VL: moe_num_experts [64, 64]): the
    text model's, the first."""
    if isinstance(value, (list, tuple)):
        value = value[0] if value else 0
    return int(value or 0)  # type: ignore[call-overload]


def _moe_fields(c: dict) -> dict:
    """The MoE fields of a config.json (any of the naming schemes of transformers' MoE configs); {} for a dense one."""
    experts = _first(
        c.get("num_experts") or c.get("num_local_experts") or c.get("n_routed_experts") or c.get("moe_num_experts") or 0
    )
    if experts <= 0:
        return {}
    layers = c["num_hidden_layers"]
    width = _first(c.get("moe_intermediate_size") or c["intermediate_size"])
    step = _first(c.get("decoder_sparse_step") or c.get("moe_layer_interval") or 1)
    # DeepSeek / ERNIE / LFM2-MoE
    first_sparse = _first(c.get("first_k_dense_replace") or c.get("moe_layer_start_index") or c.get("num_dense_layers") or 0)
    dense_only = set(c.get("mlp_only_layers") or []) | set(range(first_sparse))
    moe = [i for i in range(layers) if i not in dense_only and (i + 1) % step == 0]
    kinds = c.get("mlp_layer_types")  # transformers' per-layer list where it writes one ("dense", "sparse", "moe", ...)
    if isinstance(kinds, list) and len(kinds) == layers:
        moe = [i for i, kind in enumerate(kinds) if kind != "dense"]
    shared_count = _first(c.get("n_shared_experts") or c.get("moe_num_shared_experts") or c.get("num_shared_experts") or 0)
    shared = _first(c.get("shared_expert_intermediate_size") or c.get("shared_intermediate_size") or 0) or shared_count * width
    top_k = c.get("num_experts_per_tok") or c.get("moe_k") or c.get("moe_topk") or c.get("num_experts_per_token") or 0
    return {
        "experts": experts,
        "experts_per_token": _first(top_k),
        "expert_intermediate": width,
        "shared_intermediate": shared,
        "moe_layers": len(moe),
        "moe_layer_ids": moe,
        "biases": c.get("model_type") in BIASED_EXPERTS,
    }
