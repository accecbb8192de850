"""A tiny Qwen2 that reliably calls a tool, built from a config with weights set by hand (no hub, no training), for the
multi-turn tests and the CPU example. A random model never emits a well-formed tool call; this one always does:

  after the assistant header, it writes  <tool_call>{"name": "countdown", "arguments": {}}</tool_call><|im_end|>
  and once a tool result holding the token DONE is in its context, it answers  ok<|im_end|>  instead.

So the tool decides how many turns an episode takes (a countdown environment returns AGAIN n-1 times, then DONE).

How: one decoder layer whose MLP writes nothing. Each token's embedding is a unit vector (one-hot for the few tokens
of the chain); the attention head's query is a constant (its bias) and only DONE has a key (in a rotary pair that
barely turns), so every position after a DONE attends to it and copies a "seen DONE" flag into the residual stream.
lm_head then reads (this token, flag) -> next token: a bigram chain with one branch. Logit margins are ~15 or more,
so sampling at temperature 1 follows the chain too. The chat template is TRL's Qwen2.5 one, for which TRL knows the
response schema that parses the tool call.

Realistic cost (issue 37): --like qwen2-1.5b (or --hidden/--layers/--kv-heads/--intermediate/--head-dim/--vocab) builds
the same hand-set layer 0 inside a real agent's shape. Layers 1.. are inert: random q/k/v/gate/up weights (they compute
and their keys and values fill the KV cache, as a real model's do) but zero o_proj and down_proj, so the residual stream
passes them unchanged and the logits are exactly the one-layer model's (vocabulary padding: ids no token maps to, with
zero embedding and lm_head rows, so logit 0, far below the chain's). Training moves the inert weights once the rewards
of a group differ (zero o_proj still passes gradients); on the countdown they never do (the model plays it perfectly).

    python -m trainer.agents.tiny_tool_model /tmp/tool-model                      # one layer, hidden 128 (CPU tests)
    python -m trainer.agents.tiny_tool_model --like qwen2-1.5b --dtype bfloat16 --device cuda /tmp/tool-model-1.5b
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TOOL_NAME = "countdown"
CALL = '{"name": "countdown", "arguments": {}}'
DONE, AGAIN, ANSWER = "DONE", "AGAIN", "ok"
CHAIN = ["\n", "<tool_call>", CALL, "</tool_call>", ANSWER, "<|im_end|>"]
"""The tokens the model writes, one-hot in the embedding's first dimensions, in this order."""
ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", CALL, DONE, AGAIN, ANSWER]
SCALE = 8.0
"""lm_head weight of a chain step: its logit is SCALE x sqrt(hidden) (45) without the flag, / sqrt(2) with it."""
ANSWER_BASE, ANSWER_FLAG = 6.0, 6.0
"""lm_head weights of ANSWER on the newline and on the flag: after a newline it beats <tool_call> (SCALE) only when
the flag is set (6 < 8 < 6 + 6), and the flag alone never beats a chain step (6 < 8)."""
ATTEND = 20.0
"""Query bias and key weight of the DONE detector: a score of 20 x 20 / sqrt(head_dim) (50 at 64) for DONE, 0 elsewhere."""
INIT_STD = 0.02
"""Standard deviation of the inert layers' random weights (Qwen2's initializer_range)."""
SHAPES: dict[str, dict[str, int]] = {
    "qwen2-0.5b": dict(hidden=896, layers=24, kv_heads=2, intermediate=4864, head_dim=64, vocab=151936),
    "qwen2-1.5b": dict(hidden=1536, layers=28, kv_heads=2, intermediate=8960, head_dim=128, vocab=151936),
    "qwen2.5-3b": dict(hidden=2048, layers=36, kv_heads=2, intermediate=11008, head_dim=128, vocab=151936),
}
"""Published shapes (config.json of the Qwen models) for --like. The embedding stays untied (the hand-set lm_head reads
other dimensions than the embedding writes), so each has 151936 x hidden more parameters than the tied original."""


