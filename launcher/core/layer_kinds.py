"""The decoder layers of the families whose layers are not one Llama-style attention + SwiGLU MLP (or MoE) block:
state-space and hybrid mixers (Mamba, Mamba-2, Gated DeltaNet, LFM2's short convolutions), fused-qkv GELU bodies with
biases and learned position embeddings (GPT-2, BLOOM, GPT-NeoX, Falcon, OPT, GPT-J), 2-matrix MLP bodies (StarCoder2,
Phi, Nemotron, Apertus, Arcee), Gemma-3n, Gemma 4, Llama 4, Hunyuan-MoE, AFMoE and MiMo-V2-Flash (shared experts,
gates, sinks); and multi-head latent attention's count (mla_attention). From config.json alone (no torch): each
family's reader counts its layers' parameters as transformers builds them (checked against `sum(p.numel())` of the built
model: tests/unit/test_shape_families.py) and gives the ModelShape fields it differs in.

Activations (LayerKind.act_bytes, bytes per token of one layer kept for the backward) are an estimate with stated terms,
as launcher/memory.py's: 16 H for an attention block with its norms and residual (memory.py's own term), 8 I for a
gated MLP (gate, up, activation, product in bf16), 4 I for a 2-matrix one. The SSM mixers run transformers' PyTorch
path (the project installs neither mamba-ssm, causal-conv1d nor flash-linear-attention; their fused kernels keep far
less), which keeps fp32 tensors per token that dwarf the projections: see each mixer's function."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class LayerKind:
    """Decoder layers of one build (same mixer, same MLP): `count` of them, each of `params` parameters (every expert),
    `active` of which one token runs through, keeping `act_bytes` of activations per token for the backward."""

    name: str
    """What the layer holds, for the estimate's line ("mamba2", "attention+moe", ...)."""
    count: int
    params: int
    active: int
    act_bytes: int
    attention: bool = False
    """The layer runs softmax attention (its scores count when attention runs eagerly)."""
    routed: int = 0
    """The routed experts' parameters of one such layer (what vLLM's expert parallelism splits)."""


Part = tuple[str, int, int, int, bool, int]
"""(name, params, active, act_bytes, attention, routed) of one layer or one piece of it."""


def join(*parts: Part) -> Part:
    """The pieces of one layer (mixer, MLP, norms) as one."""
    return (
        "+".join(p[0] for p in parts if p[0]),
        sum(p[1] for p in parts),
        sum(p[2] for p in parts),
        sum(p[3] for p in parts),
        any(p[4] for p in parts),
        sum(p[5] for p in parts),
    )


def group(layers: list[Part]) -> tuple[LayerKind, ...]:
    """Per-layer pieces grouped into kinds, in order of first appearance."""
    kinds: dict[Part, int] = {}
    for layer in layers:
        kinds[layer] = kinds.get(layer, 0) + 1
    return tuple(LayerKind(n, c, p, a, b, att, r) for (n, p, a, b, att, r), c in kinds.items())


def norm(width: int, bias: bool = False) -> Part:
    return ("", width * (2 if bias else 1), width * (2 if bias else 1), 0, False, 0)


def linear(i: int, o: int, bias: bool = False) -> int:
    return i * o + (o if bias else 0)


NORM_RESIDUAL = 6
"""Bytes per token per unit of H that a layer's norms and residual keep besides its mixer: the part of memory.py's
16 H attention term that is not attention (a layer with an SSM or conv mixer keeps them too)."""


def attention(
    h: int, heads: int, kv: int, hd: int, *, bias: bool = False, o_bias: bool | None = None, gated_q: bool = False,
    qk_norm: bool = False, kv_proj: bool = True, width_in: int = 0,
) -> Part:  # fmt: skip
    """Separate q/k/v/o projections (gated_q: Qwen3-Next's output gate doubles q_proj), q/k norms of head_dim; 16 H
    of activations (memory.py's attention term: input, q/k/v, attention out, residual)."""
    w = width_in or h
    q = heads * hd
    n = linear(w, q * (2 if gated_q else 1), bias) + linear(q, h, bias if o_bias is None else o_bias)
    n += 2 * linear(w, kv * hd, bias) if kv_proj else 0
    n += (2 if kv_proj else 1) * hd if qk_norm else 0
    return ("attention", n, n, 16 * h, True, 0)


def fused_attention(h: int, qkv: int, bias: bool) -> Part:
    """One fused query_key_value projection of qkv outputs and the output dense (GPT-2, BLOOM, GPT-NeoX, Falcon)."""
    n = linear(h, qkv, bias) + linear(h, h, bias)
    return ("attention", n, n, 16 * h, True, 0)


def mlp(h: int, i: int, *, gated: bool = True, bias: bool = False) -> Part:
    n = (3 if gated else 2) * h * i + ((2 * i if gated else i) + h if bias else 0)
    return ("mlp", n, n, (8 if gated else 4) * i, False, 0)


def moe(h: int, experts: int, top_k: int, width: int, *, shared: int = 0, shared_gate: bool = False, gated: bool = True) -> Part:
    """A router (E x H), `experts` experts of `width` (gated SwiGLU: 3 H I; else 2 H I), top_k of which run per token,
    and a shared expert of width `shared` (with Qwen's sigmoid gate, H, where shared_gate)."""
    one = (3 if gated else 2) * h * width
    always = experts * h + ((3 if gated else 2) * h * shared if shared else 0) + (h if shared_gate else 0)
    act = (8 if gated else 4) * (top_k * width + shared)
    return ("moe", always + experts * one, always + top_k * one, act, False, experts * one)


def mamba(h: int, d: int, state: int, rank: int, conv: int, *, conv_bias: bool, bias: bool, bcdt_norms: bool = False) -> Part:
    """Mamba's selective SSM (mamba, falcon_mamba, Jamba's Mamba layers): in_proj to x and z (2 d), a depthwise conv,
    x_proj to dt (rank) and B, C (state each), dt_proj, A_log (d x state), D; Jamba adds RMS norms on dt, B and C.
    Activations: transformers' PyTorch scan (mamba_selective_scan) keeps per token the discretized A and B, each
    step's state (fp32, and its bf16 copy for the C product): 16 d state bytes, plus about 6 d of projections in bf16
    (measured on CPU: tests/unit/test_shape_families.py), plus the layer's NORM_RESIDUAL."""
    n = linear(h, 2 * d, bias) + d * conv + (d if conv_bias else 0) + d * (rank + 2 * state) + linear(rank, d, True)
    n += d * state + d + linear(d, h, bias) + (rank + 2 * state if bcdt_norms else 0)
    return ("mamba", n, n, 6 * d + 16 * d * state + NORM_RESIDUAL * h, False, 0)


