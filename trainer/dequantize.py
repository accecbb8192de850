"""A bf16 copy of a quantized checkpoint, what vllm.model and the trainer load: the trainer trains full-precision
weights and vLLM must serve the same ones (a bf16 push into a quantized vLLM layer would not land exactly), so the plan
refuses a quantized folder (launcher.core.quantization) and names this command.

    slurm-grpo dequantize /models/gpt-oss-20b /models/gpt-oss-20b-bf16

Streams: the source's safetensors files are read tensor by tensor (safe_open), output tensors are gathered up to
--max-shard-size and written as one shard, so the peak memory is about one output shard plus the largest output
tensor (gpt-oss-120b's fused experts of one layer: 4.2 GB in bf16), never the model. The result is written into
DST.tmp-PID and renamed to DST at the end: a crash leaves no folder that looks complete.

mxfp4 (gpt-oss): each `X_blocks` (uint8 [E, R, C/32, 16], two 4-bit codes a byte) + `X_scales` (uint8 [E, R, C/32],
exponent + 127) pair becomes `X` in bf16 by transformers' own conversion (convert_moe_packed_tensors), which gives
transformers' parameter layout ([E, C, R]: gate_up_proj [E, H, 2I], down_proj [E, I, H]) that vLLM's unquantized
gpt-oss loader reads too. fp8 block-wise (DeepSeek-V3, Qwen3-*-FP8): each float8 `weight` times its
`weight_scale_inv` (float32 [ceil(out/b0), ceil(in/b1)]), each scale over its b0 x b1 block, in bf16; the activation
scales go. Every other tensor is copied as it is stored.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from launcher.core import quantization
from launcher.core.weights import WeightsError, safetensors_header, weight_files

if TYPE_CHECKING:  # torch is imported where a tensor is made: a refusal (and --help) answers at once
    import torch

INDEX = "model.safetensors.index.json"
ACTIVATION_SCALES = ("input_scale", "activation_scale")
"""fp8 checkpoints' static activation scales: they quantize a layer's input, which a bf16 layer does not do."""
STORED_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "BOOL": 1}
STORED_BYTES |= {"U64": 8, "U32": 4, "U16": 2, "U8": 1}


class DequantizeError(ValueError):
    """The source cannot be converted, or the destination is taken; the message says why and what to do."""


@dataclass(frozen=True)
class Output:
    """One tensor of the bf16 copy: `source` (and its scales `partner`) read, converted by `kind`."""

    name: str
    kind: str
    """copy (as stored), mxfp4 (source the _blocks, partner the _scales) or fp8 (source the weight, partner its
    weight_scale_inv)."""
    source: str
    partner: str
    shape: tuple[int, ...]
    nbytes: int
    """Bytes it takes in the copy."""


@dataclass(frozen=True)
class Source:
    """The source checkpoint read by headers only: which file holds each tensor, and what each input file gives."""

    file_of: dict[str, Path]
    outputs: dict[Path, list[Output]]
    """Per input file, in file order, the outputs whose source tensor is stored there (a partner may sit elsewhere)."""
    dropped: int

    @property
    def total_bytes(self) -> int:
        return sum(o.nbytes for outs in self.outputs.values() for o in outs)


def read_source(src: Path, q: dict) -> Source:
    """Every output tensor decided from the safetensors headers, before a byte is written: a `_blocks` without its
    `_scales`, or a float8 weight without its scale, fails here."""
    m = quantization.method(q)
    try:
        files = weight_files(src)
        headers = {f: safetensors_header(f) for f in files}
    except WeightsError as e:
        raise DequantizeError(str(e)) from None
    if not files:
        raise DequantizeError(f"{src} holds no *.safetensors weights; dequantize reads safetensors checkpoints")
    file_of = {name: f for f, h in headers.items() for name in h}
    shape_of = {name: tuple(entry["shape"]) for h in headers.values() for name, entry in h.items()}
    block = quantization.block_size(q) if m == "fp8" else (0, 0)
    outputs: dict[Path, list[Output]] = {}
    dropped = 0
    for f, header in headers.items():
        outs = outputs.setdefault(f, [])
        for name, entry in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            shape, dtype = tuple(entry["shape"]), entry["dtype"]
            numel = math.prod(shape)
            if m == "mxfp4" and name.endswith("_blocks"):
                partner = name.removesuffix("_blocks") + "_scales"
                if partner not in file_of:
                    raise DequantizeError(f"{f.name}: {name} has no {partner} in {src}; is the checkpoint complete?")
                if len(shape) != 4 or shape_of[partner] != shape[:-1]:
                    raise DequantizeError(
                        f"{name} {list(shape)} and {partner} {list(shape_of[partner])} are not an mxfp4 pair "
                        "([E, R, C/32, 16] codes, [E, R, C/32] exponents)"
                    )
                experts, r, g, b = shape  # two codes a byte: C = g x 2b; convert_moe_packed_tensors gives [E, C, R]
                outs.append(Output(name.removesuffix("_blocks"), "mxfp4", name, partner, (experts, g * b * 2, r), numel * 2 * 2))
            elif m == "mxfp4" and name.endswith("_scales"):
                if name.removesuffix("_scales") + "_blocks" not in file_of:
                    raise DequantizeError(f"{f.name}: {name} has no _blocks beside it in {src}; is the checkpoint complete?")
                dropped += 1  # read with its _blocks
            elif m == "fp8" and dtype.startswith("F8_") and not name.endswith("_scale_inv"):
                partner = name + "_scale_inv"
                if partner not in file_of:
                    raise DequantizeError(f"{f.name}: {name} is {dtype} without a {partner} in {src}")
                if len(shape) < 2 or shape_of[partner] != (*shape[:-2], *scale_grid(shape, block)):
                    raise DequantizeError(
                        f"{name} {list(shape)} with weight_block_size {list(block)} needs {partner} of shape "
                        f"{[*shape[:-2], *scale_grid(shape, block)]}, the checkpoint has {list(shape_of[partner])}"
                    )
                outs.append(Output(name, "fp8", name, partner, shape, numel * 2))
            elif m == "fp8" and (name.endswith("_scale_inv") or name.rsplit(".", 1)[-1] in ACTIVATION_SCALES):
                dropped += 1  # a weight's block scales (read with it) or an activation scale (no use in bf16)
            elif dtype.startswith("F8_") or dtype not in STORED_BYTES:
                raise DequantizeError(f"{f.name}: {name} is stored as {dtype}, which a {m} checkpoint should not hold")
            else:
                outs.append(Output(name, "copy", name, "", shape, numel * STORED_BYTES[dtype]))
    return Source(file_of, outputs, dropped)


def check_against_model(config: dict, source: Source, log: Callable[..., None]) -> None:
    """Each dequantized mxfp4 tensor has the shape of the parameter transformers builds from the bf16 config.json (on
    the meta device: no memory), checked before hours of converting: a layout transformers' conversion does not give
    its own model would load as garbage or not at all. A model transformers cannot build here is not checked."""
    mxfp4 = [o for outs in source.outputs.values() for o in outs if o.kind == "mxfp4"]
    if not mxfp4:
        return
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        cfg = AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items() if k != "model_type"})
        with torch.device("meta"):
            params = {n: tuple(p.shape) for n, p in AutoModelForCausalLM.from_config(cfg).named_parameters()}
    except Exception as e:  # noqa: BLE001 - any failure to build means: nothing to compare with
        log(f"the layout is not checked: transformers does not build {config.get('model_type')!r} here ({e})")
        return
    for o in mxfp4:
        if params.get(o.name) != o.shape:
            raise DequantizeError(
                f"{o.source} dequantizes to {o.name} {list(o.shape)}, but the model transformers builds from config.json "
                f"has {list(params[o.name]) if o.name in params else 'no such parameter'}; not converted"
            )


def mxfp4_to_bf16(blocks: Any, scales: Any, experts: int) -> torch.Tensor:
    """transformers' own conversion, one expert at a time into the output: its temporaries (an int32 index per code,
    the transposed copy) stay the size of one expert's, not the layer's. blocks/scales: safetensors slices."""
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    out: torch.Tensor | None = None
    for e in range(experts):
        one = convert_moe_packed_tensors(blocks[e : e + 1], scales[e : e + 1], dtype=torch.bfloat16)
        if out is None:
            out = torch.empty((experts, *one.shape[1:]), dtype=torch.bfloat16)
        out[e] = one[0]
    assert out is not None
    return out


def scale_grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """The fp8 scales' grid over a weight's last two dims: a block of block[0] x block[1] each, the edge ones partial."""
    return math.ceil(shape[-2] / block[0]), math.ceil(shape[-1] / block[1])


def fp8_to_bf16(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """weight x scale_inv, each scale over its block of the last two dims; the edge blocks may be partial (DeepSeek-V3's
    kv_a_proj_with_mqa: 576 rows in 5 blocks of 128). transformers' Fp8Dequantize (a loader op, not a function) derives
    the block from the scale grid, which a partial edge block breaks, so the block comes from the config here."""
    import torch

    rows, cols = weight.shape[-2:]
    assert tuple(scale_inv.shape) == (*weight.shape[:-2], *scale_grid(tuple(weight.shape), block)), "read_source checks"
    # uint8 scales are E8M0 exponents (a power of two, byte - 127), as transformers reads them
    s = torch.exp2(scale_inv.float() - 127) if scale_inv.dtype == torch.uint8 else scale_inv.float()
    s = s.repeat_interleave(block[0], dim=-2)[..., :rows, :].repeat_interleave(block[1], dim=-1)[..., :cols]
    return (weight.float() * s).to(torch.bfloat16)


class ShardWriter:
    """Output tensors held until the next one would pass max_bytes, then written as one safetensors file; the files
    get their model-0000k-of-0000n names (n known only then) and the index at close()."""

    def __init__(self, out: Path, max_bytes: int):
        self.out, self.max_bytes = out, max_bytes
        self.held: dict[str, torch.Tensor] = {}
        self.held_bytes = 0
        self.files: list[tuple[Path, list[str]]] = []
        self.written = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        if self.held and self.held_bytes + nbytes > self.max_bytes:
            self.flush()
        self.held[name] = t.contiguous()
        self.held_bytes += nbytes
        if self.held_bytes >= self.max_bytes:  # a tensor larger than a shard is one alone, written before the next comes
            self.flush()

    def flush(self) -> None:
        if not self.held:
            return
        from safetensors.torch import save_file

        path = self.out / f"part-{len(self.files):05d}.safetensors"
        save_file(self.held, str(path), metadata={"format": "pt"})
        self.files.append((path, list(self.held)))
        self.written += self.held_bytes
        self.held, self.held_bytes = {}, 0

    def close(self) -> None:
        self.flush()
        n = len(self.files)
        weight_map = {}
        for k, (path, names) in enumerate(self.files, 1):
            final = f"model-{k:05d}-of-{n:05d}.safetensors"
            path.rename(self.out / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self.written}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def bf16_config(config: dict) -> dict:
    """config.json without its quantization_config (the top level's and text_config's), its dtype bfloat16."""
    out = json.loads(json.dumps(config))  # a deep copy
    for c in (out, out.get("text_config")):
        if not isinstance(c, dict):
            continue
        c.pop("quantization_config", None)
        keys = [k for k in ("torch_dtype", "dtype") if k in c]
        for k in keys or (["dtype"] if c is out else []):
            c[k] = "bfloat16"
    return out


def is_weight_file(name: str) -> bool:
    return name.endswith((".safetensors", ".safetensors.index.json", ".bin", ".pt", ".pth"))


def check_destination(dst: Path) -> None:
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise DequantizeError(f"{dst} exists and is not empty; dequantize never overwrites: name a new folder")


def dequantize(src: Path, dst: Path, max_shard_bytes: int, log: Callable[..., None] = print) -> dict:
    """SRC's bf16 copy in DST (see the module's docstring); returns what it wrote."""
    t0 = time.time()
    try:
        config = json.loads((src / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise DequantizeError(f"{src}/config.json is unreadable ({e}); SRC must be a model folder") from None
    q = quantization.quantization_config(config)
    if q is None:
        raise DequantizeError(f"{src}/config.json has no quantization_config: nothing to dequantize, use it as it is")
    if not quantization.dequantizable(q):
        raise DequantizeError(
            f"{src} is quantized with {quantization.method(q)}; dequantize converts {quantization.CONVERTS}: "
            "use the model's bf16/fp16 release"
        )
    check_destination(dst)
    source = read_source(src, q)
    check_against_model(bf16_config(config), source, log)
    dst.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(dst.parent).free
    if source.total_bytes > free:
        raise DequantizeError(f"the bf16 copy takes {source.total_bytes / 1e9:.1f} GB, {dst.parent} has {free / 1e9:.1f} GB free")
    tmp = dst.parent / f"{dst.name}.tmp-{os.getpid()}"
    tmp.mkdir()
    try:
        done = _write(tmp, source, q, max_shard_bytes, log, t0)
        (tmp / "config.json").write_text(json.dumps(bf16_config(config), indent=2) + "\n")
        skipped = []
        for f in sorted(src.iterdir()):
            if f.name.startswith(".") or f.name == "config.json" or is_weight_file(f.name):
                continue
            if f.is_dir():  # gpt-oss's original/ and metal/: the same weights in other formats, none of them loaded
                skipped.append(f.name + "/")
                continue
            shutil.copy2(f, tmp / f.name)
        check_destination(dst)  # taken while converting?
        if dst.exists():
            dst.rmdir()
        tmp.rename(dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {**done, "not_copied": skipped, "seconds": round(time.time() - t0, 1)}


def _write(out: Path, source: Source, q: dict, max_shard_bytes: int, log: Callable[..., None], t0: float) -> dict:
    from safetensors import safe_open

    writer = ShardWriter(out, max_shard_bytes)
    block = quantization.block_size(q) if quantization.method(q) == "fp8" else (0, 0)
    converted = copied = 0
    with contextlib.ExitStack() as stack:
        opened: dict[Path, Any] = {}

        def reader(name: str) -> Any:
            f = source.file_of[name]
            if f not in opened:
                opened[f] = stack.enter_context(safe_open(str(f), framework="pt"))
            return opened[f]

        for k, (f, outs) in enumerate(source.outputs.items(), 1):
            for o in outs:
                writer.add(o.name, _convert(o, reader, block))
                converted += o.kind != "copy"
                copied += o.kind == "copy"
            log(
                f"[{k}/{len(source.outputs)}] {f.name}: {sum(o.kind != 'copy' for o in outs)} tensors dequantized, "
                f"{sum(o.kind == 'copy' for o in outs)} copied; {writer.written / 1e9:.2f} GB written, "
                f"{time.time() - t0:.0f} s",
                flush=True,
            )
        writer.close()
    log(f"{len(writer.files)} shards, {writer.written / 1e9:.2f} GB in all, {time.time() - t0:.0f} s", flush=True)
    return {"dequantized": converted, "copied": copied, "dropped": source.dropped, "bytes": writer.written}


def _convert(o: Output, reader: Callable[[str], Any], block: tuple[int, int]) -> torch.Tensor:
    if o.kind == "copy":
        return reader(o.source).get_tensor(o.source)
    if o.kind == "mxfp4":
        return mxfp4_to_bf16(reader(o.source).get_slice(o.source), reader(o.partner).get_slice(o.partner), o.shape[0])
    return fp8_to_bf16(reader(o.source).get_tensor(o.source), reader(o.partner).get_tensor(o.partner), block)


def parse_size(text: str) -> int:
    """'2GB', '500MB', '200KB' or bytes -> bytes (decimal units, as transformers' max_shard_size)."""
    t = text.strip().upper()
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3), ("B", 1)):
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * scale)
    return int(t)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="slurm-grpo dequantize",
        description=(
            "Write a bf16 copy of a quantized checkpoint (quantization_config in config.json): "
            f"{quantization.CONVERTS}. The copy (safetensors shards, index, config.json without quantization_config, "
            "the tokenizer and every other top-level file) is what vllm.model and the trainer load: the plan refuses "
            "the quantized folder. Streams tensor by tensor: memory about one output shard (--max-shard-size) plus "
            "the largest output tensor (gpt-oss-120b: ~7 GB in all with the default 2GB); disk: the bf16 size "
            "(about 4x an mxfp4 expert's bytes, 2x an fp8 weight's). Never overwrites DST."
        ),
    )
    ap.add_argument("src", help="the quantized model folder")
    ap.add_argument("dst", help="the new folder for the bf16 copy (must not exist, or be empty)")
    ap.add_argument("--max-shard-size", default="2GB", help="output safetensors file size, e.g. 5GB (default 2GB)")
    a = ap.parse_args(argv)
    try:
        max_bytes = parse_size(a.max_shard_size)
    except ValueError:
        ap.error(f"--max-shard-size {a.max_shard_size!r}: give a size such as 2GB or 500MB")
    try:
        info = dequantize(Path(a.src), Path(a.dst), max_bytes)
    except DequantizeError as e:
        print(f"slurm-grpo dequantize: error: {e}", file=sys.stderr)
        return 2
    print(f"bf16 copy in {a.dst}: {info}; set vllm.model: {a.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
