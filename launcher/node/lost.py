"""A whole node of a SLURM job lost (its heartbeat stopped: launcher.node.peers.PeerLost): ask slurmctld to act now.

The surviving nodes stop their own processes within job.node_timeout_s, but SLURM keeps srun, the batch script and
slurmstepd waiting until it declares the lost node DOWN itself (SlurmdTimeout: often 300 s) and only then requeues the
job. So ONE survivor asks at once: the lowest-index node not lost (every node computes the same choice from the plan
and the lost set, so exactly one asks). With slurm.requeue: requeue the job held, exclude the lost hosts (added to any
exclusion it had; SLURM takes ExcNodeList only from a pending job), release it; the copy starts on healthy nodes and
resumes from the last checkpoint (not on slurm-wlm 22.05 for a GRES job: its restart fails at the first srun, so this
is slurm.node_loss_action requeue_now, not the default). Without requeue: cancel the job (nothing to requeue; the
default). Outside SLURM, or with no scontrol on
the node (a container image), nothing is asked: SLURM's own verdict ends the job, as before.
Every command has a deadline; a failure is logged with the command and its stderr and never hides the node's loss.
"""

from __future__ import annotations

import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

COMMAND_TIMEOUT_S = 15.0
"""Each scontrol/scancel call: slurmctld answers in well under a second when it is up."""
PENDING_WAIT_S = 2.0
"""After the requeue, how long a refused exclusion is retried. slurm-wlm 22.05 refuses ExcNodeList while the job runs
("Job is no longer pending execution") and takes it at once after `requeuehold` (the job is then held, COMPLETING on
the lost node until SLURM declares it down); short, because the requeue also stops this bootstrap: SIGTERM at once,
SIGKILL after the site's KillWait (30 s by default, 5 s on the test cluster)."""


def asker(num_nodes: int, lost: Iterable[int]) -> int | None:
    """The node that asks SLURM: the lowest index not lost (None when every node is)."""
    gone = set(lost)
    return next((k for k in range(num_nodes) if k not in gone), None)


@dataclass(frozen=True)
class Asked:
    """One command sent to SLURM and its answer."""

    argv: list[str]
    code: int
    stderr: str
    seconds: float
    stdout: str = ""

    def as_dict(self) -> dict[str, object]:
        return {"argv": self.argv, "code": self.code, "stderr": self.stderr, "seconds": round(self.seconds, 2)}


def run_command(argv: list[str]) -> Asked:
    """Run one SLURM command with its deadline; a missing command raises FileNotFoundError (the caller says so)."""
    t0 = time.monotonic()
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, preexec_fn=ignore_sigterm)
    except subprocess.TimeoutExpired:
        return Asked(argv, 124, f"no answer within {COMMAND_TIMEOUT_S:g} s", time.monotonic() - t0)
    return Asked(argv, out.returncode, out.stderr.strip()[:500], time.monotonic() - t0, out.stdout)


def ignore_sigterm() -> None:
    """In the command's process, before it runs: the requeue makes slurmstepd SIGTERM every process of the job, the
    `scontrol update` and `release` that follow it included; ignored (inherited across exec), they still get sent."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def excluded(show_job: str) -> str:
    """The job's ExcNodeList from `scontrol show job` ('' for none)."""
    m = re.search(r"\bExcNodeList=(\S*)", show_job)
    return "" if not m or m.group(1) == "(null)" else m.group(1)


def lost_hosts(lost: dict[int, str], hosts: Sequence[str]) -> list[str]:
    """SLURM's names of the lost nodes: from the job's node list by index, else as their heartbeat said."""
    out = []
    for k, host in sorted(lost.items()):
        name = hosts[k] if k < len(hosts) else host
        if name and name != "?":
            out.append(name)
    return out


def commands(job: str, requeue: bool, exclude: Sequence[str], already: str) -> list[list[str]]:
    """What to ask, in order: requeue held, exclude, release; or, without requeue, cancel."""
    if not requeue:
        return [["scancel", job]]
    steps = [["scontrol", "requeuehold", job]]
    if exclude:
        steps.append(
            ["scontrol", "update", f"JobId={job}", f"ExcNodeList={','.join([already, *exclude] if already else exclude)}"]
        )
    steps.append(["scontrol", "release", job])
    return steps


def ask(
    job: str,
    nodelist: str,
    lost: dict[int, str],
    requeue: bool,
    say: Callable[[str], None],
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> list[Asked]:
    """Ask SLURM to act on the lost nodes now (see the module's docstring); every command sent, with its answer, in
    order. A refused exclusion is retried while the requeued job is not yet pending (PENDING_WAIT_S); the release is
    sent whatever the exclusion answered (a held job never starts by itself). FileNotFoundError: no scontrol/scancel."""
    done: list[Asked] = []
    hosts: list[str] = []
    already = ""
    if requeue:  # the lost nodes' SLURM names and the job's own exclusion; without them, the heartbeat's names only
        for argv in ([["scontrol", "show", "hostnames", nodelist]] if nodelist else []) + [["scontrol", "show", "job", job]]:
            a = run_command(argv)
            done.append(a)
            if a.code != 0:
                say(f"`{' '.join(argv)}` failed (rc {a.code}): {a.stderr}")
            elif argv[2] == "hostnames":
                hosts = a.stdout.split()
            else:
                already = excluded(a.stdout)
    for argv in commands(job, requeue, lost_hosts(lost, hosts), already):
        a = run_command(argv)
        end = clock() + PENDING_WAIT_S
        while a.code != 0 and argv[1:2] == ["update"] and clock() < end:
            sleep(0.5)
            a = run_command(argv)
        done.append(a)
        if a.code != 0:
            say(f"`{' '.join(argv)}` failed (rc {a.code}): {a.stderr}")
            if argv[1:2] == ["requeuehold"]:
                break  # nothing held, nothing to release: SLURM's own verdict requeues the job later
    return done
