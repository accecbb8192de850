"""Where a vLLM server's start went, from its log (the lines vLLM 0.32 prints): the one file that reads them.

Each start of the server opens its part of the node's log with the bootstrap's `===== YYYY-MM-DD HH:MM:SS node N
vllm: ...` line (launcher.node.procs), so a restart's start is told from the first one. vLLM stamps its lines to the
second ("INFO 12-04 18:27:39 [file.py:N] ..."); the phases between them are whole seconds, vLLM's own figures (weights,
torch.compile, graph capture, engine init) are its own:

  imports             the bootstrap's start -> the API server's first line (Python, torch, vLLM, the plugin imported)
  model inspection    -> "Resolved architecture" (a fresh Python process importing the model when vLLM's cache of it
                      is cold and vllm.inspect_in_process is off)
  engine core start   -> the engine core's first line (spawned: a fresh interpreter importing vLLM again; forked: none)
  engine init         vLLM's "init engine (profile, create kv cache, warmup model) took X s", of which
    weights             "Model loading took ... and X seconds"
    torch.compile       "torch.compile took X s in total" (+ whether it compiled or loaded its cache)
    CUDA graphs         the "Graph capturing finished in N secs" lines (memory profiling, then the capture), and the
                        sizes captured
    other               the rest: memory profiling, the KV cache, kernel warm-up (Triton compiles, cached by a restart)
  server up           "init engine" -> "Starting vLLM server on" (routes, the API server's last steps)
"""

from __future__ import annotations

import re
from datetime import datetime
from pathlib import Path

HEADER = re.compile(r"^===== (\d{4})-(\d\d-\d\d \d\d:\d\d:\d\d) ", re.M)
STAMP = r"\((?:{who})[^ )]* pid=\d+\) [A-Z]+ (\d\d-\d\d \d\d:\d\d:\d\d) \[[^\]]*\] ?"
"""vLLM's line prefix: (APIServer pid=1319) INFO 12-04 18:27:39 [api_utils.py:347] (EngineCore_DP0, Worker too)."""

API_FIRST = re.compile(STAMP.format(who="APIServer"))
RESOLVED = re.compile(STAMP.format(who="APIServer") + r"Resolved architecture")
ENGINE_FIRST = re.compile(STAMP.format(who="EngineCore"))
INIT_DONE = re.compile(
    STAMP.format(who="EngineCore") + r"init engine \(profile, create kv cache, warmup model\) took ([0-9.]+) s"
)
SERVING = re.compile(STAMP.format(who="APIServer") + r"Starting vLLM server on")
WEIGHTS = re.compile(r"Model loading took [0-9.]+ GiB(?: memory)? and ([0-9.]+) seconds")
PID = r"^\(\S+ pid=(\d+)\) .*?"
"""A figure's process: with TP or DP > 1 every worker prints its own, at the same time (summed per process, the
slowest process counts)."""
COMPILE = re.compile(PID + r"torch\.compile took ([0-9.]+) s in total", re.M)
COMPILE_LOADED = re.compile(r"Directly load (?:AOT compilation|the compiled graph)")
COMPILE_RETRIED = re.compile(r"Compiling model again due to a load failure")
GRAPHS = re.compile(PID + r"Graph capturing finished in ([0-9.]+) secs", re.M)
GRAPH_SIZES = re.compile(r"Capturing CUDA graphs \(PIECEWISE\):[^|\r\n]*\|[^|\r\n]*\| *\d+/(\d+)")
KV_CACHE = re.compile(r"Available KV cache memory: ([0-9.]+) GiB")
"""A start that sized its KV cache by profiling (not one given --kv-cache-memory-bytes) prints it, per worker."""
FORCED_SPAWN = re.compile(r"We must use the `spawn` multiprocessing start method[^\n]*Reasons: ([^\n]*)")


def slowest(rx: re.Pattern[str], part: str) -> float | None:
    """A figure vLLM prints once per compiled piece or capture pass, summed per process; the slowest process's sum."""
    per: dict[str, float] = {}
    for pid, x in rx.findall(part):
        per[pid] = per.get(pid, 0.0) + float(x)
    return round(max(per.values()), 2) if per else None


