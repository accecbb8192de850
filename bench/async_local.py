"""Synchronous vs asynchronous generation (trainer.max_staleness 0 vs 1), side by side on the same config and steps:

    python -m bench.async_local [--config configs/smoke_cpu.yaml] [--steps 30] [--out bench/results/<date>-async]
                                [--set key=value ...]

One `slurm-grpo local` run per setting, one after the other on this machine; prints steps per hour, the reward of
the first and last fifth of the steps (against step and against wall time), the staleness and the vLLM-vs-trainer
logprob mismatch per step, and writes results.json / RESULTS.md under --out.
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
from launcher.jobs import read_jsonl

REPO = Path(__file__).resolve().parent.parent


def one_run(config: str, model: str, job: Path, steps: int, staleness: int, sets: list[str]) -> dict:
    argv = cli_argv(
        sys.executable, "local", config, f"vllm.model={model}", f"job.job_dir={job}", f"trainer.max_steps={steps}",
        f"trainer.max_staleness={staleness}", "trainer.save_steps=0", *sets,
    )  # fmt: skip
    t0 = time.time()
    r = subprocess.run(argv, capture_output=True, text=True, cwd=REPO)
    if r.returncode:
        raise SystemExit(f"max_staleness {staleness}: the run failed (rc {r.returncode}); see {job}/logs\n{r.stdout[-2000:]}")
    rows = [x for x in read_jsonl(job / "metrics.jsonl") if "reward" in x]
    fifth = max(1, len(rows) // 5)
    train_s = json.loads((job / "summary.json").read_text())["train_s"]
    return {
        "max_staleness": staleness,
        "wall_s": round(time.time() - t0, 1),
        "train_s": train_s,
        "steps_per_hour": round(len(rows) / train_s * 3600, 1),
        "step_s_median": statistics.median(x["step_s"] for x in rows[1:] or rows),
        "reward_first": round(statistics.mean(x["reward"] for x in rows[:fifth]), 4),
        "reward_last": round(statistics.mean(x["reward"] for x in rows[-fifth:]), 4),
        "reward_by_step": [round(x["reward"], 4) for x in rows],
        "time_by_step": [round(x["time"] - rows[0]["time"] + rows[0]["step_s"], 2) for x in rows],
        "staleness": [max(x["staleness"].values()) for x in rows],
        "logp_mismatch_mean": [x.get("logp_mismatch_mean") for x in rows],
        "is_ratio_mean": [x.get("is_ratio_mean") for x in rows],
        "parity_max": max(x["parity_max"] for x in rows),
    }


def table(runs: list[dict]) -> str:
    out = [
        "| max_staleness | steps/hour | step s (median) | reward first -> last fifth | mismatch mean (median) | parity max |",
        "|---|---|---|---|---|---|",
    ]
    for r in runs:
        mm = [m for m in r["logp_mismatch_mean"] if m is not None]
        out.append(
            f"| {r['max_staleness']} | {r['steps_per_hour']} | {r['step_s_median']:.3f} | {r['reward_first']} -> "
            f"{r['reward_last']} | {statistics.median(mm) if mm else None:.3g} | {r['parity_max']:.2g} |"
        )
    base, fast = runs[0], runs[-1]
    out.append("")
    out.append(
        f"ratio: {fast['steps_per_hour'] / base['steps_per_hour']:.2f}x the steps per hour with max_staleness "
        f"{fast['max_staleness']}; reward gain (last - first fifth) {fast['reward_last'] - fast['reward_first']:.3f} vs "
        f"{base['reward_last'] - base['reward_first']:.3f}"
    )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.async_local", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/smoke_cpu.yaml")
    ap.add_argument("--model", default="/tmp/slurm-grpo-tiny", help="model folder (made with make-tiny-model if absent)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default="")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="more section.key=value for both runs")
    a = ap.parse_args(argv)
    if not (Path(a.model) / "config.json").exists():
        subprocess.run([sys.executable, "-m", "trainer.tiny_model", a.model], check=True, cwd=REPO)
    with tempfile.TemporaryDirectory() as d:
        runs = [one_run(a.config, a.model, Path(d) / f"s{k}", a.steps, k, a.sets) for k in (0, 1)]
    text = table(runs)
    print(text)
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = {
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": f"{platform.node()}, {platform.machine()}",
            "command": "python -m bench.async_local " + " ".join(argv if argv is not None else sys.argv[1:]),
        }
        (out / "results.json").write_text(json.dumps({**meta, "runs": runs}, indent=1))
        (out / "RESULTS.md").write_text(
            f"# Sync vs async generation ({meta['date']})\n\n`{meta['command']}` on {meta['machine']}\n\n{text}\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
