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

    python -m trainer.agents.tiny_tool_model /tmp/tool-model
"""

from __future__ import annotations

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
"""Query bias and key weight of the DONE detector: a score of 20 x 20 / sqrt(64) = 50 for DONE, 0 elsewhere."""


def make_tool_model(out: str | Path, hidden: int = 128, seed: int = 0) -> dict:
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from trainer import trl_glue
    from trainer.tiny_model import make_tiny_model

    path = Path(out)
    make_tiny_model(path, hidden=hidden, layers=1, tie=False, seed=seed)  # the trained BPE tokenizer and the files
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_tokens(ADDED)
    tok.chat_template = trl_glue.qwen2_5_chat_template()
    tok.eos_token = "<|im_end|>"  # the end of an assistant turn ends generation (TRL trims the tool suffix there)
    tok.save_pretrained(path)
    ids = {t: tok.convert_tokens_to_ids(t) if t != "\n" else tok.encode("\n")[0] for t in [*CHAIN, DONE]}
    assert len(tok.encode("\n")) == 1 and len(set(ids.values())) == len(ids), ids
    head_dim, c = 64, hidden**0.5
    flag_dim, done_dim = hidden - 1, hidden - 2
    cfg = Qwen2Config(  # type: ignore[call-arg]
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=1,
        num_attention_heads=hidden // head_dim,
        num_key_value_heads=1,
        head_dim=head_dim,
        max_position_embeddings=2048,  # the tool prompt of Qwen2.5's template is long in a 300-token vocabulary
        rope_theta=1e6,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
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
        emb[:, free] = noise / noise.norm(dim=1, keepdim=True)
        for i, t in enumerate(CHAIN):
            emb[ids[t]] = 0.0
            emb[ids[t], i] = 1.0
        emb[ids[DONE]] = 0.0
        emb[ids[DONE], done_dim] = 1.0
        attn = model.model.layers[0].self_attn
        # head 0 only; dim 63 pairs with 31 in the rotary, the slowest turning pair (~1e-4 rad per position)
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
    model.save_pretrained(path)
    gen = path / "generation_config.json"
    if gen.is_file():  # vLLM stops on the generation config's eos
        g_cfg = json.loads(gen.read_text())
        g_cfg["eos_token_id"] = tok.eos_token_id
        gen.write_text(json.dumps(g_cfg, indent=2))
    return {"vocab": len(tok), "eos": tok.eos_token, "tool": TOOL_NAME}


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    if len(args) != 1:
        print("usage: python -m trainer.agents.tiny_tool_model DIR", file=sys.stderr)
        return 2
    print(f"tool-calling tiny model in {args[0]}: {make_tool_model(args[0])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
