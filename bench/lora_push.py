"""The push of a LoRA run against full fine-tuning, and the adapter's two transports side by side, on the same model,
config and steps:

    python -m bench.lora_push [--config configs/smoke_cpu.yaml] [--steps 12] [--r 16] [--hidden 512] [--layers 4]
                              [--transports engine,disk] [--no-full] [--model DIR]
                              [--out bench/results/<date>-lora-push] [--set key=value ...]

Builds a tiny Qwen2 body (trainer/tiny_model.py; --hidden/--layers size it; --model DIR uses a built one instead),
then one `slurm-grpo local` run with full fine-tuning (unless --no-full) and one per adapter transport with
trainer.lora.r = --r (trainer.lora.adapter_transport: engine = the adapter's tensors through the weight-transfer
engine, built into vLLM's LoRA manager in memory; disk = a peft folder per push loaded by /v1/load_lora_adapter), one
after the other. Prints, per setting, the bytes one push moves (push_bytes in the metrics), the push seconds (median
over the steps after the first, and the first), the adapter's send alone (the trainer log's push line: the transfer and
vLLM's install, without the gather and the prefix-cache reset), the step seconds and the parity after the pushes, and
writes results.json / RESULTS.md under --out. On GPUs, run the same with --config configs/gpu_1gpu.yaml (gpu/RESULTS.md
has the H200 command).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
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


PUSH_LINE = re.compile(r"\[push node 0 step (\d+)\] adapter \((\w+)\) [0-9.]+ ms: gather [0-9.]+, send ([0-9.]+),")
"""The adapter pusher's line per push in the trainer log (trainer.push.adapter.AdapterPusher.push)."""


def send_seconds(trainer_log: str) -> list[float]:
    """The adapter's send per push (seconds, in step order): the transfer and vLLM's install, from the trainer log."""
    return [float(m.group(3)) / 1e3 for m in PUSH_LINE.finditer(trainer_log)]


def one_run(config: str, model: str, job: Path, steps: int, r: int, sets: list[str], transport: str = "") -> dict:
    if transport:
        sets = [*sets, f"trainer.lora.adapter_transport={transport}"]
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
    send = send_seconds(JobDir(job).log(0, "trainer").read_text()) if r else []
    return {
        "setting": f"LoRA r={r} (adapter push, {transport})" if r else "full fine-tuning (full push)",
        "lora_r": r,
        "transport": transport,
        "send_s_median": round(statistics.median(send[1:] or send), 4) if send else None,
        "send_s_first": round(send[0], 4) if send else None,
        "wall_s": round(time.time() - t0, 1),
        "push_bytes": sorted(b for b in sent if b is not None),
        "push_s_first": round(push[0], 4) if push else None,
        "push_s_median": round(statistics.median(push[1:] or push), 4) if push else None,
        "step_s_median": round(statistics.median(x.step_s or 0.0 for x in rows[1:] or rows), 3),
        "parity_max": max((x.parity_max or 0.0) for x in rows),
        "steps": len(rows),
    }


def report(results: list[dict], model: dict, cmd: str) -> str:
    head = (
        "| setting | bytes per push | push s (median, after the first) | first push s | adapter send s (median) | "
        "step s (median) | parity max |"
    )
    lines = [
        f"# LoRA push: full vs adapter, engine vs disk ({platform.processor() or platform.machine()}, {time.strftime('%Y-%m-%d')})",
        "",
        f"`{cmd}`",
        "",
        f"Model: tiny Qwen2 body, {model['params'] / 1e6:.1f} M parameters (hidden {model['hidden']}, {model['layers']} layers), "
        f"{model['dtype']}; vLLM and the FSDP2 ranks of --config; one run per setting, one after the other. Adapter send: "
        "the transfer and vLLM's install of one push (the trainer log's push line), without the gather and the "
        "prefix-cache reset.",
        "",
        head,
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        b = r["push_bytes"][0] if r["push_bytes"] else 0
        lines.append(
            f"| {r['setting']} | {b / 1e6:.2f} MB | {r['push_s_median']} | {r['push_s_first']} | "
            f"{r.get('send_s_median') or '-'} | {r['step_s_median']} | {r['parity_max']:.2g} |"
        )
    by = {r["transport"]: r for r in results if r["lora_r"]}
    full = next((r for r in results if not r["lora_r"]), None)
    if full and full["push_bytes"] and by:
        lora = next(iter(by.values()))
        lines += [
            "",
            f"LoRA moves {full['push_bytes'][0] / lora['push_bytes'][0]:.0f}x fewer bytes per push than the full push "
            f"({full['push_s_median']} s).",
        ]
    if "engine" in by and "disk" in by and by["engine"]["send_s_median"] and by["disk"]["send_s_median"]:
        e, d = by["engine"], by["disk"]
        lines += [
            "",
            f"Adapter through the weight-transfer engine vs through disk: send {e['send_s_median']} s vs "
            f"{d['send_s_median']} s ({d['send_s_median'] / e['send_s_median']:.1f}x), whole push {e['push_s_median']} s "
            f"vs {d['push_s_median']} s (engine: the weight-transfer protocol, each worker builds the LoRA model from the "
            "tensors; disk: a peft folder written to node-local disk, /v1/load_lora_adapter reads it). "
            "Step times differ by more than the push (one run each: noise).",
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
    ap.add_argument("--transports", default="engine,disk", help="adapter transports to run, comma-separated")
    ap.add_argument("--no-full", action="store_true", help="skip the full fine-tuning run")
    ap.add_argument("--model", default="", help="an already built model folder (then --hidden/--layers are ignored)")
    ap.add_argument("--set", action="append", default=[], dest="sets")
    a = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="lora-push-"))
    model_dir = Path(a.model) if a.model else work / "model"
    if not a.model:
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
    model = {
        "hidden": cfg["hidden_size"],
        "layers": cfg["num_hidden_layers"],
        "params": shape.params,
        "dtype": cfg.get("torch_dtype") or cfg.get("dtype") or "float32",
    }
    arms = ([] if a.no_full else [(0, "")]) + [(a.r, t) for t in a.transports.split(",") if t]
    results = []
    for r, transport in arms:
        res = one_run(a.config, str(model_dir), work / f"r{r}{transport}", a.steps, r, a.sets, transport)
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
