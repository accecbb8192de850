"""TRL 1.16's own GRPOTrainer in colocate mode (vLLM inside the trainer process, weights loaded in process),
on the same work as `slurm-grpo local CONFIG`: the same random model, prompts, reward, batch, completion
length, learning rate and steps. The bar the project's one-GPU path is measured against (gpu/RESULTS.md).
Timing only wraps TRL's calls (generate, sync_weights); nothing of TRL is changed.

    python -m torch.distributed.run --nproc-per-node 1 gpu/trl_colocate.py CONFIG MODEL OUT.json STEPS [KEY=VALUE ...]

KEY=VALUE: more config overrides, e.g. trainer.lora.r=16: TRL then gets the same peft LoraConfig as the project's run
(`peft_config`; TRL's colocate mode syncs merged weights into its in-process vLLM).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOTrainer

from launcher.core import config as C
from trainer import data, rewards
from trainer import lora as trainer_lora
from trainer.agents.resolve import resolve as resolve_agents
from trainer.trl_glue import grpo_config


class StepTimes(TrainerCallback):
    def __init__(self) -> None:
        self.rows: list[dict] = []
        self.t0 = time.time()

    def on_step_begin(self, args, state, control, **kw):
        self.t0 = time.time()

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "reward" in logs:
            self.rows.append({"step": state.global_step, "reward": logs["reward"], "step_s": time.time() - self.t0})


def timed(obj, name: str, into: list[float], step=None) -> None:
    """Time each call of obj.name into `into`; with step (a callable: the trainer's global step), the calls of one step
    are summed into one figure: TRL's multi-turn loop generates once per turn, and a step's generation is all of them."""
    fn = getattr(obj, name)
    last: list[int] = []

    def wrapper(*a, **k):
        torch.cuda.synchronize()
        t0 = time.time()
        out = fn(*a, **k)
        torch.cuda.synchronize()
        if step is not None and last == [step()]:
            into[-1] += time.time() - t0
        else:
            into.append(time.time() - t0)
            last[:] = [step()] if step is not None else []
        return out

    setattr(obj, name, wrapper)


def main(config: str, model_path: str, out: str, steps: int, sets: list[str] | None = None) -> None:
    cfg = C.load(config, [f"vllm.model={model_path}", f"trainer.max_steps={steps}", *(sets or [])])
    t, v = cfg.trainer, cfg.vllm
    args = grpo_config(
        Path("/tmp/trl-colocate"),
        t,
        "cuda",
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=v.gpu_memory_utilization,
        vllm_max_model_length=v.max_model_len,
    )
    t_start = time.time()
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_path)
    data.use_chat_template(tok, t.chat_template)
    steps_cb = StepTimes()
    # multi-turn configs (configs/agents_1gpu.yaml): the same tools / environment, with the same deadlines, in TRL's loop
    agents = resolve_agents(t.tools, t.environment, t.rollout_func, t.tool_timeout_s) if t.multi_turn else None
    tr = GRPOTrainer(
        model=model,
        reward_funcs=[rewards.resolve(r) for r in t.reward_funcs],
        args=args,
        train_dataset=data.load_prompts(t.dataset, t.columns, t.system_prompt),
        processing_class=tok,
        callbacks=[steps_cb],
        **(agents.trainer_kwargs() if agents else {}),
        peft_config=trainer_lora.peft_config(t.lora) if t.lora.enabled else None,
    )
    gen_s: list[float] = []
    push_s: list[float] = []
    timed(tr.vllm_generation, "generate", gen_s, step=lambda: tr.state.global_step)
    timed(tr.vllm_generation, "sync_weights", push_s)
    build_s = time.time() - t_start
    tr.train()
    rows = steps_cb.rows
    later = rows[1:] or rows
    res = {
        "what": "TRL GRPOTrainer colocate" + (f", LoRA r={t.lora.r}" if t.lora.enabled else ""),
        "build_s": round(build_s, 1),
        "steps": len(rows),
        "step_s_median": round(statistics.median(r["step_s"] for r in later), 3),
        "gen_s_median": round(statistics.median(gen_s[1:] or gen_s), 3),
        "push_s_median": round(statistics.median(push_s[1:] or push_s), 4) if push_s else None,
        "reward_first5": statistics.mean(r["reward"] for r in rows[:5]),
        "reward_last5": statistics.mean(r["reward"] for r in rows[-5:]),
        "rewards": [round(r["reward"], 4) for r in rows],
        "trainer_peak_gpu_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2),
    }
    res["train_s_median"] = round(res["step_s_median"] - res["gen_s_median"] - (res["push_s_median"] or 0), 3)
    tokens = t.per_device_train_batch_size * t.max_completion_length
    res["gen_tokens_per_s_upper_bound"] = round(tokens / res["gen_s_median"], 1)  # completions can stop early at EOS
    print("[trl] " + json.dumps(res), flush=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5:])
