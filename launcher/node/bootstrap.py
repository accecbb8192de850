"""One per node (under srun, or on this machine for `slurm-grpo local`): start the node's vLLM server and torchrun
for the node's trainer ranks together (they load while vLLM starts and wait for its /health themselves; with
trainer.start_with_server false, torchrun once the server is healthy), watch /health with a deadline, supervise both.

    python -m launcher.node.bootstrap <job_dir>/plan.json [--node N]

Before anything starts, the node checks its ports, its model folder and its dataset (launcher.core.inputs).
If either process dies or misses its deadline, the node's processes (and every descendant, even one that
left their process group) are stopped and the bootstrap exits non-zero with a message naming the node,
the process and the log, with its last lines; it also writes logs/abort-<attempt>.json, which the other
nodes' bootstraps watch, so the whole job stops, not only the failed node. SIGTERM/SIGUSR2 (preemption,
the time-limit warning) are passed to the trainer, which checkpoints at the step boundary; once that
checkpoint is on disk the job is requeued (under SLURM with slurm.requeue) and resumes from it.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from launcher.core.config import ConfigError
from launcher.core.inputs import PreflightError, check_node_inputs
from launcher.core.jobdir import PREEMPTED_EXIT, Env, Events, JobDir, checkpoint_meta, remove_pushed_adapters
from launcher.core.plan import FIRST_NODE, Plan
from launcher.core.records import Event
from launcher.node import kv_reuse
from launcher.node.commands import NodeCommand, trainer_command, vllm_command
from launcher.node.diagnose import PEER_LOST, engine_cause, root_cause, tail
from launcher.node.lost import ask, asker
from launcher.node.peers import Heartbeats, JobAbort, NodeFailure, PeerLost
from launcher.node.procs import Proc, become_subreaper, descendants, kill_all
from launcher.node.reach import check_reach, node_allocation

POLL_S = 0.5
FAILED_STOP_GRACE_S = 5.0
"""After a failure, how long the node's processes get between SIGTERM and SIGKILL. Nothing is saved on this
path (a preemption checkpoint is not a failure), and a server stuck in a broken transfer would otherwise use
its whole graceful-shutdown grace (20 s): with the trainer's immediate exit on error, this cut the stop after a
15 s push deadline from 19-41 s to 16-17 s."""


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
    return argv[:i] + argv[i + 2 :]


def node_index(arg: int | None) -> int:
    if arg is not None:
        return arg
    if "SLURM_NODEID" in os.environ:
        value = os.environ["SLURM_NODEID"]
        if not value.strip().isdigit():
            raise ConfigError(f"SLURM_NODEID={value!r} is not a node index; pass --node N")
        return int(value)
    return 0


def rendezvous_host(p: Plan) -> str:
    if p.rendezvous_host != FIRST_NODE:
        return p.rendezvous_host
    if os.environ.get(Env.FIRST_NODE):  # resolved by the batch script on the host (a container may lack scontrol)
        return os.environ[Env.FIRST_NODE]
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if not nodelist:
        raise NodeFailure(
            "plan needs the first node of the SLURM allocation as rendezvous host, "
            "but SLURM_JOB_NODELIST is not set (run it under sbatch/srun, or use `slurm-grpo local`)"
        )
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
    if out.returncode != 0 or not out.stdout.split():
        raise NodeFailure(f"`scontrol show hostnames {nodelist}` failed: {out.stderr.strip()}")
    return out.stdout.split()[0]


def attempt_id() -> str:
    """Names one start of the job, the same on every node: SLURM job id and restart count (requeues)."""
    if os.environ.get("SLURM_JOB_ID"):
        return f"{os.environ['SLURM_JOB_ID']}.{os.environ.get('SLURM_RESTART_COUNT', '0')}"
    return f"local.{os.getpid()}.{int(time.time())}"


@dataclass(frozen=True)
class NodeRun:
    """This node in this attempt of the job: what every message, event and abort of the node needs."""

    plan: Plan
    node: int
    host: str
    attempt: str
    events: Events
    abort: JobAbort
    heartbeats: Heartbeats

    def check_peers(self) -> None:
        """Beat; stop (NodeFailure) if another node failed or stopped answering. Called every poll."""
        self.abort.check()
        self.heartbeats.check()

    @property
    def job_dir(self) -> Path:
        return Path(self.plan.job_dir)

    @property
    def where(self) -> str:
        return f"node {self.node} ({self.host})"

    def say(self, message: str) -> None:
        print(f"[bootstrap node {self.node} {self.host}] {message}", flush=True)


class Supervised(Protocol):
    """What the bootstrap needs of a child process (launcher.node.procs.Proc; a fake one in the unit tests)."""

    log_path: Path
    started: float

    def poll(self) -> int | None: ...
    def signal(self, sig: int) -> None: ...
    def describe(self) -> str: ...


class HealthWatch:
    """The node's server until it first answers /health, one look at a time (`poll`), so the bootstrap can watch it
    while the trainer ranks start beside it (trainer.start_with_server). NodeFailure when the server exits first
    or the deadline (vllm.health_timeout_s, from the server's start) passes, naming the node, the server and its log."""

    def __init__(self, proc: Supervised, url: str, deadline_s: float, where: str) -> None:
        self.proc, self.url, self.deadline_s, self.where = proc, url, deadline_s, where
        self.t0 = time.time()
        self.took: float | None = None
        """Seconds from the server's start to its first healthy answer; None until then."""

    def poll(self) -> bool:
        """True once the server has answered /health (it is not asked again)."""
        if self.took is not None:
            return True
        rc = self.proc.poll()
        if rc is not None:
            raise _exited_before_healthy(self.proc, rc, self.url, self.where)
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                if r.status == 200:
                    self.took = time.time() - self.t0
                    return True
        except (urllib.error.URLError, OSError, TimeoutError):
            pass
        if time.time() - self.t0 > self.deadline_s:
            proc = self.proc
            raise NodeFailure(
                f"{self.where}: vLLM server {proc.describe()} not healthy at {self.url} after "
                f"{self.deadline_s:.0f} s (vllm.health_timeout_s){_timeout_hint(proc.log_path)}\n  last lines of "
                f"{proc.log_path}:\n{tail(proc.log_path)}"
            )
        return False


def _timeout_hint(log: Path) -> str:
    """A server that never reached its engine core's first line: a forked engine core can hang on a lock or thread the
    API server held (vllm.engine_start auto forks a one-worker CUDA server)."""
    text = tail(log, 400)
    if "EngineCore" in text or "Engine000" in text:
        return ""
    return (
        "\n  hint: the engine core never logged; if it was forked (vllm.engine_start: auto or fork), try "
        "--set vllm.engine_start=spawn"
    )


def _engine_error(log: Path) -> str:
    """The engine core's own error line for a failure message ("" if none): the log's last lines show only the API
    server's "See root cause above"."""
    cause = engine_cause(tail(log, 2000, max_bytes=1_000_000))
    return f"\n  the engine core's error: {cause}" if cause else ""


def _died_during_training(proc: Supervised, rc: int, where: str) -> NodeFailure:
    return NodeFailure(
        f"{where}: vLLM server {proc.describe()} died with code {rc} during training; stopping the node's trainer "
        f"ranks{_engine_error(proc.log_path)}\n  last lines of {proc.log_path}:\n{tail(proc.log_path)}"
    )


def _exited_before_healthy(proc: Supervised, rc: int, url: str, where: str) -> NodeFailure:
    hint = ""
    text = tail(proc.log_path, 200)
    if "Failed to load plugin" in text or "Unsupported backend" in text or "gloo" in text and "not registered" in text:
        hint = (
            "\n  hint: the project's vLLM plugin did not load (is slurm-grpo installed with `pip install -e .` "
            "in the job's environment, and is there no folder named 'trainer' shadowing it in the cwd?)"
        )
    hint = _engine_error(proc.log_path) + hint
    return NodeFailure(
        f"{where}: vLLM server {proc.describe()} exited with code {rc} before it "
        f"was healthy at {url}{hint}\n  last lines of {proc.log_path}:\n{tail(proc.log_path)}"
    )


def wait_healthy(proc: Supervised, url: str, deadline_s: float, where: str, check: Callable[[], None] = lambda: None) -> float:
    """Seconds until the server answers /health; NodeFailure if it exits first or the deadline passes.
    check: called every poll (the other nodes' abort file), raises to stop waiting."""
    health = HealthWatch(proc, url, deadline_s, where)
    while True:
        check()
        if health.poll():
            assert health.took is not None
            return health.took
        time.sleep(POLL_S)


def check_port_free(port: int, what: str, where: str) -> None:
    s = socket.socket()
    # SO_REUSEADDR as the servers themselves use it: a port in TIME_WAIT after the last run is free, a listener is not
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("127.0.0.1", port))
    except OSError:
        raise NodeFailure(
            f"{where}: port {port} ({what}) is already in use on this node; "
            f"stop what holds it (`ss -ltnp 'sport = :{port}'`) or pick another port in the config"
        ) from None
    finally:
        s.close()


