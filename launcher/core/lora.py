"""How a LoRA run's push reaches the servers, decided once for the plan (dry-run prints it, the bootstrap starts vLLM
by it, the trainer pushes by it): the adapter alone (peft format, loaded by vLLM at run time) or the base with the
adapter merged in, through the ordinary weight push. Torch-free: the login node decides it.

Where vLLM 0.32 cannot serve the adapter, the push merges:
  - vllm.data_parallel_size > 1: an adapter load is one request to one API server; that it reached every engine
    is not tested here (TRL 1.16 falls back to merged weights with DP > 1 for the same reason).
  - an architecture whose vLLM model class does not support LoRA (SUPPORTED: tests/unit/test_lora_plan.py checks
    each against the installed vLLM's registry); an unreadable config.json is assumed supported (the parity check
    after the first push would tell).
The CPU build serves adapters (vLLM's CPU platform has a punica wrapper, PunicaWrapperCPU, and runs LoRA without
torch.compile), so the CPU tiers test the adapter path for real.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

from launcher.core.config import LORA_REFUSED_TARGETS, LORA_TARGETS, ConfigError, JobConfig
from launcher.core.shape import ModelShape
from launcher.core.weights import WeightsError, looks_local, weight_shapes

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""vLLM 0.32's choices of --max-lora-rank (vllm/config/lora.py MaxLoRARanks)."""

SUPPORTED = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma2ForCausalLM",
    "Phi3ForCausalLM",
)
"""Decoder architectures whose vLLM 0.32 model class supports LoRA (SupportsLoRA), checked against the installed vLLM."""

MOE_REFUSED_TARGETS = ("gate_proj", "up_proj", "down_proj", "experts", "gate_up_proj", "w1", "w2", "w3", "gate", "router")
"""On a mixture of experts, LoRA adapts the attention projections (q/k/v/o_proj) and pushes merged. Refused: every MLP
name, because peft 0.21 maps gate_proj/up_proj/down_proj onto transformers 5's fused 3-D expert parameters (a
ParamWrapper, not a linear module: neither the sharded loader's names nor the merged push's fold handle it, and vLLM
0.32 serves MoE LoRA only through its Triton kernels, not on CPU), and the router (an adapter on it changes which
experts run, every push)."""

ADAPTER_NAME = "slurm-grpo-policy"
"""The name a node's server knows the trained adapter by; generation and parity requests name it."""

ADAPTER, MERGED = "adapter", "merged"

ENGINE, DISK = "engine", "disk"
"""trainer.lora.adapter_transport: how an adapter push reaches vLLM (trainer.push.adapter)."""


def serving_rank(r: int) -> int:
    """The smallest --max-lora-rank vLLM accepts that holds rank r."""
    return next(x for x in VLLM_LORA_RANKS if x >= r)


