"""Process-tree plumbing for the node bootstrap: a child in its own process group with its own log, and
the sweep that finds and kills every descendant (even one that started its own session)."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import IO

from launcher.core.config import redact_argv
from launcher.node.commands import NodeCommand

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def descendants(pid: int) -> list[int]:
    """Every live descendant of pid (from /proc), so that a grandchild which started its own session
    (torchrun's workers, vLLM's engine core) is still found and stopped."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def become_subreaper() -> None:
    """Orphaned descendants are re-parented to us instead of init, so the final sweep still finds them."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def alive(pid: int) -> bool:
    """Running or stopped; a zombie (dead, not yet reaped) is not alive."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


def kill_all(pids: list[int], wait_s: float = 10.0) -> None:
    """SIGKILL each pid and wait until none is alive, reaping those that are our own children."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    pending, deadline = set(pids), time.time() + wait_s
    while pending and time.time() < deadline:
        for pid in list(pending):
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass  # not our child: its own parent (or init) reaps it
            if not alive(pid):
                pending.discard(pid)
        time.sleep(0.05)


class Proc:
    """A child in its own process group, logging to a file. Signals in ignore_signals are set to SIG_IGN
    for the child (dispositions set to ignore survive exec): the server must outlive the time-limit
    warning that SLURM sends to every process of the step, so that the trainer can finish its step.
    term_leader: stop() sends SIGTERM to the child alone, which stops its own children in its own order (vLLM's API
    server: its engine core after it began its shutdown; with the whole group signalled the engine core also ended by
    itself, and the server logged that as an engine death, EngineDeadError); the group gets SIGKILL after the grace."""

    def __init__(
        self,
        cmd: NodeCommand,
        job_dir: Path,
        node: int,
        grace_s: float = 20.0,
        ignore_signals: tuple[int, ...] = (),
        term_leader: bool = False,
    ):
        self.cmd, self.node, self.grace_s, self.term_leader = cmd, node, grace_s, term_leader
        self.log_path = job_dir / cmd.log
        env = {k: v for k, v in os.environ.items()}
        env.update(cmd.env)
        self._log: IO[bytes] = open(self.log_path, "ab")
        self._log.write(f"\n===== {time.strftime('%F %T')} node {node} {cmd.name}: {' '.join(redact_argv(cmd.argv))}\n".encode())
        self._log.flush()
        saved = {sig: signal.signal(sig, signal.SIG_IGN) for sig in ignore_signals}
        try:
            self.popen = subprocess.Popen(
                cmd.argv, env=env, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        finally:
            for sig, old in saved.items():
                signal.signal(sig, old)
        self.started = time.time()

    def poll(self) -> int | None:
        return self.popen.poll()

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, grace_s: float | None = None) -> None:
        """SIGTERM (and SIGCONT, for a stopped process) the group, SIGKILL the group and every descendant
        found before the stop once grace_s (default: the one given at start) has passed; always reaps."""
        tree = descendants(self.popen.pid)
        if self.popen.poll() is None:
            if self.term_leader:
                self.popen.send_signal(signal.SIGTERM)
            else:
                self.signal(signal.SIGTERM)
            self.signal(signal.SIGCONT)
            try:
                self.popen.wait(self.grace_s if grace_s is None else grace_s)
            except subprocess.TimeoutExpired:
                pass
        self.signal(signal.SIGKILL)
        kill_all(tree + descendants(self.popen.pid))
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()

    def describe(self) -> str:
        return f"{self.cmd.name} (pid {self.popen.pid}, log {self.log_path})"
