"""A checkpoint of a job (checkpoints/step-N: DCP files of the fp32 parameter shards and AdamW, written by any number
of ranks) as a model Hugging Face and vLLM load, in one CPU process without a torch.distributed world: what
`slurm-grpo export JOB` runs on the login node (launcher.core.export resolves and checks the request).

    python -m trainer.export JOB [--step N] [--out DIR] [--merged] [--dtype bfloat16]

A full fine-tune gives a model folder like JOB/model (trainer.final_model): sharded safetensors in the run's
trainer.dtype, index, config, tokenizer, generation config. A LoRA run gives the adapter in peft's format (fp32, as
trained; like JOB/adapter), or with --merged the base with the adapter merged in (W + alpha/r B A in fp32, saved in
the dtype; like JOB/merged).

Bounded by the tensor, not the model: DCP reads back one whole tensor at a time from however many ranks' files hold
its rows (the checkpoint's metadata maps every row block to its file and offset), which is written at its place in
its safetensors file (hf_folder.SafetensorsWriter) and dropped. Peak memory: the largest tensor in fp32 plus its cast."""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from launcher.core.config import ConfigError, LoraConfig
from launcher.core.export import ExportRequest, resolve
from trainer import lora as trainer_lora
from trainer.checkpoint_names import foreign_keys, saved_layout, to_saved
from trainer.hf_folder import (
    SHARD_BYTES,
    SafetensorsWriter,
    aliases,
    carry_foreign,
    checkpoint_keys,
    copy_model_files,
    fresh,
    replace,
    saved_names,
    shard_file,
)


class CheckpointTensors:
    """The model's tensors in a checkpoint folder (the trainer saves {"model": ..., "optim": ...}; DCP names them
    "model.<name>"), each read whole on its own."""

    PREFIX = "model."

    def __init__(self, folder: Path):
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.folder = Path(folder)
        md = FileSystemReader(str(folder)).read_metadata()
        self.meta = {
            k.removeprefix(self.PREFIX): v
            for k, v in md.state_dict_metadata.items()
            if k.startswith(self.PREFIX) and isinstance(v, TensorStorageMetadata)
        }

    def read(self, name: str) -> torch.Tensor:
        import torch.distributed.checkpoint as dcp

        e = self.meta[name]
        t = torch.empty(tuple(e.size), dtype=e.properties.dtype)
        with warnings.catch_warnings():  # "torch.distributed is disabled ... assuming ... a single process": yes
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({self.PREFIX + name: t}, checkpoint_id=str(self.folder), no_dist=True)
        return t


