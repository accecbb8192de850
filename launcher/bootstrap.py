"""One per node (under srun, or on this machine for `slurm-grpo local`): start the node's vLLM server,
wait for /health with a deadline, start torchrun for the node's trainer ranks, supervise both.

    python -m launcher.bootstrap <job_dir>/plan.json [--node N]

Before anything starts, the node checks its ports, its model folder and its dataset (launcher.preflight).
If either process dies or misses its deadline, the node's processes (and every descendant, even one that
left their process group) are stopped and the bootstrap exits non-zero with a message naming the node,
the process and the log, with its last lines; it also writes logs/abort-<attempt>.json, which the other
nodes' bootstraps watch, so the whole job stops, not only the failed node. SIGTERM/SIGUSR2 (preemption,
the time-limit warning) are passed to the trainer, which checkpoints at the step boundary; once that
checkpoint is on disk the job is requeued (under SLURM with slurm.requeue) and resumes from it.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO

from launcher.commands import NodeCommand, redact_argv, trainer_command, vllm_command
from launcher.config import ConfigError
from launcher.jobdir import checkpoint_meta, complete_checkpoints
from launcher.preflight import PreflightError, check_node_inputs
from launcher.topology import FIRST_NODE, Plan

PREEMPTED_EXIT = 3
"""Exit code of a trainer that checkpointed on a preemption signal (the job is requeued, not failed)."""
POLL_S = 0.5


class NodeFailure(RuntimeError):
    """A process of this node died or missed its deadline; the message names node, process and log.
    remote: this node stops because another node failed first (it writes no abort file of its own)."""

    def __init__(self, message: str, remote: bool = False):
        super().__init__(message)
        self.remote = remote


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
PEER_LOST = ("closed by peer", "reset by peer", "remote worker", "Broken pipe", "NCCL communicator was aborted")
# torchrun's failure summary: a first observed failure that is a signal (SIGKILL by the OOM killer or a user)
# is this node's own root cause, even when the surviving local ranks printed "reset by peer" before it
KILLED_RE = re.compile(r"Root Cause \(first observed failure\):.*?rank\s*:\s*(\d+) \(local_rank: (\d+)\)"
                       r".*?exitcode\s*:\s*(-\d+) \(pid: (\d+)\)\s*\((\w+)\)", re.S)


def root_cause(path: Path) -> str:
    """Why the node's trainer failed, from its log's latest start: a rank killed by a signal, as torchrun's
    summary names it, or else the first exception line a rank printed (ranks that die of the first one's
    death - peer closed, SIGTERM - print theirs after it)."""
    text = tail(path, 100_000, max_bytes=4_000_000)
    text = text[max(0, text.rfind("===== ")):]  # Proc writes this header at each start
    k = KILLED_RE.search(text)
    if k:
        rank, local, code, pid, sig = k.groups()
        return (f"rank {rank} (local rank {local}, pid {pid}) was killed by {sig} (exit code {code}); "
                f"if nobody sent it, look for the OOM killer in the node's kernel log")
    for line in text.splitlines():
        m = CAUSE_RE.match(line.strip())
        if m and not m.group(1).endswith(NOT_CAUSES):
            return f"{m.group(1).rsplit('.', 1)[-1]}: {m.group(2)}"[:600]
    return ""


def torchrun_compatible(argv: list[str]) -> list[str]:
    """torchrun gained --shutdown-timeout after 2.11: drop it (and its value) for an older torch on the node."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        major, minor = (int(x) for x in version("torch").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return argv
    if (major, minor) >= (2, 12) or "--shutdown-timeout" not in argv:
        return argv
    i = argv.index("--shutdown-timeout")
    return argv[:i] + argv[i + 2:]


def node_index(arg: int | None) -> int:
    if arg is not None:
        return arg
    if "SLURM_NODEID" in os.environ:
        return int(os.environ["SLURM_NODEID"])
    return 0


