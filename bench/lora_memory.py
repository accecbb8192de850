"""A trainer rank's peak memory in training, LoRA against full fine-tuning, measured on CPU next to what the launcher's
estimate (launcher/memory.py: dry-run, submit, simulate) says for the same shape and batch:

    python -m bench.lora_memory [--out bench/results/<date>-lora-memory] [--hidden 512 --layers 8 --vocab 8192]

Two gloo ranks of this machine load the model as the trainer does (trainer.loading.load_model: meta device, FSDP2,
each rank its rows; with LoRA the peft adapters before sharding, the base frozen in the compute dtype), then run two
GRPO-shaped steps: `completions` sequences of 256 prompt + `completion` tokens (the estimate's T), the forward with
logits for the completion tokens only (as TRL's logits_to_keep), their fp32 log-softmax, a policy-gradient loss, the
backward and AdamW (the first step allocates its moments). Measured per rank: the growth of the peak resident memory
(VmHWM) from before the load to after the second step, and the growth over each phase. The estimate's GPU peak less
its fixed CUDA overhead (OVERHEAD_GB, no CUDA here) is the figure it should match, term by term:
state + gathered units + activations + logits.

On CPU everything is host memory (no separate device), the allocator is glibc's, not the CUDA caching allocator, and
the compute dtype is bf16 as on the GPU (trainer.dtype bfloat16). glibc's default heap keeps freed blocks of a few MB
resident (its mmap threshold rises to the largest block freed, so later ones come from the heap and stay there):
1.6-4x the live tensors here. The ranks therefore run with MALLOC_MMAP_THRESHOLD_=131072 (blocks of 128 KiB and more
are mapped and given back on free), so VmHWM follows the tensors; --glibc-default measures the default heap."""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.support.ranks import cpu_parallel, run_ranks
from trainer.procmem import reset_peak, status_mb

MIB_IN_MB = 2**20 / 1e6
"""status_mb gives MiB (/proc's kB are KiB); the estimate's MB are 1e6 bytes."""
PROMPT = 256
"""Prompt tokens per sequence: launcher.memory.PROMPT_TOKENS, so T is the estimate's."""
WORLD = 2
MMAP_THRESHOLD = "131072"
"""MALLOC_MMAP_THRESHOLD_ for the spawned ranks (glibc reads it at their start)."""


def measure(rank: int, world: int, _port: int, model_dir: str, lora_r: int, completions: int, completion: int) -> dict:
    """One rank: load, two steps; the peak's growth (MB) over the whole and per phase."""
    import torch
    from transformers import AutoModelForCausalLM

    from launcher.core.config import LORA_TARGETS, LoraConfig
    from trainer.loading import load_model

    AutoModelForCausalLM.from_config  # noqa: B018  (the lazy import of the modeling code is not the model's memory)
    if lora_r:
        import peft  # noqa: F401  (its import, ~15 MB of modules, is not the model's memory either)

    def mb(key: str) -> float:
        return status_mb(key) * MIB_IN_MB

    torch.manual_seed(rank)
    par = cpu_parallel(rank, world)
    lora = LoraConfig(r=lora_r, target_modules=list(LORA_TARGETS)) if lora_r else None
    gc.collect()
    base = mb("VmRSS")
    reset_peak()
    model, _ = load_model(model_dir, par, torch.bfloat16, activation_checkpointing=True, lora=lora, seed=0)
    model.train()
    after_load = mb("VmHWM") - base
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-5)
    vocab = model.config.vocab_size
    phases = []
    for step in range(2):
        gc.collect()
        start = mb("VmRSS")
        reset_peak()
        t0 = time.time()
        ids = torch.randint(0, vocab, (completions, PROMPT + completion))
        logits = model(input_ids=ids, logits_to_keep=completion + 1).logits[:, :-1]  # as TRL: completion tokens only
        logps = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, -completion:, None]).squeeze(-1)
        advantages = torch.randn(completions, 1)
        loss = -(logps * advantages).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del logits, logps, loss
        peak = mb("VmHWM")
        phases.append(
            {
                "step": step + 1,
                "peak_over_start_mb": round(peak - start, 1),
                "start_over_base_mb": round(start - base, 1),
                "s": round(time.time() - t0, 1),
            }
        )
    peak_growth = max(after_load, *(p["start_over_base_mb"] + p["peak_over_start_mb"] for p in phases))
    return {
        "rank": rank,
        "trainable_params": sum(p.numel() for p in trainable),
        "after_load_mb": round(after_load, 1),
        "peak_growth_mb": round(peak_growth, 1),
        "steps": phases,
    }


