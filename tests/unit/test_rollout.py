"""trainer.rollout.node.NodeRollout on one rank (a world-1 gloo group in this process) against a fake vLLM at the HTTP
boundary: what a step's push and generation ask the server, in order, what generation hands back and the node's figures,
at max_staleness 0 (every batch generated at its own step, no pause) and 2 (batches generated ahead; a push with a later
batch on the server pauses it: pause keep, the weight routes, reset with running requests, resume).

The fake is faithful where it matters: it joins the trainer's gloo weight-transfer group as vLLM's worker does
(trainer.push.gloo_engine's receiving side), loads what it receives into its own copy of the tiny Qwen2 (which starts
with other weights) and answers the parity probe's prompt_logprobs from that copy, so parity runs as configured
(action fail, tolerance by dtype): a push that did not land would fail the step. Its sampled completions are
[prompt's first token, prompt's last token, weight updates the server had finished when the request arrived], so a
completion shows which weights generated it. Answers the test holds are released by events, never by timing.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer

from launcher.core.records import NodeFigures
from tests.support.fakes import JsonHandler, LocalHttpServer, join_weight_group
from tests.support.ranks import cpu_parallel, free_port
from trainer.parallel import Parallel
from trainer.push.gloo_engine import receive_packed  # imports vLLM: not inside a request's deadline
from trainer.push.pusher import PushSettings
from trainer.push.wire import ParamMeta
from trainer.rollout.node import GenerationSettings, NodeRollout, TrlAdapter
from trainer.rollout.parity import ParityError, ProbeLogprobs
from trainer.tiny_model import make_tiny_model

pytestmark = pytest.mark.filterwarnings("ignore:Tensor .* exceeds buffer_size_bytes")  # vLLM's, for our small bucket

TIMEOUT_S = 60.0  # a deadline only a hang reaches
SAMPLING = dict(max_tokens=3, temperature=1.0)
LOGPROBS = [-1.0, -2.0, -3.0]

# the weight routes of one push (the first push of a sender also sends /init_weight_transfer_engine before them)
WEIGHTS = ["/start_weight_update", "/update_weights", "/finish_weight_update"]


def batch(step: int) -> list[list[int]]:
    """This rank's prompt ids of a step; the first token names the step (100 + step)."""
    return [[100 + step, 5, 6], [100 + step, 7]]


class FakeVllm(LocalHttpServer):
    """vLLM 0.32's routes as NodeRollout uses them. calls: each request in arrival order: its path, or for
    /v1/completions "plp" (a parity probe) or "gen <step>" (a sampling request, by its prompts' first token).
    hold[step]: a sampling request for that step waits until the event is set; arrived[step] is set when it arrives."""

    def __init__(self, model: torch.nn.Module, hold: tuple[int, ...] = ()) -> None:
        super().__init__(Handler)
        self.model = model
        self.lock = threading.Lock()
        self.calls: list[str] = []
        self.bodies: list[dict] = []
        self.version = 0
        """Weight updates finished so far."""
        self.hold = {s: threading.Event() for s in hold}
        self.arrived: dict[int, threading.Event] = {s: threading.Event() for s in range(16)}
        self.group: dist.ProcessGroupGloo | None = None
        self.bucket_bytes = 0
        self.drop_updates = False
        """Receive every pushed tensor but keep the old weights: a push that did not land."""
        self.start()

    def release(self) -> None:
        for e in self.hold.values():
            e.set()

    def prompt_logprobs(self, ids: list[int]) -> list[dict[str, dict[str, float]] | None]:
        with torch.no_grad():
            logits = self.model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
        lp = torch.log_softmax(logits, -1)
        return [None] + [{str(tok): {"logprob": float(lp[i, tok])}} for i, tok in enumerate(ids[1:])]

    def load(self, received: dict[str, torch.Tensor]) -> None:
        params = dict(self.model.named_parameters())
        assert set(received) == set(params), sorted(set(received) ^ set(params))
        with torch.no_grad():
            for name, t in received.items():
                params[name].copy_(t)