def architecture(model: str) -> str | None:
    try:
        archs = json.loads((Path(model) / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError):
        return None
    return str(archs[0]) if archs else None


def model_type(model: str) -> str | None:
    try:
        return json.loads((Path(model) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


PEFT_MAMBA_TYPES = ("falcon_h1", "mamba", "mamba2", "falcon_mamba", "nemotron_h")
PEFT_MAMBA_REFUSED = ("out_proj", "conv1d")
"""peft 0.21 refuses LoRA on these modules of these model types (tuners_utils._check_lora_target_modules_mamba: the
Mamba mixer's fused kernels read out_proj's and conv1d's weights directly, past an adapter), at get_peft_model, that
is on the nodes after the queue: the default leaves them out and a user's list naming them is refused at plan time."""

DIRECT_WEIGHT = {
    "mamba": ("dt_proj",),
    "falcon_mamba": ("dt_proj",),
    "jamba": ("dt_proj",),
    "gemma3n": ("correction_coefs",),
    "gemma3n_text": ("correction_coefs",),
}
"""Linear layers whose weight transformers 5.19 reads directly instead of calling the module, so an adapter there is
bypassed and never trains (peft accepts it silently): `time_step = self.dt_proj.weight @ ...` on every path
(modeling_mamba.py:437, modeling_falcon_mamba.py:475, modeling_jamba.py:576), and Gemma-3n's AltUp in training
(`F.linear(modalities, self.correction_coefs.weight.clamp(...))`, modeling_gemma3n.py:1060). Found by a backward pass
with every adapter non-zero over all 77 tiny families (tests/unit/test_lora_default_targets.py does it for a few). The
default leaves them out; a user's list naming them is refused at plan time."""

KERNEL_DIRECT_WEIGHT = {
    "mamba": ("x_proj",),
    "falcon_mamba": ("x_proj",),
    "bamba": ("out_proj",),
    "granitemoehybrid": ("out_proj",),
    "zamba2": ("out_proj",),
}
"""Linear layers whose weight goes straight into a mamba-ssm kernel when one is installed (training, no cache):
mamba_inner_fn takes x_proj.weight (modeling_mamba.py:375, modeling_falcon_mamba.py:398),
mamba_split_conv1d_scan_combined takes out_proj.weight (modeling_bamba.py:679, modeling_granitemoehybrid.py:602,
modeling_zamba2.py:750; the same in nemotron_h, mamba2 and falcon_h1, whose out_proj peft refuses anyway). Without the
kernels (CPU) they are called as modules and train. The default leaves them out, so it trains the same everywhere; a
user's list naming them is warned."""


def bypassed(model_type_: str | None) -> tuple[str, ...]:
    """The leaves of this model type an adapter would miss somewhere (PEFT_MAMBA_REFUSED included where peft refuses)."""
    mt = model_type_ or ""
    refused = PEFT_MAMBA_REFUSED if mt in PEFT_MAMBA_TYPES else ()
    return refused + DIRECT_WEIGHT.get(mt, ()) + KERNEL_DIRECT_WEIGHT.get(mt, ())


def check_bypassed_targets(cfg: JobConfig) -> None:
    """trainer.lora.target_modules names nothing peft refuses on a Mamba-based model (PEFT_MAMBA_REFUSED) or that
    transformers bypasses (DIRECT_WEIGHT), and is not 'all-linear' on a model type with any of those or of
    KERNEL_DIRECT_WEIGHT (peft's all-linear is every linear layer but the output layer: it reaches them)."""
    mt = model_type(cfg.vllm.model) or ""
    targets = list(cfg.trainer.lora.target_modules)
    for m in targets:
        leaf = m.rpartition(".")[2]
        if mt in PEFT_MAMBA_TYPES and leaf in PEFT_MAMBA_REFUSED:
            raise ConfigError(
                f"trainer.lora.target_modules {m!r}: peft 0.21 refuses LoRA on {', '.join(PEFT_MAMBA_REFUSED)} of a "
                f"Mamba-based model ({mt}); leave it out of trainer.lora.target_modules"
            )
        if leaf in DIRECT_WEIGHT.get(mt, ()):
            raise ConfigError(
                f"trainer.lora.target_modules {m!r}: transformers reads {mt}'s {leaf}.weight directly, so its adapter "
                "would never train; leave it out of trainer.lora.target_modules"
            )
    if targets == [ALL_LINEAR] and bypassed(mt):
        raise ConfigError(
            f"trainer.lora.target_modules 'all-linear' reaches {', '.join(bypassed(mt))} of {mt}, refused by peft or "
            "bypassed in training; leave trainer.lora.target_modules at its default (without them)"
        )


def kernel_bypass_warning(cfg: JobConfig) -> str:
    """A user's list naming a KERNEL_DIRECT_WEIGHT layer: trains without the mamba-ssm kernels, not with them."""
    lora = cfg.trainer.lora
    mt = model_type(cfg.vllm.model) or ""
    named = [m for m in lora.target_modules if m.rpartition(".")[2] in KERNEL_DIRECT_WEIGHT.get(mt, ())]
    if not lora.enabled or not named:
        return ""
    return (
        f"WARNING: trainer.lora.target_modules {named[0]!r}: where mamba-ssm is installed, {mt}'s kernel reads its weight "
        "directly and the adapter never trains; leave it out to train the same everywhere"
    )


def lora_push(cfg: JobConfig, data_parallel_size: int | None = None) -> tuple[str, str]:
    """(how a push moves the LoRA run's weights, why): ('', '') without LoRA, else ADAPTER or MERGED.
    data_parallel_size: the plan's (slurm.layout shared derives it from the node's GPUs); default the config's."""
    lora = cfg.trainer.lora
    if not lora.enabled:
        return "", ""
    check_moe_targets(cfg)
    check_bypassed_targets(cfg)
    if lora.push == MERGED:
        return MERGED, "trainer.lora.push: merged"
    dp = data_parallel_size or cfg.vllm.data_parallel_size
    arch = architecture(cfg.vllm.model)
    why_not = ""
    if dp > 1:
        why_not = f"vllm.data_parallel_size {dp} > 1: an adapter load is one request, not tested to reach every engine"
    elif arch is not None and arch not in SUPPORTED:
        why_not = f"{arch} is not among the architectures vLLM 0.32 serves LoRA for here ({', '.join(SUPPORTED)})"
    if why_not and lora.push == ADAPTER:
        raise ConfigError(
            f"trainer.lora.push adapter cannot be served: {why_not}; set trainer.lora.push: auto (merges) or merged"
        )
    if why_not:
        return MERGED, why_not + "; merged weights are pushed instead"
    return ADAPTER, f"only the adapter moves (vLLM --enable-lora --max-lora-rank {serving_rank(lora.r)}), {transport_why(cfg)}"


def transport_why(cfg: JobConfig) -> str:
    """How the adapter reaches vLLM, in words (dry-run's LoRA line)."""
    if cfg.trainer.lora.adapter_transport == DISK:
        return (
            "written to node-local disk as a peft folder and loaded by /v1/load_lora_adapter at each push "
            "(trainer.lora.adapter_transport: disk)"
        )
    return (
        "its tensors through the weight-transfer engine, from which each vLLM worker builds the LoRA model in memory, "
        "no file per push (trainer.lora.adapter_transport: engine; disk writes and loads a peft folder instead)"
    )


MOE_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
"""What LoRA adapts on a mixture of experts when trainer.lora.target_modules is left at its default (LORA_TARGETS) and
its weights cannot be read here (resolved again on the nodes, Plan.load): the attention projections (the default's MLP
names are the experts', check_moe_targets)."""


def resolve_targets(cfg: JobConfig) -> JobConfig:
    """The config with LoRA's targets resolved for its model where trainer.lora.target_modules is the default
    (LORA_TARGETS, a Llama's names): the linear layers of the model's decoder layers, read from its weight names
    (default_targets), so that a model that names them otherwise (LFM2's out_proj/in_proj/w1-w3, MLA's q_a_proj ...
    kv_b_proj, GPT-NeoX's query_key_value/dense*) is adapted as a Llama is, instead of on the few names that happen to
    match, or none. A user's own list is kept (and checked: target_problems). Where the weights cannot be read here (a
    hub name, *.bin only) the default stays, an MoE's becoming MOE_TARGETS; the nodes, which read the model, resolve it
    again (Plan.load). The plan carries the result to the trainer, and its LoRA line names the targets."""
    lora = cfg.trainer.lora
    if not lora.enabled or tuple(lora.target_modules) != LORA_TARGETS:
        return cfg
    shape = ModelShape.read(cfg.vllm.model)
    moe = shape is not None and bool(shape.experts)
    shapes = readable_weight_shapes(cfg.vllm.model)
    if shapes:
        if shape is not None:  # DeepSeek-V3's multi-token-prediction layer (model.layers.61) is no decoder layer
            shapes = {k: v for k, v in shapes.items() if not ((m := LAYER.search(k)) and int(m.group(1)) >= shape.layers)}
        layers = linear_layers(shapes)
        # per-expert matrices in the checkpoint say MoE too, where config.json's fields are not ModelShape's
        targets = default_targets(layers, moe or any(".experts." in m for ms in layers.values() for m in ms))
        gone = bypassed(model_type(cfg.vllm.model))  # peft refuses them, or transformers or a kernel bypasses them
        targets = [t for t in targets if t not in gone]
        if not targets:
            raise ConfigError(
                f"trainer.lora.target_modules: the default finds no linear layer in the decoder layers of {cfg.vllm.model}"
                " to adapt; set trainer.lora.target_modules=[...] to the model's own module names"
            )
    elif moe:
        targets = list(MOE_TARGETS)
    else:
        return cfg
    return replace(cfg, trainer=replace(cfg.trainer, lora=replace(lora, target_modules=targets)))


def unresolved_note(cfg: JobConfig) -> str:
    """Where the default targets were not resolved (the plan's LoRA targets line): '' where they were (or LoRA is off,
    or the list is the user's), else what happens instead and how to set them. A hub name is never resolved (its
    weights are in a node's HF cache, read neither here nor by Plan.load); a folder without safetensors weights here is
    resolved by the nodes at start (Plan.load) if they find safetensors there; *.bin weights are never read."""
    lora, model = cfg.trainer.lora, cfg.vllm.model
    if not lora.enabled or tuple(lora.target_modules) != LORA_TARGETS or readable_weight_shapes(model) is not None:
        return ""
    fix = "set trainer.lora.target_modules=[...] to the model's own linear layers"
    if not looks_local(model):
        return (
            "not resolved: vllm.model is a hub name, read neither here nor on the nodes; peft gets a Llama's names as they "
            f"are (an error on the nodes if none match); {fix}"
        )
    return (
        "not resolved here: no safetensors weights in vllm.model on this host; the nodes resolve it at start if they "
        f"find them there (never for *.bin only: peft then gets a Llama's names as they are); or {fix}"
    )


def default_targets(layers: dict[str, list[str]], moe: bool) -> list[str]:
    """What the default adapts, by leaf name (linear_layers' order): every linear layer of the decoder layers, as
    peft's all-linear does there. On a mixture of experts only the leaves none of whose modules sits in its MLP block
    (MOE_BLOCK: the experts, the router, the shared expert and its gate; peft matches a leaf in every block, and maps
    the MLP names onto the fused experts) or in a sparse-attention indexer (transformers runs it under no_grad: its
    adapters would never train), nor one of MOE_REFUSED_TARGETS. (A Mamba-based model's out_proj is left out by
    resolve_targets: PEFT_MAMBA_REFUSED.) For the architectures that take the adapter push
    (SUPPORTED) these are vLLM's LoRA modules too: vLLM 0.32 adapts every linear layer (get_supported_lora_modules)."""
    if not moe:
        return list(layers)
    return [
        leaf
        for leaf, modules in layers.items()
        if leaf not in MOE_REFUSED_TARGETS and not any(MOE_BLOCK.search(m) for m in modules)
    ]


MOE_BLOCK = re.compile(r"\.\d+\.(mlp|feed_forward|block_sparse_moe|shared_mlp|moe)\.|\.experts\.|\.indexer\.")
"""A module of an MoE decoder layer's MLP block (Qwen's mlp, LFM2's and Jamba's feed_forward, Mixtral's and Granite's
block_sparse_moe, Granite's shared_mlp), of the experts, or of DeepSeek-V3.2's sparse-attention indexer."""


def readable_weight_shapes(model: str) -> dict[str, list[int]] | None:
    """The model folder's tensor shapes by name (safetensors headers), or None where there is none to read here (a hub
    name, *.bin weights, a damaged file: check_model says which)."""
    p = Path(model).expanduser()
    if not p.is_dir():
        return None
    try:
        return weight_shapes(p)
    except WeightsError:
        return None


def check_moe_targets(cfg: JobConfig) -> None:
    """LoRA on a mixture of experts: only the modules MOE_REFUSED_TARGETS leaves (the attention projections; not
    'all-linear', which reaches the router); an MoE pushes merged (its architectures are not in SUPPORTED)."""
    shape = ModelShape.read(cfg.vllm.model)
    if shape is None or not shape.experts:
        return
    bad = [m for m in cfg.trainer.lora.target_modules if m.rpartition(".")[2] in MOE_REFUSED_TARGETS or m == ALL_LINEAR]
    if bad:
        raise ConfigError(
            f"trainer.lora.target_modules {bad[0]!r}: on a mixture of experts LoRA adapts attention only; "
            "set trainer.lora.target_modules: [q_proj, k_proj, v_proj, o_proj]"
        )


ALL_LINEAR = "all-linear"
"""peft's special target: every linear layer but the output layer (peft tuners_utils _maybe_include_all_linear_layers);
special only as the whole of target_modules (trainer.lora.peft_config passes it to peft as the string)."""

FUSED_PROJECTIONS = ("qkv_proj", "gate_up_proj", "query_key_value", "W_pack", "c_attn", "Wqkv")
"""Linear layers that fuse what a Llama's names name apart (phi3's qkv_proj and gate_up_proj): a user's list of
Llama names misses them, and peft says nothing while any other target matches."""


LAYER = re.compile(r"\.layers\.(\d+)\.")
"""A decoder layer's index in a tensor name; one at num_hidden_layers or above is a checkpoint's extra (MTP) layer,
which transformers' causal LM drops on load."""

TOWER = re.compile(r"(^|\.)(visual|vision_tower|vision_model|audio_tower)\.")
"""A multimodal release's encoder beside the text decoder (Qwen3.5's model.visual.blocks.N): its blocks are numbered
too, but transformers' causal LM drops them on load, so no adapter could go there."""


def linear_layers(shapes: dict[str, list[int]]) -> dict[str, list[str]]:
    """Leaf name -> the module names of the linear layers (2-D `.weight` tensors) of the checkpoint's decoder layers
    (a numbered block: model.layers.3.self_attn.q_proj, GPT-2's h.3.attn.c_attn): the embeddings, the LM head, the
    model-level projections (Gemma-3n's altup_projections.0) and a vision or audio tower (TOWER) left out; the default
    targets' names first, in their order, then the others."""
    out: dict[str, list[str]] = {}
    for name, shape in shapes.items():
        if not name.endswith(".weight") or len(shape) != 2:
            continue
        module = name.removesuffix(".weight")
        leaf = module.rpartition(".")[2]
        if leaf in LORA_REFUSED_TARGETS or leaf.isdigit() or not re.search(r"\.\d+\.", module) or TOWER.search(module):
            continue
        out.setdefault(leaf, []).append(module)
    rank = {leaf: i for i, leaf in enumerate(LORA_TARGETS)}
    return dict(sorted(out.items(), key=lambda kv: (rank.get(kv[0], len(rank)), kv[0])))


def matches(target: str, module: str) -> bool:
    """peft's rule for a list of targets (check_target_module_exists): the whole name, or its dotted suffix."""
    return module == target or module.endswith("." + target)


def target_problems(cfg: JobConfig, shapes: dict[str, list[int]]) -> tuple[list[str], list[str]]:
    """(problems, warnings) of trainer.lora.target_modules (resolved: resolve_targets) against the model's weight names:
    a target that matches no linear layer of its decoder layers is refused (peft errors only when no target matches at
    all, so a typo beside a good name is silent); 'all-linear' must stand alone to be peft's special value. A user's
    own list that leaves a fused projection (FUSED_PROJECTIONS) without adapters is warned, naming the layers."""
    lora, model = cfg.trainer.lora, cfg.vllm.model
    if not lora.enabled:
        return [], []
    layers = linear_layers(shapes)
    if not layers:
        return [], []  # no 2-D weights read: nothing to check against
    names = ", ".join(layers)
    targets = list(lora.target_modules)
    if ALL_LINEAR in targets:
        if len(targets) > 1:
            return [f"trainer.lora.target_modules: {ALL_LINEAR!r} is peft's special value only alone; set "
                    f"trainer.lora.target_modules=[{ALL_LINEAR}] or name the layers ({names})"], []  # fmt: skip
        return [], []
    modules = [m for ms in layers.values() for m in ms]
    missed = [t for t in targets if not any(matches(t, m) for m in modules)]
    if missed:
        return [
            f"trainer.lora.target_modules: {missed[0]!r} matches no module of {model} (its linear layers: {names}); "
            "name those to adapt"
        ], []
    reached = {leaf for leaf, ms in layers.items() if any(matches(t, m) for t in targets for m in ms)}
    left = [leaf for leaf in layers if leaf not in reached and leaf in FUSED_PROJECTIONS]
    if not left:
        return [], []
    kept = [leaf for leaf in layers if leaf in reached or leaf in left]
    return [], [
        f"WARNING: trainer.lora.target_modules reach only {', '.join(sorted(reached))} of {model}: its fused "
        f"{', '.join(left)} get no adapter; add them: trainer.lora.target_modules=[{', '.join(kept)}]"
    ]
