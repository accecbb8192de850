"""TRL's own GRPOTrainer (+ peft) on CPU, one process, HF generate: the reference reward curve that a slurm-grpo run of
the same shape (configs/smoke_cpu.yaml: 2 ranks x 8 completions = 2 prompts x 8 generations per step, 16 tokens,
letter_a_fraction, beta 0, temperature 1) is compared against (/work/REPORT-lora.md):

    python -m bench.trl_lora_reference --lora-r 16 --lr 0.03 --steps 40 --out /tmp/trl-lora-r16.jsonl
    python -m bench.trl_lora_reference --lr 0.003 --steps 30 --out /tmp/trl-full.jsonl          # full fine-tuning
    python -m bench.trl_lora_reference --lora-r 16 --ours ...   # the adapters built by trainer.lora.apply instead
    python -m bench.trl_lora_reference --final-norm-gain 5 --save-model /tmp/tiny-gain5   # a model LoRA can move

The tiny model's logits are capped for LoRA: its tied embedding rows have norm ~0.22 (init std 0.02) and the final
RMSNorm fixes the hidden state's norm at sqrt(hidden) x its gain (1.0), so no hidden state gives a logit above ~2.5 and
the policy stays near uniform (entropy ~5.67 of ln 300 = 5.70) whatever the adapters do; full fine-tuning moves the
embedding itself. --final-norm-gain scales that gain (logits x gain, the residual stream unchanged) and lifts the cap;
--save-model writes the scaled model (with the tokenizer files) for `slurm-grpo local --set vllm.model=...`.

The LoRA settings are the ones slurm-grpo gives peft (trainer.lora.peft_config: alpha 0 = 2 r, the default targets,
dropout 0). --ours wraps the model with trainer.lora.apply (base frozen, adapters fp32) and hands TRL the peft model,
as trainer/run.py does, instead of letting TRL call get_peft_model itself. Prints and writes one JSON line per step
(step, reward, reward_std, loss, grad_norm) and the first-5 / last-5 mean reward."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from launcher.core.config import LoraConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="/tmp/slurm-grpo-tiny")
    ap.add_argument("--dataset", default="data/letters.jsonl")
    ap.add_argument("--lora-r", type=int, default=0, help="0 = full fine-tuning")
    ap.add_argument("--lora-alpha", type=int, default=0, help="0 = 2 r (trainer.lora.alpha's default)")
    ap.add_argument("--ours", action="store_true", help="the peft model from trainer.lora.apply, not TRL's peft_config")
    ap.add_argument("--lr", type=float, default=0.03)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=16, help="completions per step (per_device_train_batch_size)")
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--freeze", default="", help="full fine-tuning: freeze parameters whose name holds one of these (a,b)")
    ap.add_argument("--also-train", default="", help="with --ours: also train base parameters whose name holds one of these")
    ap.add_argument("--final-norm-gain", type=float, default=1.0, help="scale the final RMSNorm's gain (logits x this)")
    ap.add_argument("--save-model", type=Path, help="write the (scaled) model and its tokenizer files here and stop")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from trainer import lora as trainer_lora
    from trainer.data import load_prompts
    from trainer.rewards import letter_a_fraction

    torch.manual_seed(a.seed)
    lora = LoraConfig(r=a.lora_r, alpha=a.lora_alpha)
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    with torch.no_grad():
        model.get_parameter("model.norm.weight").mul_(a.final_norm_gain)
    if a.save_model:
        shutil.copytree(a.model, a.save_model, dirs_exist_ok=True)  # tokenizer, chat template, generation config
        model.save_pretrained(a.save_model)  # type: ignore[operator]
        print(f"wrote {a.save_model} (final norm gain x{a.final_norm_gain})")
        return
    if a.out is None:
        ap.error("--out is required unless --save-model is given")
    peft_config = None
    if lora.enabled and a.ours:
        model = trainer_lora.apply(model, lora, torch.float32, a.model)
    elif lora.enabled:
        peft_config = trainer_lora.peft_config(lora, a.model)
    for n, p in model.named_parameters():
        if a.also_train and any(k in n for k in a.also_train.split(",")):
            p.requires_grad_(True)
        if a.freeze and any(k in n for k in a.freeze.split(",")):
            p.requires_grad_(False)
    args = GRPOConfig(
        output_dir=str(a.out.with_suffix(".hf")),
        max_steps=a.steps,
        per_device_train_batch_size=a.batch,
        num_generations=a.generations,
        max_completion_length=a.tokens,
        learning_rate=a.lr,
        beta=0.0,
        temperature=1.0,
        seed=a.seed,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        use_vllm=False,
        disable_tqdm=True,
        dataloader_num_workers=0,
        gradient_checkpointing=False,
    )
    rows: list[dict] = []

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ARG002 (TrainerCallback's signature)
            if logs and "reward" in logs:
                row = {
                    "step": state.global_step,
                    **{k: logs.get(k) for k in ("reward", "reward_std", "loss", "grad_norm", "learning_rate", "entropy")},
                }
                rows.append(row)
                print(json.dumps(row), flush=True)

    tr = GRPOTrainer(
        model=model,  # type: ignore[arg-type]
        reward_funcs=[letter_a_fraction],  # type: ignore[list-item]
        args=args,
        train_dataset=load_prompts(a.dataset),
        processing_class=AutoTokenizer.from_pretrained(a.model),
        peft_config=peft_config,
        callbacks=[Record()],
    )
    trained = [p for p in tr.model.parameters() if p.requires_grad]  # type: ignore[union-attr]
    print(f"trainable tensors: {len(trained)} ({sum(p.numel() for p in trained)} values)")
    tr.train()
    moved = {n: round(p.detach().norm().item(), 3) for n, p in tr.model.named_parameters() if ".lora_B." in n}  # type: ignore[union-attr]
    if moved:  # B starts at zero: its norm is how far the adapter moved
        print(f"lora_B norms after training: min {min(moved.values())} max {max(moved.values())}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rewards = [r["reward"] for r in rows]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print(f"reward first 5 -> last 5: {first:.3f} -> {last:.3f} ({len(rows)} steps) -> {a.out}")


if __name__ == "__main__":
    main()