class Handler(JsonHandler):
    server: FakeVllm

    def do_POST(self) -> None:
        srv = self.server
        body = self.read_json()
        answer: dict = {"success": True}
        if self.path == "/v1/completions" and "prompt_logprobs" in body:
            srv.calls.append("plp")
            (ids,) = body["prompt"]
            with srv.lock:
                answer = {"choices": [{"index": 0, "token_ids": [0], "prompt_logprobs": srv.prompt_logprobs(ids)}]}
        elif self.path == "/v1/completions":
            step = body["prompt"][0][0] - 100
            srv.calls.append(f"gen {step}")
            srv.bodies.append(body)
            version = srv.version
            srv.arrived[step].set()
            if step in srv.hold:
                srv.hold[step].wait()
            answer = {
                "choices": [
                    {"index": i, "token_ids": [p[0], p[-1], version], "logprobs": {"token_logprobs": LOGPROBS}}
                    for i, p in enumerate(body["prompt"])
                ]
            }
        else:
            srv.calls.append(self.path)
        if self.path == "/init_weight_transfer_engine":  # the worker joins the trainer's group, as vLLM's engine does
            srv.group, srv.bucket_bytes = join_weight_group(body["init_info"])  # type: ignore[assignment]
        elif self.path == "/update_weights":
            u = body["update_info"]
            meta = [ParamMeta(n, d, s) for n, d, s in zip(u["names"], u["dtype_names"], u["shapes"])]
            assert srv.group is not None
            received: dict[str, torch.Tensor] = {}
            for chunk in receive_packed(srv.group, meta, srv.bucket_bytes):
                received.update({n: t.clone() for n, t in chunk})
            with srv.lock:
                if not srv.drop_updates:
                    srv.load(received)
        elif self.path == "/finish_weight_update":
            srv.version += 1
        self.answer(answer)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    make_tiny_model(path)
    return path


@pytest.fixture(scope="module")
def par():
    """One rank, one node: a world-1 gloo group in this process."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield cpu_parallel(0, 1)
    dist.destroy_process_group()


def load(tiny: Path, noise_seed: int | None = None) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    if noise_seed is not None:
        train_step(model, noise_seed)
    return model


def train_step(model: torch.nn.Module, seed: int, size: float = 0.05) -> None:
    """What an optimizer step does to the trainer's weights, as far as the server can tell: they change."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(size * torch.randn(p.shape, generator=g))


def rollout_for(tiny: Path, par: Parallel, server: FakeVllm, max_staleness: int, parity_every: int = 1) -> NodeRollout:
    settings = GenerationSettings(
        server_url=server.url,
        model="tiny",
        node=0,
        request_timeout_s=TIMEOUT_S,
        push=PushSettings(
            backend="gloo",
            transfer_port=free_port(),
            server_world=1,
            timeout_s=TIMEOUT_S,
            dtype=torch.float32,
            bucket_bytes=1 << 16,
        ),
        parity_tolerance=0.0,  # by dtype: 1e-3 in float32
        parity_action="fail",
        max_staleness=max_staleness,
        max_steps=10,
        parity_every=parity_every,
    )
    rollout: NodeRollout
    rollout = NodeRollout(
        load(tiny),
        AutoTokenizer.from_pretrained(tiny),
        par,
        settings,
        next_prompts=lambda: [batch(rollout.step + j) for j in range(1, max_staleness + 1)],
    )
    return rollout


@pytest.fixture
def server(tiny):
    srv = FakeVllm(load(tiny, noise_seed=1), hold=(2, 3))  # the server starts with other weights than the trainer
    yield srv
    srv.close()


def comps(step: int, version: int) -> list[tuple[list[int], list[float]]]:
    """The fake's completions of batch(step) for a request that arrived after `version` finished weight updates."""
    return [([p[0], p[-1], version], LOGPROBS) for p in batch(step)]


