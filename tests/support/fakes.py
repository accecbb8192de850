"""Process-boundary fakes for the unit tier's bootstrap and `local` tests: free ports, an environment without a
surrounding SLURM allocation, and a fake vLLM server, a package `vllm` first on PYTHONPATH, so the bootstrap's own
`python -m vllm.entrypoints.openai.api_server ...` starts it instead of the real server."""

from __future__ import annotations

import json
import os
import socket
import threading
from contextlib import ExitStack
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def free_ports(n: int) -> list[int]:
    """n distinct ports free on 127.0.0.1 right now (all held until all are picked, so no two are the same)."""
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def port_sets(n: int = 3) -> list[str]:
    """--set values for the three ports of a one-node plan (vllm.port, trainer.rendezvous_port,
    trainer.weight_transfer_port), each free now."""
    a, b, c = free_ports(n)
    return [f"vllm.port={a}", f"trainer.rendezvous_port={b}", f"trainer.weight_transfer_port={c}"]


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without a surrounding SLURM allocation's variables (a test run inside one must
    not make the bootstrap think it is node 3 of someone's job), plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))}
    env.update(extra)
    return env


SERVER = """\
import http.server, os, sys
with open({marker!r}, "a") as f:
    f.write(f"{{os.getpid()}} {{' '.join(sys.argv[1:])}}\\n")
print({say!r}, flush=True)
if {code!r} is not None:
    sys.exit({code!r})
port = int(sys.argv[sys.argv.index("--port") + 1])


class NotReady(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(503)
        self.end_headers()

    def log_message(self, *args):
        pass


http.server.HTTPServer(("127.0.0.1", port), NotReady).serve_forever()
"""


@dataclass
class FakeVllm:
    """A fake vLLM server package under `root`: put `root` first on PYTHONPATH. Every start appends
    'PID ARGV...' to `marker`."""

    root: Path
    marker: Path

    @property
    def starts(self) -> list[str]:
        return self.marker.read_text().splitlines() if self.marker.exists() else []

    def pythonpath(self) -> str:
        return os.pathsep.join([str(self.root), *filter(None, [os.environ.get("PYTHONPATH")])])


def fake_vllm(tmp_path: Path, say: str, exit_code: int | None) -> FakeVllm:
    """A server that prints `say` and exits with `exit_code`, or (None) listens on its --port and answers every
    request (/health included) with 503, as a server still loading, forever."""
    root = tmp_path / "fake-vllm"
    pkg = root / "vllm" / "entrypoints" / "openai"
    pkg.mkdir(parents=True, exist_ok=True)
    for d in (root / "vllm", root / "vllm" / "entrypoints", pkg):
        (d / "__init__.py").write_text("")
    marker = tmp_path / "fake-vllm-starts.txt"
    (pkg / "api_server.py").write_text(SERVER.format(marker=str(marker), say=say, code=exit_code))
    return FakeVllm(root, marker)


class LocalHttpServer(ThreadingHTTPServer):
    """A fake at the HTTP boundary: a real server on 127.0.0.1 (a free port), served from a daemon thread once the
    subclass has set its state and called start(). close() first lets go of whatever the test holds (release())."""

    daemon_threads = True

    def __init__(self, handler: type[BaseHTTPRequestHandler]) -> None:
        super().__init__(("127.0.0.1", 0), handler)

    def start(self) -> None:
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def release(self) -> None:
        """Set the events the test held answers on, so no handler thread outlives the test."""

    def close(self) -> None:
        self.release()
        self.shutdown()
        self.server_close()


class JsonHandler(BaseHTTPRequestHandler):
    """Quiet, JSON in and out."""

    def log_message(self, *args) -> None:
        pass

    def read_json(self) -> dict:
        return json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")

    def answer(self, body: dict, status: int = 200) -> None:
        out = json.dumps(body).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)
        except OSError:  # released at teardown: the client gave up on this request long ago
            pass


def join_weight_group(info: dict) -> tuple[object, int]:
    """What vLLM's engine does on /init_weight_transfer_engine, for a fake server: join the trainer's gloo group as
    the worker rank the init info names. Returns (the group, the packed buffer size)."""
    from datetime import timedelta

    import torch.distributed as dist

    from trainer.push.wire import loopback_gloo_group

    timeout = timedelta(seconds=info["timeout_s"])
    store = dist.TCPStore("127.0.0.1", info["master_port"], info["world_size"], is_master=False, timeout=timeout)
    return loopback_gloo_group(store, info["rank_offset"], info["world_size"], timeout), info["packed_buffer_size_bytes"]
