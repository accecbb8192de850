"""vLLM against transformers on a checkpoint as loaded, before any push: greedy completions of a few prompts from vLLM
(its logprobs), then transformers' logprobs of the same tokens. Separates "vLLM computes this model differently" from
"the push did not land" when a job's parity fails from its first push (DeepSeek-V3 at its released MLA widths on an
H100, 2026-12-06: parity 1.99 from the first push; vLLM's CPU build gave uniform logprobs at kv_lora_rank 512).

    python3 gpu/load_parity.py MODEL [--dtype bfloat16] [--out FILE.json]

Prints the max and mean |vLLM - transformers| logprob over the completions' tokens (bf16: expect <= 0.25 max)."""

from __future__ import annotations

import argparse
import json


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams

    prompts = ["hello world, the", "Count the letters in banana:", "1 2 3 4"]
    llm = LLM(model=a.model, dtype=a.dtype, max_model_len=256, gpu_memory_utilization=0.3, seed=0)
    outs = llm.generate(prompts, SamplingParams(max_tokens=a.tokens, temperature=0, logprobs=0))
    vllm_lp = [[d[t].logprob for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)] for o in outs]
    del llm
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=getattr(torch, a.dtype)).to(device)
    diffs: list[float] = []
    for prompt, o, lps in zip(prompts, outs, vllm_lp, strict=True):  # the prompt's ids as vLLM tokenized it
        completion = list(o.outputs[0].token_ids)
        ids = list(o.prompt_token_ids) + completion
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids], device=device)).logits[0].float(), -1)
        start = len(ids) - len(completion)
        hf = [logp[start - 1 + i, t].item() for i, t in enumerate(completion)]
        diffs += [abs(x - y) for x, y in zip(lps, hf, strict=True)]
        print(f"{prompt!r}: vLLM {[round(x, 3) for x in lps[:6]]} transformers {[round(x, 3) for x in hf[:6]]}")
    if not diffs:
        raise SystemExit("vLLM generated no tokens: nothing to compare")
    res = {"model": a.model, "dtype": a.dtype, "max_abs": max(diffs), "mean_abs": sum(diffs) / len(diffs), "tokens": len(diffs)}
    print(json.dumps(res))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