def test_at_max_staleness_0_each_step_pushes_then_generates_its_own_batch_without_pausing(tiny, par, server):
    """Through TrlAdapter, as TRL drives it: sync_weights (the push, parity before and after), then generate. Each
    batch is generated at its own step with the weights just pushed; nothing is sent ahead, nothing is paused. No
    parity work holds sync_weights: the after-push probe is in flight beside the batch, the trainer's side runs while
    the server generates, and both are checked when the batch is back."""
    rollout = rollout_for(tiny, par, server, max_staleness=0)
    adapter = TrlAdapter(rollout, max_completion_length=3, temperature=0.7)
    assert rollout.ahead is None
    got = []
    for step in (0, 1):
        rollout.begin_step(step)  # the callback's on_step_begin
        if step:
            train_step(rollout.pusher.model, seed=10 + step)
        adapter.sync_weights()
        assert rollout.parity.pending is not None and rollout.figures.parity is None, "the probe did not hold the push"
        assert rollout.probe_forward_due, "the trainer's side runs while the server generates, not in the push"
        got.append(adapter.generate(batch(step), None, num_generations=2))
        assert rollout.parity.pending is None and rollout.figures.parity is not None, "checked before training on it"
        assert not rollout.probe_forward_due
        if step == 0:
            figures_0 = rollout.figures
    # the after-push probe ("plp") and the batch ("gen <step>") go out at once, in either order
    n0 = len(WEIGHTS) + 2
    assert server.calls[:n0] == ["/init_weight_transfer_engine", *WEIGHTS, "/reset_prefix_cache"], server.calls
    assert sorted(server.calls[n0 : n0 + 2]) == ["gen 0", "plp"], server.calls
    assert server.calls[n0 + 2 : -2] == ["plp", *WEIGHTS, "/reset_prefix_cache"], "before the push: how stale it was"
    assert sorted(server.calls[-2:]) == ["gen 1", "plp"], server.calls
    assert len(server.calls) == 14
    for step, (prompts, ids, logprobs, extra) in enumerate(got):
        assert prompts == batch(step) and extra is None
        assert ids == [c for c, _ in comps(step, version=step + 1)], "generated with the weights of this step's push"
        assert logprobs == [[[lp] for lp in LOGPROBS]] * 2
    assert all(b["max_tokens"] == 3 and b["temperature"] == 0.7 and b["n"] == 1 for b in server.bodies), server.bodies
    f = rollout.figures
    assert figures_0.staleness == 0 and figures_0.parity_stale is None and figures_0.server_requests == 6
    assert f.staleness == 0 and f.pushes_paused == 0 and f.pushes_paused_running == 0
    assert f.ahead_hits == 0 and f.ahead_misses == 0
    assert f.server_requests == len(server.calls) - 3 == 11, "the main client's: the probes have their own"
    assert f.gen_tokens == 6
    assert f.parity is not None and f.parity < 1e-3, "the push landed: the server's logprobs are the trainer's"
    assert f.parity_stale is not None and f.parity_stale > 1e-3, "before the push the server had step 0's weights"
    assert f.prompts_digest is not None and f.prompts_digest != figures_0.prompts_digest
    assert rollout.by_node == {0: f}
    assert rollout.pusher.pushes == 2


