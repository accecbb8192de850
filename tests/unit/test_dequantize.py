"""Quantized checkpoints: the plan refuses them with the fix, and `slurm-grpo dequantize` (trainer.dequantize, run
through the real CLI) turns a tiny MXFP4 gpt-oss and a tiny block-wise FP8 Qwen3, both encoded here from values the
format represents exactly, into bf16 folders holding exactly those values, which transformers and our sharded loader
load and the plan accepts."""

from __future__ import annotations

import functools
import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from launcher.core import config as C
from launcher.core.plan import plan

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
MXFP4 = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router"]}
FP8_BLOCK = [48, 80]
"""Smaller than the releases' 128 x 128 so the tiny matrices hold several blocks; not square (rows and columns not
swapped), and dividing none of 64, 128, 256, so the edge blocks are partial (as DeepSeek-V3's 576-row
kv_a_proj_with_mqa's are)."""
FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": FP8_BLOCK}


def job(model: Path | str) -> C.JobConfig:
    return C.from_dict({"vllm": {"model": str(model)}, "slurm": {"gpus_per_node": 4}})


def test_the_plan_refuses_a_quantized_model_naming_the_fix(tmp_path):
    body = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 128, "num_hidden_layers": 2}
    body |= {"intermediate_size": 64, "vocab_size": 300, "num_attention_heads": 2, "num_local_experts": 4}
    cases = {
        "oss": (body | {"quantization_config": MXFP4}, "mxfp4"),
        "fp8": (body | {"quantization_config": FP8}, "fp8"),
        "vl": (body | {"text_config": {"quantization_config": FP8}}, "fp8"),  # a multimodal model's text_config
    }
    for name, (config, method) in cases.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        src = f"{tmp_path / name}/"  # a trailing slash: the suggested folder is still SRC-bf16 beside it
        with pytest.raises(C.ConfigError) as e:
            plan(job(src), "/jobs/x")
        want = f"vllm.model {src} is quantized ({method}); the trainer needs full-precision weights: run "
        want += f"`slurm-grpo dequantize {src} {tmp_path / name}-bf16` and set vllm.model to {tmp_path / name}-bf16"
        assert str(e.value) == want
    spaced = tmp_path / "my model"  # the command stays one a shell runs as printed
    spaced.mkdir()
    (spaced / "config.json").write_text(json.dumps(cases["oss"][0]))
    with pytest.raises(C.ConfigError, match=re.escape(f"`slurm-grpo dequantize '{spaced}' '{spaced}-bf16'`")):
        plan(job(spaced), "/jobs/x")
    # methods dequantize does not convert (fp8 without blocks is per-tensor): the bf16 release is the way
    for q in ({"quant_method": "awq", "bits": 4}, {"quant_method": "fp8"}, {"quant_method": "compressed-tensors"}):
        (tmp_path / "config.json").write_text(json.dumps(body | {"quantization_config": q}))
        with pytest.raises(C.ConfigError, match=rf"is quantized \({q['quant_method']}\), .*use the model's bf16/fp16 release$"):
            plan(job(tmp_path), "/jobs/x")
    (tmp_path / "config.json").write_text(json.dumps(body))
    assert plan(job(tmp_path), "/jobs/x").config.vllm.model == str(tmp_path)
    (tmp_path / "config.json").unlink()  # a folder that lives on the nodes only: checked nowhere here
    assert plan(job(tmp_path / "elsewhere"), "/jobs/x")


def test_dequantize_help_says_what_it_writes_and_the_memory_it_needs():
    r = dequantize_cli("--help")
    text = " ".join(r.stdout.split())
    assert r.returncode == 0 and text.startswith("usage: slurm-grpo dequantize"), r.stdout + r.stderr
    assert "what vllm.model and the trainer load" in text and "memory about one output shard" in text, text


