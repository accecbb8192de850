"""The HTTP client's deadlines against a real socket that misbehaves the way a paused (SIGSTOP) or dead
vLLM server does: every way ends in a ServerError that names the node, the route and the deadline."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from trainer.server_client import ServerClient, ServerError

HEADERS_THEN_STALL = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"a":'


def stalling_server(reply: bytes) -> int:
    """Accept one request, send `reply` (maybe nothing), then hang like a stopped process."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def serve() -> None:
        c, _ = srv.accept()
        c.recv(65536)
        c.sendall(reply)
        time.sleep(10)

    threading.Thread(target=serve, daemon=True).start()
    return srv.getsockname()[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "reply, needle",
    [
        (b"", "no answer within 1 s"),  # paused before answering
        (HEADERS_THEN_STALL, "no answer within 1 s (the answer stopped part way)"),
    ],
)
def test_a_stalled_server_is_a_deadline_not_a_hang(reply, needle):
    client = ServerClient(f"http://127.0.0.1:{stalling_server(reply)}", "m", node=1, timeout_s=1)
    t0 = time.time()
    with pytest.raises(ServerError) as e:
        client.post("/v1/completions", {}, step=7)
    assert time.time() - t0 < 5
    msg = str(e.value)
    assert needle in msg and "node 1" in msg and "/v1/completions" in msg and "step 7" in msg, msg
    assert "logs/node1-vllm.log" in msg and "trainer.request_timeout_s=1" in msg, msg


def test_a_dead_server_is_a_connection_error_with_the_question_to_ask():
    client = ServerClient(f"http://127.0.0.1:{free_port()}", "m", node=0, timeout_s=5)
    with pytest.raises(ServerError, match=r"connection failed .*is the server still running"):
        client.post("/health", {})


def test_a_prefix_cache_reset_that_answers_false_is_retried_then_an_error(monkeypatch):
    """vLLM answers /reset_prefix_cache with {"success": false} while requests still run: the push retries,
    and fails naming the node rather than serving KV cached under the old weights."""
    from trainer import weight_push

    monkeypatch.setattr(weight_push.time, "sleep", lambda s: None)
    answers = iter([{"success": False}, {"success": False}, {"success": True}])
    client = ServerClient("http://127.0.0.1:1", "m", node=2, timeout_s=1)
    calls: list[str] = []

    def post(route, body=None, timeout_s=None, step=0):
        calls.append(route)
        return next(answers)

    monkeypatch.setattr(client, "post", post)
    weight_push.reset_prefix_cache(client, step=3)
    assert calls == ["/reset_prefix_cache"] * 3
    monkeypatch.setattr(client, "post", lambda *a, **k: {"success": False})
    with pytest.raises(ServerError, match=r"node 2: .*reset_prefix_cache answered success=false 20 times at step 3"):
        weight_push.reset_prefix_cache(client, step=3)