def rendezvous_host(p: Plan) -> str:
    if p.rendezvous_host != FIRST_NODE:
        return p.rendezvous_host
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if not nodelist:
        raise NodeFailure("plan needs the first node of the SLURM allocation as rendezvous host, "
                          "but SLURM_JOB_NODELIST is not set (run it under sbatch/srun, or use `slurm-grpo local`)")
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
    if out.returncode != 0 or not out.stdout.split():
        raise NodeFailure(f"`scontrol show hostnames {nodelist}` failed: {out.stderr.strip()}")
    return out.stdout.split()[0]


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
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
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
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
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
    warning that SLURM sends to every process of the step, so that the trainer can finish its step."""

    def __init__(self, cmd: NodeCommand, job_dir: Path, node: int, grace_s: float = 20.0,
                 ignore_signals: tuple[int, ...] = ()):
        self.cmd, self.node, self.grace_s = cmd, node, grace_s
        self.log_path = job_dir / cmd.log
        env = {k: v for k, v in os.environ.items()}
        env.update(cmd.env)
        self._log: IO[bytes] = open(self.log_path, "ab")
        self._log.write(f"\n===== {time.strftime('%F %T')} node {node} {cmd.name}: {' '.join(redact_argv(cmd.argv))}\n".encode())
        self._log.flush()
        saved = {sig: signal.signal(sig, signal.SIG_IGN) for sig in ignore_signals}
        try:
            self.popen = subprocess.Popen(cmd.argv, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True)
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

    def stop(self) -> None:
        """SIGTERM (and SIGCONT, for a stopped process) the group, SIGKILL the group and every descendant
        found before the stop once grace_s has passed; always reaps."""
        tree = descendants(self.popen.pid)
        if self.popen.poll() is None:
            self.signal(signal.SIGTERM)
            self.signal(signal.SIGCONT)
            try:
                self.popen.wait(self.grace_s)
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


class JobAbort:
    """logs/abort-<attempt>.json in the shared job folder: the first node that fails writes it, every other
    node's bootstrap sees it within POLL_S and stops its own processes. SLURM's --kill-on-bad-exit does the
    same from outside, but only under srun and without saying why; this names the node that failed first."""

    def __init__(self, job_dir: Path, attempt: str, node: int, num_nodes: int):
        self.path = job_dir / "logs" / f"abort-{attempt}.json"
        self.node, self.watch = node, num_nodes > 1

    def write(self, host: str, error: str) -> None:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # the first failure wins
        except FileExistsError:
            return
        with os.fdopen(fd, "w") as f:
            json.dump({"node": self.node, "host": host, "error": error, "t": time.time()}, f)

    def settle(self, seconds: float) -> None:
        """Wait briefly for another node's abort before claiming to be the first failure."""
        end = time.time() + (seconds if self.watch else 0)
        while time.time() < end:
            self.check()
            time.sleep(0.2)

    def check(self) -> None:
        if not self.watch or not self.path.exists():
            return
        try:
            a = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return  # being written; next poll
        if a["node"] != self.node:
            raise NodeFailure(f"node {self.node}: stopping, because node {a['node']} ({a['host']}) failed: {a['error']}\n"
                              f"  see logs/node{a['node']}-*.log in the job folder", remote=True)


def attempt_id() -> str:
    """Names one start of the job, the same on every node: SLURM job id and restart count (requeues)."""
    if os.environ.get("SLURM_JOB_ID"):
        return f"{os.environ['SLURM_JOB_ID']}.{os.environ.get('SLURM_RESTART_COUNT', '0')}"
    return f"local.{os.getpid()}.{int(time.time())}"


def wait_healthy(proc: Proc, url: str, deadline_s: float, node: int, host: str, abort: JobAbort) -> float:
    t0 = time.time()
    while True:
        abort.check()
        rc = proc.poll()
        if rc is not None:
            hint = ""
            text = tail(proc.log_path, 200)
            if "Failed to load plugin" in text or "Unsupported backend" in text or "gloo" in text and "not registered" in text:
                hint = ("\n  hint: the project's vLLM plugin did not load (is slurm-grpo installed with `pip install -e .` "
                        "in the job's environment, and is there no folder named 'trainer' shadowing it in the cwd?)")
            raise NodeFailure(f"node {node} ({host}): vLLM server {proc.describe()} exited with code {rc} before it "
                              f"was healthy at {url}{hint}\n  last lines of {proc.log_path}:\n{tail(proc.log_path)}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return time.time() - t0
        except (urllib.error.URLError, OSError, TimeoutError):
            pass
        if time.time() - t0 > deadline_s:
            raise NodeFailure(f"node {node} ({host}): vLLM server {proc.describe()} not healthy at {url} after "
                              f"{deadline_s:.0f} s (vllm.health_timeout_s)\n  last lines of {proc.log_path}:\n{tail(proc.log_path)}")
        time.sleep(POLL_S)


def check_port_free(port: int, what: str, node: int, host: str) -> None:
    s = socket.socket()
    # SO_REUSEADDR as the servers themselves use it: a port in TIME_WAIT after the last run is free, a listener is not
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("127.0.0.1", port))
    except OSError:
        raise NodeFailure(f"node {node} ({host}): port {port} ({what}) is already in use on this node; "
                          f"stop what holds it (`ss -ltnp 'sport = :{port}'`) or pick another port in the config") from None
    finally:
        s.close()


