"""Synchronous vs asynchronous generation (trainer.max_staleness 0 vs 1 vs 2), side by side on the same config and steps:

    python -m bench.async_local [--config configs/smoke_cpu.yaml] [--steps 30] [--staleness 0,1,2]
                                [--cluster-env /tmp/slurm-grpo-cluster/env.sh] [--out bench/results/<date>-async]
                                [--set key=value ...]

One `slurm-grpo local` run per setting (with --cluster-env: one `slurm-grpo submit` to the test cluster, e.g.
--config configs/cluster_cpu.yaml), one after the other; prints steps per hour, the reward of the first and last
fifth of the steps (against step) and the reward reached by the time the fastest run finished (against wall time),
the staleness and the vLLM-vs-trainer logprob mismatch per step, and writes results.json / RESULTS.md under --out.
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


def one_run(config: str, model: str, job: Path, steps: int, staleness: int, sets: list[str], cluster_env: str = "") -> dict:
    sets = [
        f"vllm.model={model}", f"trainer.max_steps={steps}", f"trainer.max_staleness={staleness}", "trainer.save_steps=0", *sets
    ]  # fmt: skip
    t0 = time.time()
    if cluster_env:
        from bench.run import submit_and_wait

        jid, state = submit_and_wait(config, job, cluster_env, [f"trainer.dataset={REPO}/data/letters.jsonl", *sets])
        if not state.startswith("COMPLETED"):
            raise SystemExit(f"max_staleness {staleness}: cluster job {jid} ended {state}; see {job}/logs")
    else:
        argv = cli_argv(sys.executable, "local", config, f"job.job_dir={job}", *sets)
        r = subprocess.run(argv, capture_output=True, text=True, cwd=REPO)
        if r.returncode:
            raise SystemExit(f"max_staleness {staleness}: the run failed (rc {r.returncode}); see {job}/logs\n{r.stdout[-2000:]}")
    jd = JobDir(job)
    rows = step_rows(read_rows(jd.metrics))
    fifth = max(1, len(rows) // 5)
    train_s = json.loads(jd.summary.read_text())["train_s"]
    return {
        "max_staleness": staleness,
        "wall_s": round(time.time() - t0, 1),
        "train_s": train_s,
        "steps_per_hour": round(len(rows) / train_s * 3600, 1),
        "step_s_median": statistics.median(x.step_s or 0.0 for x in rows[1:] or rows),
        "reward_first": round(statistics.mean(x.reward for x in rows[:fifth]), 4),
        "reward_last": round(statistics.mean(x.reward for x in rows[-fifth:]), 4),
        "reward_by_step": [round(x.reward, 4) for x in rows],
        "time_by_step": [round((x.time or 0.0) - (rows[0].time or 0.0) + (rows[0].step_s or 0.0), 2) for x in rows],
        "staleness": [max(v for v in x.staleness.values() if v is not None) for x in rows],
        "pushes_paused": max((max(x.pushes_paused.values(), default=0) for x in rows), default=0),
        "logp_mismatch_mean": [x.logp_mismatch_mean for x in rows],
        "is_ratio_mean": [x.is_ratio_mean for x in rows],
        "parity_max": max(x.parity_max for x in rows if x.parity_max is not None),
    }


def reward_by_time(run: dict, t: float) -> float:
    """Mean reward of the last fifth of the steps the run had finished t seconds into training."""
    done = [r for r, s in zip(run["reward_by_step"], run["time_by_step"], strict=True) if s <= t] or run["reward_by_step"][:1]
    tail = done[-max(1, len(run["reward_by_step"]) // 5) :]
    return round(statistics.mean(tail), 4)


def table(runs: list[dict]) -> str:
    t = min(r["time_by_step"][-1] for r in runs)  # the fastest run's training time
    out = [
        "| max_staleness | steps/hour | step s (median) | reward first -> last fifth | reward at "
        f"{t:.0f} s | staleness max | pushes paused | mismatch mean (median) | parity max |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        mm = [m for m in r["logp_mismatch_mean"] if m is not None]
        out.append(
            f"| {r['max_staleness']} | {r['steps_per_hour']} | {r['step_s_median']:.3f} | {r['reward_first']} -> "
            f"{r['reward_last']} | {reward_by_time(r, t)} | {max(r['staleness'])} | {r.get('pushes_paused', 0)} | "
            f"{statistics.median(mm) if mm else None:.3g} | {r['parity_max']:.2g} |"
        )
    base = runs[0]
    out.append("")
    for fast in runs[1:]:
        out.append(
            f"max_staleness {fast['max_staleness']} vs {base['max_staleness']}: "
            f"{fast['steps_per_hour'] / base['steps_per_hour']:.2f}x the steps per hour; reward gain (last - first fifth) "
            f"{fast['reward_last'] - fast['reward_first']:.3f} vs {base['reward_last'] - base['reward_first']:.3f}; "
            f"reward at {t:.0f} s {reward_by_time(fast, t)} vs {reward_by_time(base, t)}"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.async_local", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/smoke_cpu.yaml")
    ap.add_argument("--model", default="/tmp/slurm-grpo-tiny", help="model folder (made with make-tiny-model if absent)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default="")
    ap.add_argument("--staleness", default="0,1,2", help="comma-separated trainer.max_staleness values, one run each")
    ap.add_argument("--cluster-env", default="", help="the test cluster's env.sh: submit each run there instead of local")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="more section.key=value for every run")
    a = ap.parse_args(argv)
    if not (Path(a.model) / "config.json").exists():
        subprocess.run([sys.executable, "-m", "trainer.tiny_model", a.model], check=True, cwd=REPO)
    values = [int(k) for k in a.staleness.split(",")]
    d = tempfile.mkdtemp(prefix="bench-async-", dir="/tmp")  # /tmp: the cluster's nodes see it; kept for the logs
    runs = []
    for k in values:
        print(f"max_staleness {k}: {a.steps} steps in {d}/s{k} ...", flush=True)
        runs.append(one_run(a.config, a.model, Path(d) / f"s{k}", a.steps, k, a.sets, a.cluster_env))
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