def mamba2(
    h: int, d: int, heads: int, groups: int, state: int, conv: int, chunk: int, *, conv_bias: bool, bias: bool,
    out_bias: bool | None = None, gated_norm: bool = True,
) -> Part:  # fmt: skip
    """Mamba-2 (SSD): in_proj to z, x, B, C, dt (d + conv_dim + heads), a depthwise conv over x, B, C
    (conv_dim = d + 2 groups state), dt_bias, A_log, D per head, a gated RMS norm of d, out_proj. Activations: the
    projections and the conv in bf16 (2 (2 conv_dim + d + H)), and transformers' chunked PyTorch scan
    (mamba2_chunk_scan) keeps per token in fp32 about 10 tensors of d (x, x dt, the outputs, the gated norm's and
    their batched copies), 3 of heads x chunk (the intra-chunk decay and scores), 5 of heads x state (B and C repeated
    to every head and their batched copies) and the chunk states (2 d state / chunk): 40 d + 12 heads chunk + 20 heads
    state + 8 d state / chunk bytes (measured on CPU within ~5 % at three widths: tests/unit/test_shape_families.py,
    bench/ssm_memory.py), plus the layer's NORM_RESIDUAL."""
    conv_dim = d + 2 * groups * state
    n = linear(h, d + conv_dim + heads, bias) + conv_dim * conv + (conv_dim if conv_bias else 0) + 3 * heads
    n += (d if gated_norm else 0) + linear(d, h, bias if out_bias is None else out_bias)
    act = 2 * (2 * conv_dim + d + h) + 40 * d + 12 * heads * chunk + 20 * heads * state + 8 * d * state // chunk
    act += NORM_RESIDUAL * h
    return ("mamba2", n, n, act, False, 0)


def gated_deltanet(h: int, key_heads: int, key_dim: int, value_heads: int, value_dim: int, conv: int) -> Part:
    """Gated DeltaNet (Qwen3-Next, Qwen3.5): q, k (key_heads x key_dim each), v and the output gate z (value_heads x
    value_dim each), b and a per value head (Qwen3-Next fuses them as in_proj_qkvz/ba, Qwen3.5 splits them: the same
    count), a depthwise conv over q, k, v without bias, dt_bias and A_log per value head, an RMS norm of value_dim,
    out_proj. Activations: the projections and the conv in bf16 (4 conv_dim + 6 V + 2 H, conv_dim = 2 K + V), and
    transformers' PyTorch chunked delta rule (chunk 64; q and k repeated to the value heads) keeps per token in fp32
    about 6 tensors of value_heads x 64 (the chunk's attention and decay matrices), 4 of value_heads x value_dim and 8
    of value_heads x key_dim (q, k, v, their decayed and batched copies) and the chunk states (3 value_heads key_dim
    value_dim / 64): 24 value_heads 64 + 16 value_heads value_dim + 32 value_heads key_dim + 12 value_heads key_dim
    value_dim / 64 bytes (measured on CPU within ~6 % at three widths: tests/unit/test_shape_families.py,
    bench/ssm_memory.py), plus the layer's NORM_RESIDUAL."""
    k, v = key_heads * key_dim, value_heads * value_dim
    n = h * (2 * k + 2 * v + 2 * value_heads) + (2 * k + v) * conv + 2 * value_heads + value_dim + v * h
    act = 4 * (2 * k + v) + 6 * v + 2 * h + 24 * value_heads * 64 + 16 * v + 32 * value_heads * key_dim
    act += 12 * value_heads * key_dim * value_dim // 64 + NORM_RESIDUAL * h
    return ("gated_deltanet", n, n, act, False, 0)


def short_conv(h: int, cache: int, bias: bool) -> Part:
    """LFM2's gated short convolution: in_proj to B, C, x (3 H), a depthwise conv of `cache` taps, out_proj; about
    15 H of bf16 activations (in_proj out and its transposes, conv in and out, gated products; measured on CPU), plus
    the layer's NORM_RESIDUAL."""
    n = linear(h, 3 * h, bias) + h * cache + (h if bias else 0) + linear(h, h, bias)
    return ("short_conv", n, n, 15 * h + NORM_RESIDUAL * h, False, 0)


def _get(c: dict, *keys: str, default: object = None) -> object:
    """The first of `keys` the config gives (families rename hidden_size as n_embd, ...)."""
    return next((c[k] for k in keys if c.get(k) is not None), default)


def _int(c: dict, *keys: str, default: int = 0) -> int:
    value = _get(c, *keys, default=default)
    return int(value)  # type: ignore[call-overload]


def _rank(c: dict, key: str, h: int) -> int:
    """Mamba's dt rank: "auto" (as some released config.json files say) is ceil(H / 16), as transformers computes."""
    value = c.get(key, "auto")
    return math.ceil(h / 16) if value in ("auto", None) else int(value)


def _types(c: dict, layers: int, *keys: str) -> list[str]:
    value = _get(c, *keys)
    if isinstance(value, list) and len(value) == layers:
        return [str(t) for t in value]
    return []


Reader = Callable[[dict], dict]
"""config.json (the text model's) -> the ModelShape fields of its family; ValueError where it cannot be counted."""


def _base(c: dict, h: int, layers: int, vocab: int, heads: int, kv: int, hd: int, inter: int, tied: bool) -> dict:
    return dict(hidden=h, layers=layers, intermediate=inter, vocab=vocab, heads=heads, kv_heads=kv, head_dim=hd, tied=tied)


def read_mamba(c: dict) -> dict:
    """mamba, falcon_mamba: Mamba layers only (falcon_mamba's extra B/C/dt norms have no weights)."""
    h, layers = _int(c, "hidden_size"), _int(c, "num_hidden_layers")
    d = _int(c, "intermediate_size") or int(_int(c, "expand", default=2) * h)
    state = _int(c, "state_size", default=16)
    mixer = mamba(
        h, d, state, _rank(c, "time_step_rank", h), _int(c, "conv_kernel", default=4),
        conv_bias=bool(c.get("use_conv_bias", True)), bias=bool(c.get("use_bias", False)),
    )  # fmt: skip
    # no attention heads: vLLM's TP splits d (the plan's TP check takes it as the "heads" to divide)
    out = _base(c, h, layers, _int(c, "vocab_size"), d, d, 1, d, bool(c.get("tie_word_embeddings", True)))
    return {**out, "kinds": group([join(mixer, norm(h))] * layers), "largest_extra": 2 * d * h}


