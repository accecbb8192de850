"""trainer.rollout.ahead.AheadQueue against a fake vLLM at the HTTP boundary (a real HTTP server in a thread): what
send sends and returns, what take and result hand back, and what wait reports about later batches, with the server's
answers held by the test (no timing)."""

from __future__ import annotations

import threading

import pytest

from tests.support.fakes import JsonHandler, LocalHttpServer
from trainer.rollout.ahead import AheadQueue
from trainer.rollout.server import VllmServer

TIMEOUT_S = 60.0  # a deadline only a hang reaches
SAMPLING = dict(max_tokens=2, temperature=1.0)


class FakeVllm(LocalHttpServer):
    """/v1/completions: each prompt's completion is [step-free marker 1000 + its first token, its length], logprob -0.5
    each; answers wait until `gate` is set. Records every request's path and body, in order."""

    def __init__(self) -> None:
        super().__init__(Handler)
        self.calls: list[tuple[str, dict]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.start()

    def release(self) -> None:
        self.gate.set()


class Handler(JsonHandler):
    server: FakeVllm

    def do_POST(self) -> None:
        body = self.read_json()
        self.server.calls.append((self.path, body))
        answer: dict = {"success": True}
        if self.path == "/v1/completions":
            self.server.gate.wait()
            answer = {
                "choices": [
                    {"index": i, "token_ids": [1000 + p[0], len(p)], "logprobs": {"token_logprobs": [-0.5, -0.5]}}
                    for i, p in enumerate(body["prompt"])
                ]
            }
        self.answer(answer)


@pytest.fixture
def server():
    srv = FakeVllm()
    yield srv
    srv.close()


@pytest.fixture
def queue(server):
    q = AheadQueue(VllmServer(server.url, "m", node=0, timeout_s=TIMEOUT_S), TIMEOUT_S)
    yield q
    server.gate.set()
    q.close()


def test_send_sends_each_later_step_once_and_take_hands_back_its_completions(server, queue):
    assert queue.send(4, [[[1, 2]], [[3], [5, 6, 7]]], SAMPLING) == [5, 6]
    assert queue.send(5, [[[3], [5, 6, 7]], [[8]]], SAMPLING) == [7]  # 6 is already on its way
    sent = queue.take(6)
    assert sent is not None and sent.prompts == [[3], [5, 6, 7]] and sent.weights_step == 4
    comps, gen_s = queue.result(sent)
    assert comps == [([1003, 1], [-0.5, -0.5]), ([1005, 3], [-0.5, -0.5])] and gen_s >= 0
    assert queue.take(6) is None, "a batch is taken once"
    for s in (5, 7):
        p = queue.take(s)
        assert p is not None
        queue.result(p)
    prompts = sorted(body["prompt"] for path, body in server.calls if path == "/v1/completions")
    assert prompts == sorted([[[1, 2]], [[3], [5, 6, 7]], [[8]]]), "one request per step, nothing resent"
    assert all(body["max_tokens"] == 2 and body["n"] == 1 for _, body in server.calls)


def test_wait_reports_later_batches_outstanding_and_whether_one_still_generates(server, queue):
    assert queue.wait(3) == (False, False), "nothing sent: a push needs no pause"
    server.gate.clear()  # the server holds its answers: the requests stay running
    assert queue.send(3, [[[1]], [[2]]], SAMPLING) == [4, 5]  # k = 2
    assert queue.wait(3) == (True, True), "later batches are on the server and still generating"
    server.gate.set()
    queue.pending[5].future.result(timeout=TIMEOUT_S)  # step 5's batch answered, still queued
    four = queue.take(4)
    assert four is not None and queue.result(four)[0] == [([1001, 1], [-0.5, -0.5])]
    assert queue.wait(4) == (True, False), "step 5's batch is outstanding (the push pauses it) but no longer generating"
    five = queue.take(5)
    assert five is not None and five.weights_step == 3
    assert queue.wait(5) == (False, False), "k = 1 after the last send: nothing later in flight, no pause"