def preflight(run: NodeRun) -> None:
    """Everything that can be checked before a process starts, so a bad input costs seconds, not a minute."""
    p = run.plan
    for port, what in (
        (p.server_port(run.node), "vllm.port"),
        (p.nodes[run.node].weight_transfer_port, "trainer.weight_transfer_port"),
    ):
        check_port_free(port, what, run.where)
    if run.node == 0:
        check_port_free(p.rendezvous_port, "trainer.rendezvous_port", run.where)
    try:
        check_node_inputs(p.config)
    except PreflightError as e:
        raise NodeFailure(f"{run.where}: {e}") from None


def run_node(p: Plan, node: int) -> int:
    job_dir = Path(p.job_dir)
    JobDir(job_dir).logs.mkdir(parents=True, exist_ok=True)
    host = socket.gethostname()
    python = sys.executable
    attempt = attempt_id()
    run = NodeRun(
        plan=p,
        node=node,
        host=host,
        attempt=attempt,
        events=Events(job_dir, node),
        abort=JobAbort(job_dir, attempt, node, p.num_nodes),
        heartbeats=Heartbeats(job_dir, attempt, node, p.num_nodes, host, p.config.job.node_timeout_s),
    )
    run.events(
        Event.BOOTSTRAP_START,
        host=host,
        slurm_job=os.environ.get("SLURM_JOB_ID"),
        attempt=attempt,
        restart=int(os.environ.get("SLURM_RESTART_COUNT", "0")),
    )
    become_subreaper()

    stop_requested: list[int] = []

    def on_signal(signum, _frame):
        stop_requested.append(signum)

    for sig in (signal.SIGTERM, signal.SIGUSR2, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, on_signal)

    procs: list[Proc] = []
    failed = True  # until a normal end (finished or preempted) says otherwise
    lost: PeerLost | None = None  # other nodes found lost whole: SLURM is asked to act once ours are stopped
    try:
        # the GPUs SLURM (or the user) gave this node: the plan's indices map through them (rocm: all processes see them)
        allocated = node_allocation(p)
        clear_leftovers(run, allocated)  # first: an earlier attempt's server may still hold the port preflight checks
        preflight(run)
        check_reach(p, node, python, run.where, run.say)  # rocm: trainer leader and server GPUs reach each other
        # on a GPU shared with the trainer: the KV cache sized to the work, or as an earlier start measured; given a
        # size, vLLM does not profile, so the trainer loads meanwhile
        kv = kv_reuse.server_start(p, node, vllm_command(p, node, python, allocated))
        server, kv_bytes = kv.server, kv.bytes
        measured = server if kv_bytes is None else None  # this start sizes its KV cache: recorded once healthy
        if kv_bytes is not None:
            run.say(f"vLLM's KV cache: {kv_bytes / 2**30:.2f} GiB per worker, {kv.why} (the trainer loads meanwhile)")
        elif kv.why:
            run.say(f"vLLM's KV cache: {kv.why}")
        vllm = Proc(
            server,
            job_dir,
            node,
            ignore_signals=(signal.SIGUSR1, signal.SIGUSR2),
            term_leader=True,  # the API server stops its engine: no EngineDeadError traceback on a clean end
        )
        procs.append(vllm)
        run.events(Event.VLLM_START, pid=vllm.popen.pid)
        url = p.nodes[node].server_url
        run.say(f"vLLM starting: {vllm.describe()}")
        health = HealthWatch(vllm, url, p.config.vllm.health_timeout_s, run.where)
        if not p.config.trainer.start_with_server:  # the trainer starts once the server is healthy
            while not health.poll():
                run.check_peers()
                time.sleep(POLL_S)
            server_healthy(run, health, measured)
        if stop_requested:
            raise NodeFailure(f"node {node}: stopped by signal {stop_requested[0]} before training started")
        # otherwise the ranks launch, rendezvous, load and shard while the server starts, and wait for its /health
        # (trainer.rollout.server) only before their first request; supervise watches the server's start meanwhile
        cmd = trainer_command(p, node, rendezvous_host(p), python, allocated)
        fixed = {Env.KV_CACHE_FIXED: "1"} if kv_bytes is not None else {}
        cmd = NodeCommand(cmd.name, torchrun_compatible(cmd.argv), {**cmd.env, Env.ATTEMPT: attempt, **fixed}, cmd.log)
        # torchrun's own shutdown waits up to its --shutdown-timeout for the ranks' checkpoint: outwait it
        trainer = Proc(cmd, job_dir, node, grace_s=p.bootstrap_grace_s)
        procs.append(trainer)
        run.events(Event.TRAINER_START, pid=trainer.popen.pid)
        run.say(f"trainer started: {trainer.describe()}")
        code = supervise(run, vllm, trainer, stop_requested, health, measured)
        failed = False
        return code
    except ConfigError as e:  # a plan the node cannot run (e.g. fewer GPUs allocated than planned)
        return fail(run, NodeFailure(f"{run.where}: {e}"))
    except NodeFailure as e:
        lost = e if isinstance(e, PeerLost) else None
        return fail(run, e)
    finally:
        run.heartbeats.finish()
        for pr in reversed(procs):
            pr.stop(FAILED_STOP_GRACE_S if failed else None)
        kill_all(descendants(os.getpid()))  # anything re-parented to us (subreaper) that outlived its parent
        if p.lora_push:  # trainer.lora: the adapters pushed to this node's server, in node-local /tmp (or TMPDIR)
            remove_pushed_adapters(p.job_dir, node)
        if lost is not None:  # last: SLURM's requeue stops this bootstrap too (SIGTERM, then SIGKILL after KillWait)
            act_on_lost_nodes(run, lost)
        run.events(Event.BOOTSTRAP_END)


