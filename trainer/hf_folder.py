"""A model folder in Hugging Face's layout, the pieces both writers of one share (trainer.final_model at the end of a
run, trainer.export from a checkpoint): which tensors a folder holds and under which names, how they are split into
safetensors files (model-0000i-of-0000N.safetensors + model.safetensors.index.json), a safetensors file written one
tensor at a time, and the files besides the weights (config.json in the saved dtype, generation_config.json, the
tokenizer's files), copied from the base model's folder.

The dtype written is the trainer's (trainer.dtype: bf16 on GPUs, fp32 on CPU), the dtype the nodes' servers were
pushed and parity was measured in, so `vllm serve JOB/model` computes what the run's servers computed; config.json
says so (its `dtype`), which is what from_pretrained(dtype="auto") and vLLM's --dtype auto read."""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from collections.abc import Iterable
from pathlib import Path

import torch

SHARD_BYTES = 5 * 10**9
"""Largest safetensors file written, in bytes of the saved dtype: the Hugging Face Hub's convention (5 GB files)."""

INDEX = "model.safetensors.index.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".npz")
"""Files of the base model's folder that hold weights, never copied next to the trained ones."""

SAFETENSORS_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def shard_file(index: int, count: int) -> str:
    """transformers' (and torch.distributed.checkpoint's HF writer's) name of file `index` of `count` (from 1)."""
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def shard_plan(sizes: Iterable[tuple[str, int]], max_bytes: int = SHARD_BYTES) -> dict[str, int]:
    """name -> file index (from 1), filling files in order up to max_bytes each (a tensor larger than that gets a
    file of its own)."""
    plan: dict[str, int] = {}
    index, used = 1, 0
    for name, n in sizes:
        if used and used + n > max_bytes:
            index, used = index + 1, 0
        plan[name] = index
        used += n
    return plan


