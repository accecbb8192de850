"""Multi-turn figures on CPU: the tool-calling tiny model in the countdown environment (configs/agents_cpu.yaml),
one `slurm-grpo local` run per trainer.max_staleness (TRL's own tool loop at 0, the project's episodes run ahead
at 1), and with --cluster-env one 2-node job on the test cluster (configs/cluster_cpu.yaml with the
same agent settings, each node's ranks generating on their own node's server):

    python -m bench.agents [--steps 12] [--staleness 0,1] [--cluster-env /tmp/slurm-grpo-cluster/env.sh]
                           [--out bench/results/<date>-agents]

Prints and writes (results.json, RESULTS.md) per run: steps per hour of training, turns per episode, tool calls per
episode, tool seconds and generation seconds per step (rank 0's), step seconds, reward, push seconds per node.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from launcher.cli import cli_argv
from launcher.core.jobdir import JobDir
from launcher.core.records import StepRow, read_rows, step_rows

REPO = Path(__file__).resolve().parent.parent
PY = str(REPO / ".venv" / "bin" / "python")
AGENT_SETS = [
    "trainer.environment=trainer.agents.countdown:Countdown",
    "trainer.reward_funcs=[]",
    f"trainer.dataset={REPO}/data/countdown.jsonl",
    "vllm.max_model_len=2048",
    "trainer.max_completion_length=128",
    "trainer.per_device_train_batch_size=4",
    "trainer.num_generations=4",
    "trainer.learning_rate=0.00001",
    "trainer.save_steps=0",
    "trainer.final_checkpoint=false",
    "trainer.tool_timeout_s=10",
    # the base config's eval set is the letters task: evaluate the countdown episodes instead (one prompt a node)
    f"trainer.eval.dataset={REPO}/data/countdown.jsonl",
    "trainer.eval.max_prompts=2",
    "trainer.eval.samples_per_prompt=2",
]
"""configs/agents_cpu.yaml's agent settings, for the cluster config (whose base is the single-turn smoke run)."""


def figures(job: Path) -> dict:
    rows: list[StepRow] = step_rows(read_rows(JobDir(job).metrics))
    summary = json.loads((job / "summary.json").read_text())

    def mean(key: str) -> float:
        return round(statistics.mean(r.agents.get(key, 0.0) for r in rows), 3)

    nodes = sorted({n for r in rows for n in r.push_s})
    return {
        "steps": len(rows),
        "train_s": summary["train_s"],
        "steps_per_hour": round(3600 * len(rows) / summary["train_s"], 1),
        "step_s_median": round(statistics.median(r.step_s or 0.0 for r in rows), 3),
        "turns_per_episode": mean("agents/turns_per_episode"),
        "tool_calls_per_episode": mean("tools/call_frequency"),
        "tool_failure_frequency": mean("tools/failure_frequency"),
        "tool_s_per_step_rank0": mean("agents/tool_s"),
        "gen_s_per_step_rank0": mean("agents/gen_s"),
        "requests_per_step_rank0": mean("agents/requests"),
        "staleness_mean": mean("agents/staleness"),
        "reward_mean": round(statistics.mean(r.reward for r in rows), 4),
        "push_s_median": {n: round(statistics.median(r.push_s[n] for r in rows if n in r.push_s), 4) for n in nodes},
        "parity_max": max((r.parity_max or 0.0) for r in rows),
    }


def local_run(model: str, steps: int, job: Path, staleness: int = 0) -> dict:
    sets = [f"vllm.model={model}", f"job.job_dir={job}", f"trainer.max_steps={steps}", f"trainer.max_staleness={staleness}"]
    t0 = time.time()
    r = subprocess.run(cli_argv(PY, "local", "configs/agents_cpu.yaml", *sets), cwd=REPO, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"local run failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    where = "local, 1 node (vLLM CPU + 2 ranks)" + (f", max_staleness {staleness}" if staleness else "")
    return {"where": where, "wall_s": round(time.time() - t0, 1), **figures(job)}


def cluster_run(model: str, steps: int, job: Path, env_file: str) -> dict:
    from bench.run import submit_and_wait

    sets = [f"vllm.model={model}", f"trainer.max_steps={steps}", *AGENT_SETS]
    t0 = time.time()
    jid, state = submit_and_wait("configs/cluster_cpu.yaml", job, env_file, sets)
    if not state.startswith("COMPLETED"):
        raise RuntimeError(f"cluster job {jid} ended {state}; see {job}/logs")
    return {
        "where": "test cluster, 2 nodes x (vLLM CPU + 2 ranks)",
        "job": jid,
        "wall_s": round(time.time() - t0, 1),
        **figures(job),
    }


def markdown(runs: list[dict]) -> str:
    keys = [k for k in runs[0] if k not in ("where", "job")]
    lines = [
        "# Multi-turn agents on CPU (countdown environment, tool-calling tiny model)",
        "",
        f"`python -m bench.agents` on {platform.node()} ({platform.machine()}), {time.strftime('%Y-%m-%d')}.",
        "Per-rank figures are rank 0's (TRL logs rank 0's record); tool calls and failures per episode are TRL's, over all ranks.",
        "",
        "| figure | " + " | ".join(r["where"] for r in runs) + " |",
        "|---|" + "---|" * len(runs),
    ]
    lines += [f"| {k} | " + " | ".join(str(r.get(k)) for r in runs) + " |" for k in keys]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.agents")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--cluster-env", default="")
    ap.add_argument("--staleness", default="0,1", help="trainer.max_staleness of each local run (default 0,1)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / f"{time.strftime('%Y-%m-%d')}-agents"))
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-agents-", dir="/tmp"))
    model = str(work / "tool-model")
    subprocess.run([PY, "-m", "trainer.agents.tiny_tool_model", model], check=True, cwd=REPO, capture_output=True)
    runs = []
    for k in map(int, a.staleness.split(",")):
        runs.append(local_run(model, a.steps, work / f"local-k{k}", k))
        print(json.dumps(runs[-1], indent=1), flush=True)
    if a.cluster_env:
        runs.append(cluster_run(model, a.steps, work / "cluster", a.cluster_env))
        print(json.dumps(runs[-1], indent=1), flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(runs, indent=1) + "\n")
    (out / "RESULTS.md").write_text(markdown(runs))
    print(markdown(runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