def server_healthy(run: NodeRun, health: HealthWatch, measured: NodeCommand | None = None) -> None:
    """The server answers: say so, and record the KV cache size a start that measured it found (launcher.node.kv_reuse)."""
    run.events(Event.VLLM_HEALTHY, seconds=health.took)
    run.say(f"vLLM healthy at {health.url} after {health.took:.1f} s")
    if measured is not None:
        kv_reuse.record(run.plan, run.node, measured)


def fail(run: NodeRun, e: NodeFailure) -> int:
    first = str(e).splitlines()[0]
    run.events(Event.FAILED, error=first, remote=e.remote)
    if not e.remote:
        run.abort.write(run.host, first)
    print(f"[bootstrap node {run.node} {run.host}] FAILED: {e}", file=sys.stderr, flush=True)
    return 1


def _metrics_mtime(job_dir: Path) -> float | None:
    try:
        return JobDir(job_dir).metrics.stat().st_mtime
    except OSError:
        return None


def preempt_checkpoint(job_dir: Path, attempt: str) -> tuple[int, Path] | None:
    """The checkpoint this attempt wrote on a preemption signal, if it is complete on disk."""
    done = JobDir(job_dir).complete_checkpoints()
    if not done:
        return None
    meta = checkpoint_meta(done[-1][1])
    return done[-1] if meta.reason == "preempt" and meta.attempt == attempt else None


