"""Where each parameter of the model transformers builds lives in a checkpoint on disk, as pieces the sharded loader
(trainer.loading) reads by rows. Owns the one boundary with transformers' load-time weight conversion
(`transformers.conversion_mapping` / `core_model_loading`, 5.19).

Why: transformers 5 builds MoE layers with fused 3-D expert parameters (`mlp.experts.gate_up_proj` [E, 2I, H],
`mlp.experts.down_proj` [E, H, I]), while checkpoints (the hub's and `save_pretrained`'s, which reverts the fusion)
hold one matrix per expert (`mlp.experts.{e}.gate_proj.weight` [I, H], ...; Mixtral: `block_sparse_moe.experts.{e}.w1`).
`from_pretrained` reads whole tensors and converts them with the family's own mapping; here the same mapping (never a
per-family table of ours) is read to place every per-expert matrix: expert e is row e of the fused parameter, and
FSDP2 shards on dim 0, so a rank reads exactly the experts it owns, one expert matrix at a time.

Saving goes back the other way (as_saved, to_saved: transformers' revert_weight_conversion, which save_pretrained runs),
one tensor at a time: JOB/model, JOB/merged and `slurm-grpo export` hold the checkpoint's names and per-expert tensors.

Accepted: renamings, and converters whose operations are MergeModulelist(dim=0) (stack the experts) optionally followed
by Concatenate(dim=1) (gate then up). Anything else (a transpose, an interleave, a fused q/k/v) is refused with the fix
(`trainer.model_loading=full`), never loaded wrong."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


class NamesError(RuntimeError):
    """The checkpoint's names cannot be placed row-wise into the model; the message holds the fix."""


@dataclass(frozen=True)
class Piece:
    """One checkpoint tensor and where it goes in a model parameter."""

    key: str
    """The checkpoint's tensor name."""
    expert: int | None = None
    """Row of the fused parameter (dim 0) this tensor fills; None: the tensor is the whole parameter."""
    slot: int = 0
    slots: int = 1
    """The tensor fills block `slot` of `slots` equal blocks of the expert's dim 0 (gate = 0, up = 1 of gate_up_proj)."""


def placement(model: torch.nn.Module, keys: list[str]) -> dict[str, list[Piece]]:
    """Model parameter or buffer name (as the model built from the config names it) -> the pieces that fill it."""
    renamings, converters = _transforms(model)
    out: dict[str, list[Piece]] = {}
    if not renamings and not converters:
        return {k: [Piece(k)] for k in keys}
    from transformers.core_model_loading import rename_source_key

    by_pattern = {p: c for c in converters for p in c.source_patterns}
    for key in keys:
        target, pattern = rename_source_key(key, renamings, converters)  # marks the transforms that match as used
        if pattern is None:
            out[target] = [Piece(key)]
            continue
        conv = by_pattern[pattern]
        _check_ops(conv, key)
        out.setdefault(target, []).append(
            Piece(key, _expert_index(key, pattern), conv.source_patterns.index(pattern), len(conv.source_patterns))
        )
    for target, pieces in out.items():
        if pieces[0].expert is not None:
            _check_complete(target, pieces)
    # as from_pretrained keeps them: saving (revert_weight_conversion) and a push (served_names) revert these only,
    # so a prefix the checkpoint has (Qwen3.5's `model.language_model.`) is given back and one it lacks is not added
    model._weight_conversions = [t for t in renamings + converters if t.was_used()]  # type: ignore[assignment]
    return out


@contextmanager
def _as_built(model: torch.nn.Module) -> Iterator[None]:
    """The model seen under the class transformers built, for the length of a lookup. FSDP2's fully_shard swaps a
    module's class for a subclass named FSDP<class> (torch's _fully_shard.py), and transformers looks the conversion
    mapping up by class name (GPT-NeoX's embed_out -> lm_head is keyed by GPTNeoXForCausalLM, no model_type entry):
    on the sharded root the lookup would find nothing, and the checkpoint's names would be lost."""
    from torch.distributed.fsdp import FSDPModule

    wrapped: type = type(model)
    if not isinstance(model, FSDPModule):
        yield
        return
    built: type = next(c for c in wrapped.__mro__ if not issubclass(c, FSDPModule))
    model.__class__ = built
    try:
        yield
    finally:
        model.__class__ = wrapped


