"""The submit host's checks as one path: `dry-run` (and `submit`/`resume`/`sweep --dry-run`) lists each kind as ok,
PROBLEM or skipped and fails where a problem is found; `submit`, `resume` and `sweep` refuse on the very same results
before the job folder is written. A sweep's points are checked each, a problem they share reported once."""

from __future__ import annotations

from collections.abc import Iterable

from launcher.core.config import ConfigError
from launcher.core.inputs import CHECK_KINDS, MEMORY, submit_checks, unchecked
from launcher.core.plan import Plan
from launcher.memory import memory_problems

MEMORY_WHAT = "vLLM's bf16 weights fit the memory it gets of its GPUs (launcher/memory.py estimate)"
"""Not a path: skipped only by --skip-checks memory (not all, not --skip-path-checks); unknown where the estimate
cannot tell."""
MEMORY_HINT = "if the memory estimate is wrong for this layout: --skip-checks memory"

Results = dict[str, "list[str] | str | None"]
"""kind -> its problems, one line each ([] = ok); None = skipped (--skip-checks; for memory, unknown here); a string =
nothing there to check, and why (a hub name not downloaded yet, no venv set): shown as skipped, never as ok."""


def run_checks(plans: Iterable[Plan], skip: frozenset[str]) -> Results:
    """Every kind of check over every plan (one job, or a sweep's points), each problem once."""
    plans = list(plans)
    out: Results = {}
    for kind in CHECK_KINDS:
        if kind in skip:
            out[kind] = None
            continue
        found: list[str] = []
        for p in plans:
            found += [x for x in submit_checks(p.config)[kind]() if x not in found]
        why = {unchecked(p.config).get(kind) for p in plans}
        out[kind] = why.pop() if not found and len(why) == 1 and None not in why else found
    if MEMORY in skip:  # a string: shown as skipped, never as ok or unknown
        out[MEMORY] = f"{MEMORY_WHAT} (--skip-checks memory)"
        return out
    mem = [memory_problems(p) for p in plans]
    out[MEMORY] = None if all(m is None for m in mem) else list(dict.fromkeys(x for m in mem for x in m or []))
    return out


def section(results: Results) -> str:
    """The dry-run's listing of the checks."""
    lines = ["# submit-host checks (what submit checks before sbatch; --skip-checks KIND,... skips some)"]
    for kind, found in results.items():
        what = MEMORY_WHAT if kind == MEMORY else CHECK_KINDS[kind]
        state = ("unknown" if kind == MEMORY else "skipped") if found is None else ("PROBLEM" if found else "ok")
        if kind == MEMORY and found is None:
            what += ": cannot tell here (a CPU job, or the model's config.json or slurm.gpu_memory_gb unknown)"
        elif found is None:
            what += " (--skip-checks)"
        elif isinstance(found, str):
            state, what, found = "skipped", found, []
        lines.append(f"  {kind:<8} {state:<8} {what}" + "".join(f"\n    {p}" for p in found or []))
    return "\n".join(lines)


def refusal(results: Results, listed: bool) -> ConfigError | None:
    """The error of a refused submit (None: nothing found). listed: the problems are already printed above (dry-run's
    section), else each is one line of the error."""
    failed = [k for k, found in results.items() if isinstance(found, list) and found]
    if not failed:
        return None
    paths = [k for k in failed if k != MEMORY]
    hints = [f"if those paths exist only on the nodes: --skip-checks {','.join(paths)}, or --skip-path-checks for all"]
    hint = "; ".join([*(hints if paths else []), *([MEMORY_HINT] if MEMORY in failed else [])])
    if listed:
        head = f"submit would refuse this: the {', '.join(failed)} check found problems (above)"
        return ConfigError(f"{head}; fix them" + (f", or {hint}" if hint else ""))
    problems = [
        x for k in failed for x in results[k] or [] if isinstance(results[k], list)
    ]  # one line each, the way out closing the last
    return ConfigError("\n".join(problems) + (f" ({hint})" if hint else ""))
