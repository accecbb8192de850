"""Loading a model bounded by the shard, not the model: build it on the meta device, shard it with FSDP2, then
fill each rank's shards straight from the checkpoint's safetensors files. No rank ever holds a full copy.

Why every rank reads its own rows (and not "the node leader reads, then scatters"): FSDP2 shards every
parameter on dim 0, and a safetensors tensor is stored row-major, so a rank's shard is one contiguous byte range
of the file: one positioned read per tensor. The node as a whole reads the model once (as a leader would), the
ranks read in parallel, nothing crosses the node's links, and no leader holds a tensor the others wait for.
The reads go through `readinto` of a buffer the size of the slice, not `mmap`: mapped file pages count towards
the process's resident memory, a buffer is freed as soon as its rows are copied into the shard.

What `from_pretrained` does besides reading weights is done the same way here, so the result is bit for bit
the same (tests/unit/test_loading.py): the model class and dtype from `from_config`, the tied embedding (one
parameter under two names; it is read under whichever name the checkpoint holds), and the non-persistent
buffers (rotary caches), which no checkpoint holds: transformers' own `_init_weights` computes them on the
module that owns them, as `from_pretrained` does."""

from __future__ import annotations

import json
import math
import struct
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from launcher.core.config import LoraConfig
from trainer import lora as trainer_lora
from trainer import parallel, trl_glue
from trainer.checkpoint_names import NamesError, Piece, placement
from trainer.parallel import Parallel

SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class LoadError(RuntimeError):
    """The checkpoint does not match the model built from its config; the message holds the fix."""


@dataclass(frozen=True)
class StoredTensor:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    """Byte offset of the tensor's first element in the file."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.dtype.itemsize


class SafetensorsDir:
    """The tensors of a model folder's safetensors files (one file, or shards listed by model.safetensors.index.json),
    read by rows without mapping the files."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        files = sorted(self.dir.glob("*.safetensors"))
        if not files:
            raise LoadError(
                f"no *.safetensors file in {self.dir}: the sharded loader reads safetensors checkpoints; "
                "convert the model (save_pretrained(safe_serialization=True)) or set trainer.model_loading=full"
            )
        self.tensors: dict[str, StoredTensor] = {}
        for f in files:
            self.tensors.update(self._header(f))

    @staticmethod
    def _header(path: Path) -> dict[str, StoredTensor]:
        # the format: 8 bytes little-endian header length, a JSON header, then the data (offsets relative to it)
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        out = {}
        for name, e in header.items():
            if name == "__metadata__":
                continue
            if e["dtype"] not in SAFETENSORS_DTYPES:
                raise LoadError(f"{path}: tensor {name} has dtype {e['dtype']}, which the sharded loader does not read")
            out[name] = StoredTensor(path, SAFETENSORS_DTYPES[e["dtype"]], tuple(e["shape"]), 8 + n + e["data_offsets"][0])
        return out

    def read_rows(self, name: str, first: int, stop: int) -> torch.Tensor:
        """Rows [first, stop) of dim 0 (the whole tensor for a 0-d one), in the stored dtype."""
        t = self.tensors[name]
        shape = (stop - first, *t.shape[1:]) if t.shape else ()
        size = math.prod(shape) * t.dtype.itemsize
        if size == 0:
            return torch.empty(shape, dtype=t.dtype)
        buf = bytearray(size)  # the tensor below is a view of it: one allocation, freed with the tensor
        with open(t.file, "rb", buffering=0) as f:
            f.seek(t.start + first * t.row_bytes)
            got = f.readinto(buf)
        if got != size:
            raise LoadError(f"{t.file}: tensor {name} is truncated (read {got} of {size} bytes)")
        return torch.frombuffer(buf, dtype=t.dtype).reshape(shape)


