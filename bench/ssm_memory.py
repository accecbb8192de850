"""What an SSM, Gated DeltaNet or short-conv decoder layer keeps for its backward in training, measured, next to the
memory estimate's term for it (LayerKind.act_bytes, launcher/core/layer_kinds.py; dry-run and simulate use it):

    python -m bench.ssm_memory --device cuda [--tokens 8192] [--out DIR]     # released widths, one GPU
    python -m bench.ssm_memory --small                                       # hidden 256, on this machine's CPU

Each body is two layers of one kind at a released model's widths (Mamba-Codestral-7B's Mamba-2, Jamba-v0.1's Mamba,
Qwen3-Next-80B's Gated DeltaNet, LFM2-1.2B's short convolution), bf16, in train mode, one forward over `tokens` tokens:
the bytes of the tensors saved for the backward inside the decoder layers (each storage once, the weights left out),
per token and layer, against the estimate's term. On CUDA transformers uses mamba-ssm / causal-conv1d /
flash-linear-attention where they are installed and its PyTorch path otherwise (the estimate models the PyTorch path;
the table names which kernels were importable), and the CUDA allocator's growth over the forward is given beside."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

from launcher.core.shape import ModelShape

BODIES: dict[str, tuple[str, dict]] = {
    # name: (model_type, config.json fields at released widths; 2 layers of the one kind)
    "mamba2 (Mamba-Codestral-7B)": (
        "mamba2",
        {"hidden_size": 4096, "num_heads": 128, "head_dim": 64, "n_groups": 8, "state_size": 128, "chunk_size": 256},
    ),
    "mamba (Jamba-v0.1)": (
        "jamba",
        {
            "hidden_size": 4096,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "intermediate_size": 14336,
            "num_experts": 1,
            "attn_layer_period": 8,
            "attn_layer_offset": 4,
            "mamba_d_state": 16,
            "mamba_dt_rank": 256,
        },
    ),  # fmt: skip
    "gated_deltanet (Qwen3-Next-80B)": (
        "qwen3_5_text",
        {
            "hidden_size": 2048,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "head_dim": 256,
            "intermediate_size": 512,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "layer_types": ["linear_attention"] * 2,
        },
    ),  # fmt: skip
    "short_conv (LFM2-1.2B)": (
        "lfm2",
        {
            "hidden_size": 2048,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "intermediate_size": 12288,
            "block_dim": 2048,
            "conv_dim": 2048,
            "conv_dim_out": 2048,
            "layer_types": ["conv"] * 2,
            "full_attn_idxs": [],
        },
    ),  # fmt: skip
}
SMALL = {"hidden_size": 256, "num_heads": 8, "head_dim": 64, "intermediate_size": 512, "linear_num_key_heads": 2,
         "linear_num_value_heads": 4, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
         "block_dim": 256, "conv_dim": 256, "conv_dim_out": 256, "mamba_dt_rank": 16, "num_attention_heads": 4,
         "num_key_value_heads": 2}  # fmt: skip
"""--small: the widths that shrink (hidden 256), so the CPU runs each body in seconds."""
KERNELS = ("mamba_ssm", "causal_conv1d", "fla")


def measure(family: str, fields: dict, tokens: int, device: str) -> dict:
    """One body: saved bytes per token and layer inside the decoder layers, the estimate's term, the CUDA growth."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {"num_hidden_layers": 2, "vocab_size": 256, "tie_word_embeddings": True, **fields}
    if family == "qwen3_5_text" and fields["hidden_size"] < 2048:
        fields["head_dim"] = 64
    cfg = AutoConfig.for_model(family, **fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(device=device, dtype=torch.bfloat16).train()
    layers = [m for n, m in model.named_modules() if n.rsplit(".", 1)[-1].isdigit() and ".layers." in f".{n}"]
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}
    inside = [False]

    def keep(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if inside[0] and ptr not in weights:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    for layer in layers:
        layer.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
        layer.register_forward_hook(lambda *_: inside.__setitem__(0, False))
    ids = torch.randint(0, 256, (1, tokens), device=device)
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        out = model(input_ids=ids, use_cache=False)
    grown = (torch.cuda.memory_allocated() - before - out.logits.numel() * 2) if cuda else None
    shape = ModelShape.from_config(json.loads(cfg.to_json_string()))
    assert isinstance(shape, ModelShape) and len(shape.kinds) == 1, shape
    per = sum(saved.values()) / tokens / len(layers)
    return {
        "measured_bytes_per_token_layer": round(per),
        "estimate_bytes_per_token_layer": shape.kinds[0].act_bytes,
        "ratio": round(shape.kinds[0].act_bytes / per, 3),
        "cuda_growth_bytes_per_token_layer": round(grown / tokens / len(layers)) if grown is not None else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--small", action="store_true", help="hidden 256 (CPU); the estimate at those widths")
    ap.add_argument("--out", type=Path, default=None, help="write ssm_memory.json here")
    a = ap.parse_args(argv)
    kernels = {k: importlib.util.find_spec(k) is not None for k in KERNELS}
    rows = {}
    for name, (family, fields) in BODIES.items():
        if a.small:
            fields = {k: SMALL.get(k, v) for k, v in fields.items()}
        rows[name] = measure(family, fields, 512 if a.small else a.tokens, a.device)
        print(f"{name:34s} " + "  ".join(f"{k} {v}" for k, v in rows[name].items()), flush=True)
    print(f"kernels importable: {kernels} (the estimate models transformers' PyTorch path: none of them)")
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        result = {"device": a.device, "tokens": a.tokens, "small": a.small, "kernels": kernels, "rows": rows}
        (a.out / "ssm_memory.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