def make_tool_model(
    out: str | Path,
    hidden: int = 128,
    seed: int = 0,
    layers: int = 1,
    kv_heads: int = 1,
    intermediate: int = 0,
    head_dim: int = 64,
    vocab: int = 0,
    dtype: str = "float32",
    device: str = "cpu",
) -> dict:
    """The model folder. layers > 1 adds inert layers after the hand-set one; intermediate 0 = 2 x hidden; vocab 0 =
    the tokenizer's size (more pads the vocabulary, as real models do); device: where the weights are built (cuda is
    much faster for billions of parameters)."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from trainer import trl_glue
    from trainer.tiny_model import make_tiny_model

    heads = hidden // head_dim
    if hidden % head_dim or hidden < 64 or heads % kv_heads or layers < 1:
        raise ValueError(
            f"hidden {hidden}, head_dim {head_dim}, kv_heads {kv_heads}, layers {layers}: hidden must be a multiple of "
            "head_dim and at least 64, kv_heads must divide hidden / head_dim, layers at least 1"
        )
    path = Path(out)
    make_tiny_model(path, hidden=128, layers=1, tie=False, seed=seed)  # the trained BPE tokenizer and the files
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_tokens(ADDED)
    tok.chat_template = trl_glue.qwen2_5_chat_template()
    tok.eos_token = "<|im_end|>"  # the end of an assistant turn ends generation (TRL trims the tool suffix there)
    tok.save_pretrained(path)
    ids = {t: tok.convert_tokens_to_ids(t) if t != "\n" else tok.encode("\n")[0] for t in [*CHAIN, DONE]}
    assert len(tok.encode("\n")) == 1 and len(set(ids.values())) == len(ids), ids
    if vocab and vocab < len(tok):
        raise ValueError(f"vocab {vocab} is below the tokenizer's {len(tok)} tokens; give 0 or at least {len(tok)}")
    c = hidden**0.5
    flag_dim, done_dim = hidden - 1, hidden - 2
    cfg = Qwen2Config(  # type: ignore[call-arg]
        vocab_size=vocab or len(tok),
        hidden_size=hidden,
        intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=2048,  # the tool prompt of Qwen2.5's template is long in a 300-token vocabulary
        rope_theta=1e6,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
        initializer_range=INIT_STD,
    )
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for norm in (model.model.layers[0].input_layernorm, model.model.layers[0].post_attention_layernorm, model.model.norm):
            norm.weight.fill_(1.0)
        emb = model.model.embed_tokens.weight
        free = slice(len(CHAIN) + 2, hidden - 32)  # every other token: a random unit vector away from the signals
        noise = torch.randn(len(tok), free.stop - free.start, generator=g)
        emb[: len(tok), free] = (noise / noise.norm(dim=1, keepdim=True)).to(emb.device)
        for i, t in enumerate(CHAIN):
            emb[ids[t]] = 0.0
            emb[ids[t], i] = 1.0
        emb[ids[DONE]] = 0.0
        emb[ids[DONE], done_dim] = 1.0
        attn = model.model.layers[0].self_attn
        # head 0 only; its last dim pairs with dim head_dim / 2 - 1 in the rotary, the slowest turning pair
        attn.q_proj.bias[head_dim - 1] = ATTEND
        attn.k_proj.weight[head_dim - 1, done_dim] = ATTEND / c
        attn.v_proj.weight[0, done_dim] = 1.0 / c  # the normed DONE embedding is c on done_dim: v = 1
        attn.o_proj.weight[flag_dim, 0] = 1.0
        head = model.lm_head.weight
        steps = (("\n", "<tool_call>"), ("<tool_call>", CALL), (CALL, "</tool_call>"), ("</tool_call>", "<|im_end|>"))
        for src, dst in (*steps, (ANSWER, "<|im_end|>")):
            head[ids[dst], CHAIN.index(src)] = SCALE  # reads the one-hot dimension of src
        head[ids[ANSWER], CHAIN.index("\n")] = ANSWER_BASE
        head[ids[ANSWER], flag_dim] = ANSWER_FLAG
        inert_layers(model, seed)
    model.to(getattr(torch, dtype)).save_pretrained(path)
    gen = path / "generation_config.json"
    if gen.is_file():  # vLLM stops on the generation config's eos
        g_cfg = json.loads(gen.read_text())
        g_cfg["eos_token_id"] = tok.eos_token_id
        gen.write_text(json.dumps(g_cfg, indent=2))
    return {
        "vocab": cfg.vocab_size,
        "tokens": len(tok),
        "eos": tok.eos_token,
        "tool": TOOL_NAME,
        "hidden": hidden,
        "layers": layers,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate": cfg.intermediate_size,
        "params": sum(p.numel() for p in model.parameters()),
        "dtype": dtype,
    }


def inert_layers(model, seed: int) -> None:
    """Layers 1..: norms 1, q/k/v/gate/up random (their attention and MLP compute, their keys and values fill the KV
    cache), o_proj and down_proj zero, so each adds exactly nothing to the residual stream."""
    import torch

    layers = model.model.layers[1:]
    if not layers:
        return
    g = torch.Generator(device=model.lm_head.weight.device).manual_seed(seed + 1)
    for layer in layers:
        layer.input_layernorm.weight.fill_(1.0)
        layer.post_attention_layernorm.weight.fill_(1.0)
        a, m = layer.self_attn, layer.mlp
        for lin in (a.q_proj, a.k_proj, a.v_proj, m.gate_proj, m.up_proj):
            lin.weight.normal_(0.0, INIT_STD, generator=g)
        assert not a.o_proj.weight.any() and not m.down_proj.weight.any()  # zeroed with the rest: the layer is inert


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m trainer.agents.tiny_tool_model",
        description="A Qwen2 with hand-set weights that calls the countdown tool; inert layers give it a real shape.",
    )
    ap.add_argument("dir", help="output folder")
    ap.add_argument("--like", choices=sorted(SHAPES), help="a published shape; the flags below override its fields")
    ap.add_argument("--hidden", type=int, help="hidden size (default 128)")
    ap.add_argument("--layers", type=int, help="decoder layers: the hand-set one, then inert ones (default 1)")
    ap.add_argument("--kv-heads", type=int, help="key/value heads (default 1)")
    ap.add_argument("--intermediate", type=int, help="MLP size (default 2 x hidden)")
    ap.add_argument("--head-dim", type=int, help="attention head size (default 64, what vLLM's CPU build needs)")
    ap.add_argument("--vocab", type=int, help="vocabulary, padded past the tokenizer's tokens (default: the tokenizer's)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="saved weights (default float32)")
    ap.add_argument("--device", default="cpu", help="where to build the weights (cuda is much faster for big shapes)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    shape = dict(SHAPES[a.like]) if a.like else {}
    shape.update({k: v for k in ("hidden", "layers", "kv_heads", "intermediate", "head_dim", "vocab") if (v := getattr(a, k))})
    try:
        info = make_tool_model(a.dir, seed=a.seed, dtype=a.dtype, device=a.device, **shape)
    except ValueError as e:
        print(f"tiny_tool_model: error: {e}", file=sys.stderr)
        return 2
    print(f"tool-calling tiny model in {a.dir}: {info}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