def _transforms(model: torch.nn.Module) -> tuple[list, list]:
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    with _as_built(model):
        mapping = get_model_conversion_mapping(model, add_legacy=False)  # type: ignore[arg-type]
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    other = [t for t in mapping if not isinstance(t, WeightRenaming | WeightConverter)]
    if other:
        raise NamesError(
            f"{type(model).__name__}: transformers maps its checkpoint with {other}, which the sharded loader "
            "does not read; set trainer.model_loading=full"
        )
    return renamings, converters


def _check_ops(conv, key: str) -> None:
    from transformers.core_model_loading import Concatenate, MergeModulelist

    ops = list(conv.operations)
    stack = len(ops) >= 1 and isinstance(ops[0], MergeModulelist) and ops[0].dim == 0
    cat = len(ops) == 1 or (len(ops) == 2 and isinstance(ops[1], Concatenate) and ops[1].dim == 1)
    if not (stack and cat and len(ops) <= 2):
        raise NamesError(
            f"{key}: transformers converts it with {ops} on load, which the sharded loader does not read "
            "row-wise; set trainer.model_loading=full"
        )


def _expert_index(key: str, pattern: str) -> int:
    """The integer the pattern's `*` matched in key (mlp.experts.*.gate_proj.weight -> the expert). The pattern is a
    regex, as transformers compiles it (DeepSeek-V4's `\\.experts.*.w1.weight`)."""
    head, star, tail = pattern.partition("*")
    m = re.search(head + r"(\d+)" + tail + "$", key) if star else None
    if m is None:
        raise NamesError(
            f"{key}: no expert index where transformers' pattern {pattern!r} has one; set trainer.model_loading=full"
        )
    return int(m.group(1))


def _check_complete(target: str, pieces: list[Piece]) -> None:
    experts = {p.expert for p in pieces}
    want = {(e, s) for e in range(len(experts)) for s in range(pieces[0].slots)}
    got = {(p.expert, p.slot) for p in pieces}
    if got != want or len(pieces) != len(want):
        raise NamesError(
            f"{target}: the checkpoint's per-expert tensors are not experts 0..{len(experts) - 1} "
            f"x {pieces[0].slots} parts each (missing {sorted(want - got)[:4]}); the checkpoint is incomplete"
        )


VLLM_FUSED_GATE_UP = {("gate_proj", "up_proj"): "gate_up_proj", ("w1", "w3"): "w13"}
"""vLLM 0.32's name of a fused gate/up expert tensor, from the checkpoint's per-expert names
(`RoutedExperts.build_expert_params_mapping(include_fused=True)`); a fused down projection keeps the per-expert name."""