def kv_cache_gib(part: str) -> float | None:
    """The KV cache one start measured (GiB, the smallest of its workers'), or None where it measured none."""
    sizes = [float(x) for x in KV_CACHE.findall(part)]
    return min(sizes) if sizes else None


def starts(text: str) -> list[str]:
    """The log's parts, one per start of the server, oldest first (text before the first header is dropped)."""
    cuts = [m.start() for m in HEADER.finditer(text)]
    return [text[a:b] for a, b in zip(cuts, [*cuts[1:], len(text)], strict=True)]


def _when(year: str, stamp: str) -> datetime:
    return datetime.strptime(f"{year}-{stamp}", "%Y-%m-%d %H:%M:%S")


def phases(part: str) -> dict[str, float | str]:
    """The phases of one start (one element of `starts`), in order; those whose lines are missing are left out (a start
    still running, or one that failed part way: the last phase present says how far it came)."""
    head = HEADER.search(part)
    if head is None:
        return {}
    year = head.group(1)
    t0 = _when(year, head.group(2))

    def at(rx: re.Pattern[str]) -> datetime | None:
        m = rx.search(part)
        return _when(year, m.group(1)) if m else None

    marks = [("imports", at(API_FIRST)), ("model inspection", at(RESOLVED)), ("engine core start", at(ENGINE_FIRST))]
    out: dict[str, float | str] = {}
    last = t0
    for name, t in marks:
        if t is None:
            break
        out[name] = (t - last).total_seconds()
        last = t
    forced = FORCED_SPAWN.search(part)
    if forced:
        out["engine core spawned"] = forced.group(1).strip()[:120]
    init = INIT_DONE.search(part)
    weights, compiled, graphs = WEIGHTS.search(part), slowest(COMPILE, part), slowest(GRAPHS, part)
    if weights:
        out["weights"] = float(weights.group(1))
    if compiled is not None:
        out["torch.compile"] = compiled
    if COMPILE_LOADED.search(part) and not COMPILE_RETRIED.search(part):
        out["compile cache"] = "loaded"
    elif COMPILE_RETRIED.search(part):
        out["compile cache"] = "load failed, compiled again"
    elif compiled is not None:
        out["compile cache"] = "compiled"
    if graphs is not None:
        out["CUDA graphs"] = graphs
        sizes = [int(x) for x in GRAPH_SIZES.findall(part)]
        if sizes:
            out["graph sizes"] = max(sizes)
    if init:
        total = float(init.group(2))
        out["engine init"] = total
        spent = sum(float(out[k]) for k in ("weights", "torch.compile", "CUDA graphs") if k in out)
        if spent:  # a CPU build names none of them: its engine init is all there is
            out["other init (profiling, KV cache, kernel warm-up)"] = round(max(0.0, total - spent), 2)
        serving = at(SERVING)
        if serving:
            out["server up"] = (serving - _when(year, init.group(1))).total_seconds()
            out["total"] = (serving - t0).total_seconds()
    return out


def node_starts(log: Path) -> list[dict[str, float | str]]:
    """Every start's phases in a node's vLLM log, oldest first; [] without the log."""
    if not log.is_file():
        return []
    return [phases(p) for p in starts(log.read_text(errors="replace"))]


def describe(ph: dict[str, float | str]) -> str:
    """One line for `slurm-grpo status`: the phases in seconds, the compile's outcome and the graph sizes in words."""
    words = []
    for k, v in ph.items():
        if k == "graph sizes":
            continue
        if k == "CUDA graphs" and "graph sizes" in ph:
            words.append(f"CUDA graphs {float(v):.0f} s ({ph['graph sizes']} sizes)")
        elif isinstance(v, str):
            words.append(f"{k}: {v}")
        else:
            words.append(f"{k} {v:.1f} s" if v < 10 else f"{k} {v:.0f} s")
    return ", ".join(words)