def test_at_max_staleness_2_a_push_with_a_later_batch_outstanding_pauses_it(tiny, par, server):
    """k = 2: step 0's generation sends the batches of steps 1 and 2 ahead (step 2's held on the server, still
    running). Step 1's push waits for step 1's batch, then pauses step 2's: pause keep, the weight routes, reset with
    running requests, resume; its generation takes the batch sent ahead (staleness 1, no request) and sends step 3's.
    Step 2 the same with step 3's held: its batch was generated with step 0's weights (staleness 2)."""
    rollout = rollout_for(tiny, par, server, max_staleness=2)
    assert rollout.ahead is not None
    try:
        rollout.begin_step(0)
        rollout.push(0)
        out0 = rollout.generate(batch(0), SAMPLING)
        f0 = rollout.figures
        assert server.arrived[2].wait(TIMEOUT_S), "step 2's batch never reached the server"

        rollout.begin_step(1)
        train_step(rollout.pusher.model, seed=11)
        rollout.push(1)
        out1 = rollout.generate(batch(1), SAMPLING)
        f1 = rollout.figures
        server.hold[2].set()  # step 2's batch finishes; step 3's (sent at step 1) reaches the server and is held
        assert server.arrived[3].wait(TIMEOUT_S), "step 3's batch never reached the server"

        rollout.begin_step(2)
        train_step(rollout.pusher.model, seed=12)
        rollout.push(2)
        out2 = rollout.generate(batch(2), SAMPLING)
        f2 = rollout.figures
    finally:
        rollout.ahead.close()
    paused_push = ["plp", "/pause?mode=keep", *WEIGHTS, "/reset_prefix_cache?reset_running_requests=true", "/resume", "plp"]
    assert server.calls == [
        "/init_weight_transfer_engine",
        *WEIGHTS,
        "/reset_prefix_cache",  # nothing sent ahead yet: no pause, nothing running to reset
        "plp",
        "gen 0",
        "gen 1",  # sent ahead (the queue's own client), with step 0's weights
        "gen 2",
        *paused_push,  # step 1's push, step 2's batch held on the server
        "gen 3",  # sent at step 1, once step 2's answer freed the queue's thread
        *paused_push,  # step 2's push, step 3's batch held
    ], server.calls
    assert out0 == comps(0, version=1)
    assert out1 == comps(1, version=1) and out2 == comps(2, version=1), "generated ahead with step 0's weights"
    assert (f0.staleness, f1.staleness, f2.staleness) == (0, 1, 2)
    assert (f0.ahead_hits, f1.ahead_hits, f2.ahead_hits) == (0, 1, 2) and f2.ahead_misses == 0
    assert (f0.pushes_paused, f1.pushes_paused, f2.pushes_paused) == (0, 1, 2)
    assert (f1.pushes_paused_running, f2.pushes_paused_running) == (1, 2), "the paused batch was still generating"
    # the main client's requests only: not the batches the queue sent ahead, nor the parity probes (their own clients)
    assert (f0.server_requests, f1.server_requests, f2.server_requests) == (6, 12, 18)
    assert f2.parity is not None and f2.parity < 1e-3 and f2.parity_stale is not None and f2.parity_stale > 1e-3
    assert rollout.by_node == {0: f2} and isinstance(f2, NodeFigures)


def test_parity_every_n_proves_every_push_but_probes_staleness_every_n_steps_with_one_trainer_forward_a_push(tiny, par, server):
    """trainer.parity_every 3: every push is followed by the after-push probe (the proof it landed); the stale probe
    before it runs at steps 3 and 6 only (not at step 0: nothing trained yet); the trainer's side of both is one
    forward per push. The parity seconds are the node's own figure."""
    rollout = rollout_for(tiny, par, server, max_staleness=0, parity_every=3)
    forwards, drifts = [], []
    rollout.pusher.model.register_forward_hook(lambda *_: forwards.append(rollout.step))
    for step in range(7):
        rollout.begin_step(step)
        if step:
            train_step(rollout.pusher.model, seed=20 + step)
        rollout.push(step)
        f = rollout.figures
        assert f.parity is not None and f.parity < 1e-3, (step, f.parity)  # every push proven
        assert (f.parity_stale is not None) == (step in (3, 6)), (step, f.parity_stale)
        if step in (3, 6):
            assert f.parity_stale is not None and f.parity_stale > 1e-3, "the server lagged one step behind"
        assert f.parity_s is not None and f.parity_s > 0
        drifts.append(f.probe_drift)
    assert forwards == list(range(7)), "one trainer forward per push, shared by the stale and the after-push probe"
    # the drift: 0 at the attempt's first push, then how far the trained model's probe moved from it (the server
    # followed: every after-push parity held)
    first = rollout.parity.history[0]["trainer"]
    last = rollout.parity.history[-1]["trainer"]
    assert drifts[0] == 0.0 and drifts[-1] == max(abs(a - b) for a, b in zip(last, first, strict=True)) > 1e-3, drifts
    kinds = [(h["step"], h["kind"]) for h in rollout.parity.history]
    assert [k for k in kinds if k[1] == "stale"] == [(3, "stale"), (6, "stale")], kinds
    assert [k[0] for k in kinds if k[1] == "after_push"] == list(range(7)), kinds
    assert server.calls.count("plp") == 9 and rollout.pusher.pushes == 7


