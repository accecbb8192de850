"""Leftovers of earlier jobs on a node, found before the node starts its server (torch-free, /proc only).

A vLLM server or torchrun that outlived its job (a killed srun step, a node the scheduler gave back before the
processes died) holds the port the new server must bind, or the GPUs it must fill; vLLM's shared-memory queues
(/dev/shm/psm_*) of killed processes stay behind and take memory. Before the node starts anything:

  processes     the node's ports (vLLM HTTP, rendezvous, weight transfer) and GPUs (nvidia-smi, CUDA nodes) are
                checked for holders. A holder started by this job folder (an earlier attempt: a requeue or resume,
                recognised by SLURM_GRPO_JOB_DIR in its environment, which launcher.node.commands sets) is stopped
                (SIGTERM, then SIGKILL); any other holder fails the node, naming its pid, command, user and job.
  shared memory vLLM/Python shared-memory segments in /dev/shm of this user that no live process has open or mapped
                and that are older than a minute are removed (nothing can reach them any more), and named.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from launcher.core.jobdir import Env

SHM_PREFIXES = ("psm_", "vllm")
SHM_MIN_AGE_S = 60


@dataclass(frozen=True)
class Holder:
    pid: int
    what: str
    """What it holds: 'port 8000' or 'GPU'."""
    uid: int
    cmdline: str
    job_dir: str
    slurm_job: str
    node: str = ""
    """SLURM_GRPO_NODE of its environment: which node of the job started it (set by launcher.node.commands)."""

    def describe(self) -> str:
        origin = f"job folder {self.job_dir}" if self.job_dir else f"SLURM job {self.slurm_job or '?'}"
        return f"{self.what} is already in use by pid {self.pid} (uid {self.uid}, {origin}): {self.cmdline[:160]}"


def listening_inodes(ports: dict[int, str], proc: Path = Path("/proc")) -> dict[int, int]:
    """socket inode -> port, for TCP sockets listening on one of `ports` (any address, IPv4 or IPv6)."""
    out = {}
    for table in ("tcp", "tcp6"):
        try:
            lines = (proc / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > 9 and f[3] == "0A":  # LISTEN
                port = int(f[1].rsplit(":", 1)[1], 16)
                if port in ports:
                    out[int(f[9])] = port
    return out


def read_environ(pid: int, proc: Path = Path("/proc")) -> dict[str, str]:
    try:
        raw = (proc / str(pid) / "environ").read_bytes()
    except OSError:
        return {}
    return dict(x.split("=", 1) for x in raw.decode(errors="replace").split("\0") if "=" in x)


def holder(pid: int, what: str, proc: Path = Path("/proc")) -> Holder | None:
    try:
        uid = (proc / str(pid)).stat().st_uid
        cmd = (proc / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None  # gone meanwhile
    env = read_environ(pid, proc)
    return Holder(pid, what, uid, cmd, env.get(Env.JOB_DIR, ""), env.get("SLURM_JOB_ID", ""), env.get(Env.NODE, ""))


def port_holders(ports: dict[int, str], proc: Path = Path("/proc")) -> list[Holder]:
    """ports: port -> the config key that set it (named in the error)."""
    inodes = listening_inodes(ports, proc)
    if not inodes:
        return []
    found = []
    for d in proc.iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            links = [os.readlink(fd) for fd in (d / "fd").iterdir()]
        except OSError:
            continue  # another user's process, or gone
        for link in links:
            if link.startswith("socket:[") and int(link[8:-1]) in inodes:
                port = inodes[int(link[8:-1])]
                h = holder(int(d.name), f"port {port} ({ports[port]})", proc)
                if h:
                    found.append(h)
                break
    return found


def gpu_holders(gpus: str | None, proc: Path = Path("/proc")) -> list[Holder]:
    """Processes with a CUDA context on the node's GPUs (`gpus`: SLURM's CUDA_VISIBLE_DEVICES, else all it sees),
    from nvidia-smi's own list; none where it is absent."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    select = ["-i", gpus] if gpus else []
    try:
        out = subprocess.run(
            [exe, *select, "--query-compute-apps=pid", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    pids = [int(x) for x in out.stdout.split() if x.strip().isdigit()]
    return [h for h in (holder(p, "GPU", proc) for p in pids) if h]


def alive(pid: int, proc: Path = Path("/proc")) -> bool:
    """Running (a zombie has ended: it only waits for its parent to collect its exit code)."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def stop(pids: list[int], grace_s: float = 5.0) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.time() + grace_s
    while time.time() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def open_paths(proc: Path = Path("/proc"), shm: Path = Path("/dev/shm")) -> set[str]:
    """Every path under `shm` some live process has open or mapped (that we may read)."""
    under = str(shm.resolve()) + "/"  # /proc shows resolved paths
    seen: set[str] = set()
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            seen.update(p for p in (os.readlink(fd) for fd in (d / "fd").iterdir()) if p.startswith(under))
            seen.update(ln.split(None, 5)[5] for ln in (d / "maps").read_text().splitlines() if under in ln)
        except (OSError, IndexError):
            continue
    return {p.replace(" (deleted)", "") for p in seen}


def orphaned_segments(shm: Path = Path("/dev/shm"), proc: Path = Path("/proc"), now: float | None = None) -> list[Path]:
    now = time.time() if now is None else now
    used = open_paths(proc, shm)
    out = []
    for f in sorted(shm.glob("*")):
        try:
            st = f.stat()
        except OSError:
            continue
        if (
            f.name.startswith(SHM_PREFIXES)
            and f.is_file()
            and st.st_uid == os.getuid()
            and now - st.st_mtime > SHM_MIN_AGE_S
            and str(f.resolve()) not in used
        ):
            out.append(f)
    return out


class StaleError(RuntimeError):
    pass


def clean_node(
    job_dir: str,
    ports: dict[int, str],
    cuda: bool,
    say,
    gpus: str | None = None,
    shm: Path = Path("/dev/shm"),
    proc: Path = Path("/proc"),
    node: int | None = None,
) -> dict:
    """Stop this job folder's leftovers, fail on anyone else's that is in the way (any user's on our ports, where the
    server could not bind; the same user's on our GPUs), drop orphaned shared memory in `shm`. Returns what was done
    (the bootstrap's `leftovers` event). node: only that node's processes count on the GPUs (job.emulate_gpus: every
    node of the job runs on this host's one GPU, and node i must not stop node j)."""
    on_gpu = gpu_holders(gpus, proc) if cuda else []
    if node is not None:
        on_gpu = [h for h in on_gpu if h.job_dir != job_dir or h.node == str(node)]
    holders = port_holders(ports, proc) + on_gpu
    mine = [h for h in holders if h.job_dir == job_dir]
    others = [
        h
        for h in holders
        if h.job_dir != job_dir and h.pid != os.getpid() and (h.what.startswith("port") or h.uid == os.getuid())
    ]
    if others:
        raise StaleError(
            "; ".join(h.describe() for h in others)
            + " -- not this job's: stop it (scancel its job, or kill the pid) or pick other ports in the config"
        )
    for h in mine:
        say(f"stopping a leftover of this job's earlier attempt: {h.describe()}")
    stop(sorted({h.pid for h in mine}))
    segments = orphaned_segments(shm, proc)
    removed = freed = 0
    for f in segments:
        try:
            size = f.stat().st_blocks * 512
            f.unlink()
        except OSError:
            continue  # gone meanwhile, or not ours to remove
        removed, freed = removed + 1, freed + size
    if removed:
        say(f"removed {removed} orphaned shared-memory segment(s) in {shm} ({freed / 2**20:.0f} MiB held)")
    return {"stopped": [h.pid for h in mine], "shm_removed": removed, "shm_freed_mb": round(freed / 2**20, 1)}