def saved_names(model: torch.nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """(name, full shape) of every tensor a Hugging Face folder of this model holds, in the model's order: every
    parameter once (a tied embedding under its first name, as save_pretrained drops the tied lm_head.weight) and every
    persistent buffer. Works on the meta device (shapes only); DTensor shapes are the global ones."""
    out = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    for mod_name, mod in model.named_modules():
        for b_name, b in mod.named_buffers(recurse=False):
            if b is not None and b_name not in mod._non_persistent_buffers_set:
                out.append((f"{mod_name}.{b_name}" if mod_name else b_name, tuple(b.shape)))
    return out


def aliases(model: torch.nn.Module) -> dict[str, list[str]]:
    """Every name of each parameter, keyed by its first name (a tied embedding: [model.embed_tokens.weight,
    lm_head.weight])."""
    by_id: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(n)
    return {names[0]: names for names in by_id.values()}


class SafetensorsWriter:
    """Safetensors files written one tensor at a time, in any order: each file's header (names, dtypes, shapes,
    offsets) is written first, then each tensor's bytes at its offset, so a writer holds one tensor, never a file's
    worth (safetensors.torch.save_file needs the whole file's tensors in memory). Files follow `shard_plan`; close()
    checks that every tensor came and writes the index. The format: 8 bytes little-endian header length, the JSON
    header (padded with spaces to 8 bytes), then the data."""

    def __init__(
        self,
        folder: Path,
        entries: list[tuple[str, tuple[int, ...]]],
        dtype: torch.dtype,
        max_bytes: int = SHARD_BYTES,
        create: bool = True,
    ):
        """create=False: the files exist (another process of a collective write created them); only the layout is
        computed, so this writer fills its share of the tensors in place."""
        self.folder, self.dtype = Path(folder), dtype
        size = torch.tensor([], dtype=dtype).element_size()
        self.shapes = dict(entries)
        plan = shard_plan(((n, math.prod(s) * size) for n, s in entries), max_bytes)
        self.count = max(plan.values(), default=1)
        self.files: dict[int, list[str]] = {}
        for name, i in plan.items():
            self.files.setdefault(i, []).append(name)
        self.where: dict[str, tuple[int, int]] = {}
        """name -> (file index, absolute byte offset of its data in that file)."""
        self.left = {i: set(names) for i, names in self.files.items()}
        self.total = 0
        for i, names in self.files.items():
            header: dict[str, object] = {"__metadata__": {"format": "pt"}}
            offsets, at = {}, 0
            for n in names:
                nbytes = math.prod(self.shapes[n]) * size
                header[n] = {"dtype": SAFETENSORS_DTYPE[dtype], "shape": list(self.shapes[n]), "data_offsets": [at, at + nbytes]}
                offsets[n] = at
                at += nbytes
            raw = json.dumps(header, separators=(",", ":")).encode()
            raw += b" " * (-len(raw) % 8)
            if create:
                with open(self.path(i), "wb") as f:
                    f.write(struct.pack("<Q", len(raw)) + raw)
                    f.truncate(8 + len(raw) + at)
            self.where.update({n: (i, 8 + len(raw) + off) for n, off in offsets.items()})
            self.total += at

    def path(self, index: int) -> Path:
        return self.folder / shard_file(index, self.count)

    def write(self, name: str, t: torch.Tensor) -> int | None:
        """Write one tensor (cast to the folder's dtype); returns the file index when that file is now complete."""
        i, at = self.where[name]
        if tuple(t.shape) != self.shapes[name]:
            raise ValueError(f"{name}: shape {tuple(t.shape)}, the folder's header says {self.shapes[name]}")
        data = t.detach().to("cpu", self.dtype).contiguous().reshape(-1)
        with open(self.path(i), "r+b") as f:
            f.seek(at)
            f.write(data.view(torch.uint8).numpy().tobytes())
        self.left[i].discard(name)
        return i if not self.left[i] else None

    def close(self) -> None:
        missing = sorted(n for names in self.left.values() for n in names)
        if missing:
            raise RuntimeError(f"{len(missing)} tensors were never written: {missing[:5]}")
        self.write_index()

    def write_index(self) -> None:
        weight_map = {n: shard_file(i, self.count) for i, names in self.files.items() for n in names}
        write_index(self.folder, weight_map, self.total)


def write_index(folder: Path, weight_map: dict[str, str], total_size: int) -> None:
    (Path(folder) / INDEX).write_text(json.dumps({"metadata": {"total_size": total_size}, "weight_map": weight_map}, indent=2))


EXTRA_FILE = "model-extra-{:05d}.safetensors"
"""The files of the base checkpoint's tensors the trained model does not hold (carry_foreign)."""


def carry_foreign(base_model: str | Path, out: Path, keys: list[str], max_bytes: int = SHARD_BYTES) -> None:
    """The base checkpoint's tensors named in `keys` (checkpoint_names.foreign_keys: untouched by training, e.g. a
    vision tower) copied as they are into `out`, in files of their own (EXTRA_FILE) added to its index, so the folder
    is the whole model its config.json names (`vllm serve` of a multimodal release needs its vision weights). One file's
    tensors in memory at a time."""
    if not keys:
        return
    from safetensors import safe_open
    from safetensors.torch import save_file

    base, out = Path(base_model), Path(out)
    index = out / INDEX
    if index.exists():
        written = json.loads(index.read_text())
        weight_map, total = written["weight_map"], written["metadata"]["total_size"]
    else:  # one file, no index (a small model's layout): index it now
        header = _header(out / "model.safetensors")
        weight_map = dict.fromkeys(header, "model.safetensors")
        total = sum(e["data_offsets"][1] - e["data_offsets"][0] for e in header.values())
    from launcher.core.weights import weight_files

    keys = [k for k in keys if k not in weight_map]  # never a second copy of a tensor the folder holds
    where = {}
    for f in weight_files(base):
        with safe_open(str(f), "pt") as g:
            where.update(dict.fromkeys(g.keys(), f))
    batch: dict[str, torch.Tensor] = {}
    used, count = 0, 0

    def flush() -> None:
        nonlocal batch, used, count
        if batch:
            count += 1
            save_file(batch, str(out / EXTRA_FILE.format(count)), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(batch, EXTRA_FILE.format(count)))
        batch, used = {}, 0

    for key in keys:
        with safe_open(str(where[key]), "pt") as g:
            t = g.get_tensor(key)
        if used and used + t.nbytes > max_bytes:
            flush()
        batch[key], used, total = t, used + t.nbytes, total + t.nbytes
    flush()
    write_index(out, weight_map, total)


def checkpoint_keys(model_dir: str | Path) -> list[str]:
    """Every tensor name of the safetensors files transformers and vLLM load from the folder (weight_files: a Mistral
    repo's consolidated.safetensors, another copy under other names, is not one of them)."""
    from launcher.core.weights import weight_files

    return [k for f in weight_files(Path(model_dir)) for k in _header(f)]


def base_foreign_keys(base_model: str | Path) -> list[str]:
    """checkpoint_names.foreign_keys of the base folder, on the model transformers builds from its config (on meta:
    no memory), never the trained one: an FSDP-wrapped model is another class to transformers, which then finds no
    name transforms for it (Qwen3.5's `model.language_model.` prefix: every key would look foreign)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.checkpoint_names import foreign_keys

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base_model), dtype=torch.float32)
    return foreign_keys(model, checkpoint_keys(base_model))


def _header(path: Path) -> dict[str, dict]:
    """A safetensors file's tensor entries (dtype, shape, data_offsets), from its JSON header."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def copy_model_files(base_model: str | Path, out: Path, dtype: torch.dtype, chat_template: str = "") -> None:
    """Everything of the base model's folder but its weights (config, tokenizer files, chat template, generation
    config, custom code), config.json saying the saved dtype, and a generation_config.json (made from the config when
    the base has none: transformers' GenerationConfig.from_model_config, as save_pretrained does). `chat_template`
    (trainer.chat_template: the Jinja text or a file holding it; "" keeps the base's) becomes the folder's template."""
    base = Path(base_model)
    for f in base.iterdir():
        hidden = f.name.startswith(".")  # .gitattributes, make-tiny-model's marker: not the model's
        if f.is_file() and not hidden and not f.name.endswith(WEIGHT_SUFFIXES) and not f.name.endswith(".index.json"):
            shutil.copy2(f, out / f.name)
    if chat_template:
        write_chat_template(out, chat_template)
    config = json.loads((base / "config.json").read_text())
    name = str(dtype).removeprefix("torch.")
    config["dtype"] = name  # transformers 5's key; older configs name it torch_dtype: both say the same
    if "torch_dtype" in config:
        config["torch_dtype"] = name
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if not (out / "generation_config.json").exists():
        from transformers import AutoConfig, GenerationConfig

        GenerationConfig.from_model_config(AutoConfig.from_pretrained(base)).save_pretrained(out)


def write_chat_template(out: Path, template: str) -> None:
    """The template the run trained with (trainer.chat_template) as the folder's only one, so `vllm serve` and
    AutoTokenizer render prompts as training did: chat_template.jinja (what save_pretrained writes), and no other
    template left to compete with it (tokenizer_config.json's `chat_template`, a chat_template.json)."""
    from launcher.core.config import ConfigError
    from launcher.core.inputs import is_inline_template

    path = Path(template).expanduser()
    if not is_inline_template(template) and not path.is_file():
        raise ConfigError(f"trainer.chat_template {template!r}: no such file here; the model folder needs the template")
    text = template if is_inline_template(template) else path.read_text()
    (out / "chat_template.jinja").write_text(text)
    (out / "chat_template.json").unlink(missing_ok=True)
    tok = out / "tokenizer_config.json"
    if tok.is_file():
        cfg = json.loads(tok.read_text())
        if cfg.pop("chat_template", None) is not None:
            tok.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def fresh(out: Path) -> Path:
    """An empty OUT.tmp next to `out`, where a folder is written before `replace` renames it into place."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True, mode=0o700)
    return tmp


def replace(tmp: Path, out: Path) -> Path:
    """OUT.tmp becomes OUT (an older OUT is removed first): a reader finds a complete folder or none."""
    if out.exists():
        shutil.rmtree(out)
    os.rename(tmp, out)
    return out