def test_a_resumed_attempts_first_push_is_probed_before_it(tiny, par, server):
    """The first push of an attempt past step 0 (a resume: its server holds the base model) gets the stale probe
    whatever parity_every says; later ones only on the period (0: never again)."""
    rollout = rollout_for(tiny, par, server, max_staleness=0, parity_every=0)
    for step in (16, 17):
        rollout.begin_step(step)
        rollout.push(step)
        if step == 16:
            assert rollout.figures.parity_stale is not None and rollout.figures.parity_stale > 1e-3
    assert rollout.figures.parity_stale is None and rollout.figures.parity is not None
    assert [h["kind"] for h in rollout.parity.history] == ["stale", "after_push", "after_push"]


def test_a_push_that_did_not_land_stops_the_step_after_its_generation_before_training(tiny, par, server):
    """The after-push probe is not waited for in sync_weights; a push whose weights the server dropped is caught when
    the batch generated beside the probe comes back (before TRL trains on it), naming the node and the step."""
    rollout = rollout_for(tiny, par, server, max_staleness=0)
    adapter = TrlAdapter(rollout, max_completion_length=3, temperature=0.7)
    server.drop_updates = True
    rollout.begin_step(0)
    adapter.sync_weights()  # returns with the probe in flight
    assert rollout.parity.pending is not None
    with pytest.raises(ParityError, match="node 0: parity check failed at step 0"):
        adapter.generate(batch(0), None, num_generations=2)
    assert server.calls[-2:] in (["plp", "gen 0"], ["gen 0", "plp"]), server.calls


def test_parity_allows_bf16_rounding_that_grows_with_the_logits_yet_catches_a_push_that_did_not_land(tiny, par):
    """A sharpened model (the final norm x80: logits up to 80, logprobs down to -150, as a trained model whose reward
    has saturated) served in bf16 against the trainer's float32: rounding alone moves logprobs by more than the 0.25
    bf16 tolerance, which stopped Qwen2.5-3B's shape on an H100 with every push landed. The check allows each token
    eps(bf16) x its logits' size on top, and still fails a server that holds other weights, naming the token; and at
    logits of an everyday size (x8: up to 15) a server one small step behind (0.56 apart) still fails."""
    import copy

    from trainer.rollout.parity import ParityChecker
    from trainer.rollout.server import VllmServer

    probe = "The quick brown fox jumps over the lazy dog; a parity probe of some length."
    tokenizer = AutoTokenizer.from_pretrained(tiny)

    def sharpened(factor: float) -> torch.nn.Module:
        model = load(tiny)
        with torch.no_grad():
            model.model.norm.weight.mul_(factor)  # type: ignore[operator,union-attr]
        return model

    trainer_model = sharpened(80.0)
    srv = FakeVllm(copy.deepcopy(trainer_model).to(torch.bfloat16))
    try:
        client = VllmServer(srv.url, "tiny", 0, TIMEOUT_S)
        checker = ParityChecker(trainer_model, client, par, tokenizer, 0.0, "fail", probe, torch.bfloat16)
        assert checker.tolerance == 0.25 and checker.rounding == 2**-7
        mine = checker.trainer_side()
        checker.start_after_push(1)
        _, after = checker.settle(mine)
        assert after is not None and after > 0.25, f"rounding alone exceeds the absolute tolerance: {after}"
        assert max(mine.scale) > 100 and min(mine.logprobs) < -100, (max(mine.scale), min(mine.logprobs))

        stale = copy.deepcopy(trainer_model)
        train_step(stale, seed=3)  # the server keeps weights one optimizer step behind: the push did not land
        with srv.lock:
            srv.model = stale.to(torch.bfloat16)
        checker.start_after_push(2)
        with pytest.raises(ParityError, match=r"parity check failed at step 2: .* at the probe's token \d+ .*rounding 0.0078125"):
            checker.settle(mine)

        everyday = sharpened(8.0)
        with srv.lock:
            srv.model = copy.deepcopy(everyday).to(torch.bfloat16)  # what the server held before the push
        train_step(everyday, seed=3, size=0.0005)  # the trainer's step that the push did not bring
        checker = ParityChecker(everyday, client, par, tokenizer, 0.0, "fail", probe, torch.bfloat16)
        mine = checker.trainer_side()
        assert 10 < max(mine.scale) < 20, max(mine.scale)
        checker.start_after_push(3)
        with pytest.raises(ParityError, match=r"parity check failed at step 3: .* disagrees with the trainer by 0\.5"):
            checker.settle(mine)
    finally:
        srv.close()