def served_names(model: torch.nn.Module, names: list[str]) -> dict[str, str]:
    """The name vLLM's `load_weights` takes for each of the trainer's parameter names (as transformers builds the
    model; a peft model is read through to its base): the checkpoint's module names (transformers' load-time renamings
    reverted: Mixtral's `.mlp.` is `.block_sparse_moe.`), fused experts kept fused under the name vLLM gives the
    checkpoint's gate/up pair (`experts.w13` for w1/w3). Same bytes, same layout: HF's gate_up_proj [E, 2I, H] is
    vLLM's w13 (gate rows first)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # type: ignore[operator]
    renamings, converters = _saved_transforms(base)
    if not renamings and not converters:
        return {n: n for n in names}
    from transformers.core_model_loading import rename_source_key

    back = [r.reverse_transform() for r in renamings[::-1]]
    leaves = {c.target_patterns[0].lstrip(".").rpartition(".")[2]: _fused_leaf(c) for c in converters if _stacks_experts(c)}
    out = {}
    for n in names:
        head, _, leaf = n.rpartition(".")
        if head.endswith(".experts") and leaf in leaves:
            n_served = f"{head}.{leaves[leaf]}"
        else:
            n_served = n
        out[n] = rename_source_key(n_served, back, [], reverse=True)[0]
    return out


def _saved_transforms(model: torch.nn.Module) -> tuple[list, list]:
    """The transforms whose reverse gives the checkpoint's names, chosen as revert_weight_conversion chooses: those
    the load used (placement or from_pretrained keep them on the model), else the family's mapping without its
    PrefixChange. A PrefixChange strips an optional prefix on load (Qwen3.5's and Gemma-3n's `model.language_model.`):
    vLLM serves the checkpoint's architecture, whose loader takes the checkpoint's own names (Gemma3nForCausalLM knows no
    `language_model.`, Qwen3_5ForConditionalGeneration needs it)."""
    used = getattr(model, "_weight_conversions", None)
    if used is None:
        from transformers.core_model_loading import PrefixChange

        renamings, converters = _transforms(model)
        return [r for r in renamings if not isinstance(r, PrefixChange)], converters
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    return [t for t in used if isinstance(t, WeightRenaming)], [t for t in used if isinstance(t, WeightConverter)]


def _stacks_experts(conv) -> bool:
    from transformers.core_model_loading import MergeModulelist

    return bool(conv.operations) and isinstance(conv.operations[0], MergeModulelist)


def _fused_leaf(conv) -> str:
    stems = tuple(p.partition("*.")[2].removesuffix(".weight") for p in conv.source_patterns)
    if len(stems) == 1:
        return stems[0]
    if stems in VLLM_FUSED_GATE_UP:
        return VLLM_FUSED_GATE_UP[stems]
    raise NamesError(
        f"experts {list(stems)}: vLLM 0.32 has no fused name for this gate/up pair, so a push cannot send the fused "
        "tensor; this family is not supported for pushes"
    )


def as_saved(model: torch.nn.Module, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """One of the trainer's tensors (its name as transformers builds the model) as the checkpoint names and layout it
    has on disk: transformers' own reverse conversion, the one save_pretrained runs (revert_weight_conversion), fed one
    tensor at a time so a writer holds one fused tensor and its per-expert views, never the model. A fused
    `mlp.experts.gate_up_proj` [E, 2I, H] gives E gate and E up matrices [I, H] (Mixtral: `block_sparse_moe.experts.{e}
    .w1/.w3.weight`); a dense family's tensor comes back as it is. Works on meta tensors (names and shapes only)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # type: ignore[operator]
    # the transforms a push reverts too (served_names): the load's, kept on the model through FSDP2's class swap
    renamings, converters = _saved_transforms(base)
    if not renamings and not converters:
        return {name: tensor}
    from transformers.core_model_loading import revert_weight_conversion

    if getattr(base, "_weight_conversions", None) is not None:  # loaded: revert reads the load's transforms
        return revert_weight_conversion(base, {name: tensor})  # type: ignore[arg-type]
    with _as_built(base):  # built from a config, then sharded: revert looks the mapping up, under the built class
        return revert_weight_conversion(base, {name: tensor})  # type: ignore[arg-type]


def saved_layout(model: torch.nn.Module, entries: list[tuple[str, tuple[int, ...]]]) -> list[tuple[str, tuple[int, ...]]]:
    """(checkpoint name, shape) of every tensor a saved folder holds, from the trainer's (name, shape) entries."""
    out = []
    for n, shape in entries:
        out += [(k, tuple(v.shape)) for k, v in as_saved(model, n, torch.empty(shape, device="meta")).items()]
    return out


def to_saved(model: torch.nn.Module, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The trainer's (name, tensor) stream under the checkpoint's names and layout (as_saved), lazily."""
    for n, t in tensors:
        yield from as_saved(model, n, t).items()


def foreign_keys(model: torch.nn.Module, keys: list[str]) -> list[str]:
    """The checkpoint's keys (`keys`, its tensor names) that feed none of the model's parameters or persistent buffers:
    what transformers' causal LM drops on load, e.g. a multimodal release's vision tower (Qwen3.5's `model.visual.*`)
    or its multi-token-prediction layers (`mtp.*`). The model's own names come from `placement`, as the load's; a peft
    model's are its base's (trainer.lora.base_name), its adapters none of the checkpoint's."""
    from trainer.lora import base_name

    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # type: ignore[operator]
    named = [*base.named_parameters(remove_duplicate=False), *base.named_buffers(remove_duplicate=False)]
    known = {b for n, _ in named if (b := base_name(n)) is not None}
    try:
        places = placement(base, keys)
    except NamesError as e:  # a checkpoint only from_pretrained reads (trainer.model_loading: full): nothing carried
        print(f"the base checkpoint's tensors beside the model are not carried over: {e}", flush=True)
        return []
    return sorted(p.key for target, pieces in places.items() if target not in known for p in pieces)