def rows_owned(p: torch.Tensor) -> tuple[int, int]:
    """The rows [first, stop) of the full tensor that this rank's shard holds (FSDP2 shards on dim 0 only)."""
    if not isinstance(p, DTensor):
        return 0, (p.shape[0] if p.dim() else 0)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    if any(offset[1:]) or tuple(local_shape[1:]) != tuple(p.shape[1:]):
        raise LoadError(f"a shard of shape {tuple(local_shape)} at {tuple(offset)} is not a block of rows; FSDP2 shards on dim 0")
    return offset[0], offset[0] + local_shape[0]


def aliases(model: torch.nn.Module) -> dict[int, list[str]]:
    """Every name of every parameter (a tied embedding has two), keyed by the parameter's identity."""
    names: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    return names


def persistent_buffers(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for mod_name, mod in model.named_modules():
        for b_name, b in mod.named_buffers(recurse=False):
            if b_name not in mod._non_persistent_buffers_set:
                yield (f"{mod_name}.{b_name}" if mod_name else b_name), b


@torch.no_grad()
def fill_from_checkpoint(
    model: torch.nn.Module,
    store: SafetensorsDir,
    rename: Callable[[str], str | None] = str,
    places: dict[str, list[Piece]] | None = None,
) -> int:
    """Copy every parameter's and persistent buffer's owned rows from the checkpoint; returns the bytes read.
    rename: the checkpoint's name of a model name, None for one no checkpoint holds (a LoRA adapter: trainer.lora).
    places: where each (renamed) name's tensors are in the checkpoint (trainer.checkpoint_names.placement, made on the
    model as transformers built it); default: under the same name, whole."""
    read = 0
    names = aliases(model)
    places = places if places is not None else {k: [Piece(k)] for k in store.tensors}
    targets: list[tuple[list[str], torch.Tensor]] = [(names[id(p)], p) for _, p in model.named_parameters()]
    targets += [([n], b) for n, b in persistent_buffers(model)]
    targets = [([r for r in map(rename, c) if r is not None], t) for c, t in targets]
    for candidates, t in targets:
        if not candidates:
            continue
        name = next((n for n in candidates if n in places), None)
        if name is None:
            raise LoadError(
                f"{' / '.join(candidates)} is not in the checkpoint {store.dir}: its tensor names differ from the model's "
                "(a checkpoint that needs renaming on load); set trainer.model_loading=full to load it with from_pretrained"
            )
        first, stop = rows_owned(t)
        local = t.to_local() if isinstance(t, DTensor) else t
        pieces = places[name]
        if pieces[0].expert is None:
            read += _fill_whole(store, pieces[0].key, t, local, first, stop)
        else:
            read += _fill_experts(store, name, pieces, t, local, first, stop)
    return read


def fill_whole_tensor(store: SafetensorsDir, name: str, pieces: list[Piece], t: torch.Tensor) -> int:
    """All of a (plain, unsharded) tensor `t` from its checkpoint pieces (placement), in t's dtype; returns the bytes
    read: one checkpoint tensor in memory at a time beside `t` (trainer.export's merge of a LoRA run)."""
    if pieces[0].expert is None:
        return _fill_whole(store, pieces[0].key, t, t, 0, t.shape[0] if t.dim() else 0)
    return _fill_experts(store, name, pieces, t, t, 0, t.shape[0])


def _fill_whole(store: SafetensorsDir, key: str, t: torch.Tensor, local: torch.Tensor, first: int, stop: int) -> int:
    stored = store.tensors[key]
    if tuple(stored.shape) != tuple(t.shape):
        raise LoadError(f"{key}: the checkpoint holds shape {stored.shape}, the model built from config.json {tuple(t.shape)}")
    src = store.read_rows(key, first, stop)
    local.copy_(src.reshape(local.shape))  # converts the stored dtype to the master dtype
    return src.numel() * src.element_size()


def _fill_experts(
    store: SafetensorsDir, name: str, pieces: list[Piece], t: torch.Tensor, local: torch.Tensor, first: int, stop: int
) -> int:
    """A fused expert parameter [E, slots x R, ...] from per-expert tensors [R, ...]: the rank's experts [first, stop)
    only, each read whole (one expert matrix at a time: contiguous on disk, freed after its copy)."""
    read = 0
    rows = t.shape[1] // pieces[0].slots
    for p in pieces:
        assert p.expert is not None
        if not first <= p.expert < stop:
            continue
        stored = store.tensors[p.key]
        if len(pieces) // pieces[0].slots != t.shape[0] or tuple(stored.shape) != (rows, *t.shape[2:]):
            raise LoadError(
                f"{p.key} {stored.shape}: does not fit expert {p.expert} of {name} {tuple(t.shape)} "
                f"(the model built from config.json; {len(pieces)} per-expert tensors in the checkpoint)"
            )
        src = store.read_rows(p.key, 0, rows)
        local[p.expert - first, p.slot * rows : (p.slot + 1) * rows].copy_(src)
        read += src.numel() * src.element_size()
    return read


@torch.no_grad()
def init_nonpersistent_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Rotary caches, Gemma's embedding scale and the like: made on `device` and computed by transformers'
    `_init_weights`, on the modules that own them and then on their ancestors, children before parents as
    from_pretrained's initialisation runs: an ancestor may set a descendant's buffer (Falcon-H1's model sets every
    mixer's `mup_vector`). During each call every parameter and persistent buffer under the module is swapped out for
    a meta tensor (Gemma's scaled embedding owns its weight), so the initialisation touches nothing loaded."""
    owners = [m for m in model.modules() if any(m._buffers.get(b) is not None for b in m._non_persistent_buffers_set)]
    if not owners:
        return
    for mod in owners:
        for b in mod._non_persistent_buffers_set:
            if mod._buffers.get(b) is not None:
                mod._buffers[b] = torch.empty_like(mod._buffers[b], device=device)  # type: ignore[arg-type]
    owner_ids = {id(o) for o in owners}
    order = [m for m in reversed(list(model.modules())) if any(id(d) in owner_ids for d in m.modules())]
    init_by = _init_models(model)
    for mod in order:  # descendants before ancestors (reversed pre-order)
        by = init_by[id(mod)]
        if by is None and id(mod) not in owner_ids:
            continue  # a peft wrapper around the transformers model: from_pretrained never initialises it
        with _loaded_swapped_out(mod):
            trl_glue.init_module_weights(by or model, mod)


def _init_models(model: torch.nn.Module) -> dict[int, torch.nn.Module | None]:
    """id(module) -> the model whose `_init_weights` transformers runs on it: the innermost PreTrainedModel around it
    (itself included), as from_pretrained's `smart_apply` dispatches (Gemma-3n's text model reads its own hidden_size);
    None above the outermost one (a peft wrapper)."""
    from transformers import PreTrainedModel

    out: dict[int, torch.nn.Module | None] = {}

    def walk(m: torch.nn.Module, by: torch.nn.Module | None) -> None:
        by = m if isinstance(m, PreTrainedModel) else by
        out[id(m)] = by
        for c in m.children():
            walk(c, by)

    walk(model, None)
    return out


@contextmanager
def _loaded_swapped_out(module: torch.nn.Module) -> Iterator[None]:
    """Every parameter and persistent buffer under `module` replaced by a meta tensor of its shape, restored after."""
    saved = []
    for m in module.modules():
        params, bufs = dict(m._parameters), dict(m._buffers)
        saved.append((m, params, bufs))
        for k, p in params.items():
            if p is not None:
                m._parameters[k] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), p.requires_grad)
        for k, b in bufs.items():
            if b is not None and k not in m._non_persistent_buffers_set:
                m._buffers[k] = torch.empty(b.shape, dtype=b.dtype, device="meta")
    try:
        yield
    finally:
        for m, params, bufs in saved:  # the non-persistent buffers keep what the initialisation gave them
            m._parameters.update(params)
            m._buffers.update({k: b for k, b in bufs.items() if k not in m._non_persistent_buffers_set})


@dataclass(frozen=True)
class LoadReport:
    seconds: float
    bytes_read: int
    loader: str


def load_model(
    model_dir: str,
    par: Parallel,
    param_dtype: torch.dtype,
    *,
    loader: str = "sharded",
    activation_checkpointing: bool = False,
    cpu_offload: bool = False,
    lora: LoraConfig | None = None,
    seed: int = 0,
    attn_implementation: str = "",
    read_weights: bool = True,
) -> tuple[Any, LoadReport]:
    """The model sharded with FSDP2 on the plan's mesh, fp32 master weights, ready to train.

    loader "sharded": meta device, shard, fill each rank's rows (peak: this rank's shard plus one tensor's rows).
    loader "full": `from_pretrained` of the whole model on every rank, then shard (peak: the whole fp32 model per
    rank); kept for checkpoints that transformers converts in ways not read row-wise (trainer.checkpoint_names).
    lora (enabled): peft adapters added before sharding, the base frozen in param_dtype (trainer.lora).
    attn_implementation: transformers' attention for the model (trainer.attn_implementation; '' = its own choice).
    read_weights False (loader "sharded"): the shards allocated, not filled, for a resume whose checkpoint replaces every
    parameter and persistent buffer (checkpoint.load refuses one it lacks): 5.6 GB of a 2.8 B body's reads saved."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    t0 = time.time()
    attention = {"attn_implementation": attn_implementation} if attn_implementation else {}
    if loader == "full":
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **attention)
        read = sum(p.numel() * 4 for p in model.parameters())
        _prepare(model, activation_checkpointing)
        if lora is not None and lora.enabled:
            model = trainer_lora.apply(model, lora, param_dtype, model_dir)  # type: ignore[assignment]
        if not cpu_offload:
            model = model.to(par.device)  # type: ignore[arg-type]
        parallel.shard_model(model, par, param_dtype, cpu_offload=cpu_offload)
        if cpu_offload:
            for mod in model.modules():  # buffers stay where the compute is
                for b, v in mod._buffers.items():
                    if v is not None:
                        mod._buffers[b] = v.to(par.device)
        if lora is not None and lora.enabled:
            trainer_lora.init_adapters(model, seed)
        return model, LoadReport(time.time() - t0, read, loader)
    store = SafetensorsDir(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **attention)
    try:  # on the model as transformers built it (names as from_pretrained gives them), before LoRA wraps it
        places = placement(model, list(store.tensors))
    except NamesError as e:
        raise LoadError(str(e)) from None
    if (Path(model_dir) / "generation_config.json").exists():
        model.generation_config = GenerationConfig.from_pretrained(model_dir)
    _prepare(model, activation_checkpointing)
    with_lora = lora is not None and lora.enabled
    if with_lora:
        assert lora is not None
        model = trainer_lora.apply(model, lora, param_dtype, model_dir)  # type: ignore[assignment]
    parallel.shard_model(model, par, param_dtype, cpu_offload=cpu_offload)
    # offloaded shards live in host memory (FSDP2 copies each unit to the GPU for its compute)
    model.to_empty(device=torch.device("cpu") if cpu_offload else par.device)
    read = fill_from_checkpoint(model, store, trainer_lora.base_name if with_lora else str, places) if read_weights else 0
    if with_lora:
        trainer_lora.init_adapters(model, seed)
    init_nonpersistent_buffers(model, par.device)
    model.eval()  # as from_pretrained returns it; the Trainer switches to train mode
    return model, LoadReport(time.time() - t0, read, loader)


def _prepare(model: torch.nn.Module, activation_checkpointing: bool) -> None:
    if activation_checkpointing:
        # transformers' per-decoder-layer checkpointing; non-reentrant, the variant that composes with FSDP2's hooks
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # type: ignore[operator]
