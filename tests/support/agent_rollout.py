"""A user's own episode loop (trainer.rollout_func) for the integration tier, in TRL 1.16's form:
rollout_func(prompts, trainer) -> {"prompt_ids", "completion_ids", "logprobs"} plus extra fields, which TRL hands the
reward functions. One turn per prompt (TRL passes this rank's prompts, each already repeated num_generations times),
generated through the trainer's generation backend: this rank's own client of its node's vLLM server, as the README
says a rollout_func generates. The extra field `rollout_rank` is what rank_reward scores (0.25 on rank 0, 0.5 on
rank 1), so the reward in the metrics shows the field reached the reward function on both ranks."""

from __future__ import annotations

import os


def rollout(prompts: list, trainer) -> dict[str, list]:
    tok = trainer.processing_class
    prompt_ids = [list(tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False)) for p in prompts]
    _, completion_ids, logprobs, _ = trainer.vllm_generation.generate(prompts=prompt_ids, images=None, num_generations=1)
    return {
        "prompt_ids": prompt_ids,
        "completion_ids": completion_ids,
        "logprobs": [[lp[0] for lp in seq] for seq in logprobs],  # the sampled token's logprob (top-1 of each)
        "rollout_rank": [int(os.environ.get("RANK", "0"))] * len(prompts),
    }


def rank_reward(completions: list, rollout_rank: list[int], **kwargs) -> list[float]:
    return [0.25 * (1 + r) for r in rollout_rank]
