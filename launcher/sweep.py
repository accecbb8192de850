"""Hyperparameter sweeps as one SLURM job array.

    slurm-grpo sweep CONFIG --grid trainer.learning_rate=1e-6,3e-6 --grid trainer.beta=0,0.04 [--parallel 2]
    slurm-grpo sweep CONFIG --grid 'trainer.reward_funcs=[math_accuracy,think_answer_format],[math_accuracy]'

A --grid's values are YAML, as --set's, split at the commas outside brackets, braces and quotes: a list is one value.

The grid's cartesian product gives the points; each point is an ordinary job folder (its resolved config, plan,
logs, checkpoints, metrics) under the sweep folder as point-000, point-001, ...; sweep.json lists them with their
values. One sbatch submits them all as an array (submitit's array support; `--parallel N` is the %N throttle): task i
runs point-i's plan (`launcher.node.bootstrap --sweep DIR`). The array's tasks share one sbatch header, so a grid cannot
vary slurm.* keys; everything else can vary. `slurm-grpo status SWEEP_DIR` shows every point's state and last reward.
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass
from pathlib import Path

from launcher.core.config import ConfigError, JobConfig, load, override_value, parse_override
from launcher.core.jobdir import JobDir, point_dir
from launcher.core.plan import Plan, plan
from launcher.core.records import read_rows, step_rows

GRID_SYNTAX = (
    "values are YAML split at the commas outside brackets and quotes, e.g. --grid trainer.beta=0,0.04 or "
    "--grid 'trainer.reward_funcs=[a,b],[c]'"
)


def split_values(text: str) -> list[str]:
    """'[a,b],[c],"x,y"' -> ['[a,b]', '[c]', '"x,y"']: split at the commas outside [], {} and quotes. As in YAML, a
    quote or bracket opens only where a value (or, inside brackets, an item) starts: "Let's think" is plain text; ''
    is a quote inside '...', a backslash escapes inside "...". ValueError: a bracket or quote left open, or a bracket
    closed by the other kind."""
    vals: list[str] = []
    depth: list[str] = []
    quote, start, fresh = "", 0, True  # fresh: nothing but blanks since the value's (or the item's) start
    pairs = {"[": "]", "{": "}"}
    i = 0
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\" and quote == '"':
                i += 1
            elif c == quote and quote == "'" and text[i + 1 : i + 2] == "'":
                i += 1
            elif c == quote:
                quote = ""
        elif c.isspace():
            pass
        elif c in "'\"" and fresh:
            quote, fresh = c, False
        elif c in pairs and (fresh or depth):
            depth.append(pairs[c])
        elif c in "]}" and depth:
            if depth.pop() != c:
                raise ValueError(f"{c!r} at character {i + 1} of the values closes no bracket")
            fresh = False
        elif c == ",":
            if not depth:
                vals.append(text[start:i].strip())
                start = i + 1
            fresh = True
        elif c == ":" and depth and text[i + 1 : i + 2] in (" ", ""):
            fresh = True
        else:
            fresh = False
        i += 1
    if quote:
        raise ValueError(f"the quote {quote} is not closed")
    if depth:
        raise ValueError(f"a bracket is not closed ({depth[-1]!r} missing)")
    return [*vals, text[start:].strip()]


def parse_grid(specs: list[str]) -> list[tuple[str, list[str]]]:
    """['trainer.beta=0,0.04', ...] -> [('trainer.beta', ['0', '0.04']), ...]; values stay text for --set, each read
    here as --set reads it so that a bad one fails naming the --grid."""
    grid = []
    for spec in specs:
        key, eq, values = spec.partition("=")
        (section, name), _ = parse_override(f"{key}=0")  # the key's form: section.key
        if not eq or not values.strip():
            raise ConfigError(f"--grid {spec!r} must be section.key=v1,v2,..., e.g. --grid trainer.learning_rate=1e-6,3e-6")
        if section == "slurm" or key in ("job.job_dir", "job.name"):
            raise ConfigError(
                f"--grid {key}: the points of a sweep are the tasks of one job array and share its sbatch header and "
                f"folder; vary trainer/vllm keys (submit separate jobs to compare slurm settings)"
            )
        try:
            vals = split_values(values)
        except ValueError as e:
            raise ConfigError(f"--grid {spec!r}: {e}; {GRID_SYNTAX}") from None
        if any(not v for v in vals) or len(set(vals)) != len(vals):
            raise ConfigError(f"--grid {spec!r}: empty or repeated values; {GRID_SYNTAX}")
        for v in vals:  # read as --set reads it: YAML, a text key's value as typed
            try:
                override_value(f"{key}={v}")
            except ConfigError as e:
                raise ConfigError(f"--grid {spec!r}: {v!r} cannot be read ({e}); {GRID_SYNTAX}") from None
        grid.append((key, vals))
    if not grid:
        raise ConfigError("a sweep needs at least one --grid section.key=v1,v2")
    if len({k for k, _ in grid}) != len(grid):
        raise ConfigError("--grid names the same key twice; list all its values in one --grid")
    return grid


def grid_points(grid: list[tuple[str, list[str]]]) -> list[list[str]]:
    """Every combination, as --set overrides, the first key varying slowest."""
    return [[f"{k}={v}" for (k, _), v in zip(grid, combo)] for combo in itertools.product(*(vals for _, vals in grid))]


@dataclass(frozen=True)
class Point:
    index: int
    overrides: list[str]
    config: JobConfig
    plan: Plan


def plan_sweep(config_path: str, overrides: list[str], grid: list[tuple[str, list[str]]], sweep_dir: Path) -> list[Point]:
    """Load, validate and plan every point (a bad value fails here, naming the point, before anything is written)."""
    points = []
    for i, point in enumerate(grid_points(grid)):
        d = point_dir(sweep_dir, i)
        try:
            cfg = load(config_path, [*overrides, *point, f"job.job_dir={json.dumps(str(d))}"])
            points.append(Point(i, point, cfg, plan(cfg, str(d))))
        except ConfigError as e:
            raise ConfigError(f"sweep point {i} ({' '.join(point)}): {e}") from None
    return points


def sweep_dir_for(cfg: JobConfig, now: float | None = None) -> Path:
    if cfg.job.job_dir:
        return Path(cfg.job.job_dir).expanduser().absolute()
    return (Path("runs") / f"{cfg.job.name}-sweep-{time.strftime('%Y%m%d-%H%M%S', time.localtime(now))}").absolute()


def write_sweep(sweep_dir: Path, grid: list[tuple[str, list[str]]], points: list[Point]) -> None:
    from launcher.core.jobdir import write_job_dir

    sd = JobDir(sweep_dir)
    sd.submitit.mkdir(parents=True, exist_ok=True)  # the array's sbatch file and logs
    for p in points:
        write_job_dir(p.config, p.plan)
    record = {
        "grid": {k: v for k, v in grid},
        "points": [{"index": p.index, "overrides": p.overrides, "job_dir": p.plan.job_dir} for p in points],
    }
    sd.sweep.write_text(json.dumps(record, indent=1))


def grid_table(points: list[Point]) -> list[str]:
    return [f"  point-{p.index:03d}  {' '.join(p.overrides)}" for p in points]


def is_sweep(d: Path) -> bool:
    return JobDir(d).is_sweep()


def sweep_status(sweep_dir: Path) -> str:
    """One line per point: its array task's SLURM state, last step and reward."""
    from launcher.status import q, slurm_state

    sd = JobDir(sweep_dir)
    record = json.loads(sd.sweep.read_text())
    jid = sd.read_job_id()
    lines = [f"sweep folder: {q(sweep_dir)}", f"SLURM job array {jid}" if jid else "not submitted"]
    states = {}
    for ln in slurm_state(jid) if jid else []:
        parts = ln.split("|")
        if len(parts) > 1 and "_" in parts[0] and "." not in parts[0]:
            states[parts[0].split("_", 1)[1]] = parts[1]
    lines.append(f"  {'point':<10} {'state':<12} {'step':>5} {'reward':>8}  values")
    for pt in record["points"]:
        rows = step_rows(read_rows(JobDir(Path(pt["job_dir"])).metrics))
        last = rows[-1] if rows else None
        reward = f"{last.reward:.4f}" if last is not None else "-"
        step = last.step if last is not None else "-"
        state = states.get(str(pt["index"]), "PENDING" if jid else "-")
        lines.append(f"  point-{pt['index']:03d}  {state:<12} {step!s:>5} {reward:>8}  {' '.join(pt['overrides'])}")
    return "\n".join(lines)
