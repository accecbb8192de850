"""LoRA on the sharded model (trainer.lora): peft's adapters are added on the meta device, before FSDP2 shards the
model, so base and adapters are sharded together (one FSDP2 unit per decoder layer, as without LoRA).

The base is frozen and kept in the serving dtype (trainer.dtype): no fp32 master copy, no gradients, no optimizer
state. The adapters are fp32 and trained; FSDP2 computes with them in trainer.dtype, like the base. One unit mixing
a frozen bf16 base with fp32 adapters is accepted by torch 2.13's fully_shard: it requires one original dtype among
a unit's *trainable* parameters only (_fsdp_param_group.py, _init_mp_dtypes), and its all-gather packs parameters of
mixed dtypes as bytes (tests/unit/test_lora_sharded.py runs both on gloo).

Adapter weights are initialised as peft does (A: Kaiming-uniform, B: zeros), but from a generator seeded by
trainer.seed and the parameter's index, on the full tensor, of which each rank keeps its own rows: the same
adapters on any number of ranks.

Names: a peft model's parameter `base_model.model.<name>.base_layer.weight` is the base checkpoint's `<name>.weight`;
`...lora_A.default.weight` is the adapter file's `base_model.model.<name>.lora_A.weight` (peft's format drops the
adapter name)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from launcher.core.config import LoraConfig
from launcher.core.lora import ALL_LINEAR

ADAPTER = "default"
"""peft's name of the one adapter we train."""
PEFT_PREFIX = "base_model.model."


def peft_config(lora: LoraConfig, base_model: str = "") -> Any:
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(
        r=lora.r,
        lora_alpha=lora.scale_alpha,
        lora_dropout=lora.dropout,
        # peft's "all-linear" is special only as a string; in a list it names a module called all-linear
        target_modules=ALL_LINEAR if list(lora.target_modules) == [ALL_LINEAR] else list(lora.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model or None,
    )


def apply(model: torch.nn.Module, lora: LoraConfig, base_dtype: torch.dtype, base_model: str = "") -> torch.nn.Module:
    """The peft model: every base parameter frozen in `base_dtype`, the adapters fp32 and trainable. Works on the meta
    device (the sharded loader) as on a real one (the full loader; adapters then get init_adapters after sharding)."""
    from peft import get_peft_model

    model.to(base_dtype)
    for p in model.parameters():
        p.requires_grad_(False)
    peft_model = get_peft_model(model, peft_config(lora, base_model), autocast_adapter_dtype=False)  # type: ignore[arg-type]
    for name, p in peft_model.named_parameters():
        if is_adapter(name):
            p.data = p.data.to(torch.float32)
            p.requires_grad_(True)
    return peft_model


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def base_name(name: str) -> str | None:
    """The base checkpoint's name of a peft model's parameter (None for an adapter's)."""
    if is_adapter(name):
        return None
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def peft_file_name(name: str) -> str:
    """An adapter parameter's name in peft's adapter_model.safetensors."""
    return name.replace(f".{ADAPTER}.", ".")


def rows_of(p: torch.Tensor) -> tuple[int, int]:
    from trainer.loading import rows_owned

    return rows_owned(p)


@torch.no_grad()
def init_adapters(model: torch.nn.Module, seed: int) -> None:
    """A: Kaiming-uniform (a = sqrt 5, peft's), B: zeros, each the same full tensor on every rank (a generator seeded by
    `seed` and the parameter's index), of which each rank copies its own rows into its shard."""
    for i, (name, p) in enumerate((n, p) for n, p in model.named_parameters() if is_adapter(n)):
        local = p.to_local() if isinstance(p, DTensor) else p
        if ".lora_B." in name:
            local.zero_()
            continue
        g = torch.Generator().manual_seed(seed * 1_000_003 + i)
        full = torch.empty(tuple(p.shape), dtype=torch.float32)
        torch.nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=g)
        first, stop = rows_of(p)
        local.copy_(full[first:stop].reshape(local.shape))


def adapter_params(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, p) for n, p in model.named_parameters() if is_adapter(n)]


def transposed_modules(model: torch.nn.Module) -> frozenset[str]:
    """The adapted modules whose base weight is stored [in, out] (peft's fan_in_fan_out, which peft sets itself on
    GPT-2's Conv1D): their merge adds (B A)^T, as peft's get_delta_weight does. Names as the model's parameters have
    them (trainer.push.adapter.merged_params)."""
    return frozenset(n for n, m in model.named_modules() if getattr(m, "fan_in_fan_out", False) and hasattr(m, "lora_A"))


def scaling(lora: LoraConfig) -> float:
    """peft's scaling of B @ A (not rank-stabilised): alpha / r."""
    return lora.scale_alpha / lora.r


def save_outputs(
    model: torch.nn.Module, lora: LoraConfig, base_model: str, job_dir: Path, dtype: torch.dtype, chat_template: str = ""
) -> list[Path]:
    """Collective (every rank gathers). Rank 0 writes the final adapter in peft's format into JOB/adapter (fp32, as
    trained: PeftModel.from_pretrained(base, JOB/adapter)) and, with trainer.lora.save_merged, the merged model into
    JOB/merged (in `dtype`, with the base's config and tokenizer files: from_pretrained-loadable), one unit at a time:
    each merged tensor goes to its place in the safetensors files as it comes (trainer.hf_folder), so rank 0 never
    holds the whole model; under the checkpoint's names (an MoE's experts one tensor each, checkpoint_names.to_saved)
    and with the run's chat template when trainer.chat_template is set. Returns what it wrote."""
    import torch.distributed as dist

    from launcher.core.jobdir import JobDir
    from trainer.checkpoint_names import saved_layout, to_saved
    from trainer.hf_folder import SafetensorsWriter, base_foreign_keys, carry_foreign, copy_model_files, fresh, replace
    from trainer.push.adapter import gather_adapter, merged_params, write_adapter
    from trainer.push.gather import iter_unsharded_params

    rank0 = dist.get_rank() == 0
    out = JobDir(job_dir)
    tensors = gather_adapter(model, torch.float32, keep=rank0)
    written = []
    if rank0:
        write_adapter(out.adapter, tensors, lora, base_model)
        written.append(out.adapter)
    if lora.save_merged:
        entries = [(b, tuple(p.shape)) for n, p in model.named_parameters() if (b := base_name(n)) is not None]
        tmp = fresh(out.merged) if rank0 else None
        writer = SafetensorsWriter(tmp, saved_layout(model, entries), dtype) if tmp is not None else None
        merged = merged_params(iter_unsharded_params(model, dtype), scaling(lora), dtype, transposed_modules(model))
        for n, t in to_saved(model, merged):  # every rank gathers
            if writer is not None:
                writer.write(n, t)
        if writer is not None and tmp is not None:
            writer.close()
            carry_foreign(base_model, tmp, base_foreign_keys(base_model))
            copy_model_files(base_model, tmp, dtype, chat_template)
            written.append(replace(tmp, out.merged))
    dist.barrier()
    return written
