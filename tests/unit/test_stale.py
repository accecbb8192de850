"""launcher.node.stale against real processes and the real /proc: a leftover of this job folder's earlier attempt holding a
port or a GPU is stopped, anyone else's is named in the error, orphaned shared memory goes and used memory stays.
Shared memory is a folder of the test's own (never the machine's /dev/shm: its segments are other people's); the
GPU list comes from a fake `nvidia-smi` on PATH (the process boundary), naming real processes."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.core.jobdir import Env
from launcher.node.stale import StaleError, clean_node, orphaned_segments

LISTEN = (
    # SO_REUSEADDR as servers bind: the port may hold TIME_WAIT connections of the run that just ended (the node's
    # /health polls, which the server closes), and a listener must still bind it
    "import socket,time; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
    "s.bind(('127.0.0.1', {port})); s.listen(); print('up', flush=True); time.sleep(300)"
)
NOBODY = 65534
needs_root = pytest.mark.skipif(
    os.getuid() != 0, reason="only root can start a process as another user (a non-root run cannot make that holder)"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listener(port: int, job_dir: str) -> subprocess.Popen:
    p = subprocess.Popen(
        [sys.executable, "-c", LISTEN.format(port=port)],
        env={**os.environ, Env.JOB_DIR: job_dir},
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None and p.stdout.readline().strip() == "up"
    return p


def sleeper(env: dict[str, str], **kw) -> subprocess.Popen:
    """A process that holds nothing but its place in /proc (a GPU holder, as nvidia-smi names it)."""
    sleep = shutil.which("sleep")
    assert sleep is not None
    return subprocess.Popen([sleep, "300"], env=env, **kw)


@pytest.fixture
def shm(tmp_path: Path) -> Path:
    d = tmp_path / "shm"
    d.mkdir()
    return d


def test_a_leftover_of_this_job_is_stopped_and_anyone_elses_is_named(shm):
    port = free_port()
    said: list[str] = []
    mine = listener(port, "/runs/this-job")
    try:
        done = clean_node("/runs/this-job", {port: "vllm.port"}, cuda=False, say=said.append, shm=shm)
        assert done == {"stopped": [mine.pid], "shm_removed": 0, "shm_freed_mb": 0.0}
        assert mine.wait(timeout=10) is not None  # it is gone
        assert any(f"pid {mine.pid}" in s and f"port {port} (vllm.port)" in s for s in said), said
    finally:
        mine.kill()
    theirs = listener(port, "/runs/other-job")
    try:
        want = rf"port {port} \(vllm.port\) is already in use by pid {theirs.pid} \(uid \d+, job folder /runs/other-job\)"
        with pytest.raises(StaleError, match=want):
            clean_node("/runs/this-job", {port: "vllm.port"}, cuda=False, say=said.append, shm=shm)
        assert theirs.poll() is None  # not ours: left alone
    finally:
        theirs.kill()
        theirs.wait(timeout=10)
    assert clean_node("/runs/this-job", {port: "vllm.port"}, cuda=False, say=said.append, shm=shm)["stopped"] == []


@needs_root
def test_a_port_holder_of_another_user_is_named_with_its_uid_and_job_and_left_alone(shm):
    """Root reads every process's fds: another user's holder (here `sleep` as nobody, holding a listening socket it
    inherited) is found and named. (Without root its fds are unreadable and the bootstrap's check_port_free is the
    guard.)"""
    port = free_port()
    sock = socket.socket()
    sock.bind(("127.0.0.1", port))
    sock.listen()
    theirs = sleeper({"SLURM_JOB_ID": "4242"}, user=NOBODY, group=NOBODY, pass_fds=[sock.fileno()])
    sock.close()  # only theirs holds it now
    try:
        assert Path(f"/proc/{theirs.pid}").stat().st_uid == NOBODY
        want = rf"port {port} \(trainer.rendezvous_port\) is already in use by pid {theirs.pid} \(uid {NOBODY}, SLURM job 4242\)"
        with pytest.raises(StaleError, match=want):
            clean_node("/runs/this-job", {port: "trainer.rendezvous_port"}, cuda=False, say=print, shm=shm)
        assert theirs.poll() is None
    finally:
        theirs.kill()
        theirs.wait(timeout=10)


def test_orphaned_shared_memory_goes_and_memory_in_use_stays(shm):
    """Removed: this user's psm_*/vllm* segments older than a minute that no process has open. Kept: one a live
    process holds open, a fresh one (its creator may not have opened it yet), one of another name, and (as root,
    who can make one) another user's."""
    tag = f"{os.getpid()}_{time.time_ns()}"
    orphans = [shm / f"psm_t{tag}a", shm / f"vllm_t{tag}"]
    used, fresh, other, foreign = shm / f"psm_t{tag}b", shm / f"psm_t{tag}c", shm / f"other_{tag}", shm / f"psm_t{tag}d"
    everything = [*orphans, used, fresh, other] + ([foreign] if os.getuid() == 0 else [])
    for f in everything:
        f.write_bytes(b"x" * 2**20)
    if os.getuid() == 0:
        os.chown(foreign, NOBODY, NOBODY)
    old = time.time() - 3600
    for f in everything:
        if f is not fresh:
            os.utime(f, (old, old))
    freed = sum(f.stat().st_blocks * 512 for f in orphans) / 2**20
    holder = subprocess.Popen([sys.executable, "-c", f"f=open({str(used)!r}); print('up', flush=True); import time; time.sleep(300)"],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    said: list[str] = []
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "up"
        assert orphaned_segments(shm) == sorted(orphans)
        done = clean_node("/runs/this-job", {}, cuda=False, say=said.append, shm=shm)
    finally:
        holder.kill()
        holder.wait(timeout=10)
    # what the bootstrap's `leftovers` event records (launcher.node.bootstrap.clear_leftovers: events("leftovers", **done))
    assert done == {"stopped": [], "shm_removed": 2, "shm_freed_mb": round(freed, 1)} and freed >= 1.9, (done, freed)
    assert sorted(shm.iterdir()) == sorted(f for f in everything if f not in orphans)
    assert said == [f"removed 2 orphaned shared-memory segment(s) in {shm} ({freed:.0f} MiB held)"], said
    # once its holder is gone the used (old) segment is an orphan too; the fresh one waits until it is a minute old
    assert orphaned_segments(shm) == [used]


@pytest.fixture
def fake_nvidia_smi(tmp_path, monkeypatch):
    """`nvidia-smi` on PATH that records its arguments and lists the pids written to `pids` as compute apps."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls, pids = tmp_path / "nvidia-smi.calls", tmp_path / "nvidia-smi.pids"
    exe = bin_dir / "nvidia-smi"
    exe.write_text(f'#!/bin/sh\necho "$@" >> "{calls}"\ncat "{pids}" 2>/dev/null\n')
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")

    def listing(*procs: subprocess.Popen) -> None:
        pids.write_text("".join(f"{p.pid}\n" for p in procs))

    listing.calls = calls  # type: ignore[attr-defined]
    return listing


def test_gpu_holders_come_from_nvidia_smi_ours_are_stopped_and_anyone_elses_is_named(fake_nvidia_smi, shm):
    mine = sleeper({Env.JOB_DIR: "/runs/this-job"})
    theirs = sleeper({Env.JOB_DIR: "/runs/other-job", "SLURM_JOB_ID": "77"})
    said: list[str] = []
    try:
        fake_nvidia_smi(mine)
        done = clean_node("/runs/this-job", {}, cuda=True, say=said.append, gpus="2,3", shm=shm)
        assert done["stopped"] == [mine.pid] and mine.wait(timeout=10) is not None, done
        assert any(f"GPU is already in use by pid {mine.pid}" in s for s in said), said
        # only the GPUs SLURM gave this job are asked about
        assert fake_nvidia_smi.calls.read_text().splitlines() == ["-i 2,3 --query-compute-apps=pid --format=csv,noheader"]
        fake_nvidia_smi(theirs)
        want = rf"GPU is already in use by pid {theirs.pid} \(uid {os.getuid()}, job folder /runs/other-job\)"
        with pytest.raises(StaleError, match=want):
            clean_node("/runs/this-job", {}, cuda=True, say=said.append, shm=shm)
        assert fake_nvidia_smi.calls.read_text().splitlines()[-1] == "--query-compute-apps=pid --format=csv,noheader"
        assert theirs.poll() is None  # not ours: left alone
        # a CPU run never asks nvidia-smi
        before = fake_nvidia_smi.calls.read_text()
        assert clean_node("/runs/this-job", {}, cuda=False, say=said.append, shm=shm)["stopped"] == []
        assert fake_nvidia_smi.calls.read_text() == before
    finally:
        for p in (mine, theirs):
            p.kill()
            p.wait(timeout=10)


@needs_root
def test_a_gpu_holder_of_another_user_is_not_this_jobs_business(fake_nvidia_smi, shm):
    """On the GPUs only the same user's holders count (launcher.node.stale.clean_node; on the ports, anyone's): another
    user's process is neither stopped nor an error. The test above is its control: the same user's is an error."""
    theirs = sleeper({}, user=NOBODY, group=NOBODY)
    try:
        fake_nvidia_smi(theirs)
        assert clean_node("/runs/this-job", {}, cuda=True, say=print, shm=shm)["stopped"] == []
        assert theirs.poll() is None
    finally:
        theirs.kill()
        theirs.wait(timeout=10)


def test_an_emulated_node_stops_only_its_own_leftovers_on_the_shared_gpu(fake_nvidia_smi, shm):
    """job.emulate_gpus: every node of the job runs on this host's one GPU; node 1 starting must not stop node 0's
    server (same job folder), only an earlier attempt of its own. Without `node` (a real node) both are stopped."""
    job = "/runs/emulated"
    node0 = sleeper({Env.JOB_DIR: job, Env.NODE: "0"})
    node1_old = sleeper({Env.JOB_DIR: job, Env.NODE: "1"})
    try:
        fake_nvidia_smi(node0, node1_old)
        done = clean_node(job, {}, cuda=True, say=lambda _: None, shm=shm, node=1)
        assert done["stopped"] == [node1_old.pid] and node1_old.wait(timeout=10) is not None, done
        assert node0.poll() is None, "node 1 stopped node 0's process"
        fake_nvidia_smi(node0)
        assert clean_node(job, {}, cuda=True, say=lambda _: None, shm=shm)["stopped"] == [node0.pid]
    finally:
        for p in (node0, node1_old):
            p.kill()
            p.wait(timeout=10)
