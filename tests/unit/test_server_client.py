"""The HTTP client of a node's vLLM server against real local servers (the process boundary): one that answers
(http.server), and raw sockets that misbehave the way a paused (SIGSTOP), dying or overloaded vLLM server does.
Every misbehaviour ends in a ServerError naming the node, the route and the deadline; none is a hang. The
misbehaving servers hold their connection open until the test ends, so only the client's deadline can end a call."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from trainer.rollout.server import ServerError, VllmServer

HEADERS_THEN_STALL = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"a":'
HEADERS_THEN_TRICKLE = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000000\r\n\r\n"
HANG_S = 60
"""How long a call may take before the test calls it a hang: far above every deadline used here."""


@pytest.fixture
def misbehaving() -> Iterator[Callable[[bytes, bool], int]]:
    """misbehaving(reply, trickle) -> port: a server that accepts one request, sends `reply` (maybe nothing), then
    either hangs like a stopped process or, with trickle, sends one more byte every 50 ms; until the test ends."""
    done = threading.Event()
    socks: list[socket.socket] = []

    def start(reply: bytes, trickle: bool = False) -> int:
        srv = socket.socket()
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        socks.append(srv)

        def serve() -> None:
            c, _ = srv.accept()
            socks.append(c)
            c.recv(65536)
            c.sendall(reply)
            while trickle and not done.wait(0.05):
                try:
                    c.sendall(b" ")
                except OSError:
                    return  # the client gave up and closed
            done.wait()

        threading.Thread(target=serve, daemon=True).start()
        return srv.getsockname()[1]

    yield start
    done.set()
    for s in socks:
        s.close()


def call(fn: Callable[[], Any]) -> tuple[BaseException | None, float]:
    """Run fn in a thread; fail the test if it is still running after HANG_S. Returns what it raised and its time."""
    out: dict[str, Any] = {}

    def run() -> None:
        t0 = time.monotonic()
        try:
            fn()
        except BaseException as e:
            out["error"] = e
        out["took"] = time.monotonic() - t0

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(HANG_S)
    if t.is_alive():
        pytest.fail(f"the call still runs after {HANG_S} s: a hang, not a deadline")
    return out.get("error"), out["took"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "reply, trickle, timeout_s, needle",
    [
        (b"", False, 1, "no answer within 1 s"),  # paused before answering
        (HEADERS_THEN_STALL, False, 1, "no answer within 1 s (the answer stopped part way)"),
        # every read gets a byte, so a per-read timeout never fires: only a deadline for the whole answer ends it
        (HEADERS_THEN_TRICKLE, True, 2, "no answer within 2 s (the answer was still arriving, too slowly)"),
    ],
    ids=["paused", "stopped-part-way", "trickling"],
)
def test_a_misbehaving_server_is_a_deadline_not_a_hang(misbehaving, reply, trickle, timeout_s, needle):
    client = VllmServer(f"http://127.0.0.1:{misbehaving(reply, trickle)}", "m", node=1, timeout_s=timeout_s)
    error, took = call(lambda: client.post("/v1/completions", {}, step=7))
    assert isinstance(error, ServerError), error
    msg = str(error)
    assert needle in msg and "node 1" in msg and "/v1/completions" in msg and "step 7" in msg, msg
    assert "logs/node1-vllm.log" in msg and f"trainer.request_timeout_s={timeout_s}" in msg, msg
    assert took >= timeout_s * 0.9, f"it gave up after {took:.2f} s, before its {timeout_s} s deadline"


def test_a_dead_server_is_a_connection_error_with_the_question_to_ask():
    client = VllmServer(f"http://127.0.0.1:{free_port()}", "m", node=0, timeout_s=5)
    with pytest.raises(ServerError, match=r"connection failed .*is the server still running"):
        client.post("/health", {})


class FakeVllm(BaseHTTPRequestHandler):
    """The routes the client and the pusher (trainer.push.pusher) use, answering from the server's script; every request is recorded."""

    protocol_version = "HTTP/1.1"  # keep-alive, as uvicorn

    def do_POST(self) -> None:
        srv: Any = self.server
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        srv.seen.append((self.path, json.loads(body or b"{}"), self.client_address[1]))
        status, answer = srv.answer(self.path)
        data = answer if isinstance(answer, bytes) else json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


class FakeVllmServer(ThreadingHTTPServer):
    daemon_threads = True  # a kept-alive connection's handler waits for the next request: not joined at the end


@pytest.fixture
def fake_vllm() -> Iterator[ThreadingHTTPServer]:
    srv: Any = FakeVllmServer(("127.0.0.1", 0), FakeVllm)
    srv.seen = []
    srv.answer = lambda path: (200, {"success": True})
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


def client_of(srv: ThreadingHTTPServer, node: int = 2) -> VllmServer:
    return VllmServer(f"http://127.0.0.1:{srv.server_address[1]}", "m", node=node, timeout_s=10)


def test_answers_arrive_whole_over_one_kept_alive_connection_and_an_http_error_is_named(fake_vllm):
    srv: Any = fake_vllm
    big = {"choices": [{"index": i, "text": "x" * 1000} for i in range(1000)]}  # 1 MB: many reads
    srv.answer = lambda path: (200, big) if path == "/big" else (500, b"Internal Server Error: boom")
    client = client_of(srv)
    assert client.post("/big", {"a": 1}) == big and client.post("/big", {"a": 2}) == big
    assert [(p, b) for p, b, _ in srv.seen] == [("/big", {"a": 1}), ("/big", {"a": 2})]
    assert srv.seen[0][2] == srv.seen[1][2], "the second request opened a new connection"
    assert client.requests_sent == 2
    with pytest.raises(
        ServerError, match=r"node 2: vLLM server http://.*/fail failed at step 4: HTTP 500: Internal Server Error: boom"
    ):
        client.post("/fail", {}, step=4)


def test_a_prefix_cache_reset_that_answers_false_is_retried_then_an_error(fake_vllm):
    """vLLM answers /reset_prefix_cache with {"success": false} while requests still run: the push retries,
    and fails naming the node rather than serving KV cached under the old weights."""
    srv: Any = fake_vllm
    answers = iter([False, False, True])
    srv.answer = lambda path: (200, {"success": next(answers)})
    client = client_of(srv)
    client.RESET_PAUSE_S = 0.0  # the 0.1 s pause between retries
    client.reset_prefix_cache(step=3)
    assert [p for p, _, _ in srv.seen] == ["/reset_prefix_cache"] * 3
    srv.seen.clear()
    srv.answer = lambda path: (200, {"success": False})
    with pytest.raises(ServerError, match=r"node 2: .*reset_prefix_cache answered success=false 20 times at step 3"):
        client.reset_prefix_cache(step=3, running=True)
    assert [p for p, _, _ in srv.seen] == ["/reset_prefix_cache?reset_running_requests=true"] * 20


def test_a_call_with_its_own_deadline_names_that_deadline(misbehaving):
    """The push gives its own deadline (trainer.push_timeout_s): the error says which limit ran out."""
    client = VllmServer(f"http://127.0.0.1:{misbehaving(b'', False)}", "m", node=0, timeout_s=60)
    error, took = call(lambda: client.post("/update_weights", {}, timeout_s=1, step=3))
    assert isinstance(error, ServerError), error
    assert "no answer within 1 s" in str(error) and "(deadline 1 s given for this call;" in str(error), error
    assert "request_timeout_s" not in str(error) and took < 60
