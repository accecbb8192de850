"""trainer.push.senders.call_while: a request and the local end of a collective run side by side; the first error ends
the wait (the other end may never finish: NCCL has no timeout), and past the deadline the error names the route."""

from __future__ import annotations

import threading

import pytest

from trainer.push.senders import call_while
from trainer.rollout.server import ServerError, VllmServer

GENEROUS_S = 60.0  # a deadline only a hang reaches


@pytest.fixture
def held():
    """What the blocked side waits on; released at teardown so no thread outlives the test."""
    ev = threading.Event()
    yield ev
    ev.set()


def client() -> VllmServer:
    return VllmServer("http://127.0.0.1:9", "m", node=3, timeout_s=GENEROUS_S)  # never asked: call_while only names it


def test_a_failed_request_ends_the_wait_while_the_work_is_stuck(held):
    def post():
        raise ServerError("the server said no")

    with pytest.raises(ServerError, match="the server said no"):
        call_while(client(), "/update_weights", post, GENEROUS_S, step=4, work=held.wait)


def test_failed_work_ends_the_wait_while_the_request_is_stuck(held):
    def work():
        raise RuntimeError("broadcast broke")

    with pytest.raises(RuntimeError, match="broadcast broke"):
        call_while(client(), "/update_weights", held.wait, GENEROUS_S, step=4, work=work)


def test_past_the_deadline_the_error_names_node_route_step_and_key(held):
    with pytest.raises(ServerError) as e:
        call_while(client(), "/update_weights", held.wait, 0.3, step=7, work=lambda: None)
    msg = str(e.value)
    for needle in ("node 3", "/update_weights", "http://127.0.0.1:9", "trainer.push_timeout_s", "step 7"):
        assert needle in msg, msg


def test_both_finishing_returns():
    seen: list[str] = []
    call_while(client(), "/update_weights", lambda: seen.append("post"), GENEROUS_S, step=0, work=lambda: seen.append("work"))
    assert sorted(seen) == ["post", "work"]