def supervise(
    run: NodeRun,
    vllm: Supervised,
    trainer: Supervised,
    stop_requested: list[int],
    health: HealthWatch | None = None,
    measured: NodeCommand | None = None,
) -> int:
    """Watch the node's two processes until the trainer ends: 0 when it finished, PREEMPTED_EXIT when it
    checkpointed on a preemption signal; NodeFailure (naming the node, the process and its log) for a dead
    server, a failed trainer, a stalled run, another node's abort or a node that stopped answering.
    health: the server's start, while it is not yet healthy (the trainer started beside it): its deadline and its
    exit before it answered are the node's failure; None = healthy already. measured: the server's command when its
    start sizes the KV cache itself (its size is then recorded for a restart: launcher.node.kv_reuse)."""
    forwarded = False
    stall = run.plan.config.trainer.stall_timeout_s
    starting = health is not None and health.took is None
    while True:
        run.check_peers()
        if starting and health is not None:
            if stop_requested:
                raise NodeFailure(f"node {run.node}: stopped by signal {stop_requested[0]} before training started")
            if health.poll():
                server_healthy(run, health, measured)
                starting = False
        if stop_requested and not forwarded:
            # preemption or time-limit warning: the trainer checkpoints at its next step boundary and exits
            run.say(f"signal {stop_requested[0]}: asking the trainer to checkpoint")
            run.events(Event.PREEMPT_SIGNAL, signum=stop_requested[0])
            trainer.signal(signal.SIGUSR2)
            forwarded = True
        # the server first: when it dies the trainer dies of it a moment later, but name the cause. During
        # a preemption SLURM may have stopped the server itself; the trainer's checkpoint does not need it.
        rc = vllm.poll()
        if rc is not None and not stop_requested:
            run.events(Event.VLLM_EXIT, code=rc)
            raise _died_during_training(vllm, rc, run.where)
        rc = trainer.poll()
        if rc is not None:
            run.events(Event.TRAINER_EXIT, code=rc)
            if rc == 0:
                run.say("trainer finished")
                return 0
            # torchrun reports any failed rank as 1, so the checkpoint on disk, not the code, says "preempted"
            ck = preempt_checkpoint(run.job_dir, run.attempt)
            if ck is not None:
                run.say(f"checkpointed step {ck[0]} on a preemption signal ({ck[1]})")
                requeue(run)
                return PREEMPTED_EXIT
            why = f" after signal {stop_requested[0]} (no preemption checkpoint was written)" if stop_requested else ""
            cause = root_cause(trainer.log_path)
            # a rank that died of another node's failure (its peers vanished): wait for that node's abort,
            # which names the real cause, before claiming to be the first failure
            # (or for the lost node's heartbeat to time out: a node that died whole writes no abort file)
            peer_lost = any(m in cause for m in PEER_LOST)
            run.abort.settle(run.plan.config.job.node_timeout_s + 5.0 if peer_lost else 3.0, also=run.heartbeats.check)
            raise NodeFailure(
                f"{run.where}: {trainer.describe()} exited with code {rc}{why}"
                f"{': ' + cause if cause else ''}\n"
                f"  last lines of {trainer.log_path}:\n{tail(trainer.log_path)}"
            )
        if stall:
            m = _metrics_mtime(run.job_dir)
            if m is not None and time.time() - max(m, trainer.started) > stall:
                raise NodeFailure(
                    f"{run.where}: no training step for {stall:.0f} s (trainer.stall_timeout_s); "
                    f"{trainer.describe()}\n  last lines of {trainer.log_path}:\n{tail(trainer.log_path)}"
                )
        time.sleep(POLL_S)