def read_mamba2(c: dict) -> dict:
    h, layers = _int(c, "hidden_size"), _int(c, "num_hidden_layers")
    d = int(_int(c, "expand", default=2) * h)
    heads, groups, state = _int(c, "num_heads", default=128), _int(c, "n_groups", default=8), _int(c, "state_size", default=128)
    mixer = mamba2(
        h, d, heads, groups, state, _int(c, "conv_kernel", default=4), _int(c, "chunk_size", default=256),
        conv_bias=bool(c.get("use_conv_bias", True)), bias=bool(c.get("use_bias", False)),
    )  # fmt: skip
    out = _base(c, h, layers, _int(c, "vocab_size"), heads, heads, d // heads, d, bool(c.get("tie_word_embeddings", False)))
    return {**out, "kinds": group([join(mixer, norm(h))] * layers), "largest_extra": h * (2 * d + 2 * groups * state + heads)}


NEMOTRON_H_PATTERN = {"M": "mamba", "E": "moe", "*": "attention", "-": "mlp"}
"""Nemotron-H's older hybrid_override_pattern characters."""


def read_nemotron_h(c: dict) -> dict:
    """Nemotron-H: each layer is ONE of Mamba-2, attention, a relu2 MLP (up, down) or an MoE of relu2 experts with a
    shared expert (and an optional latent projection around the experts); one norm each. transformers never ties its
    lm_head (NemotronHForCausalLM has no tied keys)."""
    h = _int(c, "hidden_size")
    types = _get(c, "layers_block_type", "layer_types", default=[])
    if not types and isinstance(c.get("hybrid_override_pattern"), str):
        types = [NEMOTRON_H_PATTERN.get(ch, ch) for ch in c["hybrid_override_pattern"]]
    # transformers derives num_hidden_layers from the pattern (its config.json may leave it out)
    layers = _int(c, "num_hidden_layers") or len(types)  # type: ignore[arg-type]
    if not isinstance(types, list) or not types or len(types) != layers:
        raise ValueError("no layers_block_type (or hybrid_override_pattern) of num_hidden_layers entries")
    heads, kv = _int(c, "num_attention_heads"), _int(c, "num_key_value_heads", "num_attention_heads")
    hd = _int(c, "head_dim", "attention_head_dim", default=128)  # transformers' default, not H / heads
    mh, mhd = _int(c, "mamba_num_heads", default=128), _int(c, "mamba_head_dim", default=64)
    mlp_bias, inter = bool(c.get("mlp_bias", False)), _int(c, "intermediate_size")
    e, k, width = _int(c, "n_routed_experts"), _int(c, "num_experts_per_tok"), _int(c, "moe_intermediate_size")
    latent = _int(c, "moe_latent_size")
    pieces = {
        "mamba": mamba2(
            h, mh * mhd, mh, _int(c, "n_groups", default=8), _int(c, "ssm_state_size", default=128),
            _int(c, "conv_kernel", default=4), _int(c, "chunk_size", default=128),
            conv_bias=bool(c.get("use_conv_bias", True)), bias=bool(c.get("use_bias", False)),
        ),
        "attention": attention(h, heads, kv, hd),
        "mlp": mlp(h, inter, gated=False, bias=mlp_bias),
    }  # fmt: skip
    if e:
        name, total, active, act, _, routed = moe(latent or h, e, k, width, gated=False)
        fix = e * (h - (latent or h))  # the router reads the hidden state, not the latent one
        extra = linear(h, latent, mlp_bias) + linear(latent, h, mlp_bias) if latent else 0
        shared = mlp(h, _int(c, "moe_shared_expert_intermediate_size"), gated=False, bias=mlp_bias)[1]
        pieces["moe"] = (name, total + fix + extra + shared, active + fix + extra + shared, act, False, routed)
    alias = {"linear_attention": "mamba", "full_attention": "attention"}
    kinds = [alias.get(str(t), str(t)) for t in types]
    unknown = sorted(set(kinds) - set(pieces))
    if unknown:
        raise ValueError(f"unknown layer type {unknown[0]!r} (known: {', '.join(pieces)})")
    # a layer holds one block: an MLP or MoE layer keeps its norm and residual beside it (attention's 16 H has them)
    residual = ("", 0, 0, NORM_RESIDUAL * h, False, 0)
    layer = [join(pieces[t], norm(h), *([residual] if t in ("mlp", "moe") else [])) for t in kinds]
    out = _base(c, h, layers, _int(c, "vocab_size"), heads, kv, hd, inter, False)
    # its config.json carries the expert fields (n_routed_experts 8) whether or not a layer is "moe"
    moe_fields = {"experts": e, "experts_per_token": k, "expert_intermediate": width} if "moe" in kinds else {}
    return {**out, **moe_fields, "moe_layers": kinds.count("moe"), "kinds": group(layer)}


def read_jamba(c: dict) -> dict:
    """Jamba: attention every attn_layer_period-th layer (else Mamba with dt/B/C norms), experts every
    expert_layer_period-th (else a dense SwiGLU MLP); two norms per layer."""
    h, layers = _int(c, "hidden_size"), _int(c, "num_hidden_layers")
    heads, kv = _int(c, "num_attention_heads"), _int(c, "num_key_value_heads", "num_attention_heads")
    hd = h // heads
    inter, e, k = _int(c, "intermediate_size"), _int(c, "num_experts", default=16), _int(c, "num_experts_per_tok", default=2)
    d = int(_int(c, "mamba_expand", default=2) * h)
    ssm = mamba(
        h, d, _int(c, "mamba_d_state", default=16), _rank(c, "mamba_dt_rank", h), _int(c, "mamba_d_conv", default=4),
        conv_bias=bool(c.get("mamba_conv_bias", True)), bias=bool(c.get("mamba_proj_bias", False)), bcdt_norms=True,
    )  # fmt: skip
    period, offset = _int(c, "attn_layer_period", default=8), _int(c, "attn_layer_offset", default=4)
    e_period, e_offset = _int(c, "expert_layer_period", default=2), _int(c, "expert_layer_offset", default=1)
    layer = []
    for i in range(layers):
        mixer = attention(h, heads, kv, hd) if i % period == offset else ssm
        ffn = moe(h, e, k, inter) if e > 1 and i % e_period == e_offset else mlp(h, inter)
        layer.append(join(mixer, ffn, norm(2 * h)))
    moe_layers = sum(1 for i in range(layers) if e > 1 and i % e_period == e_offset)
    out = _base(c, h, layers, _int(c, "vocab_size"), heads, kv, hd, inter, bool(c.get("tie_word_embeddings", False)))
    moe_fields = {"experts": e, "experts_per_token": k, "expert_intermediate": inter} if moe_layers else {}
    return {**out, **moe_fields, "moe_layers": moe_layers, "kinds": group(layer)}


def read_falcon_h1(c: dict) -> dict:
    """Falcon-H1: attention and Mamba-2 side by side in every layer, then a SwiGLU MLP; two norms per layer (its
    mup_vector is a buffer)."""
    h, layers = _int(c, "hidden_size"), _int(c, "num_hidden_layers")
    heads, kv = _int(c, "num_attention_heads"), _int(c, "num_key_value_heads", "num_attention_heads")
    hd = _int(c, "head_dim") or h // heads
    d = _int(c, "mamba_d_ssm") or int(_int(c, "mamba_expand", default=2) * h)
    mh = _int(c, "mamba_n_heads", default=128)
    ssm = mamba2(
        h, d, mh, _int(c, "mamba_n_groups", default=1), _int(c, "mamba_d_state", default=256),
        _int(c, "mamba_d_conv", default=4), _int(c, "mamba_chunk_size", default=256),
        conv_bias=bool(c.get("mamba_conv_bias", True)), bias=bool(c.get("mamba_proj_bias", False)),
        out_bias=bool(c.get("projectors_bias", False)), gated_norm=bool(c.get("mamba_rms_norm", False)),
    )  # fmt: skip
    inter = _int(c, "intermediate_size")
    mixer = attention(h, heads, kv, hd, bias=bool(c.get("attention_bias", False)))
    layer = join(mixer, ssm, mlp(h, inter, bias=bool(c.get("mlp_bias", False))), norm(2 * h))
    out = _base(c, h, layers, _int(c, "vocab_size"), heads, kv, hd, inter, bool(c.get("tie_word_embeddings", False)))
    return {**out, "kinds": group([layer] * layers)}


def read_zamba2(c: dict) -> dict:
    """Zamba2: a Mamba-2 layer everywhere; each "hybrid" layer adds a linear (H x H) and runs one of num_mem_blocks
    shared transformer blocks (attention on [hidden, embeddings], 2 H wide; a SwiGLU MLP) with per-layer LoRA-like
    adapters. The shared blocks' weights are counted once, in the first hybrid layers that hold them."""
    h, layers = _int(c, "hidden_size"), _int(c, "num_hidden_layers")
    types = _types(c, layers, "layers_block_type", "layer_types")
    if len(types) != layers:
        raise ValueError("no layers_block_type of num_hidden_layers entries")
    heads, kv = _int(c, "num_attention_heads"), _int(c, "num_key_value_heads", "num_attention_heads")
    hd, inter, r = 2 * h // heads, _int(c, "intermediate_size"), _int(c, "adapter_rank", default=128)
    bias, blocks = bool(c.get("add_bias_linear", False)), _int(c, "num_mem_blocks", default=1)
    d = int(_int(c, "mamba_expand", default=2) * h)
    mh = _int(c, "n_mamba_heads", default=8)
    ssm = join(
        mamba2(
            h, d, mh, _int(c, "mamba_ngroups", default=1), _int(c, "mamba_d_state", default=64),
            _int(c, "mamba_d_conv", default=4), _int(c, "chunk_size", default=256),
            conv_bias=bool(c.get("use_conv_bias", True)), bias=bias,
        ),
        norm(h),
    )  # fmt: skip
    adapters = h * r + r * 2 * inter + (3 * 2 * (2 * h * r) if c.get("use_shared_attention_adapter") else 0)
    shared_attention = attention(h, heads, kv, hd, width_in=2 * h)
    block = join(shared_attention, ("mlp", linear(h, 2 * inter, bias) + linear(inter, h, bias), 0, 8 * inter, False, 0))
    block = join(block, norm(3 * h))
    hybrids = [i for i, t in enumerate(types) if t == "hybrid"]
    layer = []
    for i, t in enumerate(types):
        if t != "hybrid":
            layer.append(ssm)
            continue
        n = hybrids.index(i)
        weights = block[1] if n < blocks else 0  # later hybrid layers reuse a shared block's weights
        # a token runs through the shared block in every hybrid layer: its weights count as active there
        layer.append(join(ssm, ("hybrid", h * h + adapters + weights, h * h + adapters + block[1], block[3], True, 0)))
    out = _base(c, h, layers, _int(c, "vocab_size"), heads, kv, hd, inter, bool(c.get("tie_word_embeddings", True)))
    return {**out, "kinds": group(layer)}


def read_granitemoehybrid(c: dict) -> dict:
    """Granite-4.0-H: Mamba-2 or attention, then a shared SwiGLU MLP (and experts where num_local_experts > 0)."""
    h, layers = _int(c, "hidden_size"), _int(c, "num_hidden_layers")
    types = _types(c, layers, "layer_types", "layers_block_type")
    if len(types) != layers:
        raise ValueError("no layer_types of num_hidden_layers entries")
    heads, kv = _int(c, "num_attention_heads"), _int(c, "num_key_value_heads", "num_attention_heads")
    hd = h // heads
    d = int(_int(c, "mamba_expand", default=2) * h)
    mh = _int(c, "mamba_n_heads", default=128)
    ssm = mamba2(
        h, d, mh, _int(c, "mamba_n_groups", default=1), _int(c, "mamba_d_state", default=256),
        _int(c, "mamba_d_conv", default=4), _int(c, "mamba_chunk_size", default=256),
        conv_bias=bool(c.get("mamba_conv_bias", True)), bias=bool(c.get("mamba_proj_bias", False)),
    )  # fmt: skip
    mixer = attention(h, heads, kv, hd, bias=bool(c.get("attention_bias", False)))
    inter, e, k = _int(c, "intermediate_size"), _int(c, "num_local_experts"), _int(c, "num_experts_per_tok")
    ffn = mlp(h, _int(c, "shared_intermediate_size"))
    if e:
        ffn = join(ffn, moe(h, e, k, inter))
    layer = [join(ssm if t in ("mamba", "linear_attention") else mixer, ffn, norm(2 * h)) for t in types]
    out = _base(c, h, layers, _int(c, "vocab_size"), heads, kv, hd, inter, bool(c.get("tie_word_embeddings", False)))
    moe_fields = {"experts": e, "experts_per_token": k, "expert_intermediate": inter, "moe_layers": layers} if e else {}
    return {**out, **moe_fields, "kinds": group(layer)}


def read_qwen3_next(c: dict, moe_layers: set[int]) -> dict:
    """Qwen3-Next, Qwen3.5 (dense and MoE): Gated DeltaNet or gated attention (q_proj doubled, q/k norms), then a
    SwiGLU MLP or an MoE with a gated shared expert; two norms per layer."""
    h, layers = _int(c, "hidden_size"), _int(c, "num_hidden_layers")
    types = _types(c, layers, "layer_types")
    if not types:
        every = _int(c, "full_attention_interval", default=4)
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(layers)]
    heads, kv = _int(c, "num_attention_heads"), _int(c, "num_key_value_heads", "num_attention_heads")
    hd = _int(c, "head_dim") or h // heads
    delta = gated_deltanet(
        h, _int(c, "linear_num_key_heads", default=16), _int(c, "linear_key_head_dim", default=128),
        _int(c, "linear_num_value_heads", default=32), _int(c, "linear_value_head_dim", default=128),
        _int(c, "linear_conv_kernel_dim", default=4),
    )  # fmt: skip
    mixer = attention(h, heads, kv, hd, bias=bool(c.get("attention_bias", False)), gated_q=True, qk_norm=True)
    inter = _int(c, "intermediate_size")
    e, k = _int(c, "num_experts"), _int(c, "num_experts_per_tok")
    width, shared = _int(c, "moe_intermediate_size"), _int(c, "shared_expert_intermediate_size")
    layer = []
    for i, t in enumerate(types):
        ffn = moe(h, e, k, width, shared=shared, shared_gate=bool(shared)) if e and i in moe_layers else mlp(h, inter)
        layer.append(join(delta if t == "linear_attention" else mixer, ffn, norm(2 * h)))
    out = _base(c, h, layers, _int(c, "vocab_size"), heads, kv, hd, inter, bool(c.get("tie_word_embeddings", False)))
    return {**out, "kinds": group(layer)}


