"""N2 of ../shared/GPU-AUDIT.md: at max_staleness >= 2 a push runs between /pause?mode=keep and /resume. When it fails
part way, the engine is left inside the transfer (vLLM runs the update in its engine loop; PyNccl has no timeout),
so /resume is not served either: the push must raise its own cause within trainer.push_timeout_s plus a short
resume deadline, not wait trainer.request_timeout_s for /resume and report that instead.

The server is faked at the process boundary: an HTTP server on 127.0.0.1 that speaks vLLM's weight-transfer routes
and joins the trainer's gloo group as the worker would (trainer.push.gloo_engine's own receiving side), and that never
answers /resume while a transfer is stuck (as an engine blocked in the receive cannot).
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist

from tests.support.fakes import JsonHandler, LocalHttpServer, join_weight_group
from trainer.push.gloo_engine import receive_packed  # imports vLLM: not inside a request's deadline
from trainer.push.pusher import RESUME_AFTER_FAILURE_S, NodePusher, PushSettings
from trainer.push.wire import ParamMeta
from trainer.rollout.server import ServerError, VllmServer

pytestmark = pytest.mark.filterwarnings("ignore:Tensor .* exceeds buffer_size_bytes")  # vLLM's, for our tiny bucket

REQUEST_TIMEOUT_S = 60.0  # what a stuck /resume used to cost; every test below must end well inside it
PUSH_TIMEOUT_S = 3.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeVllm(LocalHttpServer):
    """vLLM's weight-transfer routes. An update whose chunks stop coming stays stuck (an NCCL receive has no timeout);
    stuck_after_receive: /update_weights receives every chunk, then never answers either. /resume is not answered
    between /start_weight_update and /finish_weight_update: a transfer that failed part way leaves the engine in
    it (vLLM runs the update in its engine loop, which also serves /resume). Everything stuck ends at close()."""

    def __init__(self, stuck_after_receive: bool = False) -> None:
        super().__init__(Handler)
        self.stuck_after_receive = stuck_after_receive
        self.routes: list[str] = []
        self.received: dict[str, torch.Tensor] = {}
        self.group: dist.ProcessGroupGloo | None = None
        self.bucket_bytes = 0
        self.updating = threading.Event()
        self.released = threading.Event()
        self.start()

    def release(self) -> None:
        self.released.set()


class Handler(JsonHandler):
    server: FakeVllm

    def do_POST(self) -> None:
        srv = self.server
        body = self.read_json()
        srv.routes.append(self.path)
        status, answer = 200, {"success": True}
        if self.path == "/init_weight_transfer_engine":  # the worker joins the trainer's group, as vLLM's engine does
            srv.group, srv.bucket_bytes = join_weight_group(body["init_info"])  # type: ignore[assignment]
        elif self.path == "/start_weight_update":
            srv.updating.set()
        elif self.path == "/update_weights":
            u = body["update_info"]
            meta = [ParamMeta(n, d, s) for n, d, s in zip(u["names"], u["dtype_names"], u["shapes"])]
            assert srv.group is not None
            try:
                for chunk in receive_packed(srv.group, meta, srv.bucket_bytes):
                    srv.received.update({n: t.clone() for n, t in chunk})
            except RuntimeError:  # the trainer stopped sending; an NCCL receive has no timeout: stuck for good
                srv.released.wait()
                status = 500
            if srv.stuck_after_receive:
                srv.released.wait()
        elif self.path == "/finish_weight_update":
            srv.updating.clear()
        elif self.path == "/resume":
            if srv.updating.is_set():  # an update left open: the engine never gets to it
                srv.released.wait()
        self.answer(answer, status)


@pytest.fixture
def server(request):
    srv = FakeVllm(**getattr(request, "param", {}))
    yield srv
    srv.close()


def pusher(url: str) -> tuple[torch.nn.Module, NodePusher]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
    settings = PushSettings(
        backend="gloo",
        transfer_port=free_port(),
        server_world=1,
        timeout_s=PUSH_TIMEOUT_S,
        dtype=torch.float32,
        bucket_bytes=512,  # chunks [0.weight] [0.bias 1.weight] [1.bias]
    )
    client = VllmServer(url, "m", node=0, timeout_s=REQUEST_TIMEOUT_S)
    return model, NodePusher(model, client, settings, torch.device("cpu"))


def test_a_push_that_breaks_part_way_raises_its_cause_not_the_resume_timeout(server, capsys):
    """Two of three chunks are sent, then the trainer's side breaks (the parameter stream no longer matches the
    metadata the server cuts chunks by). The error names that cause (chained) and arrives within the resume
    deadline; /resume was tried, briefly, and its failure is reported beside it."""
    model, p = pusher(server.url)
    model[1].bias = torch.nn.Parameter(torch.zeros(8))  # after the metadata was taken: the 4th tensor is wrong
    t0 = time.monotonic()
    with pytest.raises(ServerError) as e:
        p.push(step=3, keep_in_flight=True)
    elapsed = time.monotonic() - t0
    msg = str(e.value)
    assert "push order broken at 1.bias" in msg and "sending weights (gloo)" in msg and "step 3" in msg, msg
    assert "/resume" not in msg, msg
    assert isinstance(e.value.__cause__, RuntimeError) and "push order broken" in str(e.value.__cause__)
    assert elapsed < RESUME_AFTER_FAILURE_S + 15, (
        f"{elapsed:.0f} s: it waited for /resume (request timeout {REQUEST_TIMEOUT_S:.0f} s)"
    )
    # /update_weights goes out on its own thread, maybe after the failure and /resume
    assert server.routes[:3] == ["/init_weight_transfer_engine", "/pause?mode=keep", "/start_weight_update"], server.routes
    assert "/resume" in server.routes and "/finish_weight_update" not in server.routes, server.routes
    assert "/resume after the failed push at step 3 did not succeed" in capsys.readouterr().err


@pytest.mark.parametrize("server", [{"stuck_after_receive": True}], indirect=True)
def test_a_transfer_past_its_deadline_names_the_route_and_the_deadline(server):
    """Every chunk is received but the server never finishes /update_weights: the push deadline
    (trainer.push_timeout_s) is the error, within that deadline plus the resume deadline."""
    _, p = pusher(server.url)
    t0 = time.monotonic()
    with pytest.raises(ServerError) as e:
        p.push(step=5, keep_in_flight=True)
    elapsed = time.monotonic() - t0
    msg = str(e.value)
    # the POST's own deadline (push_timeout_s) or call_while's, whichever fires first: both name the route and 3 s
    assert "/update_weights" in msg and "within 3 s" in msg and "step 5" in msg and "/resume" not in msg, msg
    assert elapsed < PUSH_TIMEOUT_S + RESUME_AFTER_FAILURE_S + 15, f"{elapsed:.0f} s: it waited for /resume"
    assert server.routes[-1] == "/resume" and "/finish_weight_update" not in server.routes, server.routes


def test_a_push_that_lands_resumes_after_resetting_the_cache(server):
    """The path that works is unchanged: pause, the transfer, finish, reset with running requests, resume; the
    server holds the model's tensors."""
    model, p = pusher(server.url)
    p.push(step=1, keep_in_flight=True)
    assert server.routes == [
        "/init_weight_transfer_engine",
        "/pause?mode=keep",
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/reset_prefix_cache?reset_running_requests=true",
        "/resume",
    ], server.routes
    want = dict(model.named_parameters())
    assert set(server.received) == set(want)
    assert all(torch.equal(server.received[n], t.detach()) for n, t in want.items())
