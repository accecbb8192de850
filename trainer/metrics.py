"""metrics.jsonl (one line per step, rank 0), the end-of-run summary.json and the metrics.png plot."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from launcher.status import format_summary, read_jsonl, summarize


class MetricsWriter:
    def __init__(self, job_dir: Path):
        self.path = job_dir / "metrics.jsonl"

    def write(self, row: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"time": round(time.time(), 3), **row}) + "\n")

    def set_aside_after(self, step: int) -> int:
        """On resume from `step`: the rows of later steps (run by an attempt that died before its next checkpoint,
        so run again now) move to metrics.lost.jsonl, so metrics.jsonl holds each step once. Returns how many."""
        if not self.path.is_file():
            return 0
        keep: list[str] = []
        lost: list[str] = []
        for line in self.path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a line cut by the crash
            (lost if "reward" in row and row.get("step", 0) > step else keep).append(line)
        if lost:
            with open(self.path.with_name("metrics.lost.jsonl"), "a") as f:
                f.write("\n".join(lost) + "\n")
            tmp = self.path.with_name("metrics.jsonl.tmp")
            tmp.write_text("".join(x + "\n" for x in keep))
            tmp.replace(self.path)
        return len(lost)


def write_summary_and_plot(job_dir: Path, extra: dict[str, Any]) -> dict[str, Any]:
    rows = read_jsonl(job_dir / "metrics.jsonl")
    s = {**summarize(rows), **extra}
    (job_dir / "summary.json").write_text(json.dumps(s, indent=2))
    try:
        plot(rows, job_dir / "metrics.png")
    except Exception as e:  # a missing plotting library must not fail a finished run
        print(f"WARNING: could not write metrics.png: {e}", flush=True)
    print("summary: " + format_summary(s), flush=True)
    return s


def plot(rows: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r for r in rows if "reward" in r]
    x = [r["step"] for r in steps]
    fig, ax = plt.subplots(1, 3, figsize=(13, 3.6))
    ax[0].plot(x, [r["reward"] for r in steps], marker=".")
    ax[0].set_title("mean reward")
    ax[1].plot(x, [r.get("kl") or 0.0 for r in steps], marker=".")
    ax[1].set_title("KL (0 when beta = 0)")
    nodes = sorted({n for r in steps for n in (r.get("push_s") or {})})
    for n in nodes:
        ax[2].plot(x, [(r.get("push_s") or {}).get(n, float("nan")) for r in steps], marker=".", label=f"node {n}")
    ax[2].set_title("weight push seconds per node")
    if nodes:
        ax[2].legend()
    for a in ax:
        a.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
