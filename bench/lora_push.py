"""The push of a LoRA run against full fine-tuning, side by side on the same model, config and steps:

    python -m bench.lora_push [--config configs/smoke_cpu.yaml] [--steps 12] [--r 16] [--hidden 512] [--layers 4]
                              [--out bench/results/<date>-lora-push] [--set key=value ...]

Builds a tiny Qwen2 body (trainer/tiny_model.py; --hidden/--layers size it), then one `slurm-grpo local` run with full
fine-tuning and one with trainer.lora.r = --r (the adapter path: only the adapter moves, vLLM loads it at run time),
one after the other. Prints, per setting, the bytes one push moves (push_bytes in the metrics), the push seconds
(median over the steps after the first, and the first), the step seconds and the parity after the pushes, and writes
results.json / RESULTS.md under --out. On GPUs, run the same with --config configs/gpu_1gpu.yaml.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from launcher.cli import cli_argv
from launcher.core.jobdir import JobDir
from launcher.core.records import read_rows, step_rows

REPO = Path(__file__).resolve().parent.parent


def one_run(config: str, model: str, job: Path, steps: int, r: int, sets: list[str]) -> dict:
    argv = cli_argv(
        sys.executable,
        "local",
        config,
        f"job.job_dir={job}",
        f"vllm.model={model}",
        f"trainer.max_steps={steps}",
        "trainer.save_steps=0",
        "trainer.final_checkpoint=false",
        f"trainer.lora.r={r}",
        *sets,
    )
    t0 = time.time()
    p = subprocess.run(argv, capture_output=True, text=True, cwd=REPO)
    if p.returncode:
        raise SystemExit(f"lora r={r}: the run failed (rc {p.returncode}); see {job}/logs\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
    rows = step_rows(read_rows(JobDir(job).metrics))
    push = [x.push_s["0"] for x in rows if "0" in x.push_s]
    sent = {x.push_bytes.get("0") for x in rows}
    return {
        "setting": f"LoRA r={r} (adapter push)" if r else "full fine-tuning (full push)",
        "lora_r": r,
        "wall_s": round(time.time() - t0, 1),
        "push_bytes": sorted(b for b in sent if b is not None),
        "push_s_first": round(push[0], 4) if push else None,
        "push_s_median": round(statistics.median(push[1:] or push), 4) if push else None,
        "step_s_median": round(statistics.median(x.step_s or 0.0 for x in rows[1:] or rows), 3),
        "parity_max": max((x.parity_max or 0.0) for x in rows),
        "steps": len(rows),
    }


def report(results: list[dict], model: dict, cmd: str) -> str:
    head = "| setting | bytes per push | push s (median, after the first) | first push s | step s (median) | parity max |"
    lines = [
        f"# LoRA push vs full push (CPU, {platform.processor() or platform.machine()}, {time.strftime('%Y-%m-%d')})",
        "",
        f"`{cmd}`",
        "",
        f"Model: tiny Qwen2 body, {model['params'] / 1e6:.1f} M parameters (hidden {model['hidden']}, {model['layers']} layers), "
        "float32; vLLM CPU build and 2 FSDP2 ranks on the same 2 cores; one run per setting, one after the other.",
        "",
        head,
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        b = r["push_bytes"][0] if r["push_bytes"] else 0
        lines.append(
            f"| {r['setting']} | {b / 1e6:.2f} MB | {r['push_s_median']} | {r['push_s_first']} | {r['step_s_median']} | "
            f"{r['parity_max']:.2g} |"
        )
    full, lora = results[0], results[-1]
    if full["push_bytes"] and lora["push_bytes"] and lora["push_s_median"]:
        lines += [
            "",
            f"LoRA moves {full['push_bytes'][0] / lora['push_bytes'][0]:.0f}x fewer bytes per push; its push takes "
            f"{lora['push_s_median'] / full['push_s_median']:.2f}x the full push's time (adapter push: gather the adapter, write a peft "
            "folder to node-local disk, vLLM loads it by HTTP; full push: gather every weight, gloo broadcast, vLLM's load). "
            "Step times differ by more than the push (one run each, 2 shared cores: noise).",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/smoke_cpu.yaml")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--r", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / f"{time.strftime('%Y-%m-%d')}-lora-push"))
    ap.add_argument("--set", action="append", default=[], dest="sets")
    a = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="lora-push-"))
    model_dir = work / "model"
    subprocess.run(
        [sys.executable, "-m", "trainer.tiny_model", str(model_dir), "--hidden", str(a.hidden), "--layers", str(a.layers)],
        check=True,
        capture_output=True,
        cwd=REPO,
    )
    cfg = json.loads((model_dir / "config.json").read_text())
    from launcher.core.shape import ModelShape

    shape = ModelShape.read(str(model_dir))
    assert shape is not None
    model = {"hidden": cfg["hidden_size"], "layers": cfg["num_hidden_layers"], "params": shape.params}
    results = []
    for r in (0, a.r):
        res = one_run(a.config, str(model_dir), work / f"r{r}", a.steps, r, a.sets)
        print(json.dumps(res), flush=True)
        results.append(res)
    cmd = "python -m bench.lora_push " + " ".join(argv if argv is not None else sys.argv[1:])
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"model": model, "results": results}, indent=1))
    text = report(results, model, cmd.strip())
    (out / "RESULTS.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
