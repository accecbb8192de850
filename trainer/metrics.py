"""metrics.jsonl (one typed row per step and per evaluation, rank 0; launcher.core.records), the end-of-run
summary.json and the metrics.png plot."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from launcher.core.jobdir import JobDir
from launcher.core.records import EvalRow, Row, StepRow, eval_rows, format_summary, read_rows, row_from_dict, step_rows, summarize


class MetricsWriter:
    def __init__(self, job_dir: Path):
        self.jd = JobDir(job_dir)
        self.path = self.jd.metrics

    def write(self, row: Row) -> None:
        """Append the row, stamped with the time it was written."""
        stamped = dataclasses.replace(row, time=round(time.time(), 3))
        with open(self.path, "a") as f:
            f.write(json.dumps(stamped.to_dict()) + "\n")

    def set_aside_after(self, step: int) -> int:
        """On resume from `step`: the step and eval rows of later steps (run by an attempt that died before its next checkpoint,
        so run again now) move to metrics.lost.jsonl, so metrics.jsonl holds each step once. Returns how many."""
        if not self.path.is_file():
            return 0
        keep: list[str] = []
        lost: list[str] = []
        for line in self.path.read_text().splitlines():
            try:
                row = row_from_dict(json.loads(line))
            except (ValueError, TypeError):
                continue  # a line cut by the crash
            (lost if isinstance(row, (StepRow, EvalRow)) and row.step > step else keep).append(line)
        if lost:
            with open(self.jd.metrics_lost, "a") as f:
                f.write("\n".join(lost) + "\n")
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(x + "\n" for x in keep))
            tmp.replace(self.path)
        return len(lost)


def write_summary_and_plot(job_dir: Path, extra: dict[str, Any]) -> dict[str, Any]:
    """summary.json: the summary of the run's step rows plus what the run adds (`extra`); and metrics.png."""
    jd = JobDir(job_dir)
    rows = read_rows(jd.metrics)
    summary = summarize(rows)
    evals = eval_rows(rows)
    s = {**(summary.to_dict() if summary else {}), **({"eval_last": evals[-1].to_dict()} if evals else {}), **extra}
    jd.summary.write_text(json.dumps(s, indent=2))
    try:
        plot(step_rows(rows), jd.plot, evals)
    except Exception as e:  # a missing plotting library must not fail a finished run
        print(f"WARNING: could not write metrics.png: {e}", flush=True)
    print("summary: " + format_summary(summary), flush=True)
    return s


PHASES = ("generation", "push", "parity", "training")
"""Where a step's seconds go on a node, in the order the bars stack them."""


def step_phases(r: StepRow, node: str) -> dict[str, float] | None:
    """A step's seconds on one node: waiting for its batch, the push, the parity checks, and the rest of the step
    (training: forward, backward, optimizer, TRL's own work). None when the row lacks the step's time."""
    if r.step_s is None:
        return None
    gen, push, parity = r.gen_wait_s.get(node, 0.0), r.push_s.get(node, 0.0), r.parity_s.get(node, 0.0)
    return {"generation": gen, "push": push, "parity": parity, "training": max(r.step_s - gen - push - parity, 0.0)}


def step_seconds_bars(ax, steps: list[StepRow]) -> None:
    """One stacked bar per step and node (side by side): the step's seconds by phase (step_phases)."""
    nodes = sorted({n for r in steps for n in (*r.gen_wait_s, *r.push_s)}) or ["0"]
    width = 0.8 / len(nodes)
    colors = dict(zip(PHASES, ("tab:blue", "tab:orange", "tab:red", "tab:green"), strict=True))
    for i, node in enumerate(nodes):
        xs, parts = [], []
        for r in steps:
            p = step_phases(r, node)
            if p is not None:
                xs.append(r.step - 0.4 + width * (i + 0.5))
                parts.append(p)
        bottom = [0.0] * len(xs)
        for phase in PHASES:
            h = [p[phase] for p in parts]
            ax.bar(xs, h, width, bottom=bottom, color=colors[phase], label=phase if i == 0 else None)
            bottom = [b + v for b, v in zip(bottom, h, strict=True)]
    title = "step seconds by phase" + (f" (nodes {', '.join(nodes)} side by side)" if len(nodes) > 1 else "")
    ax.set_title(title)
    ax.legend(fontsize=7)


def eval_curves(ax, evals: list[EvalRow]) -> None:
    """The evaluations over the steps (0: before training): mean@k, pass@1 and pass@k, on the reward panel."""
    if not evals:
        return
    x = [r.step for r in evals]
    k = evals[-1].samples_per_prompt
    means = [float("nan") if r.mean_at_k is None else r.mean_at_k for r in evals]  # None: no prompt had a reward
    ax.plot(x, means, marker="o", linestyle="--", label=f"eval mean@{k}")
    for j in sorted({"1", str(k)}, key=int):
        ax.plot(x, [r.pass_at.get(j, float("nan")) for r in evals], marker="s", linestyle=":", label=f"eval pass@{j}")
    ax.legend(fontsize=7)


def plot(steps: list[StepRow], out: Path, evals: list[EvalRow] | None = None) -> None:
    """evals: the evaluations (trainer.eval), drawn over the training reward."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r.step for r in steps]
    fig, ax = plt.subplots(1, 3, figsize=(13, 3.6))
    ax[0].plot(x, [r.reward for r in steps], marker=".", label="train reward")
    eval_curves(ax[0], evals or [])
    ax[0].set_title("mean reward" + (" and evaluation" if evals else ""))
    step_seconds_bars(ax[1], steps)
    nodes = sorted({n for r in steps for n in r.push_s})
    for n in nodes:
        ax[2].plot(x, [r.push_s.get(n, float("nan")) for r in steps], marker=".", label=f"node {n}")
    ax[2].set_title("weight push seconds per node")
    if nodes:
        ax[2].legend()
    for a in ax:
        a.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