def clear_leftovers(run: NodeRun, allocated: str | None) -> None:
    """Before this node binds its ports and fills its GPUs: stop what an earlier attempt of this job left running,
    fail naming anything else in the way, remove orphaned shared memory (launcher.node.stale)."""
    from launcher.node.stale import StaleError, clean_node

    p = run.plan
    ports = {
        p.rendezvous_port: "trainer.rendezvous_port",
        p.nodes[run.node].weight_transfer_port: "trainer.weight_transfer_port",
        p.server_port(run.node): "vllm.port",
    }
    if p.emulated and run.node:  # emulated nodes share one host: node 0's torchrun holds the rendezvous port
        del ports[p.rendezvous_port]
    try:
        # emulated nodes share one GPU: a node stops only its own leftovers there, never another node's processes
        done = clean_node(p.job_dir, ports, p.device == "cuda", run.say, allocated, node=run.node if p.emulated else None)
    except StaleError as e:
        raise NodeFailure(f"{run.where}: {e}") from None
    run.events(Event.LEFTOVERS, **done)


def requeue(run: NodeRun) -> None:
    """Every node asks (the first request wins, the others get a harmless error): with --kill-on-bad-exit the
    first node to exit may take the others down before they could ask."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        run.say("preempted outside SLURM: run the same command again to resume")
        return
    if not run.plan.config.slurm.requeue:
        run.say("slurm.requeue is off: resubmit the config to resume")
        return
    try:
        out = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except FileNotFoundError:  # in a container image without SLURM's tools
        run.events(Event.REQUEUE, job=job, code=127, stderr="scontrol not found")
        run.say(
            f"requeue job {job}: scontrol is not in this image; the checkpoint is saved: `slurm-grpo resume` the job "
            f"folder from the login node (or bind-mount scontrol and the SLURM config into the image)"
        )
        return
    run.events(Event.REQUEUE, job=job, code=out.returncode, stderr=out.stderr.strip())
    run.say(f"requeue job {job}: rc={out.returncode} {out.stderr.strip()}")


def act_on_lost_nodes(run: NodeRun, e: PeerLost) -> None:
    """Other nodes were lost whole: SLURM would keep the job's srun and batch script waiting until it declares them
    down (SlurmdTimeout), then requeue. The lowest-index survivor asks it now (launcher.node.lost): requeue without the
    lost hosts (slurm.node_loss_action requeue_now), or cancels (slurm.requeue false: nothing to requeue). Every other
    node leaves it to that one."""
    names = ", ".join(f"node {k} ({h})" for k, h in sorted(e.lost.items()))
    if asker(run.plan.num_nodes, e.lost) != run.node:
        return
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        run.say(f"{names} lost outside SLURM: nothing to ask a scheduler; run the same command again to resume")
        return
    how, requeue = run.plan.config.slurm.node_loss_action, run.plan.config.slurm.requeue
    if how == "wait" or (how == "auto" and requeue):
        run.say(
            f"{names} lost; slurm.node_loss_action {how}: SLURM "
            + ("requeues the job once it declares the node down" if requeue else "ends the job once it declares the node down")
            + (" (requeue_now would requeue it at once: see that key)" if requeue else "")
        )
        return
    action = "requeue without the lost nodes" if requeue else "cancel (slurm.requeue is off)"
    try:
        done = ask(job, os.environ.get("SLURM_JOB_NODELIST", ""), e.lost, requeue, run.say)
    except FileNotFoundError as missing:  # a container image without SLURM's tools
        run.events(Event.SLURM_ASKED, job=job, lost=names, action=action, code=127, stderr=str(missing))
        run.say(
            f"{names} lost; scontrol/scancel is not on this node ({missing.filename}): SLURM ends the job only once it "
            f"declares the node down (SlurmdTimeout), then requeues it if slurm.requeue"
        )
        return
    code = next((a.code for a in done if a.code != 0), 0)
    run.events(Event.SLURM_ASKED, job=job, lost=names, action=action, code=code, commands=[a.as_dict() for a in done])
    sent = "; ".join(f"{' '.join(a.argv[1:])} -> rc {a.code}" for a in done)
    run.say(f"{names} lost: asked SLURM to {action} of job {job}: {sent}")


def sweep_point_plan(sweep_dir: str) -> str:
    """The plan of this array task's point (launcher.sweep writes point-NNN/ per grid point)."""
    task = os.environ.get("SLURM_ARRAY_TASK_ID")
    if task is None:
        raise ConfigError(f"--sweep {sweep_dir}: SLURM_ARRAY_TASK_ID is not set; a sweep runs as a SLURM job array")
    if not task.isdigit():
        raise ConfigError(
            f"--sweep {sweep_dir}: SLURM_ARRAY_TASK_ID={task!r} is not a task index; a sweep runs as a SLURM job array"
        )
    return str(JobDir(Path(sweep_dir)).point(int(task)).plan)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m launcher.node.bootstrap", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("plan", nargs="?", help="the job's plan.json")
    ap.add_argument("--sweep", default="", help="a sweep folder: run the plan of its point $SLURM_ARRAY_TASK_ID")
    ap.add_argument("--node", type=int, default=None, help="node index (default: $SLURM_NODEID, else 0)")
    a = ap.parse_args(argv)
    if bool(a.plan) == bool(a.sweep):
        ap.error("give a plan.json or --sweep DIR")
    try:
        p = Plan.load(a.plan or sweep_point_plan(a.sweep))
        node = node_index(a.node)
    except ConfigError as e:
        print(f"bootstrap: {e}", file=sys.stderr)
        return 2
    if not 0 <= node < p.num_nodes:
        source = "--node" if a.node is not None else "$SLURM_NODEID"
        print(
            f"bootstrap: node index {node} ({source}) is outside the plan's {p.num_nodes} node(s), 0..{p.num_nodes - 1}; "
            f"run it in the job's own allocation (srun sets SLURM_NODEID per node) or pass --node 0..{p.num_nodes - 1}",
            file=sys.stderr,
        )
        return 2
    return run_node(p, node)


if __name__ == "__main__":
    sys.exit(main())
