"""TRL 1.16's own GRPOTrainer in colocate mode (vLLM inside the trainer process, weights loaded in process),
on the same work as `slurm-grpo local CONFIG`: the same random model, prompts, reward, batch, completion
length, learning rate and steps. The bar the project's one-GPU path is measured against (gpu/RESULTS.md).
Timing only wraps TRL's calls (generate, sync_weights); nothing of TRL is changed.

    python -m torch.distributed.run --nproc-per-node 1 gpu/trl_colocate.py CONFIG MODEL OUT.json STEPS [KEY=VALUE ...]

KEY=VALUE: more config overrides, e.g. trainer.lora.r=16: TRL then gets the same peft LoraConfig as the project's run
(`peft_config`; TRL's colocate mode syncs merged weights into its in-process vLLM).

Multi-turn configs (configs/agents_1gpu.yaml): the same tools / environment / rollout_func with the same deadlines in
TRL's own tool loop, the environment's get_reward as the reward, trainer.grpo's max_tool_calling_iterations. TRL then
calls generate once per turn: generation seconds are summed per step, and the tokens counted, as the project's
agents/gen_s and agents/gen_tokens are. trl.json names the run's kind (dense, lora, agents), which gpu/report.py
matches before it computes step_ratio_vs_trl.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import psutil
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


def timed(obj, name: str, into: dict[int, float], step: Callable[[], int], tokens: dict[int, int] | None = None) -> None:
    """obj.name's seconds summed per training step (`step()` when called); `tokens`: the completion tokens generate
    returned, per step."""
    fn = getattr(obj, name)

    def wrapper(*a, **k):
        torch.cuda.synchronize()
        t0 = time.time()
        out = fn(*a, **k)
        torch.cuda.synchronize()
        into[step()] += time.time() - t0
        if tokens is not None:
            tokens[step()] += sum(len(c) for c in out[1])
        return out

    setattr(obj, name, wrapper)


def check_dtype(model_path: str, dtype: str) -> None:
    """TRL builds its colocated vLLM from the folder with no dtype, so vLLM's "auto" runs the saved one, a float32 one
    in bfloat16 (its preferred dtype on Ampere and later); the project's server runs vllm.dtype. They must be the same
    for a fair generation time."""
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    saved = cfg.get("dtype") or cfg.get("torch_dtype")
    served = "bfloat16" if saved == "float32" else saved
    if served != dtype:
        raise ValueError(
            f"{model_path} is saved in {saved}, which TRL's colocated vLLM serves in {served}, but vllm.dtype is {dtype}; "
            f"build the model with --dtype {dtype} or set vllm.dtype={served}"
        )


def trainer_kwargs(cfg: C.JobConfig, model, tok, device: str = "cuda", **overrides) -> dict:
    """GRPOTrainer's arguments for the config's work in TRL's colocate mode, from the functions the project's own run
    uses (grpo_config, load_prompts, rewards, agents, peft_config), so the two cannot drift. overrides: more of
    GRPOConfig's (the CPU test turns vLLM off)."""
    t, v = cfg.trainer, cfg.vllm
    args = grpo_config(
        Path("/tmp/trl-colocate"),
        t,
        device,
        **{
            "vllm_mode": "colocate",
            "vllm_gpu_memory_utilization": v.gpu_memory_utilization,
            "vllm_max_model_length": v.max_model_len,
            **overrides,
        },
    )
    data.use_chat_template(tok, t.chat_template)
    # multi-turn configs: the same tools / environment / rollout_func, with the same deadlines, in TRL's loop
    agents = resolve_agents(t.tools, t.environment, t.rollout_func, t.tool_timeout_s) if t.multi_turn else None
    return dict(
        model=model,
        reward_funcs=[rewards.resolve(r) for r in t.reward_funcs],
        args=args,
        train_dataset=data.load_prompts(t.dataset, t.columns, t.system_prompt),
        processing_class=tok,
        **(agents.trainer_kwargs() if agents else {}),
        peft_config=trainer_lora.peft_config(t.lora) if t.lora.enabled else None,
    )


def main(config: str, model_path: str, out: str, steps: int, sets: list[str] | None = None) -> None:
    cfg = C.load(config, [f"vllm.model={model_path}", f"trainer.max_steps={steps}", *(sets or [])])
    t = cfg.trainer
    check_dtype(model_path, cfg.vllm.dtype)
    t_start = time.time()
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_path)
    steps_cb = StepTimes()
    tr = GRPOTrainer(**trainer_kwargs(cfg, model, tok), callbacks=[steps_cb])
    gen_s: dict[int, float] = defaultdict(float)
    gen_tokens: dict[int, int] = defaultdict(int)
    push_s: dict[int, float] = defaultdict(float)
    step = lambda: tr.state.global_step  # noqa: E731
    timed(tr.vllm_generation, "generate", gen_s, step, gen_tokens)
    timed(tr.vllm_generation, "sync_weights", push_s, step)
    build_s = time.time() - t_start
    # from the process's own start: its imports (torch, transformers, TRL) counted, as a vLLM server's start counts its
    # own (launcher.vllm_log "imports"): the figure to hold a server's start against
    from_process_start_s = time.time() - psutil.Process().create_time()
    tr.train()
    rows = steps_cb.rows
    later = rows[1:] or rows
    gens, pushes = [gen_s[k] for k in sorted(gen_s)], [push_s[k] for k in sorted(push_s)]
    res = {
        "what": "TRL GRPOTrainer colocate" + (f", LoRA r={t.lora.r}" if t.lora.enabled else ""),
        "kind": t.run_kind,
        "build_s": round(build_s, 1),
        "build_from_process_start_s": round(from_process_start_s, 1),
        # gpu/device.sh gives TRL cold compile caches of its own, as a fresh job folder's are; else the machine's
        "compile_caches": os.environ.get("TORCHINDUCTOR_CACHE_DIR", "the machine's (~/.cache, ~/.triton, /tmp)"),
        "steps": len(rows),
        "step_s_median": round(statistics.median(r["step_s"] for r in later), 3),
        "gen_s_median": round(statistics.median(gens[1:] or gens), 3),
        "push_s_median": round(statistics.median(pushes[1:] or pushes), 4) if pushes else None,
        "reward_first5": statistics.mean(r["reward"] for r in rows[:5]),
        "reward_last5": statistics.mean(r["reward"] for r in rows[-5:]),
        "rewards": [round(r["reward"], 4) for r in rows],
        "trainer_peak_gpu_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2),
    }
    res["train_s_median"] = round(res["step_s_median"] - res["gen_s_median"] - (res["push_s_median"] or 0), 3)
    gen_steps = sorted(gen_s)[1:] or sorted(gen_s)
    tps = [gen_tokens[k] / gen_s[k] for k in gen_steps if gen_s[k]]
    res["gen_tokens_per_s_median"] = round(statistics.median(tps), 1) if tps else None  # the tokens generated
    print("[trl] " + json.dumps(res), flush=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5:])