def save_split(tensors: dict, out: Path, second: set[str]) -> None:
    """The HF sharded layout: two safetensors files (`second` in the other one) and the index naming them."""
    from safetensors.torch import save_file

    files: dict[str, dict] = {"model-00001-of-00002.safetensors": {}, "model-00002-of-00002.safetensors": {}}
    for name, t in tensors.items():
        files["model-00002-of-00002.safetensors" if name in second else "model-00001-of-00002.safetensors"][name] = t
    for file, part in files.items():
        save_file(part, str(out / file), metadata={"format": "pt"})
    weight_map = {n: f for f, part in files.items() for n in part}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def quantized_copy(body: Path, src: Path, tensors: dict, second: set[str], q: dict) -> None:
    """SRC: body's every file but its weights, `tensors` split over two files, config.json with `q`."""
    src.mkdir()
    for f in body.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            (src / f.name).write_bytes(f.read_bytes())
    config = json.loads((body / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(config | {"quantization_config": q}))
    save_split(tensors, src, second)


def dequantize_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launcher", "dequantize", *args], capture_output=True, text=True, timeout=120)


def read_all(folder: Path) -> dict:
    from safetensors.torch import load_file

    out: dict = {}
    for f in sorted(folder.glob("*.safetensors")):
        out |= load_file(str(f))
    return out


def bits(t):
    """A tensor's bytes as integers: equal here means bit for bit (-0.0 differs from 0.0)."""
    import torch

    return t.contiguous().view(torch.uint8)


def check_copy(src: Path, dst: Path, body: dict, want: dict) -> None:
    """DST: body's tensor names, `want`'s tensors bit for bit, every other one as SRC stores it; config.json plain bf16;
    the other files copied; loaded by transformers with no key missing or left over; planned."""
    import torch
    from transformers import AutoModelForCausalLM

    got, stored = read_all(dst), read_all(src)
    assert sorted(got) == sorted(body)
    for name, t in got.items():
        ref = want.get(name, stored.get(name))
        assert ref is not None and t.dtype == ref.dtype and t.shape == ref.shape, (name, t.dtype, t.shape)
        assert torch.equal(bits(t), bits(ref)), f"{name} differs from what was encoded"
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(body)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in got.values())
    assert len(set(index["weight_map"].values())) > 1  # --max-shard-size split it
    config = json.loads((dst / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    for f in TOKENIZER_FILES:
        assert (dst / f).read_bytes() == (src / f).read_bytes(), f
    assert not list(dst.parent.glob("*.tmp-*"))
    loaded: Any = AutoModelForCausalLM.from_pretrained(dst, output_loading_info=True)  # (model, info) with the flag
    model, info = loaded
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    params = dict(model.named_parameters())
    for name, t in want.items():  # transformers' own parameter layout: the shapes from_config builds, the same values
        assert torch.equal(params[name].detach(), t), name
    assert plan(job(dst), "/jobs/x").config.vllm.model == str(dst)


def encode_mxfp4(param, gen):
    """Values MXFP4 holds exactly for a parameter of transformers' layout [E, C, R] (gate_up_proj [E, H, 2I]): stored
    transposed, [E, R, C], each row in blocks of 32 codes (4-bit indices into FP4_VALUES) sharing one exponent.
    Returns (the bf16 values, blocks [E, R, C/32, 16] with the even code in the low nibble, scales exponent + 127)."""
    import torch
    from transformers.integrations.mxfp4 import FP4_VALUES

    e, c, r = param.shape
    codes = torch.randint(0, 16, (e, r, c), generator=gen)
    exponents = torch.randint(-8, 3, (e, r, c // 32), generator=gen)
    values = torch.ldexp(torch.tensor(FP4_VALUES)[codes], exponents.repeat_interleave(32, dim=-1))
    pairs = codes.reshape(e, r, c // 32, 16, 2)
    blocks = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
    return values.transpose(1, 2).to(torch.bfloat16).contiguous(), blocks, (exponents + 127).to(torch.uint8)


def sharded_experts(rank: int, world: int, _port: int, model_dir: str) -> dict:
    import torch
    from torch.distributed.tensor import DTensor

    from tests.support.ranks import cpu_parallel
    from trainer.loading import load_model

    model, _ = load_model(model_dir, cpu_parallel(rank, world), torch.float32)
    full = {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in model.named_parameters() if p.dim() == 3}
    return {n: t.detach().numpy() for n, t in full.items()}  # numpy: by value (a torch tensor goes by a shared fd)


def test_dequantize_turns_an_mxfp4_gpt_oss_into_the_bf16_values_it_encodes(tmp_path):
    import torch
    from safetensors.torch import load_file

    from tests.support.ranks import run_ranks
    from trainer.tiny_model import make_tiny_model

    make_tiny_model(tmp_path / "body", family="gpt_oss", tie=False, dtype="bfloat16")
    body = load_file(str(tmp_path / "body" / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    tensors, want = dict(body), {}
    for name in [n for n in body if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        want[name], tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = encode_mxfp4(body[name], gen)
        del tensors[name]
    assert len(want) == 4, sorted(want)
    # layer 0's scales in the other file than their blocks: a pair is found through the index
    second = {n for n in tensors if n.startswith("model.layers.0.") == n.endswith("_scales")}
    src, dst = tmp_path / "gpt-oss", tmp_path / "out" / "gpt-oss-bf16"
    quantized_copy(tmp_path / "body", src, tensors, second, MXFP4)
    with pytest.raises(C.ConfigError, match=rf"quantized \(mxfp4\).*`slurm-grpo dequantize {src} {src}-bf16`"):
        plan(job(src), "/jobs/x")

    r = dequantize_cli(str(src), str(dst), "--max-shard-size", "200KB")
    assert r.returncode == 0, r.stderr
    progress = [line for line in r.stdout.splitlines() if line.startswith("[")]
    assert [line.split(" ", 1)[0] for line in progress] == ["[1/2]", "[2/2]"], r.stdout
    assert "tensors dequantized" in progress[0] and "GB written" in progress[0]
    check_copy(src, dst, body, want)
    experts = run_ranks(1, functools.partial(sharded_experts, model_dir=str(dst)))[0]
    assert sorted(experts) == sorted(want)
    assert all(torch.equal(torch.from_numpy(experts[n]), want[n].float()) for n in want)

    # a layout transformers' own model does not have is refused before anything is written (here: a config whose
    # experts are half as wide as the checkpoint's)
    from trainer.dequantize import DequantizeError, dequantize

    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(config | {"intermediate_size": 32}))
    with pytest.raises(
        DequantizeError, match=r"down_proj_blocks dequantizes to \S+ \[3, 64, 128\], but the model .* has \[3, 32, 128\]"
    ):
        dequantize(src, tmp_path / "narrow", 10**9)
    assert not (tmp_path / "narrow").exists() and not list(tmp_path.glob("narrow*"))

    again = dequantize_cli(str(src), str(dst))  # never overwrites
    assert again.returncode == 2 and "exists and is not empty" in again.stderr, again.stderr
    (src / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "gptq"}}))
    other = dequantize_cli(str(src), str(tmp_path / "gptq-bf16"))
    assert other.returncode == 2 and "quantized with gptq; dequantize converts mxfp4" in other.stderr, other.stderr
    assert not (tmp_path / "gptq-bf16").exists()


def encode_fp8(weight, gen, block: list[int]):
    """Random float8_e4m3fn codes (NaN's two codes made 0) and a power-of-two float32 scale per block (a partial block
    at the edges): (the bf16 values, the fp8 weight, weight_scale_inv [ceil(rows/b0), ceil(cols/b1)])."""
    import torch

    rows, cols = weight.shape
    raw = torch.randint(0, 256, (rows, cols), generator=gen, dtype=torch.uint8)
    raw[(raw & 0x7F) == 0x7F] = 0
    fp8 = raw.view(torch.float8_e4m3fn)
    grid = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    scales = torch.exp2(torch.randint(-6, 6, grid, generator=gen).float())
    values = fp8.float()
    for i in range(grid[0]):
        for j in range(grid[1]):
            values[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]] *= scales[i, j]
    return values.to(torch.bfloat16), fp8, scales


def test_dequantize_turns_a_block_fp8_qwen3_into_the_bf16_values_it_encodes(tmp_path):
    import torch
    from safetensors.torch import load_file

    from trainer.tiny_model import make_tiny_model

    make_tiny_model(tmp_path / "body", family="qwen3", tie=False, dtype="bfloat16")
    body = load_file(str(tmp_path / "body" / "model.safetensors"))
    gen = torch.Generator().manual_seed(1)
    tensors, want = dict(body), {}
    for name in [n for n in body if n.endswith("_proj.weight")]:
        want[name], tensors[name], tensors[f"{name}_scale_inv"] = encode_fp8(body[name], gen, FP8_BLOCK)
        tensors[name.removesuffix("weight") + "input_scale"] = torch.tensor(0.5)  # static activation scales go
    assert len(want) == 14, sorted(want)  # q, k, v, o, gate, up, down in 2 layers
    second = {n for n in tensors if n.startswith("model.layers.0.") == n.endswith("_scale_inv")}
    src, dst = tmp_path / "qwen3-fp8", tmp_path / "qwen3-fp8-bf16"
    quantized_copy(tmp_path / "body", src, tensors, second, FP8)
    with pytest.raises(C.ConfigError, match=rf"quantized \(fp8\).*`slurm-grpo dequantize {src} {src}-bf16`"):
        plan(job(src), "/jobs/x")

    r = dequantize_cli(str(src), str(dst), "--max-shard-size", "200KB")
    assert r.returncode == 0, r.stderr
    check_copy(src, dst, body, want)

    # scales that do not tile the weights by the config's blocks are refused from the headers, before a byte is written
    from trainer.dequantize import DequantizeError, dequantize

    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(config | {"quantization_config": FP8 | {"weight_block_size": [128, 128]}}))
    with pytest.raises(
        DequantizeError,
        match=r"down_proj.weight \[128, 256\] with weight_block_size \[128, 128\] needs \S+ of shape \[1, 2\], the checkpoint has \[3, 4\]",
    ):
        dequantize(src, tmp_path / "wrong", 10**9)
    assert not list(tmp_path.glob("wrong*"))