def meta_model(base_model: str, lora: LoraConfig | None = None, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The trained model's structure, on the meta device (no memory): its names, shapes, ties; with LoRA, the peft
    model the trainer built (trainer.lora.apply)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(base_model)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if lora is not None:
        model = trainer_lora.apply(model, lora, dtype, base_model)  # type: ignore[assignment]
    return model


def write_model(
    tmp: Path,
    entries: list[tuple[str, tuple[int, ...]]],
    tensors: Iterator[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    max_bytes: int,
) -> None:
    """The safetensors files and index of `entries`, from `tensors` (any order), printing a line per finished file."""
    w = SafetensorsWriter(tmp, entries, dtype, max_bytes)
    t0 = time.time()
    for name, t in tensors:
        done = w.write(name, t)
        if done is not None:
            names = w.files[done]
            size = w.path(done).stat().st_size
            print(
                f"  {shard_file(done, w.count)} ({len([i for i in w.left if not w.left[i]])}/{w.count}): "
                f"{len(names)} tensors, {size / 1e9:.2f} GB ({size / 1e6:.1f} MB), {time.time() - t0:.1f} s",
                flush=True,
            )
    w.close()


def export_full(
    checkpoint: Path, base_model: str, out: Path, dtype: torch.dtype, max_bytes: int = SHARD_BYTES, chat_template: str = ""
) -> Path:
    """A full fine-tune's checkpoint as a model folder (JOB/model's layout: the checkpoint's names, an MoE's experts
    one tensor each; the run's trainer.chat_template when it set one)."""
    ck = CheckpointTensors(checkpoint)
    model = meta_model(base_model)
    foreign = foreign_keys(model, checkpoint_keys(base_model))  # first: it records the load's names (placement)
    entries = saved_names(model)
    names = aliases(model)
    source = {}
    for n, _ in entries:
        found = next((a for a in names.get(n, [n]) if a in ck.meta), None)
        if found is None:
            lora = any(trainer_lora.is_adapter(k) for k in ck.meta)
            raise ConfigError(
                f"{n} is not in the checkpoint {checkpoint}"
                + (
                    ": it holds LoRA adapters only; the job's config.yaml says it is a full fine-tune"
                    if lora
                    else f" (the model of {base_model} has it)"
                )
            )
        source[n] = found
    tmp = fresh(out)
    stream = to_saved(model, ((n, ck.read(source[n])) for n, _ in entries))
    write_model(tmp, saved_layout(model, entries), stream, dtype, max_bytes)
    carry_foreign(base_model, tmp, foreign, max_bytes)
    copy_model_files(base_model, tmp, dtype, chat_template)
    return replace(tmp, out)


def adapter_names(ck: CheckpointTensors, model: torch.nn.Module, checkpoint: Path) -> list[str]:
    want = [n for n, _ in trainer_lora.adapter_params(model)]
    missing = [n for n in want if n not in ck.meta]
    if missing:
        raise ConfigError(
            f"{checkpoint} lacks the adapter {missing[0]} ({len(missing)} of {len(want)} missing): was it written with "
            "these trainer.lora settings (r, target_modules)?"
        )
    return want


def export_adapter(checkpoint: Path, lora: LoraConfig, base_model: str, out: Path) -> Path:
    """A LoRA run's checkpoint as the adapter in peft's format, fp32 as trained (PeftModel.from_pretrained(base, out))."""
    from trainer.push.adapter import write_adapter

    ck = CheckpointTensors(checkpoint)
    names = adapter_names(ck, meta_model(base_model, lora), checkpoint)
    tensors = {trainer_lora.peft_file_name(n): ck.read(n) for n in names}
    out.parent.mkdir(parents=True, exist_ok=True)
    written = write_adapter(out, tensors, lora, base_model)
    print(f"  adapter_model.safetensors: {len(tensors)} tensors, {written / 1e6:.2f} MB", flush=True)
    return out


def export_merged(
    checkpoint: Path,
    lora: LoraConfig,
    base_model: str,
    out: Path,
    dtype: torch.dtype,
    max_bytes: int = SHARD_BYTES,
    chat_template: str = "",
) -> Path:
    """A LoRA run's checkpoint merged into its base, module by module, as a model folder (JOB/merged's weights): the
    base tensors read from the base model's safetensors one at a time, the adapters from the checkpoint, both in
    `dtype` as the trainer's merge has them (trainer.push.adapter.merged_params, the merged push's own code)."""
    from trainer.checkpoint_names import placement
    from trainer.loading import SafetensorsDir, fill_whole_tensor
    from trainer.push.adapter import merged_params

    ck = CheckpointTensors(checkpoint)
    store = SafetensorsDir(base_model)
    model = meta_model(base_model, lora, dtype)
    adapter_names(ck, model, checkpoint)
    names = aliases(model)
    params = list(model.named_parameters())
    entries = [(b, tuple(p.shape)) for n, p in params if (b := trainer_lora.base_name(n)) is not None]

    # where each base parameter is in the base's files (an MoE's fused experts: one file tensor per expert)
    places = placement(model.get_base_model(), list(store.tensors))  # type: ignore[operator]

    def base_tensor(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        stored = next((b for a in names.get(name, [name]) if (b := trainer_lora.base_name(a)) in places), None)
        if stored is None:
            raise ConfigError(f"{trainer_lora.base_name(name)} is not in the base model's files {base_model}")
        t = torch.empty(shape, dtype=dtype)
        fill_whole_tensor(store, stored, places[stored], t)
        return t

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        for n, p in params:
            yield n, (ck.read(n).to(dtype) if trainer_lora.is_adapter(n) else base_tensor(n, tuple(p.shape)))

    tmp = fresh(out)
    merged = to_saved(model, merged_params(stream(), trainer_lora.scaling(lora), dtype, trainer_lora.transposed_modules(model)))
    write_model(tmp, saved_layout(model, entries), merged, dtype, max_bytes)
    carry_foreign(base_model, tmp, foreign_keys(model, checkpoint_keys(base_model)), max_bytes)
    copy_model_files(base_model, tmp, dtype, chat_template)
    return replace(tmp, out)


def export(req: ExportRequest) -> Path:
    t = req.config.trainer
    dtype = getattr(torch, req.dtype)
    base = req.config.vllm.model
    if req.kind == "adapter":
        return export_adapter(req.checkpoint, t.lora, base, req.out)
    if req.kind == "merged":
        return export_merged(req.checkpoint, t.lora, base, req.out, dtype, chat_template=t.chat_template)
    return export_full(req.checkpoint, base, req.out, dtype, chat_template=t.chat_template)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer.export", description=__doc__.split("\n\n")[0])
    ap.add_argument("job", help="job folder")
    ap.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the newest)")
    ap.add_argument("--out", default=None, help="output folder (default: JOB/exports/step-N-KIND)")
    ap.add_argument("--merged", action="store_true", help="LoRA runs: the base with the adapter merged in")
    ap.add_argument("--dtype", default="", help="saved dtype (default: the run's trainer.dtype)")
    a = ap.parse_args(argv)
    t0 = time.time()
    try:
        req = resolve(Path(a.job), a.step, a.out, a.merged, a.dtype)
        out = export(req)
    except ConfigError as e:
        print(f"slurm-grpo export: error: {e}", file=sys.stderr)
        return 2
    what = "adapter (fp32)" if req.kind == "adapter" else f"{req.kind} in {req.dtype}"
    print(f"exported step {req.step} as {what} to {out} in {time.time() - t0:.1f} s", flush=True)
    if req.kind != "adapter":
        print(f"load it: AutoModelForCausalLM.from_pretrained({str(out)!r}); serve it: vllm serve {out}", flush=True)
    else:
        print(f"load it: PeftModel.from_pretrained(base, {str(out)!r}); base: {req.config.vllm.model}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