def test_multi_turn_checks_the_probe_and_gathers_the_figures_at_the_steps_end(tiny, par, server):
    """Multi-turn (trainer.agents.generation.RankGeneration): ranks make different numbers of requests, so the probe
    is checked and every node's figures gathered in end_step (the callback's on_step_end), not in a generate call."""
    from trainer.agents.generation import RankGeneration

    rollout = rollout_for(tiny, par, server, max_staleness=0)
    backend = RankGeneration(rollout, max_completion_length=3, temperature=0.7)
    assert rollout.gather_at_step_end
    rollout.begin_step(0)
    backend.sync_weights()
    backend.generate(batch(0), None, num_generations=2)
    backend.generate(batch(0), None, num_generations=2)  # a second turn
    assert rollout.parity.pending is not None and rollout.by_node == {}, "nothing checked or gathered mid-step"
    rollout.end_step()
    assert rollout.parity.pending is None
    f = rollout.by_node[0]
    assert f.parity is not None and f.parity < 1e-3 and f.parity_s is not None and f.push_s is not None


def release_step_0_when_the_forward_runs(rollout: NodeRollout, srv: FakeVllm) -> list[bool]:
    """The trainer's side of parity, wrapped: it first waits for step 0's request to be on the server (held there),
    then releases it. Returns what each forward saw (True: the request was there): without the overlap the held
    request would hang to its deadline."""
    forward = rollout.parity.trainer_side
    seen: list[bool] = []

    def forward_while_generating() -> ProbeLogprobs:
        seen.append(srv.arrived[0].wait(TIMEOUT_S))
        srv.hold[0].set()
        return forward()

    rollout.parity.trainer_side = forward_while_generating  # type: ignore[method-assign]
    return seen


def test_in_trls_tool_loop_the_parity_forward_runs_beside_the_first_turn(tiny, par):
    """Multi-turn with TRL's own tool loop (RankGeneration.forward_in_first_turn, trainer.run): the push leaves the
    trainer's side of parity to the step's first request, which every rank makes before the optimizer step; the fake
    holds that turn until the forward has started, so without the overlap it would hang to its deadline. Later turns
    run nothing beside them; end_step compares. A step whose first turn never came refuses to compare at its end."""
    from trainer.agents.generation import RankGeneration

    srv = FakeVllm(load(tiny, noise_seed=1), hold=(0,))
    try:
        rollout = rollout_for(tiny, par, srv, max_staleness=0)
        backend = RankGeneration(rollout, max_completion_length=3, temperature=0.7)
        backend.forward_in_first_turn = True
        seen = release_step_0_when_the_forward_runs(rollout, srv)
        rollout.begin_step(0)
        backend.sync_weights()
        assert seen == [] and rollout.probe_forward_due
        backend.generate(batch(0), None, num_generations=2)
        assert seen == [True] and not rollout.probe_forward_due, "the forward ran while the first turn was on the server"
        backend.generate(batch(0), None, num_generations=2)  # a second turn: nothing beside it
        assert seen == [True] and backend.take_figures()["requests"] == 2
        rollout.end_step()
        assert rollout.by_node[0].parity is not None and rollout.by_node[0].parity < 1e-3

        rollout.begin_step(1)
        backend.sync_weights()  # no generation follows (a path that broke the promise)
        with pytest.raises(RuntimeError, match="the parity forward of the push at step 1 did not run in the step's first"):
            rollout.end_step()
    finally:
        srv.close()