def read_lfm2(c: dict, moe_layers: set[int]) -> dict:
    """LFM2 (and LFM2-MoE): a gated short convolution or attention (q/k norms), then a SwiGLU MLP (LFM2 resizes its
    width: 2/3, times block_ffn_dim_multiplier, rounded up to block_multiple_of) or experts (LFM2-MoE's first
    num_dense_layers dense); two norms per layer; the final norm is embedding_norm."""
    h, layers = _int(c, "hidden_size"), _int(c, "num_hidden_layers")
    types = _types(c, layers, "layer_types")
    if not types:
        full = set(c.get("full_attn_idxs") or [])
        types = ["full_attention" if i in full else "conv" for i in range(layers)]
    heads, kv = _int(c, "num_attention_heads"), _int(c, "num_key_value_heads", "num_attention_heads")
    hd = h // heads
    inter = _int(c, "intermediate_size", "block_ff_dim")
    if c.get("model_type") == "lfm2" and c.get("block_auto_adjust_ff_dim", True):
        inter = int(2 * inter / 3)
        if c.get("block_ffn_dim_multiplier", 1.0) is not None:
            multiple = _int(c, "block_multiple_of", default=256)
            inter = int(float(c.get("block_ffn_dim_multiplier", 1.0)) * inter)
            inter = multiple * ((inter + multiple - 1) // multiple)
    conv = short_conv(h, _int(c, "conv_L_cache", default=3), bool(c.get("conv_bias", False)))
    mixer = attention(h, heads, kv, hd, qk_norm=True)
    e, k, width = _int(c, "num_experts"), _int(c, "num_experts_per_tok"), _int(c, "moe_intermediate_size")
    layer = []
    for i, t in enumerate(types):
        ffn = moe(h, e, k, width) if e and i in moe_layers else mlp(h, inter)
        layer.append(join(mixer if "attention" in t else conv, ffn, norm(2 * h)))
    out = _base(c, h, layers, _int(c, "vocab_size"), heads, kv, hd, inter, bool(c.get("tie_word_embeddings", True)))
    return {**out, "kinds": group(layer)}


PLAIN_MLP = {
    # model_type: (q/k/v/o biased by, MLP biased by, norms per layer, norms with bias, q/k norms, lm_head bias)
    "starcoder2": ("use_bias", "use_bias", 2, True, False, False),
    "phi": (True, True, 1, True, "qk_layernorm", True),
    "nemotron": ("attention_bias", "mlp_bias", 2, True, False, False),
    "apertus": ("attention_bias", False, 2, False, True, False),
    "arcee": ("attention_bias", "mlp_bias", 2, False, False, False),
}
"""Llama-style attention (GQA, separate q/k/v/o) with a 2-matrix MLP (up, down: GELU, ReLU^2, xIELU): how each
family biases and normalizes (True/False, or the config key that says)."""


def read_plain_mlp(c: dict) -> dict:
    """StarCoder2, Phi, Nemotron(-4), Apertus, Arcee: attention as Llama's, a 2-matrix MLP; LayerNorms with bias where
    the family has them (Phi: one, before its parallel attention and MLP, q/k LayerNorms where qk_layernorm; its lm_head
    has a bias); Apertus's xIELU has two learned scalars per layer."""
    h, layers = _int(c, "hidden_size"), _int(c, "num_hidden_layers")
    heads, kv = _int(c, "num_attention_heads"), _int(c, "num_key_value_heads", "num_attention_heads")
    hd, inter = _int(c, "head_dim") or h // heads, _int(c, "intermediate_size")
    attn_bias, mlp_bias, norms, norm_bias, qk, head_bias = PLAIN_MLP[str(c["model_type"])]

    def flag(v: object) -> bool:  # StarCoder2's use_bias defaults to True in transformers, the others to False
        return bool(c.get(v, v == "use_bias")) if isinstance(v, str) else bool(v)

    mixer = attention(h, heads, kv, hd, bias=flag(attn_bias))
    if flag(qk):  # Phi's are LayerNorms (with bias) over head_dim, Apertus's RMS norms
        mixer = join(mixer, norm(2 * hd, bias=norm_bias))
    extra = ("", 2, 2, 0, False, 0) if c.get("model_type") == "apertus" else norm(0)
    layer = join(mixer, mlp(h, inter, gated=False, bias=flag(mlp_bias)), norm(norms * h, bias=norm_bias), extra)
    tied = bool(c.get("tie_word_embeddings", c["model_type"] == "starcoder2"))  # transformers' class defaults
    out = _base(c, h, layers, _int(c, "vocab_size"), heads, kv, hd, inter, tied)
    root = (h if norm_bias else 0) + (_int(c, "vocab_size") if head_bias else 0)
    return {**out, "kinds": group([layer] * layers), "root_extra": root}


def read_gpt2(c: dict) -> dict:
    """GPT-2: fused c_attn (3 H), GELU MLP of n_inner (4 H), biases, two LayerNorms with bias; learned positions."""
    h, layers, heads = _int(c, "n_embd", "hidden_size"), _int(c, "n_layer", "num_hidden_layers"), _int(c, "n_head")
    inter = _int(c, "n_inner") or 4 * h
    layer = join(fused_attention(h, 3 * h, True), mlp(h, inter, gated=False, bias=True), norm(2 * h, bias=True))
    out = _base(c, h, layers, _int(c, "vocab_size"), heads, heads, h // heads, inter, bool(c.get("tie_word_embeddings", True)))
    return {**out, "kinds": group([layer] * layers), "root_extra": _int(c, "n_positions", default=1024) * h + h}


def read_bloom(c: dict) -> dict:
    """BLOOM: fused query_key_value (3 H), a 4 H GELU MLP, biases, LayerNorms with bias, a LayerNorm after the
    embedding (ALiBi: no position weights)."""
    h, layers, heads = (  # BloomConfig's defaults where config.json leaves them out
        _int(c, "hidden_size", "n_embed", default=64),
        _int(c, "n_layer", "num_hidden_layers", default=2),
        _int(c, "n_head", "num_attention_heads", default=8),
    )
    layer = join(fused_attention(h, 3 * h, True), mlp(h, 4 * h, gated=False, bias=True), norm(2 * h, bias=True))
    out = _base(c, h, layers, _int(c, "vocab_size"), heads, heads, h // heads, 4 * h, bool(c.get("tie_word_embeddings", True)))
    return {**out, "kinds": group([layer] * layers), "root_extra": 3 * h}


def read_gpt_neox(c: dict) -> dict:
    """GPT-NeoX (Pythia): fused query_key_value (3 H, biased where attention_bias), a biased GELU MLP, two
    LayerNorms with bias."""
    h, layers, heads = _int(c, "hidden_size"), _int(c, "num_hidden_layers"), _int(c, "num_attention_heads")
    inter, bias = _int(c, "intermediate_size"), bool(c.get("attention_bias", True))
    layer = join(fused_attention(h, 3 * h, bias), mlp(h, inter, gated=False, bias=True), norm(2 * h, bias=True))
    out = _base(c, h, layers, _int(c, "vocab_size"), heads, heads, h // heads, inter, bool(c.get("tie_word_embeddings", False)))
    return {**out, "kinds": group([layer] * layers), "root_extra": h}


def read_falcon(c: dict) -> dict:
    """Falcon (RW): fused query_key_value of heads + 2 kv heads (multi-query: one; new_decoder_architecture:
    num_kv_heads), a 2-matrix GELU MLP of ffn_hidden_size (4 H), biases where `bias`; one LayerNorm before the parallel
    attention and MLP (two: ln_attn, ln_mlp, in the new architecture; sequential: two), all with bias."""
    h, layers, heads = _int(c, "hidden_size"), _int(c, "num_hidden_layers", "n_layer"), _int(c, "num_attention_heads", "n_head")
    hd, new = h // heads, bool(c.get("new_decoder_architecture", False))
    kv = _int(c, "num_kv_heads", default=heads) if new else (1 if c.get("multi_query", True) else heads)
    inter, bias = _int(c, "ffn_hidden_size") or 4 * h, bool(c.get("bias", False))
    norms = 2 if (new and _int(c, "num_ln_in_parallel_attn", default=2) == 2) or not c.get("parallel_attn", True) else 1
    layer = join(
        fused_attention(h, (heads + 2 * kv) * hd, bias), mlp(h, inter, gated=False, bias=bias), norm(norms * h, bias=True)
    )
    out = _base(c, h, layers, _int(c, "vocab_size"), heads, kv, hd, inter, bool(c.get("tie_word_embeddings", True)))
    return {**out, "kinds": group([layer] * layers), "root_extra": h}


def read_opt(c: dict) -> dict:
    """OPT: biased q/k/v/out and fc1/fc2 (ReLU, ffn_dim), two LayerNorms; learned positions (max + 2 rows), token
    embeddings of word_embed_proj_dim with project_in/out where it differs from H."""
    h, layers, heads = _int(c, "hidden_size"), _int(c, "num_hidden_layers"), _int(c, "num_attention_heads")
    inter, bias = _int(c, "ffn_dim"), bool(c.get("enable_bias", True))
    affine = bool(c.get("layer_norm_elementwise_affine", True))
    mixer = attention(h, heads, heads, h // heads, bias=bias)
    layer = join(mixer, mlp(h, inter, gated=False, bias=bias), norm(2 * h, bias=True) if affine else norm(0))
    wp = _int(c, "word_embed_proj_dim") or h
    tied = bool(c.get("tie_word_embeddings", True))
    final = 2 * h if affine and c.get("do_layer_norm_before", True) and not c.get("_remove_final_layer_norm") else 0
    root = (_int(c, "max_position_embeddings", default=2048) + 2) * h + (2 * wp * h if wp != h else 0) + final
    # embeddings (and an untied lm_head) are V x word_embed_proj_dim: root_extra corrects ModelShape's V x H terms
    root += (_int(c, "vocab_size") * (wp - h)) * (1 if tied else 2) - h
    out = _base(c, h, layers, _int(c, "vocab_size"), heads, heads, h // heads, inter, tied)
    return {**out, "kinds": group([layer] * layers), "root_extra": root}


def read_gptj(c: dict) -> dict:
    """GPT-J: unbiased q/k/v/out, a biased GELU MLP of n_inner (4 H), one LayerNorm (attention and MLP in parallel),
    an lm_head with a bias (kept when its weight is tied)."""
    h, layers, heads = _int(c, "n_embd", "hidden_size"), _int(c, "n_layer", "num_hidden_layers"), _int(c, "n_head")
    inter = _int(c, "n_inner") or 4 * h
    layer = join(attention(h, heads, heads, h // heads), mlp(h, inter, gated=False, bias=True), norm(h, bias=True))
    out = _base(c, h, layers, _int(c, "vocab_size"), heads, heads, h // heads, inter, bool(c.get("tie_word_embeddings", False)))
    return {**out, "kinds": group([layer] * layers), "root_extra": h + _int(c, "vocab_size")}


def read_gemma3n(c: dict) -> dict:
    """Gemma-3n's text model: per layer attention (q/k norms; the last num_kv_shared_layers layers reuse earlier k/v
    and have no k/v weights), a GeGLU MLP of that layer's intermediate_size, four norms, AltUp (altup_num_inputs
    streams: coefficients, router, norm, scale), LAuReL (rank laurel_rank) and the per-layer input gate and projection;
    at the root the per-layer embeddings (vocab_size_per_layer_input x layers x hidden_size_per_layer_input), their
    projection and norm, and the AltUp in/out projections. Activations: the AltUp streams add 4 n H per layer."""
    h, layers = _int(c, "hidden_size"), _int(c, "num_hidden_layers")
    heads, kv = _int(c, "num_attention_heads"), _int(c, "num_key_value_heads", "num_attention_heads")
    hd = _int(c, "head_dim") or h // heads
    widths = c.get("intermediate_size")
    widths = [int(w) for w in widths] if isinstance(widths, list) else [int(widths or 0)] * layers  # type: ignore[call-overload]
    n, rank, hp = (
        _int(c, "altup_num_inputs", default=4),
        _int(c, "laurel_rank", default=64),
        _int(c, "hidden_size_per_layer_input", default=256),
    )
    shared_kv, bias = _int(c, "num_kv_shared_layers"), bool(c.get("attention_bias", False))
    extras = h + n * n + n**3 + h * n + h + 2 * h * rank + h + 2 * h * hp + h + 3 * h  # AltUp, LAuReL, per-layer, norms
    layer = []
    for i in range(layers):
        mixer = attention(h, heads, kv, hd, bias=bias, qk_norm=True, kv_proj=i < layers - shared_kv)
        layer.append(join(mixer, mlp(h, widths[i]), ("", extras + h, extras + h, 4 * n * h, False, 0)))
    vp = _int(c, "vocab_size_per_layer_input", default=262144)
    root = vp * layers * hp + h * layers * hp + hp + 2 * (n - 1) * h * h
    out = _base(c, h, layers, _int(c, "vocab_size"), heads, kv, hd, max(widths), bool(c.get("tie_word_embeddings", True)))
    return {**out, "kinds": group(layer), "root_extra": root, "largest_extra": vp * layers * hp}


def read_gemma4(c: dict) -> dict:
    """Gemma 4's text model: per layer attention whose head_dim and kv heads a full-attention layer may override
    (per_layer_config, or transformers' global_head_dim 512 and num_global_key_value_heads), q/k norms, no v_proj in a
    full layer under attention_k_eq_v, no k/v weights in the last num_kv_shared_layers layers (whose GeGLU MLP is twice
    as wide under use_double_wide_mlp); four norms; the per-layer input gate, projection and norm; with
    enable_moe_block also a router (norm scale, per-expert scale) and experts beside the MLP, and three more norms. At
    the root the per-layer embeddings, their projection and norm."""
    h, layers = _int(c, "hidden_size"), _int(c, "num_hidden_layers")
    heads, kv = _int(c, "num_attention_heads"), _int(c, "num_key_value_heads", "num_attention_heads")
    hd, inter, hp = (
        _int(c, "head_dim", default=256),
        _int(c, "intermediate_size"),
        _int(c, "hidden_size_per_layer_input", default=256),
    )
    types = _types(c, layers, "layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(layers)]
    overrides = {int(k): v for k, v in (c.get("per_layer_config") or {}).items()}
    if "per_layer_config" not in c:  # transformers' __post_init__ builds it from these two
        full = {"head_dim": _int(c, "global_head_dim", default=512)}
        if c.get("num_global_key_value_heads") is not None and c.get("attention_k_eq_v", True):
            full["num_key_value_heads"] = _int(c, "num_global_key_value_heads")
        overrides = {i: full for i, t in enumerate(types) if t == "full_attention"}
    shared, bias = layers - _int(c, "num_kv_shared_layers"), bool(c.get("attention_bias", False))
    e, k, width = _int(c, "num_experts"), _int(c, "top_k_experts"), _int(c, "moe_intermediate_size")
    layer = []
    for i, t in enumerate(types):
        d = int(overrides.get(i, {}).get("head_dim", hd))
        n_kv = int(overrides.get(i, {}).get("num_key_value_heads", kv))
        weights = linear(h, heads * d, bias) + d + linear(heads * d, h, bias)
        if i < shared:  # k (and v unless k = v in a full layer) with the k norm
            v = 0 if c.get("attention_k_eq_v") and t != "sliding_attention" else linear(h, n_kv * d, bias)
            weights += linear(h, n_kv * d, bias) + v + d
        wide = 2 if c.get("use_double_wide_mlp") and i >= shared else 1
        parts = [("attention", weights, weights, 16 * h, True, 0), mlp(h, wide * inter), norm(4 * h)]
        parts += [("", 2 * h * hp + h, 2 * h * hp + h, 0, False, 0)] if hp else []
        if c.get("enable_moe_block"):
            name, total, active, act, _, routed = moe(h, e, k, width)
            parts += [(name, total + h + e, active + h + e, act, False, routed), norm(3 * h)]
        layer.append(join(*parts))
    root = (_int(c, "vocab_size_per_layer_input", default=262144) * layers * hp + h * layers * hp + hp) if hp else 0
    out = _base(c, h, layers, _int(c, "vocab_size"), heads, kv, hd, inter, bool(c.get("tie_word_embeddings", True)))
    moe_fields = {"experts": e, "experts_per_token": k, "expert_intermediate": width, "moe_layers": layers}
    return {**out, **(moe_fields if c.get("enable_moe_block") else {}), "kinds": group(layer), "root_extra": root}


def read_llama4(c: dict) -> dict:
    """Llama 4's text model: attention (its q/k norms are weightless L2 norms), then in each of moe_layers (every
    interleave_moe_layer_step-th where config.json has no list) experts of intermediate_size with a router and a
    shared SwiGLU expert of the same width, in the others a dense SwiGLU MLP of intermediate_size_mlp."""
    h, layers = _int(c, "hidden_size"), _int(c, "num_hidden_layers")
    heads, kv = _int(c, "num_attention_heads"), _int(c, "num_key_value_heads", "num_attention_heads")
    hd, inter = _int(c, "head_dim", default=128), _int(c, "intermediate_size")
    e, k = _int(c, "num_local_experts", default=16), _int(c, "num_experts_per_tok", default=1)
    step = _int(c, "interleave_moe_layer_step", default=1)
    moe_ids = c.get("moe_layers")
    moe_ids = set(moe_ids) if isinstance(moe_ids, list) else set(range(step - 1, layers, step))
    mixer = attention(h, heads, kv, hd, bias=bool(c.get("attention_bias", False)))
    dense = mlp(h, _int(c, "intermediate_size_mlp"))
    sparse = moe(h, e, k, inter, shared=inter)
    layer = [join(mixer, sparse if i in moe_ids else dense, norm(2 * h)) for i in range(layers)]
    out = _base(c, h, layers, _int(c, "vocab_size"), heads, kv, hd, inter, bool(c.get("tie_word_embeddings", False)))
    moe_fields = {"experts": e, "experts_per_token": k, "expert_intermediate": inter, "shared_intermediate": inter}
    return {**out, **moe_fields, "moe_layers": len(moe_ids & set(range(layers))), "kinds": group(layer)}


def read_hunyuan_moe(c: dict) -> dict:
    """Hunyuan-MoE (v1): attention with q/k norms, then in every layer experts of intermediate_size with a router and
    an always-on shared SwiGLU MLP (shared_mlp) of the same width."""
    h, layers = _int(c, "hidden_size"), _int(c, "num_hidden_layers")
    heads, kv = _int(c, "num_attention_heads"), _int(c, "num_key_value_heads", "num_attention_heads")
    hd, inter = _int(c, "head_dim") or h // heads, _int(c, "intermediate_size")
    e, k = _int(c, "num_experts", default=1), _int(c, "moe_topk", default=1)
    mixer = attention(h, heads, kv, hd, bias=bool(c.get("attention_bias", False)), qk_norm=True)
    layer = join(mixer, moe(h, e, k, inter, shared=inter), norm(2 * h))
    out = _base(c, h, layers, _int(c, "vocab_size"), heads, kv, hd, inter, bool(c.get("tie_word_embeddings", True)))
    moe_fields = {"experts": e, "experts_per_token": k, "expert_intermediate": inter, "shared_intermediate": inter}
    return {**out, **moe_fields, "moe_layers": layers, "kinds": group([layer] * layers)}


def read_afmoe(c: dict) -> dict:
    """AFMoE: attention with q/k norms and a sigmoid output gate (gate_proj, heads x head_dim), four norms, then a
    dense SwiGLU MLP in the first num_dense_layers and experts after, with a shared expert of num_shared_experts x
    moe_intermediate_size and the router's expert_bias (a parameter, not trained)."""
    h, layers = _int(c, "hidden_size"), _int(c, "num_hidden_layers")
    heads, kv = _int(c, "num_attention_heads"), _int(c, "num_key_value_heads", "num_attention_heads")
    hd, inter = _int(c, "head_dim") or h // heads, _int(c, "intermediate_size")
    e, k, width = _int(c, "num_experts"), _int(c, "num_experts_per_tok"), _int(c, "moe_intermediate_size")
    mixer = attention(h, heads, kv, hd, bias=bool(c.get("attention_bias", False)), qk_norm=True)
    gate = ("", h * heads * hd, h * heads * hd, 0, False, 0)
    name, total, active, act, _, routed = moe(h, e, k, width, shared=width * _int(c, "num_shared_experts", default=2))
    sparse = (name, total + e, active + e, act, False, routed)
    dense_layers = _int(c, "num_dense_layers", default=1)
    layer = [join(mixer, gate, sparse if i >= dense_layers else mlp(h, inter), norm(4 * h)) for i in range(layers)]
    out = _base(c, h, layers, _int(c, "vocab_size"), heads, kv, hd, inter, bool(c.get("tie_word_embeddings", False)))
    moe_fields = {"experts": e, "experts_per_token": k, "expert_intermediate": width}
    return {**out, **moe_fields, "moe_layers": max(layers - dense_layers, 0), "kinds": group(layer)}


def read_mimo_v2_flash(c: dict) -> dict:
    """MiMo-V2-Flash: attention with head_dim keys and v_head_dim values; a sliding-window layer has twice the kv heads
    and an attention sink per head (layer_types; transformers' default: full at layer 0 and every 6th); then a dense
    SwiGLU MLP or experts without a shared one (mlp_layer_types; default: layer 0 dense)."""
    h, layers = _int(c, "hidden_size"), _int(c, "num_hidden_layers")
    heads, kv = _int(c, "num_attention_heads", default=64), _int(c, "num_key_value_heads", default=4)
    hd, vd, bias = _int(c, "head_dim", default=192), _int(c, "v_head_dim", default=128), bool(c.get("attention_bias", False))
    types = _types(c, layers, "layer_types") or [
        "full_attention" if i == 0 or not (i + 1) % 6 else "sliding_attention" for i in range(layers)
    ]
    mlps = _types(c, layers, "mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1)
    inter, e, k = _int(c, "intermediate_size"), _int(c, "n_routed_experts", default=256), _int(c, "num_experts_per_tok")
    width = _int(c, "moe_intermediate_size")
    layer = []
    for t, m in zip(types, mlps, strict=True):
        swa = t == "sliding_attention"
        n_kv = 2 * kv if swa else kv
        n = linear(h, heads * hd, bias) + linear(h, n_kv * hd, bias) + linear(h, n_kv * vd, bias) + heads * vd * h
        n += heads if swa else 0  # the sinks
        ffn = moe(h, e, k, width) if m == "sparse" else mlp(h, inter)
        layer.append(join(("attention", n, n, 16 * h, True, 0), ffn, norm(2 * h)))
    out = _base(c, h, layers, _int(c, "vocab_size"), heads, kv, hd, inter, bool(c.get("tie_word_embeddings", False)))
    moe_fields = {"experts": e, "experts_per_token": k, "expert_intermediate": width}
    # transformers has no SDPA path for its sinks (_supports_sdpa False): the trainer's attention is the eager one
    return {**out, **moe_fields, "moe_layers": mlps.count("sparse"), "eager_attention": True, "kinds": group(layer)}


def mla_attention(c: dict) -> int:
    """Multi-head latent attention's parameters with the layer's two norms (DeepSeek-V2/V3, MiniCPM3, GLM-4.7-Flash,
    A.X-K1), 0 for a family without kv_lora_rank: q through a q_lora_rank bottleneck (with its norm; DeepSeek-V2-Lite:
    none), the compressed kv and the rope key (kv_a, its norm), kv_b to each head's nope key and value, o_proj; with
    DeepSeek Sparse Attention's indexer (index_n_heads) its q, k, k LayerNorm and head weights."""
    kv_rank = _int(c, "kv_lora_rank")
    if not kv_rank:
        return 0
    h, heads = _int(c, "hidden_size"), _int(c, "num_attention_heads")
    nope, rope, v = _int(c, "qk_nope_head_dim"), _int(c, "qk_rope_head_dim"), _int(c, "v_head_dim")
    q_rank = _int(c, "q_lora_rank")
    q = h * q_rank + q_rank + q_rank * heads * (nope + rope) if q_rank else h * heads * (nope + rope)
    n = q + h * (kv_rank + rope) + kv_rank + kv_rank * heads * (nope + v) + heads * v * h + 2 * h
    index_heads, index_dim = _int(c, "index_n_heads"), _int(c, "index_head_dim")
    if index_heads:
        n += (q_rank or h) * index_heads * index_dim + h * index_dim + 2 * index_dim + h * index_heads
    return n


READERS: dict[str, Reader] = {
    "mamba": read_mamba,
    "falcon_mamba": read_mamba,
    "mamba2": read_mamba2,
    "nemotron_h": read_nemotron_h,
    "jamba": read_jamba,
    "falcon_h1": read_falcon_h1,
    "zamba2": read_zamba2,
    "granitemoehybrid": read_granitemoehybrid,
    "gpt2": read_gpt2,
    "bloom": read_bloom,
    "gpt_neox": read_gpt_neox,
    "falcon": read_falcon,
    "opt": read_opt,
    "gptj": read_gptj,
    "gemma3n_text": read_gemma3n,
    "gemma4_text": read_gemma4,
    "llama4_text": read_llama4,
    "hunyuan_v1_moe": read_hunyuan_moe,
    "afmoe": read_afmoe,
    "mimo_v2_flash": read_mimo_v2_flash,
    **dict.fromkeys(PLAIN_MLP, read_plain_mlp),
}
"""model_type -> its reader (Qwen3-Next/Qwen3.5 and LFM2 take the MoE layer set too: MOE_AWARE)."""

MOE_AWARE: dict[str, Callable[[dict, set[int]], dict]] = {
    "qwen3_next": read_qwen3_next,
    "qwen3_5_text": read_qwen3_next,
    "qwen3_5_moe_text": read_qwen3_next,
    "lfm2": read_lfm2,
    "lfm2_moe": read_lfm2,
}
"""Families that take their MoE layers from shape.py's reader of the MoE fields (mlp_only_layers, num_dense_layers)."""
