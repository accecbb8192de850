"""What a node's bootstrap knows of the other nodes of its job, through the shared job folder: the abort file
the first failing node writes, and every node's heartbeat. A node that crashed, lost its network or was
killed writes nothing, so only the missing heartbeat can name it."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from launcher.core.jobdir import JobDir
from launcher.core.records import AbortRecord, Heartbeat


class NodeFailure(RuntimeError):
    """A process of this node died or missed its deadline; the message names node, process and log.
    remote: this node stops because another node failed first (it writes no abort file of its own)."""

    def __init__(self, message: str, remote: bool = False):
        super().__init__(message)
        self.remote = remote


class PeerLost(NodeFailure):
    """Other nodes of the job stopped answering (their heartbeat, launcher.node.peers.Heartbeats): lost whole, as a
    node that crashed, lost its network or lost its power. lost: node index -> its host as its heartbeat said ('?' for
    one never seen). launcher.node.lost asks SLURM to act on it at once."""

    def __init__(self, message: str, lost: dict[int, str]):
        super().__init__(message, remote=True)
        self.lost = lost


class JobAbort:
    """logs/abort-<attempt>.json in the shared job folder: the first node that fails writes it, every other
    node's bootstrap sees it within POLL_S and stops its own processes. SLURM's --kill-on-bad-exit does the
    same from outside, but only under srun and without saying why; this names the node that failed first."""

    def __init__(
        self,
        job_dir: Path,
        attempt: str,
        node: int,
        num_nodes: int,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.path = JobDir(job_dir).abort(attempt)
        self.node, self.watch = node, num_nodes > 1
        self.clock, self.sleep = clock, sleep

    def write(self, host: str, error: str) -> None:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # the first failure wins
        except FileExistsError:
            return
        with os.fdopen(fd, "w") as f:
            f.write(AbortRecord(self.node, host, error, time.time()).to_json())

    def settle(self, seconds: float, also: Callable[[], None] = lambda: None) -> None:
        """Wait briefly for another node's abort (or `also` to raise: a node found lost) before claiming to be
        the first failure. Checks once more at the end, so an abort written during the last poll is seen."""
        end = self.clock() + (seconds if self.watch else 0)
        while True:
            self.check()
            also()
            left = end - self.clock()
            if left <= 0:
                return
            self.sleep(min(0.2, left))

    def check(self) -> None:
        if not self.watch or not self.path.exists():
            return
        try:
            a = AbortRecord.from_json(self.path.read_text())
        except (OSError, ValueError, TypeError):
            return  # being written; next poll
        if a.node != self.node:
            raise NodeFailure(
                f"node {self.node}: stopping, because node {a.node} ({a.host}) failed: {a.error}\n"
                f"  see logs/node{a.node}-*.log in the job folder",
                remote=True,
            )


class Heartbeats:
    """logs/heartbeat-<attempt>/node<i>.json, rewritten (a counter and the host) every BEAT_S by each node's
    bootstrap while it runs. A node watches the others' files change, timed by its own clock (so clock skew
    between nodes does not matter): one unchanged for timeout_s is declared lost. A node never seen at all
    gets NEVER_SEEN_S (nodes start at slightly different times; a slow file system or container start)."""

    BEAT_S = 2.0
    NEVER_SEEN_S = 300.0

    def __init__(
        self,
        job_dir: Path,
        attempt: str,
        node: int,
        num_nodes: int,
        host: str,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.jd, self.attempt = JobDir(job_dir), attempt
        self.dir = self.jd.heartbeats(attempt)
        self.node, self.host, self.timeout_s, self.clock = node, host, timeout_s, clock
        self.others = [k for k in range(num_nodes) if k != node]
        self.started = clock()
        self.beats, self.last_beat = 0, float("-inf")
        self.seen: dict[int, tuple[str, float]] = {}
        """Per other node: the content last read and when (this node's clock) it last changed."""

    def beat(self, done: bool = False) -> None:
        now = self.clock()
        if now - self.last_beat < self.BEAT_S and not done:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        self.beats += 1
        path = self.jd.heartbeat(self.attempt, self.node)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(Heartbeat(self.node, self.host, self.beats, done).to_json())
        os.replace(tmp, path)  # readers never see half a file
        self.last_beat = now

    def finish(self) -> None:
        """This node's bootstrap is ending (done, preempted or failed): the others must not call it lost while
        it stops its processes; a failure of its own reaches them through the abort file."""
        self.beat(done=True)

    def check(self) -> None:
        """Beat, then raise PeerLost naming the first other node whose heartbeat stopped (and listing every one)."""
        if not self.others:
            return
        self.beat()
        now = self.clock()
        lost: dict[int, str] = {}
        first = ""
        for k in self.others:
            try:
                text = self.jd.heartbeat(self.attempt, k).read_text()
            except OSError:
                text = ""
            if text and Heartbeat.from_json(text).done:
                continue
            last = self.seen.get(k)
            if last is None or last[0] != text:
                self.seen[k] = (text, now if text else self.started)
                continue
            quiet = now - last[1]
            if text and quiet > self.timeout_s:
                host = Heartbeat.from_json(text).host
                why = f"no heartbeat for {quiet:.0f} s"
            elif not text and quiet > max(self.timeout_s, self.NEVER_SEEN_S):
                host, why = "?", f"no heartbeat at all in the {quiet:.0f} s since this node started"
            else:
                continue
            lost[k] = host
            first = first or (
                f"node {self.node}: stopping, because node {k} ({host}) stopped answering: {why} (crashed, lost its "
                f"network or was killed; job.node_timeout_s={self.timeout_s:g})"
            )
        if lost:
            k, host = next(iter(lost.items()))
            also = ", ".join(f"node {j} ({h})" for j, h in lost.items() if j != k)
            raise PeerLost(
                f"{first}{'; also lost: ' + also if also else ''}\n"
                f"  see logs/node{k}-*.log in the job folder and the scheduler's view of that node (sinfo -n {host})",
                lost,
            )
