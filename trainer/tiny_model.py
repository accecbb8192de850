"""A tiny Qwen2 (or another family: --family, trainer.tiny_families; head_dim 64, which vLLM's CPU attention needs) with a byte-level BPE tokenizer
trained here and a chat template. No hub access: tests and the CPU smoke run build it in ~1 s.

    slurm-grpo make-tiny-model /tmp/tiny-model
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path
from typing import Any

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


MARKER = ".slurm-grpo-tiny-model"
"""Marks a folder make-tiny-model built: only there does a rebuild delete the weights it finds (never a real model's)."""


def _corpus() -> list[str]:
    words = "the quick brown fox jumps over a lazy dog and a cat sat on a mat banana apple".split()
    lines = [" ".join(words[(i + j) % len(words)] for j in range(8)) + f" {i}" for i in range(200)]
    return lines + ["1 + 2 = 3", "a b c d e f g h i j k l m n o p q r s t u v w x y z", "aaaa aa a"]


def tiny_config(
    family: str,
    *,
    vocab: int,
    token_id: int,
    hidden: int,
    layers: int,
    kv_heads: int,
    intermediate: int,
    tie: bool,
    dtype: str,
    head_dim: int,
    experts: int,
    experts_per_token: int,
    expert_intermediate: int,
) -> Any:
    """The transformers config of make_tiny_model's body (validated by transformers as it is made): the family's fields
    (trainer.tiny_families), its layer kinds at `layers` (trainer.tiny_layers), the MoE flags' expert fields."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    from trainer.tiny_families import FAMILIES, config_fields, moe_fields

    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; known: {', '.join(FAMILIES)}")
    if hidden % head_dim:
        raise ValueError(f"hidden ({hidden}) must be a multiple of head_dim ({head_dim}; vLLM's CPU attention needs 64)")
    heads = hidden // head_dim
    if heads % kv_heads:
        raise ValueError(f"kv_heads ({kv_heads}) must divide the {heads} attention heads (hidden / head_dim)")
    fields = config_fields(
        family,
        vocab=vocab,
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate=intermediate or 2 * hidden,
        tie=tie,
        token_id=token_id,
        dtype=dtype,
    )
    resize = moe_fields(family, experts=experts, experts_per_token=experts_per_token, expert_intermediate=expert_intermediate)
    try:
        return AutoConfig.for_model(family, **{**fields, **resize})
    except StrictDataclassError as e:  # transformers' own checks (e.g. Mamba-2's heads x head_dim = 2 x hidden)
        raise ValueError(f"{family} cannot take these sizes: {e.__cause__ or e}".replace("\n", " ")) from e


def make_tiny_model(
    out: str | os.PathLike,
    hidden: int = 128,
    layers: int | None = None,
    vocab: int = 300,
    seed: int = 0,
    dtype: str = "float32",
    kv_heads: int = 1,
    intermediate: int = 0,
    tie: bool = True,
    max_shard_size: str | None = None,
    device: str = "cpu",
    head_dim: int = 64,
    family: str = "qwen2",
    experts: int = 0,
    experts_per_token: int = 0,
    expert_intermediate: int = 0,
) -> dict:
    """Random weights of `family` (trainer.tiny_families: qwen2, llama, gemma2, qwen3_moe, ...) from a config (never
    the hub). The defaults make the CPU test model; the
        transformer body of Qwen2-0.5B is hidden 896, 24 layers, kv_heads 2, intermediate 4864 (the
        vocabulary stays this tokenizer's: a random model samples every id of its vocabulary). tie=False gives a
    separate lm_head (as 7B+ models have; a family vLLM serves with its own lm_head, DeepSeek's, gpt-oss's,
    launcher.core.plan.NEVER_TIED_FAMILIES, always has one; one vLLM serves tied, ALWAYS_TIED_FAMILIES, never);
    max_shard_size (e.g. "50MB") writes several safetensors files and an index.
    experts, experts_per_token, expert_intermediate: an MoE family's routed experts, top-k and expert width (0 keeps
    the tiny default of trainer.tiny_families.MOE). layers: None = 2 (trainer.tiny_layers.TINY_LAYERS: nemotron_h 4); a
    hybrid family's layers follow its released layer pattern at any count (trainer.tiny_layers)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from launcher.core.shape import ModelShape
    from trainer.tiny_layers import TINY_LAYERS

    if layers is None:
        layers = TINY_LAYERS.get(family, 2)
    config = functools.partial(
        tiny_config,
        family,
        hidden=hidden,
        layers=layers,
        kv_heads=kv_heads,
        intermediate=intermediate,
        tie=tie,
        dtype=dtype,
        head_dim=head_dim,
        experts=experts,
        experts_per_token=experts_per_token,
        expert_intermediate=expert_intermediate,
    )
    # every argument checked (transformers validates the config) before anything is written: a refused call leaves no
    # half-made folder behind
    config(vocab=vocab, token_id=0)
    path = Path(out)
    weights = [*path.glob("*.safetensors"), *path.glob("*.safetensors.index.json"), *path.glob("*.bin")]
    if weights and not (path / MARKER).is_file():
        raise ValueError(f"{path} holds model weights make-tiny-model did not write ({weights[0].name}); choose an empty folder")
    path.mkdir(parents=True, exist_ok=True)
    for old in weights:
        old.unlink()  # an earlier tiny build's shards or index beside this one's would be loaded as part of it
    (path / MARKER).write_text("written by slurm-grpo make-tiny-model: a rebuild here replaces its weights\n")
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    bpe = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), bpe)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>", bos_token=None)
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(path)
    cfg = config(vocab=len(hf), token_id=hf.eos_token_id)
    torch.manual_seed(seed)
    with torch.device(device):  # cuda: a 7B body is initialised in seconds instead of minutes
        model = AutoModelForCausalLM.from_config(cfg).to(getattr(torch, dtype))
    model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    shape = ModelShape.read(str(path))  # the launcher's own count (dry-run's memory estimate), next to the model's
    return {
        "vocab": len(hf),
        "params": sum(p.numel() for p in model.parameters()),
        # the dry-run's memory estimate counts from config.json alone (launcher.core.shape: close, not exact)
        "params_estimated": shape.params if shape else None,
        "params_active_estimated": shape.active_params if shape else None,
        "hidden": hidden,
        "layers": cfg.num_hidden_layers,
        "kv_heads": kv_heads,
        "intermediate": cfg.intermediate_size,
        "dtype": dtype,
        "family": family,
        **({"experts": shape.experts, "experts_per_token": shape.experts_per_token} if shape and shape.experts else {}),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="slurm-grpo make-tiny-model",
        description=(
            "Build a random model of a family (default Qwen2, head_dim 64) and a locally trained tokenizer, no hub. "
            "E.g. --hidden 896 --layers 24 --kv-heads 2 --intermediate 4864 --dtype bfloat16 for a 0.5B-class body; "
            "--family qwen3_moe --hidden 2048 --layers 24 --head-dim 128 --kv-heads 4 --experts 64 --top-k 8 "
            "--moe-intermediate 256 --dtype bfloat16 --device cuda for an MoE of 2.7B parameters, 0.6B active."
        ),
    )
    ap.add_argument("dir", help="output folder")
    ap.add_argument("--hidden", type=int, default=128, help="hidden size (multiple of 64; default 128)")
    ap.add_argument(
        "--layers",
        type=int,
        default=None,
        help="decoder layers (default 2, nemotron_h 4); hybrid families repeat their released layer pattern (trainer.tiny_layers)",
    )
    ap.add_argument("--seed", type=int, default=0, help="init seed (default 0)")
    ap.add_argument("--kv-heads", type=int, default=1, help="key/value heads (default 1)")
    ap.add_argument("--intermediate", type=int, default=0, help="MLP size (default 2 x hidden)")
    ap.add_argument("--vocab", type=int, default=300, help="tokenizer vocabulary to train (default 300)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="saved weights (default float32)")
    ap.add_argument("--head-dim", type=int, default=64, help="attention head size (default 64, what vLLM's CPU build needs)")
    from trainer.tiny_families import FAMILIES

    ap.add_argument(
        "--family",
        default="qwen2",
        choices=list(FAMILIES),
        metavar="FAMILY",
        help=f"model_type of the body (default qwen2): {', '.join(FAMILIES)}",
    )
    moe = "; MoE families only (trainer.tiny_families.MOE), 0 keeps the tiny default"
    ap.add_argument("--experts", type=int, default=0, help=f"routed experts per MoE layer{moe} (3)")
    ap.add_argument("--top-k", type=int, default=0, help=f"experts each token runs through{moe} (2)")
    ap.add_argument(
        "--moe-intermediate",
        type=int,
        default=0,
        help=f"each expert's MLP width (moe_intermediate_size, or intermediate_size where the family has no such field){moe}",
    )
    ap.add_argument("--device", default="cpu", help="where to initialise the weights (cuda is much faster for big bodies)")
    ap.add_argument(
        "--untied",
        action="store_true",
        help="a separate lm_head instead of the tied embedding (always, for the families vLLM serves untied: DeepSeek, gpt-oss, ...)",
    )
    ap.add_argument("--max-shard-size", default=None, help="split the weights into safetensors files of this size, e.g. 2GB")
    a = ap.parse_args(argv)
    try:
        info = make_tiny_model(
            a.dir,
            hidden=a.hidden,
            layers=a.layers,
            seed=a.seed,
            dtype=a.dtype,
            kv_heads=a.kv_heads,
            intermediate=a.intermediate,
            vocab=a.vocab,
            tie=not a.untied,
            max_shard_size=a.max_shard_size,
            device=a.device,
            head_dim=a.head_dim,
            family=a.family,
            experts=a.experts,
            experts_per_token=a.top_k,
            expert_intermediate=a.moe_intermediate,
        )
    except ValueError as e:
        print(f"slurm-grpo make-tiny-model: error: {e}", file=sys.stderr)
        return 2
    print(f"tiny model in {a.dir}: {info}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
