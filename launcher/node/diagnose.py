"""Log forensics for failure messages: the last lines of a log, and the root cause of a trainer's failure
as torchrun and the ranks wrote it (a rank killed by a signal, else the first exception a rank printed)."""

from __future__ import annotations

import os
import re
from pathlib import Path


def tail(path: Path, lines: int = 25, max_bytes: int = 64_000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            text = f.read().decode(errors="replace")
    except OSError:
        return f"(no log at {path})"
    return "\n".join("    " + ln for ln in text.splitlines()[-lines:])


CAUSE_RE = re.compile(r"^(?:\[rank\d+\]:\s*)?((?:[A-Za-z_][\w.]*\.)?\w*(?:Error|Exception|Interrupt)): (.+)$")
NOT_CAUSES = ("ChildFailedError", "SignalException")
# "stopped by another rank's failure": trainer.parallel.FailureWatch (a rank stopped because another rank failed)
PEER_LOST = (
    "closed by peer",
    "reset by peer",
    "remote worker",
    "Broken pipe",
    "NCCL communicator was aborted",
    "stopped by another rank's failure",
)
# torchrun's failure summary lists every failed rank ("Failures:" and "Root Cause (first observed failure):"). A rank
# killed by a signal (SIGKILL by the OOM killer or a user, SIGSEGV, ...) is this node's own root cause, even when the
# surviving local ranks printed "reset by peer" before it and torchrun, seeing both exits in one poll, named a
# survivor first. SIGTERM is not: torchrun sends it to the survivors itself.
FAILED_RANK_RE = re.compile(
    r"rank\s*:\s*(\d+) \(local_rank: (\d+)\)\s*exitcode\s*:\s*(-\d+) \(pid: (\d+)\)\s*\((\w+)\)",
)
OWN_SIGNALS_EXCLUDE = ("SIGTERM",)


def root_cause(path: Path) -> str:
    """Why the node's trainer failed, from its log's latest start: a rank killed by a signal, as torchrun's
    summary names it, or else the first exception line a rank printed (ranks that die of the first one's
    death - peer closed, SIGTERM - print theirs after it)."""
    text = tail(path, 100_000, max_bytes=4_000_000)
    text = text[max(0, text.rfind("===== ")) :]  # Proc writes this header at each start
    summary = text[text.find("Failures:") :] if "Failures:" in text else text
    killed = [m for m in FAILED_RANK_RE.finditer(summary) if m.group(5) not in OWN_SIGNALS_EXCLUDE]
    if killed:
        rank, local, code, pid, sig = killed[0].groups()
        return (
            f"rank {rank} (local rank {local}, pid {pid}) was killed by {sig} (exit code {code}); "
            f"if nobody sent it, look for the OOM killer in the node's kernel log"
        )
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = CAUSE_RE.match(line.strip())
        if m and not m.group(1).endswith(NOT_CAUSES) and not wrapped(lines[i + 1 : i + 4]):
            return f"{m.group(1).rsplit('.', 1)[-1]}: {m.group(2)}"[:600]
    return ""


ENGINE_ERROR_RE = re.compile(r"^\((?:EngineCore|Engine\d+|Worker)[^)]*\) ERROR \S+ \S+ \[[^\]]+\]\s?(.*)$")
"""A line vLLM's engine core (or a worker) logged at ERROR: `(EngineCore pid=4521) ERROR 12-06 12:10:18 [core.py:1510] ...`."""


def engine_cause(text: str) -> str:
    """The exception that stopped vLLM's engine core, from the server's log: the API server's own traceback ends in
    "Engine core initialization failed. See root cause above", which is all a log's last lines show."""
    text = text[max(0, text.rfind("===== ")) :]  # the log's latest start (Proc writes this header at each)
    for line in text.splitlines():
        m = ENGINE_ERROR_RE.match(line.strip())
        cause = CAUSE_RE.match(m.group(1).strip()) if m else None
        if cause and not cause.group(1).endswith(NOT_CAUSES):
            return f"{cause.group(1).rsplit('.', 1)[-1]}: {cause.group(2)}"[:600]
    return ""


def wrapped(following: list[str]) -> bool:
    """An exception re-raised `from` it by our own code follows it ("direct cause"): that outer one says what was
    being done (the push at step N of node K) and names the inner cause itself, so it is the line to report."""
    return any("The above exception was the direct cause of the following exception" in ln for ln in following)
