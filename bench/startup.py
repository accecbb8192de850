"""Start-up of a job, first start and restart (a resume of the same job folder), phase by phase:

    python -m bench.startup [--config configs/smoke_cpu.yaml] [--code DIR] [--steps 3] [--more 2]
                            [--out bench/results/<date>-startup/NAME.json] [--set key=value ...]

Runs `slurm-grpo local CONFIG` in a fresh job folder for --steps steps (checkpointing at the end), then again in the
same folder for --more steps (it resumes from that checkpoint: the restart), and prints each start's phases from the
node's events file (launcher.status.startup_phases: server start, trainer launch + rendezvous, model load + shard,
build + first step, vLLM healthy -> step 1, total), plus whether vLLM compiled or read its compile cache (its log).
--code DIR runs another checkout's code (e.g. the commit before a change, from `git archive`) with this venv: the
command runs in DIR, which comes first on the path. On the GPU: --config configs/gpu_1gpu.yaml --set vllm.model=...
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.run import write_results
from launcher.core.jobdir import JobDir
from launcher.status import startup_phases
from launcher.vllm_log import node_starts

REPO = Path(__file__).resolve().parent.parent
COMPILE_LINES = (
    r"init engine \(profile, create kv cache, warmup model\) took [0-9.]+ s",
    r"torch\.compile takes [0-9.]+ s[^\n]*",
    r"Compiling model again due to a load failure[^\n]*reason: [^\n]*",
    r"saved AOT compiled function",
    r"Directly load the compiled graph[^\n]*",
)


CACHE_PATH_LINES = re.compile(
    r"(Using cache directory|Directly load AOT compilation from path|Compiling model again due to a load failure from"
    r"|saved AOT compiled function to):? (\S+?),?(?=\s|$)"
)
"""vLLM's lines that name a compile-cache path: the folder it uses, the AOT graph it loads, fails to load or saves."""


def this_start(log: Path) -> str:
    """The latest start's part of a server log: each start of the server opens its part with a ===== line."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    return text[text.rfind("\n===== ") :]


def compile_cache_use(text: str, job: Path) -> dict:
    """What one start of vLLM did with its compile cache, from its log: the cache paths it named, whether all of them
    lie in the job folder (where a requeue or resume finds them), and whether it loaded the compiled graph from there
    ("loaded"), tried and compiled again ("load failed: REASON"), or compiled with nothing to load ("compiled")."""
    paths = sorted({m.group(2) for m in CACHE_PATH_LINES.finditer(text)})
    root = os.path.realpath(job) + os.sep
    failed = re.search(r"Compiling model again due to a load failure from \S+ reason: ([^\n]*)", text)
    if failed:
        aot = "load failed: " + failed.group(1).strip()[:160]
    elif re.search(r"Directly load (AOT compilation from path|the compiled graph)", text):
        aot = "loaded"
    else:
        aot = "compiled"
    return {
        "paths": paths,
        "in_job_folder": bool(paths) and all(os.path.realpath(x).startswith(root) for x in paths),
        "aot": aot,
    }


def compile_notes(log: Path) -> list[str]:
    """vLLM's own lines about compiling or loading compiled graphs, from this start's part of its log."""
    text = this_start(log)
    out = []
    for pattern in COMPILE_LINES:
        out += [re.sub(r"/\S{40,}", "...", m.group(0))[:200] for m in re.finditer(pattern, text)]
    return out[:6]


def start(code: Path, config: str, job: Path, steps: int, sets: list[str]) -> dict:
    argv = [sys.executable, "-m", "launcher", "local", str(REPO / config), f"job.job_dir={job}"]
    argv += [f"trainer.max_steps={steps}", f"trainer.save_steps={steps}", *sets]
    cmd = [argv[0], *argv[1:5], *[x for s in argv[5:] for x in ("--set", s)]]
    t0 = time.time()
    # every process of the job (bootstrap, vLLM's plugin, ranks) runs `code`, before whatever the path held (a device's
    # carried site-packages)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(x for x in (str(code), os.environ.get("PYTHONPATH", "")) if x)}
    r = subprocess.run(cmd, cwd=code, capture_output=True, text=True, timeout=1800, env=env)
    wall = time.time() - t0
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return {
        "wall_s": round(wall, 1),
        "phases_s": startup_phases(job, 0),
        "compile": compile_notes(JobDir(job).log(0, "vllm")),
        "vllm_phases_s": (node_starts(JobDir(job).log(0, "vllm")) or [{}])[-1],  # this start's, from vLLM's log
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/smoke_cpu.yaml")
    ap.add_argument("--code", default=str(REPO), help="the checkout whose code runs (default: this one)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--more", type=int, default=2, help="steps the restart adds")
    ap.add_argument("--out", default="")
    ap.add_argument("--set", dest="sets", action="append", default=[])
    a = ap.parse_args()
    code = Path(a.code).resolve()
    job = Path(tempfile.mkdtemp(prefix="startup-")) / "job"
    first = start(code, a.config, job, a.steps, a.sets)
    print("first start:", json.dumps(first), flush=True)
    again = start(code, a.config, job, a.steps + a.more, a.sets)
    print("restart:    ", json.dumps(again), flush=True)
    git = subprocess.run(["git", "-C", str(code), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "code": str(code),
        "commit": git.stdout.strip() or ((code / "COMMIT").read_text().strip() if (code / "COMMIT").is_file() else "?"),
        "config": a.config,
        "sets": a.sets,
        "host": platform.node(),
        "python": platform.python_version(),
        "job": str(job),
        "first_start": first,
        "restart": again,
    }
    write_results(a.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