def test_a_failed_parity_forward_beside_the_generation_is_named_as_such(tiny, par, server):
    """The forward runs beside the leader's request (node_generate's meanwhile): its error reaches every rank of the
    node as the parity forward's, not as the generation's."""
    rollout = rollout_for(tiny, par, server, max_staleness=0)
    adapter = TrlAdapter(rollout, max_completion_length=3, temperature=0.7)
    rollout.begin_step(0)
    adapter.sync_weights()

    def broken_forward() -> ProbeLogprobs:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (as a forward would say)")

    rollout.parity.trainer_side = broken_forward  # type: ignore[method-assign]
    with pytest.raises(RuntimeError) as caught:
        adapter.generate(batch(0), None, num_generations=2)
    msg = str(caught.value)
    assert msg.startswith("node 0: the trainer's side of parity (probe_forward)") and "out of memory" in msg, msg
    assert "generation of" not in msg, msg
    assert "gen 0" in server.calls, "the request itself was answered"


def test_the_trainers_side_of_parity_runs_while_the_server_generates_the_batch(tiny, par):
    """The point of deferring the probe's forward: it runs while the leader's generation request is out. The fake
    holds the step's batch until the forward has started, so without the overlap the request would hang to its
    deadline and the test fail."""
    srv = FakeVllm(load(tiny, noise_seed=1), hold=(0,))
    try:
        rollout = rollout_for(tiny, par, srv, max_staleness=0)
        adapter = TrlAdapter(rollout, max_completion_length=3, temperature=0.7)
        seen = release_step_0_when_the_forward_runs(rollout, srv)
        rollout.begin_step(0)
        adapter.sync_weights()
        assert seen == [] and rollout.probe_forward_due
        adapter.generate(batch(0), None, num_generations=2)
        assert seen == [True], "the forward ran while the batch was on the server"
        assert rollout.figures.parity is not None and rollout.figures.parity < 1e-3
    finally:
        srv.close()


def test_an_evaluation_push_is_settled_before_the_next_optimizer_step(tiny, par, server):
    """An evaluation pushes (sync_weights) and generates outside TRL's step; what it left unsettled is checked at the
    next step's begin_step, before that step's optimizer step changes the weights; a forward due after the weights
    moved on is refused with the reason, never compared."""
    rollout = rollout_for(tiny, par, server, max_staleness=0)
    adapter = TrlAdapter(rollout, max_completion_length=3, temperature=0.7)
    rollout.begin_step(0)
    adapter.sync_weights()  # an evaluation's push: nothing generated through the rollout after it
    rollout.begin_step(0)  # the next step starts at the same weights
    assert not rollout.probe_forward_due and rollout.figures.parity is not None and rollout.figures.parity < 1e-3
    adapter.sync_weights()  # the same step's push: settled, nothing changed, nothing sent
    rollout.step = 1  # a push left due past an optimizer step (a path that skipped its settle)
    rollout.pushed_step = None
    adapter.sync_weights()
    rollout.step = 2
    with pytest.raises(RuntimeError, match="the parity forward of the push at step 1 is due at step 2"):
        rollout.probe_forward()
    with pytest.raises(RuntimeError, match="the push at step 1 is still due at the start of step 2"):
        rollout.begin_step(2)  # where such a path would surface first