def preflight(p: Plan, node: int, host: str) -> None:
    """Everything that can be checked before a process starts, so a bad input costs seconds, not a minute."""
    for port, what in ((p.vllm_port, "vllm.port"), (p.nodes[node].weight_transfer_port, "trainer.weight_transfer_port")):
        check_port_free(port, what, node, host)
    if node == 0:
        check_port_free(p.rendezvous_port, "trainer.rendezvous_port", node, host)
    try:
        check_node_inputs(p.config)
    except PreflightError as e:
        raise NodeFailure(f"node {node} ({host}): {e}") from None


class Events:
    """logs/node{i}-events.jsonl: phase timestamps (server start, healthy, trainer start, exits)."""

    def __init__(self, job_dir: Path, node: int):
        self.path = job_dir / "logs" / f"node{node}-events.jsonl"
        self.node = node

    def __call__(self, event: str, **kw) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"t": time.time(), "node": self.node, "event": event, **kw}) + "\n")


def run_node(p: Plan, node: int) -> int:
    job_dir = Path(p.job_dir)
    (job_dir / "logs").mkdir(parents=True, exist_ok=True)
    host = socket.gethostname()
    python = sys.executable
    attempt = attempt_id()
    ev = Events(job_dir, node)
    ev("bootstrap_start", host=host, slurm_job=os.environ.get("SLURM_JOB_ID"), attempt=attempt,
       restart=int(os.environ.get("SLURM_RESTART_COUNT", "0")))
    abort = JobAbort(job_dir, attempt, node, p.num_nodes)
    become_subreaper()

    stop_requested: list[int] = []

    def on_signal(signum, _frame):
        stop_requested.append(signum)

    for sig in (signal.SIGTERM, signal.SIGUSR2, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, on_signal)

    procs: list[Proc] = []
    try:
        preflight(p, node, host)
        vllm = Proc(vllm_command(p, node, python), job_dir, node, ignore_signals=(signal.SIGUSR1, signal.SIGUSR2))
        procs.append(vllm)
        ev("vllm_start", pid=vllm.popen.pid)
        url = p.nodes[node].server_url
        print(f"[bootstrap node {node} {host}] vLLM starting: {vllm.describe()}", flush=True)
        took = wait_healthy(vllm, url, float(p.config["vllm"]["health_timeout_s"]), node, host, abort)
        ev("vllm_healthy", seconds=took)
        print(f"[bootstrap node {node} {host}] vLLM healthy at {url} after {took:.1f} s", flush=True)
        if stop_requested:
            raise NodeFailure(f"node {node}: stopped by signal {stop_requested[0]} before training started")
        cmd = trainer_command(p, node, rendezvous_host(p), python)
        cmd = NodeCommand(cmd.name, torchrun_compatible(cmd.argv), dict(cmd.env), cmd.log)
        cmd.env["SLURM_GRPO_ATTEMPT"] = attempt
        # torchrun's own shutdown waits up to its --shutdown-timeout for the ranks' checkpoint: outwait it
        trainer = Proc(cmd, job_dir, node, grace_s=max(30, int(p.config["slurm"]["signal_seconds"]) - 30) + 10)
        procs.append(trainer)
        ev("trainer_start", pid=trainer.popen.pid)
        print(f"[bootstrap node {node} {host}] trainer started: {trainer.describe()}", flush=True)
        return supervise(p, node, host, vllm, trainer, stop_requested, ev, abort, attempt)
    except NodeFailure as e:
        first = str(e).splitlines()[0]
        ev("failed", error=first, remote=e.remote)
        if not e.remote:
            abort.write(host, first)
        print(f"[bootstrap node {node} {host}] FAILED: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        for pr in reversed(procs):
            pr.stop()
        kill_all(descendants(os.getpid()))  # anything re-parented to us (subreaper) that outlived its parent
        ev("bootstrap_end")


def _metrics_mtime(job_dir: Path) -> float | None:
    try:
        return (job_dir / "metrics.jsonl").stat().st_mtime
    except OSError:
        return None


def preempt_checkpoint(job_dir: Path, attempt: str) -> tuple[int, Path] | None:
    """The checkpoint this attempt wrote on a preemption signal, if it is complete on disk."""
    done = complete_checkpoints(job_dir / "checkpoints")
    if not done:
        return None
    meta = checkpoint_meta(done[-1][1])
    return done[-1] if meta.get("reason") == "preempt" and meta.get("attempt") == attempt else None


def supervise(p: Plan, node: int, host: str, vllm: Proc, trainer: Proc, stop_requested: list[int], ev,
              abort: JobAbort, attempt: str) -> int:
    forwarded = False
    job_dir = Path(p.job_dir)
    stall = float(p.config["trainer"]["stall_timeout_s"])
    while True:
        abort.check()
        if stop_requested and not forwarded:
            # preemption or time-limit warning: the trainer checkpoints at its next step boundary and exits
            print(f"[bootstrap node {node} {host}] signal {stop_requested[0]}: asking the trainer to checkpoint", flush=True)
            ev("preempt_signal", signum=stop_requested[0])
            trainer.signal(signal.SIGUSR2)
            forwarded = True
        # the server first: when it dies the trainer dies of it a moment later, but name the cause. During
        # a preemption SLURM may have stopped the server itself; the trainer's checkpoint does not need it.
        rc = vllm.poll()
        if rc is not None and not stop_requested:
            ev("vllm_exit", code=rc)
            raise NodeFailure(f"node {node} ({host}): vLLM server {vllm.describe()} died with code {rc} during training; "
                              f"stopping the node's trainer ranks\n  last lines of {vllm.log_path}:\n{tail(vllm.log_path)}")
        rc = trainer.poll()
        if rc is not None:
            ev("trainer_exit", code=rc)
            if rc == 0:
                print(f"[bootstrap node {node} {host}] trainer finished", flush=True)
                return 0
            # torchrun reports any failed rank as 1, so the checkpoint on disk, not the code, says "preempted"
            ck = preempt_checkpoint(job_dir, attempt)
            if ck is not None:
                print(f"[bootstrap node {node} {host}] checkpointed step {ck[0]} on a preemption signal ({ck[1]})", flush=True)
                requeue(p, node, host, ev)
                return PREEMPTED_EXIT
            why = f" after signal {stop_requested[0]} (no preemption checkpoint was written)" if stop_requested else ""
            cause = root_cause(trainer.log_path)
            # a rank that died of another node's failure (its peers vanished): wait for that node's abort,
            # which names the real cause, before claiming to be the first failure
            abort.settle(30.0 if any(m in cause for m in PEER_LOST) else 3.0)
            raise NodeFailure(f"node {node} ({host}): {trainer.describe()} exited with code {rc}{why}"
                              f"{': ' + cause if cause else ''}\n"
                              f"  last lines of {trainer.log_path}:\n{tail(trainer.log_path)}")
        if stall:
            m = _metrics_mtime(job_dir)
            if m is not None and time.time() - max(m, trainer.started) > stall:
                raise NodeFailure(f"node {node} ({host}): no training step for {stall:.0f} s (trainer.stall_timeout_s); "
                                  f"{trainer.describe()}\n  last lines of {trainer.log_path}:\n{tail(trainer.log_path)}")
        time.sleep(POLL_S)


def requeue(p: Plan, node: int, host: str, ev) -> None:
    """Every node asks (the first request wins, the others get a harmless error): with --kill-on-bad-exit the
    first node to exit may take the others down before they could ask."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        print(f"[bootstrap node {node} {host}] preempted outside SLURM: run the same command again to resume", flush=True)
        return
    if not p.config["slurm"]["requeue"]:
        print(f"[bootstrap node {node} {host}] slurm.requeue is off: resubmit the config to resume", flush=True)
        return
    out = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    ev("requeue", job=job, code=out.returncode, stderr=out.stderr.strip())
    print(f"[bootstrap node {node} {host}] requeue job {job}: rc={out.returncode} {out.stderr.strip()}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m launcher.bootstrap", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("plan", help="the job's plan.json")
    ap.add_argument("--node", type=int, default=None, help="node index (default: $SLURM_NODEID, else 0)")
    a = ap.parse_args(argv)
    try:
        p = Plan.load(a.plan)
    except ConfigError as e:
        print(f"bootstrap: {e}", file=sys.stderr)
        return 2
    node = node_index(a.node)
    if not 0 <= node < p.num_nodes:
        print(f"bootstrap: node index {node} is outside the plan's {p.num_nodes} nodes", file=sys.stderr)
        return 2
    return run_node(p, node)


if __name__ == "__main__":
    sys.exit(main())