def estimated(model_dir: str, lora_r: int, completions: int, completion: int) -> dict:
    from launcher.core.config import LORA_TARGETS
    from launcher.core.shape import ModelShape
    from launcher.memory import OVERHEAD_GB, Layout, Options, estimate

    shape = ModelShape.read(model_dir)
    assert shape is not None
    lay = Layout(
        nodes=1,
        ranks_per_node=WORLD,
        tensor_parallel_size=1,
        shard_ranks=WORLD,
        shared_gpu=False,
        gpu_gb=0.0,
        vllm_fraction=0.3,
        compute_bytes=2,
        completions_per_rank=completions,
        completion_tokens=completion,
    )
    opt = Options(activation_checkpointing=True, lora_r=lora_r, lora_targets=LORA_TARGETS if lora_r else ())
    e = estimate(shape, lay, opt)
    terms = {"state": e.state_gb, "gathered": e.gathered_gb, "activations": e.activations_gb, "logits": e.logits_gb}
    return {
        "params": shape.params,
        "adapter_params": round(e.adapter_params_m * 1e6),
        "terms_mb": {k: round(v * 1e3, 1) for k, v in terms.items()},
        "peak_mb": round((e.gpu_gb - OVERHEAD_GB) * 1e3, 1),
    }


def run(model_dir: str, r: int, completions: int, completion: int) -> dict:
    rows = []
    for lora_r in (0, r):
        fn = functools.partial(measure, model_dir=model_dir, lora_r=lora_r, completions=completions, completion=completion)
        res = run_ranks(WORLD, fn, timeout_s=1200)
        est = estimated(model_dir, lora_r, completions, completion)
        for m in sorted(res.values(), key=lambda x: x["rank"]):
            rows.append({"mode": f"LoRA r={lora_r}" if lora_r else "full", "estimate": est, **m})
    return {"rows": rows, "tokens_per_rank": completions * (PROMPT + completion)}


def table(result: dict) -> str:
    out = [
        f"T = {result['tokens_per_rank']} tokens per rank ({result['completions']} x ({PROMPT} + {result['completion']})), "
        f"{WORLD} ranks, bf16 compute, activation checkpointing; estimate = launcher/memory.py's GPU peak less its "
        "2 GB CUDA overhead",
        "",
        "| mode | rank | trainable params | estimate (MB): state + gathered + activations + logits = peak | measured peak growth (MB) | measured / estimate | after load (MB) | step 1 / step 2 peak over their start (MB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        e = r["estimate"]
        t = e["terms_mb"]
        terms = f"{t['state']} + {t['gathered']} + {t['activations']} + {t['logits']} = {e['peak_mb']}"
        steps = " / ".join(str(s["peak_over_start_mb"]) for s in r["steps"])
        out.append(
            f"| {r['mode']} | {r['rank']} | {r['trainable_params']:,} | {terms} | {r['peak_growth_mb']} | "
            f"{r['peak_growth_mb'] / e['peak_mb']:.2f} | {r['after_load_mb']} | {steps} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.lora_memory", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="", help="folder for results.json and RESULTS.md (default: print only)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=1408)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--r", type=int, default=16, help="LoRA rank (all seven projections)")
    ap.add_argument("--completions", type=int, default=2, help="sequences per rank")
    ap.add_argument("--completion", type=int, default=256, help="completion tokens per sequence")
    ap.add_argument("--glibc-default", action="store_true", help="leave glibc's heap as it is (no MALLOC_MMAP_THRESHOLD_)")
    a = ap.parse_args(argv)
    if not a.glibc_default:
        os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", MMAP_THRESHOLD)
    import torch
    import transformers

    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "-m", "trainer.tiny_model", d, "--hidden", str(a.hidden), "--layers", str(a.layers)]
        cmd += ["--intermediate", str(a.intermediate), "--kv-heads", "2", "--vocab", str(a.vocab), "--dtype", "bfloat16"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        result = run(d, a.r, a.completions, a.completion)
        result["model"] = {k: v for k, v in json.loads((Path(d) / "config.json").read_text()).items() if not isinstance(v, dict)}
    result |= {"completions": a.completions, "completion": a.completion, "r": a.r}
    result["command"] = "python -m bench.lora_memory " + " ".join(argv if argv is not None else sys.argv[1:])
    result["machine"] = f"{platform.node()} {platform.machine()}, Python {platform.python_version()}"
    result["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__}
    result["malloc_mmap_threshold"] = os.environ.get("MALLOC_MMAP_THRESHOLD_", "glibc default")
    result["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    text = table(result)
    print(text)
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(result, indent=1))
        (out / "RESULTS.md").write_text(
            f"# A trainer rank's training peak, LoRA vs full, measured against the estimate ({result['date']})\n\n"
            f"`{result['command']}` on {result['machine']}, {result['versions']}, MALLOC_MMAP_THRESHOLD_ "
            f"{result['malloc_mmap_threshold']}\n\n{text}\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
