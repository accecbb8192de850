"""One per node (under srun, or on this machine for `slurm-grpo local`): start the node's vLLM server,
wait for /health with a deadline, start torchrun for the node's trainer ranks, supervise both.

    python -m launcher.bootstrap <job_dir>/plan.json [--node N]

If either side dies, the node's processes are stopped and the bootstrap exits non-zero with a message
naming the node, the process and the log, with its last lines. SIGTERM/SIGUSR2 (preemption, the time
limit warning) are passed to the trainer, which checkpoints; then node 0 requeues the job.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO

from launcher.commands import NodeCommand, trainer_command, vllm_command
from launcher.config import ConfigError
from launcher.topology import FIRST_NODE, Plan

PREEMPTED_EXIT = 3
"""Exit code of a trainer that checkpointed on a preemption signal (the job is requeued, not failed)."""
POLL_S = 0.5


class NodeFailure(RuntimeError):
    """A process of this node died or missed its deadline; the message names node, process and log."""


def tail(path: Path, lines: int = 25) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64_000))
            text = f.read().decode(errors="replace")
    except OSError:
        return f"(no log at {path})"
    return "\n".join("    " + ln for ln in text.splitlines()[-lines:])


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


class Proc:
    """A child in its own process group (so stopping it stops its whole tree), logging to a file."""

    def __init__(self, cmd: NodeCommand, job_dir: Path, node: int):
        self.cmd, self.node = cmd, node
        self.log_path = job_dir / cmd.log
        env = {k: v for k, v in os.environ.items()}
        env.update(cmd.env)
        self._log: IO[bytes] = open(self.log_path, "ab")
        self._log.write(f"\n===== {time.strftime('%F %T')} node {node} {cmd.name}: {' '.join(cmd.argv)}\n".encode())
        self._log.flush()
        self.popen = subprocess.Popen(cmd.argv, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True)
        self.started = time.time()

    def poll(self) -> int | None:
        return self.popen.poll()

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the group, SIGKILL what is left after grace_s; always reaps."""
        if self.popen.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        self.signal(signal.SIGKILL)  # stragglers of the group (vLLM's engine core, torchrun's workers)
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()

    def describe(self) -> str:
        return f"{self.cmd.name} (pid {self.popen.pid}, log {self.log_path})"


def wait_healthy(proc: Proc, url: str, deadline_s: float, node: int, host: str) -> float:
    t0 = time.time()
    while True:
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
    ev = Events(job_dir, node)
    ev("bootstrap_start", host=host, slurm_job=os.environ.get("SLURM_JOB_ID"),
       restart=int(os.environ.get("SLURM_RESTART_COUNT", "0")))
    deadline = float(p.config["vllm"]["health_timeout_s"])
    stall = float(p.config["trainer"]["stall_timeout_s"])
    for port, what in ((p.vllm_port, "vllm.port"), (p.nodes[node].weight_transfer_port, "trainer.weight_transfer_port")):
        check_port_free(port, what, node, host)
    if node == 0:
        check_port_free(p.rendezvous_port, "trainer.rendezvous_port", node, host)

    stop_requested: list[int] = []

    def on_signal(signum, _frame):
        stop_requested.append(signum)

    for sig in (signal.SIGTERM, signal.SIGUSR2, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, on_signal)

    procs: list[Proc] = []
    try:
        vllm = Proc(vllm_command(p, node, python), job_dir, node)
        procs.append(vllm)
        ev("vllm_start", pid=vllm.popen.pid)
        url = p.nodes[node].server_url
        print(f"[bootstrap node {node} {host}] vLLM starting: {vllm.describe()}", flush=True)
        took = wait_healthy(vllm, url, deadline, node, host)
        ev("vllm_healthy", seconds=took)
        print(f"[bootstrap node {node} {host}] vLLM healthy at {url} after {took:.1f} s", flush=True)
        if stop_requested:
            raise NodeFailure(f"node {node}: stopped by signal {stop_requested[0]} before training started")
        trainer = Proc(trainer_command(p, node, rendezvous_host(p), python), job_dir, node)
        procs.append(trainer)
        ev("trainer_start", pid=trainer.popen.pid)
        print(f"[bootstrap node {node} {host}] trainer started: {trainer.describe()}", flush=True)
        return supervise(p, node, host, vllm, trainer, stop_requested, ev, stall)
    except NodeFailure as e:
        ev("failed", error=str(e).splitlines()[0])
        print(f"[bootstrap node {node} {host}] FAILED: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        for pr in reversed(procs):
            pr.stop()
        ev("bootstrap_end")


def _metrics_mtime(job_dir: Path) -> float | None:
    try:
        return (job_dir / "metrics.jsonl").stat().st_mtime
    except OSError:
        return None


def supervise(p: Plan, node: int, host: str, vllm: Proc, trainer: Proc, stop_requested: list[int], ev, stall: float) -> int:
    forwarded = False
    job_dir = Path(p.job_dir)
    while True:
        if stop_requested and not forwarded:
            # preemption or time-limit warning: the trainer checkpoints at its next step boundary and exits 3
            print(f"[bootstrap node {node} {host}] signal {stop_requested[0]}: asking the trainer to checkpoint", flush=True)
            ev("preempt_signal", signum=stop_requested[0])
            trainer.signal(signal.SIGUSR2)
            forwarded = True
        # the server first: when it dies the trainer dies of it a moment later; name the cause
        rc = vllm.poll()
        if rc is not None:
            ev("vllm_exit", code=rc)
            raise NodeFailure(f"node {node} ({host}): vLLM server {vllm.describe()} died with code {rc} during training; "
                              f"stopping the node's trainer ranks\n  last lines of {vllm.log_path}:\n{tail(vllm.log_path)}")
        rc = trainer.poll()
        if rc is not None:
            ev("trainer_exit", code=rc)
            if rc == 0:
                print(f"[bootstrap node {node} {host}] trainer finished", flush=True)
                return 0
            if rc == PREEMPTED_EXIT or forwarded:
                requeue(p, node, host, ev)
                return PREEMPTED_EXIT
            raise NodeFailure(f"node {node} ({host}): trainer {trainer.describe()} exited with code {rc}\n"
                              f"  last lines of {trainer.log_path}:\n{tail(trainer.log_path)}")
        if stall:
            m = _metrics_mtime(job_dir)
            if m is not None and time.time() - max(m, trainer.started) > stall:
                raise NodeFailure(f"node {node} ({host}): no training step for {stall:.0f} s (trainer.stall_timeout_s); "
                                  f"trainer {trainer.describe()}\n  last lines of {trainer.log_path}:\n{tail(trainer.log_path)}")
        time.sleep(POLL_S)


def requeue(p: Plan, node: int, host: str, ev) -> None:
    job = os.environ.get("SLURM_JOB_ID")
    if node != 0 or not job or not p.config["slurm"]["requeue"]:
        return
    out = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    ev("requeue", job=job, code=out.returncode, stderr=out.stderr.strip())
    print(f"[bootstrap node {node} {host}] requeued job {job}: rc={out.returncode} {out.stderr.strip()}", flush=True)


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
