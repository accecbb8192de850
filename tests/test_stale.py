"""launcher.stale against real processes and real /proc, /dev/shm: a leftover of this job folder's earlier attempt
holding a port is stopped, anyone else's is named in the error, orphaned shared memory goes and used memory stays."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.stale import JOB_DIR_ENV, StaleError, clean_node, orphaned_segments

LISTEN = (
    "import socket,time; s=socket.socket(); s.bind(('127.0.0.1', {port})); s.listen(); print('up', flush=True); time.sleep(300)"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listener(port: int, job_dir: str) -> subprocess.Popen:
    p = subprocess.Popen(
        [sys.executable, "-c", LISTEN.format(port=port)],
        env={**os.environ, JOB_DIR_ENV: job_dir},
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None and p.stdout.readline().strip() == "up"
    return p


def test_a_leftover_of_this_job_is_stopped_and_anyone_elses_is_named():
    port = free_port()
    said: list[str] = []
    mine = listener(port, "/runs/this-job")
    try:
        done = clean_node("/runs/this-job", {port: "vllm.port"}, cuda=False, say=said.append)
        assert done["stopped"] == [mine.pid]
        assert mine.wait(timeout=10) is not None  # it is gone
        assert any(f"pid {mine.pid}" in s and f"port {port} (vllm.port)" in s for s in said), said
    finally:
        mine.kill()
    theirs = listener(port, "/runs/other-job")
    try:
        want = rf"port {port} \(vllm.port\) is already in use by pid {theirs.pid} \(uid \d+, job folder /runs/other-job\)"
        with pytest.raises(StaleError, match=want):
            clean_node("/runs/this-job", {port: "vllm.port"}, cuda=False, say=said.append)
        assert theirs.poll() is None  # not ours: left alone
    finally:
        theirs.kill()
    assert clean_node("/runs/this-job", {port: "vllm.port"}, cuda=False, say=said.append)["stopped"] == []  # nothing in the way


def test_orphaned_shared_memory_goes_and_memory_in_use_stays():
    shm = Path("/dev/shm")
    tag = f"{os.getpid()}_{time.time_ns()}"
    orphan, used, fresh, other = (shm / f"psm_t{tag}a", shm / f"psm_t{tag}b", shm / f"psm_t{tag}c", shm / f"other_{tag}")
    for f in (orphan, used, fresh, other):
        f.write_bytes(b"x" * 4096)
    old = time.time() - 3600
    for f in (orphan, used, other):
        os.utime(f, (old, old))
    holder = subprocess.Popen([sys.executable, "-c", f"f=open({str(used)!r}); print('up', flush=True); import time; time.sleep(300)"],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "up"
        found = orphaned_segments()
        assert orphan in found and used not in found and fresh not in found and other not in found
    finally:
        holder.kill()
        for f in (orphan, used, fresh, other):
            f.unlink(missing_ok=True)
