"""The final model of a full fine-tune in Hugging Face's format (trainer.save_model), written into JOB/model by the
ranks that trained it, bounded by the shard: torch.distributed.checkpoint's own Hugging Face writer
(HuggingFaceStorageWriter, save_distributed) has every rank write its own shards, in trainer.dtype, into
model.tmp/sharded/; then every rank consolidates a share of the output files, one full tensor at a time
(torch's consolidate_safetensors_files_on_every_rank, which also writes the index); rank 0 adds config, tokenizer and
generation config and renames the folder into place. No rank ever holds the whole model: a rank's extra memory is its
shards cast to the saved dtype (nothing in fp32) while it writes, then one tensor while it consolidates.
An MoE (transformers' fused experts) is consolidated under the model's names first, then every rank rewrites a share
of the files under the checkpoint's names and layout, one expert matrix per tensor (write_saved_layout), so `vllm serve`
and from_pretrained read it as any checkpoint; the extra disk is the fused copy, removed after.
torchtitan writes its Hugging Face checkpoints the same way (its checkpoint.last_save_in_hf)."""

from __future__ import annotations

import math
import os
import shutil
import time
from pathlib import Path

import torch

from trainer.checkpoint_names import as_saved, saved_layout
from trainer.hf_folder import (
    SHARD_BYTES,
    SafetensorsWriter,
    base_foreign_keys,
    carry_foreign,
    copy_model_files,
    fresh,
    replace,
    saved_names,
    shard_file,
    shard_plan,
)


def save(
    model: torch.nn.Module,
    dtype: torch.dtype,
    base_model: str,
    out: Path,
    max_bytes: int = SHARD_BYTES,
    chat_template: str = "",
) -> Path:
    """Collective (every rank calls it). Writes `out` (JOB/model) from the FSDP2-sharded `model` in `dtype`; the files
    besides the weights come from the base model's folder `base_model`, the chat template from `chat_template`
    (trainer.chat_template) when set. Returns `out`."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files_on_every_rank
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    t0 = time.time()
    rank0 = dist.get_rank() == 0
    tmp = out.with_name(out.name + ".tmp")
    if rank0:
        fresh(out)
    dist.barrier()
    shapes = dict(saved_names(model))
    msd = get_model_state_dict(model)  # this rank's shards (DTensors), under the model's own names
    missing = sorted(set(shapes) - set(msd))
    assert not missing, f"the model's state dict lacks {missing[:5]}"
    # each rank casts its own shards; the tied lm_head.weight (a second name of the embedding) is not written
    state = {n: t.detach().to(dtype) for n, t in msd.items() if n in shapes and isinstance(t, torch.Tensor)}
    del msd
    size = torch.tensor([], dtype=dtype).element_size()
    plan = shard_plan(((n, math.prod(s) * size) for n, s in shapes.items()), max_bytes)
    sharded = tmp / "sharded"
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(str(sharded), fqn_to_index_mapping=plan, save_distributed=True))
    del state
    # an MoE's fused experts are consolidated under the model's names first, then split into the checkpoint's
    layout = saved_layout(model, list(shapes.items()))
    fused = tmp / "fused" if [n for n, _ in layout] != list(shapes) else tmp
    fused.mkdir(exist_ok=True)
    # ends with a barrier; rank 0 writes model.safetensors.index.json
    consolidate_safetensors_files_on_every_rank(str(sharded), str(fused), plan)
    if fused != tmp:
        write_saved_layout(model, fused, plan, shapes, layout, dtype, tmp, max_bytes)
    if rank0:
        shutil.rmtree(sharded)
        carry_foreign(base_model, tmp, base_foreign_keys(base_model), max_bytes)
        copy_model_files(base_model, tmp, dtype, chat_template)
        replace(tmp, out)
        files = len({n for n in os.listdir(out) if n.endswith(".safetensors")})
        gb = sum(math.prod(s) for s in shapes.values()) * size / 1e9
        print(
            f"final model: {out} ({files} safetensors file(s), {gb:.3f} GB in {str(dtype).removeprefix('torch.')}) "
            f"in {time.time() - t0:.1f} s; serve it: vllm serve {out}",
            flush=True,
        )
    dist.barrier()
    return out


def write_saved_layout(
    model: torch.nn.Module,
    fused: Path,
    plan: dict[str, int],
    shapes: dict[str, tuple[int, ...]],
    layout: list[tuple[str, tuple[int, ...]]],
    dtype: torch.dtype,
    out: Path,
    max_bytes: int,
) -> None:
    """Collective. The consolidated folder `fused` (the model's names, an MoE's experts fused) rewritten into `out`
    under the checkpoint's names and layout (checkpoint_names.as_saved: what save_pretrained writes, what vLLM and
    from_pretrained read), then removed. Rank 0 lays the files out; each rank fills the output files of its share
    (no two ranks write one file), reading one consolidated tensor at a time."""
    import torch.distributed as dist
    from safetensors import safe_open

    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        SafetensorsWriter(out, layout, dtype, max_bytes)
    dist.barrier()
    w = SafetensorsWriter(out, layout, dtype, max_bytes, create=False)
    file_of = {n: i for i, names in w.files.items() for n in names}
    mine = {i for i in w.files if (i - 1) % world == rank}
    count = max(plan.values(), default=1)
    for name, index in plan.items():
        if not any(file_of[k] in mine for k, _ in saved_layout(model, [(name, shapes[name])])):
            continue
        with safe_open(str(fused / shard_file(index, count)), "pt") as f:
            tensor = f.get_tensor(name)
        for k, t in as_saved(model, name, tensor).items():
            if file_of[k] in mine:
                w.write(k, t)
        del tensor
    dist.barrier()
    if rank == 0:
        w.write_index()
        shutil.rmtree(fused)
