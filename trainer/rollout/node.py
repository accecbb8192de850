"""One node's generation for TRL's GRPOTrainer, in place of trl's `VLLMGeneration`.

Stock TRL server mode: global rank 0 gathers every prompt of the world, asks one server, broadcasts
everything back, and pushes every weight. Here every node works alone:

  generate:     gather the node's prompts on the node leader (node process group only), one request to
                the node's own server with one completion per prompt entry (n=1: duplicate prompts and
                groups split across ranks/nodes keep their own samples, nothing is deduplicated), then
                scatter each rank's completions back in order.
  push:         every rank takes part in the FSDP2 gather, parameter by parameter; each node leader
                streams them to its own server (trainer.push.pusher), then checks parity (trainer.rollout.parity).
  k steps off:  with trainer.max_staleness k, right after a step's generation the node's ranks hand the prompts of
                their next k steps (trainer.data.LookaheadPrompts) to the leader, whose AheadQueue
                (trainer.rollout.ahead) sends those not yet sent to the server in the background while the ranks train.
                Before a push the leader waits for the batch the next step needs. With k = 1 nothing else is in flight
                then; with k >= 2 later batches are outstanding (running or done): the push runs between
                pause_keep and resume (vLLM 0.32 freezes them in its queue: nothing lost, nothing aborted), and
                reset_prefix_cache with reset_running_requests recomputes their KV under the new weights, so their
                remaining tokens come from the new weights (vLLM returns each token's own logprob, which TRL's
                importance-sampling correction uses). `abort` would lose them and `wait` would hold the push until
                they finish, idling the trainer. server_requests counts the main client's requests only.

`NodeRollout` is built before TRL's trainer and owns the step (`begin_step`, called by the callback), the node's
figures (`figures`; every node's in `by_node`, gathered once per generation), the pusher, parity and the ahead queue.
`TrlAdapter` is the thin class TRL instantiates with its own keyword arguments (trainer.trl_glue's backend swap): it
keeps TRL's sampling settings and hands every call to the rollout.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist

from launcher.core.jobdir import Env
from launcher.core.plan import Plan
from launcher.core.records import NodeFigures, NodeFinal, ParityRecord
from trainer.parallel import Parallel
from trainer.push.adapter import LoraPush, make_pusher, push_bytes
from trainer.push.pusher import PushSettings
from trainer.rollout.ahead import AheadQueue, Completions, timed_complete
from trainer.rollout.parity import ParityChecker, ProbeLogprobs
from trainer.rollout.server import RoutedCompletion, ServerError, VllmServer
from trainer.routing_replay import RouteTable

log = logging.getLogger(__name__)

PARITY_PROBE = "the quick brown fox jumps over a lazy dog and a cat sat on a mat"


@dataclass(frozen=True)
class GenerationSettings:
    """Everything the node-local backend needs, from the plan."""

    server_url: str
    model: str
    node: int
    request_timeout_s: float
    push: PushSettings
    parity_tolerance: float
    """0 = by dtype and attention (trainer.rollout.parity.default_tolerance)."""
    parity_action: str
    parity_probe: str = PARITY_PROBE
    max_staleness: int = 0
    """k: the node's prompts of the next k steps go to its server right after this step's generation (trainer.max_staleness)."""
    max_steps: int = 0
    server_engines: int = 1
    """vLLM engines behind the node's server (vllm.data_parallel_size): parity is checked on each."""
    parity_every: int = 1
    """The stale parity probe's period in steps (trainer.parity_every); the after-push check runs at every push."""
    server_start_timeout_s: float = 0.0
    """> 0: the trainer started beside its server (trainer.start_with_server), which may still be starting: every rank
    waits for its /health, up to this long (vllm.health_timeout_s), before its first request or step; 0 = it is up."""
    server_shares_gpu: bool = False
    """vLLM and this node's trainer ranks share its GPUs (the plan's shared_gpu: one-GPU nodes, slurm.layout shared)."""
    server_kv_fixed: bool = False
    """The node's server was started with a KV cache size, the work's or an earlier start's (Env.KV_CACHE_FIXED)."""
    lora: LoraPush | None = None
    """trainer.lora: how the push moves the adapter (trainer.push.adapter); model is then the adapter's name."""
    routing_replay: bool = False
    """trainer.routing_replay: every completion comes back with the experts vLLM routed it to (rollout.routes)."""

    @staticmethod
    def from_plan(plan: Plan, node: int, dtype: torch.dtype) -> GenerationSettings:
        t, n = plan.config.trainer, plan.nodes[node]
        push = PushSettings(
            backend=plan.weight_transfer_backend,
            transfer_port=n.weight_transfer_port,
            server_world=plan.server_world,
            timeout_s=t.push_timeout_s,
            dtype=dtype,
            bucket_bytes=t.bucket_mb * 2**20,
            ipc_buffer_bytes=t.ipc_buffer_mb * 2**20,
        )
        lora = LoraPush.from_plan(plan, node)
        return GenerationSettings(
            server_url=n.server_url,
            model=(lora and lora.served_name) or plan.config.vllm.model,
            node=node,
            request_timeout_s=t.request_timeout_s,
            push=push,
            parity_tolerance=t.parity_tolerance,
            parity_action=t.parity_action,
            max_staleness=t.max_staleness,
            max_steps=t.max_steps,
            server_engines=plan.data_parallel_size,
            parity_every=t.parity_every,
            server_start_timeout_s=float(plan.config.vllm.health_timeout_s) if t.start_with_server else 0.0,
            server_shares_gpu=n.shared_gpu,
            server_kv_fixed=os.environ.get(Env.KV_CACHE_FIXED) == "1",
            lora=lora,
            routing_replay=t.routing_replay,
        )


class MeanwhileFailed(RuntimeError):
    """What ran beside a generation request (beside's meanwhile: the parity forward) failed, not the request."""


T = TypeVar("T")


def beside(ask: Callable[[], T], meanwhile: Callable[[], None]) -> T:
    """ask() on a worker thread while meanwhile() runs on this one (the trainer's side of parity while the server
    generates); ask's answer once both are done. ask's own deadline (trainer.request_timeout_s) bounds the wait for it;
    an error of meanwhile is raised as MeanwhileFailed once ask is over, so a report tells the two apart."""
    with ThreadPoolExecutor(1, thread_name_prefix="generation") as pool:
        asked = pool.submit(ask)
        try:
            meanwhile()
        except Exception as e:  # leaving the pool waits for ask
            what = getattr(meanwhile, "__name__", "meanwhile")
            raise MeanwhileFailed(f"the trainer's side of parity ({what}) beside the generation request failed: {e!r}") from e
        return asked.result()


def node_generate(
    par: Parallel,
    prompts: list[list[int]],
    ask_server: Callable[[list[list[int]]], list],
    meanwhile: Callable[[], None] | None = None,
):
    """Gather the node's prompts on its leader (node group only), ask the node's server once for one
    completion per entry, scatter each rank its own completions in its own order. Collective over
    the node's ranks. Returns (this rank's completions, tokens generated on the node: leader only).
    meanwhile: run on every rank while the leader's request is out (a collective of the whole world may run there:
    every rank of every node calls this at the same step). On the leader ask_server runs on a worker thread meanwhile:
    what meanwhile touches must be none of what ask_server does (NodeRollout's figures: only ask_server notes them)."""
    gathered: list[Any] | None = [None] * len(par.node_ranks) if par.is_leader else None
    dist.gather_object(prompts, gathered, dst=par.leader, group=par.node_group)
    out: list[Any] | None = None
    tokens = 0
    if gathered is None and meanwhile is not None:
        meanwhile()
    if gathered is not None:  # the node leader
        flat = [p for rank_prompts in gathered for p in rank_prompts]
        try:
            comps = ask_server(flat) if meanwhile is None else beside(lambda: ask_server(flat), meanwhile)
            assert len(comps) == len(flat), (len(comps), len(flat))
            out, i = [], 0
            for rank_prompts in gathered:
                out.append(comps[i : i + len(rank_prompts)])
                i += len(rank_prompts)
            tokens = sum(len(c[0]) for c in comps)  # (ids, logprobs[, routes])
        except MeanwhileFailed as e:  # hand the error to every rank of the node, so none waits forever
            out = [RuntimeError(f"node {par.node}: {e}")] * len(par.node_ranks)
        except Exception as e:
            out = [RuntimeError(f"generation of {len(flat)} completions on node {par.node} failed: {e}")] * len(par.node_ranks)
    mine: list[Any] = [None]
    dist.scatter_object_list(mine, out, src=par.leader, group=par.node_group)
    if isinstance(mine[0], Exception):
        raise mine[0]
    return mine[0], tokens


NextPrompts = Callable[[], list[list[list[int]]]]
"""This rank's prompt ids of each of the next steps (trainer.data.LookaheadPrompts; fewer at a pass's end)."""


class NodeRollout:
    """One node's generation, weight push and parity, built before TRL's trainer; every rank of the node holds one
    (the collectives need them all), the node leader alone talks to the server."""

    def __init__(self, model, tokenizer, par: Parallel, settings: GenerationSettings, next_prompts: NextPrompts | None = None):
        self.par, self.settings = par, settings
        self.next_prompts: NextPrompts = next_prompts or (lambda: [])
        self.step = 0
        """The optimizer step the trainer is at (begin_step)."""
        self.pushed_step: int | None = None
        """The step whose weights the server holds (the last push's)."""
        self.figures = NodeFigures()
        """This node's figures as they stand (leader; empty elsewhere)."""
        self.by_node: dict[int, NodeFigures] = {}
        """Every node's figures at the last generation (gathered from the node leaders, on every rank)."""
        self.gather_at_step_end = False
        """Multi-turn generation (trainer.agents.generation): the figures are gathered at the step's end (end_step)."""
        self.probe_mine: ProbeLogprobs | None = None
        """The trainer's probe logprobs with the weights of the last push (ParityChecker.trainer_side)."""
        self.probe_forward_due = False
        """The last push left its trainer side to run while the server generates (probe_forward)."""
        self.probe_step = 0
        """The step the trainer was at when it pushed last (its weights are the pushed ones until it moves on)."""
        s = settings
        self.client: VllmServer | None = None
        self.ahead: AheadQueue | None = None
        start = s.server_start_timeout_s
        if par.is_leader:  # its first request waits for the server's start (a push without a step first: finish)
            self.client = VllmServer(s.server_url, s.model, par.node, s.request_timeout_s, start)
            if s.max_staleness:  # its own client: the main thread's is busy with pushes and parity
                self.ahead = AheadQueue(VllmServer(s.server_url, s.model, par.node, s.request_timeout_s), s.request_timeout_s)
        self.routes = RouteTable() if s.routing_replay else None
        """trainer.routing_replay: this rank's routes of its latest generation (TrlAdapter fills it)."""
        self.server_start = (
            (self.client or VllmServer(s.server_url, s.model, par.node, s.request_timeout_s, start)) if start else None
        )
        """Until the first step: the server may still be starting (trainer.start_with_server)."""
        self.pusher = make_pusher(model, self.client, s.push, s.lora, par.device)
        self.parity = ParityChecker(
            model,
            self.client,
            par,
            tokenizer,
            s.parity_tolerance,
            s.parity_action,
            s.parity_probe,
            s.push.dtype,
            s.server_engines,
            s.parity_every,
        )

    def wait_for_server(self) -> None:
        """Every rank: wait for the node's server to be healthy if it may still be starting (trainer.start_with_server),
        so that no rank waits in a collective meanwhile. At once after the first call."""
        if self.server_start is not None:
            self.server_start.wait_started()
            self.server_start = None

    def before_resume(self) -> None:
        """Before a resumed attempt loads its checkpoint (the optimizer state: twice the fp32 model) onto GPUs it shares
        with vLLM: wait for the server. vLLM sizes its KV cache as its share of the GPU less every byte the GPU lost
        between its start and the end of its profile run, other processes' included; a restart of a 2.8 B body on one
        H100 whose trainer loaded its Adam state in that window got -9.7 GiB and vLLM did not start (2026-12-06,
        gpu/results/2026-12-06-lora-shapes/). The first start creates the optimizer state at the first step, after. A
        server given a size (the work's, or the one its first start measured: launcher.node.kv_reuse) sizes nothing: the load goes on at once."""
        if self.settings.server_shares_gpu and not self.settings.server_kv_fixed:
            self.wait_for_server()

    def begin_step(self, step: int) -> None:
        self.wait_for_server()  # every rank, before the first step's collectives: none waits in one
        if self.probe_forward_due and step != self.probe_step:  # an evaluation's push carries the step it follows
            raise RuntimeError(
                f"node {self.par.node}: the parity forward of the push at step {self.probe_step} is still due at the "
                f"start of step {step}: an optimizer step came between (a bug: a push's forward runs before it)"
            )
        self.settle_parity()  # a push whose probes nothing settled yet: now, before this step's optimizer step
        ensure_loaded = getattr(self.pusher, "ensure_loaded", None)  # trainer.lora: the adapter's name servable
        if ensure_loaded is not None:
            ensure_loaded()
        self.step = step

    def _note(self, **figures: Any) -> None:
        self.figures = dataclasses.replace(self.figures, **figures)

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: list[list[int]], sampling: dict[str, Any]) -> Completions:
        """This rank's completions of its prompts at the current step. Collective over the world (the figures)."""
        t0 = time.time()
        step = self.step
        client = self.client
        if self.routes is not None:  # the ahead queue's requests too: the same sampling reaches them
            sampling = {**sampling, "routed_experts": True}

        def ask_server(flat: list[list[int]]) -> Completions:
            assert client is not None  # node_generate asks on the leader only
            # which prompts this node trained on at this step (a resumed run must continue the same order)
            self._note(prompts_digest=hashlib.sha1(repr(flat).encode()).hexdigest()[:12])
            sent = self.ahead.take(step) if self.ahead is not None else None
            if sent is not None and sent.prompts == flat:  # generated during earlier steps' training
                assert self.ahead is not None
                comps, gen_s = self.ahead.result(sent)
                self._note(gen_s=gen_s, staleness=step - sent.weights_step, ahead_hits=self.figures.ahead_hits + 1)
                return comps
            if sent is not None:  # the lookahead saw other prompts: never train on them, generate these now
                self._note(ahead_misses=self.figures.ahead_misses + 1)
            comps, gen_s = timed_complete(client, flat, sampling, step)
            self._note(staleness=0, gen_s=gen_s)
            return comps

        # the trainer's side of the push's parity runs while the server generates the batch
        mine, node_tokens = node_generate(self.par, prompts, ask_server, meanwhile=self.probe_forward)
        if client is not None:
            # gen_s: the server's time for this step's batch; gen_wait_s: what the step waited for it (less when ahead)
            self._note(gen_tokens=node_tokens, gen_wait_s=time.time() - t0, server_requests=client.requests_sent)
        self.settle_parity()  # the after-push probe went out beside this batch: checked before anything trains on it
        if self.settings.max_staleness:
            self.send_ahead(step, sampling)
        self.gather_figures()
        return mine

    def send_ahead(self, step: int, sampling: dict[str, Any]) -> None:
        """Collective over the node: gather every rank's prompts of the next max_staleness steps on the leader, whose
        queue sends those not yet sent to the server in the background and returns at once. Not past the last step."""
        k = min(self.settings.max_staleness, self.settings.max_steps - step - 1)
        nxt = self.next_prompts()[: max(k, 0)]
        gathered: list[Any] | None = [None] * len(self.par.node_ranks) if self.par.is_leader else None
        dist.gather_object(nxt, gathered, dst=self.par.leader, group=self.par.node_group)
        if gathered is None or self.ahead is None:
            return
        depth = min(len(g) for g in gathered)
        self.ahead.send(step, [[list(p) for g in gathered for p in g[j]] for j in range(depth)], sampling)

    def gather_figures(self) -> None:
        """Collective over the whole world (all_gather_object): every rank learns every node leader's figures."""
        mine = (self.par.node, self.figures) if self.par.is_leader else None
        out: list[Any] = [None] * self.par.world
        dist.all_gather_object(out, mine)
        for got in out:
            if got is not None:
                self.by_node[got[0]] = got[1]

    # ------------------------------------------------------------------ weights
    def push(self, step: int, probe_in_background: bool = False, forward_in_generation: bool = False) -> None:
        """Push and check parity: after the push (it landed) always, before it (how stale the server was) when due
        (trainer.parity_every); one trainer forward serves both (trainer.rollout.parity). Collective.
        probe_in_background (TRL's sync_weights, during training): nothing of parity holds the push: the probes'
        server sides go out (the after-push one in the background, beside the step's generation) and settle_parity
        compares them. forward_in_generation: the trainer's side too waits, for the step's first generation to run it
        (probe_forward) while the server generates; the caller promises one comes before the next optimizer step, on
        every rank (an evaluation's push, which none follows: at the latest begin_step's settle). Else it runs here.
        Neither: both are checked here."""
        self.wait_for_server()  # a resumed attempt with no step left pushes first (finish) while vLLM may be starting
        self.settle_parity()  # the last push's first: at most one in flight, and checked before a new push
        if step == self.pushed_step:  # an evaluation brought this push forward (trainer.evaluation): nothing changed since
            return
        in_flight, running = self.ahead.wait(step) if self.ahead is not None else (False, False)
        later_forward = probe_in_background and forward_in_generation
        try:
            t0 = time.time()
            mine = None
            if later_forward:
                if self.par.device.type == "cuda":  # what the forward's host sync did: the optimizer's writes first
                    torch.cuda.current_stream(self.par.device).synchronize()
            else:
                mine = self.parity.trainer_side()
            if self.parity.stale_due(step):
                self.parity.probe_stale(step)
            parity_s = time.time() - t0
            push_s = self.pusher.push(step, keep_in_flight=in_flight)
            t1 = time.time()
            self.parity.start_after_push(step)
            parity_s += time.time() - t1
        except ServerError as e:
            raise ServerError(f"weight push at step {step} (node {self.par.node}) failed: {e}") from e
        self.pushed_step = step
        self.probe_mine = mine
        self.probe_forward_due = later_forward
        self.probe_step = self.step
        if self.par.is_leader:
            self._note(push_s=push_s, parity_s=parity_s, parity=None, parity_stale=None)
            self._note(push_bytes=push_bytes(self.pusher))
            if in_flight:  # pushes that paused later steps' requests; _running: one was still generating then
                self._note(
                    pushes_paused=self.figures.pushes_paused + 1,
                    pushes_paused_running=self.figures.pushes_paused_running + running,
                )
        if not probe_in_background:
            self.settle_parity()  # the probes just sent, checked now

    def probe_forward(self) -> None:
        """The trainer's side of the last push's probes, if still due: collective over every rank (an FSDP forward).
        Only valid before the next optimizer step (it must see the pushed weights): the step's generation, an
        evaluation's, or at the latest the next step's begin_step, before its optimizer step."""
        if self.probe_forward_due:
            if self.step != self.probe_step:
                raise RuntimeError(
                    f"node {self.par.node}: the parity forward of the push at step {self.probe_step} is due at step "
                    f"{self.step}: the weights changed since the push, so it would compare other weights (a bug: the "
                    "push's probes are settled before the next optimizer step)"
                )
            self.probe_forward_due = False
            self.probe_mine = self.parity.trainer_side()

    def settle_parity(self) -> None:
        """Compare the probes the last push left to check (its trainer side first, if still due: a collective, so every
        rank calls this at the same points: a push, a generation, a step's end). The server's answers wait on the
        node leader only; the wait counts in the step's parity seconds. Raises ParityError as the check in push would."""
        t0 = time.time()
        self.probe_forward()
        if self.parity.pending is None and self.parity.pending_stale is None:
            return
        try:
            self._note_parity()
        except (ServerError, FutureTimeout) as e:
            raise ServerError(f"parity probe of the push at step {self.pushed_step} (node {self.par.node}) failed: {e!r}") from e
        self._note(parity_s=(self.figures.parity_s or 0.0) + time.time() - t0)

    def _note_parity(self) -> None:
        assert self.probe_mine is not None
        stale, after = self.parity.settle(self.probe_mine)
        if self.par.is_leader:
            self._note(parity_stale=stale, probe_drift=self.parity.drift(self.probe_mine))
            if after is not None:
                self._note(parity=after, parity_engines=self.parity.history[-1]["per_engine"])

    def end_step(self) -> None:
        """The callback's on_step_end, on every rank: multi-turn generation (trainer.agents) settles its probe and
        gathers every node's figures here, once its ranks' episodes are all done (a collective)."""
        if self.gather_at_step_end:
            if self.probe_forward_due:  # past the optimizer step: the forward would see other weights than were pushed
                raise RuntimeError(
                    f"node {self.par.node}: the parity forward of the push at step {self.probe_step} did not run in the "
                    "step's first generation request (a bug: forward_in_generation promised one before the optimizer step)"
                )
            self.settle_parity()
            self.gather_figures()

    def finish(self, step: int) -> NodeFinal | None:
        """The last optimizer step is never pushed during training (a push precedes each generation): push it,
        so every server ends holding the final weights, proven by parity. Returns the node's figures (leader)."""
        self.push(step)
        if self.ahead is not None:
            self.ahead.close()
        if not self.par.is_leader:
            return None
        return NodeFinal(
            node=self.par.node,
            parity_final=self.figures.parity,
            push_s_final=self.figures.push_s,
            pushes=self.pusher.pushes,
            server_requests=self.client.requests_sent if self.client else None,
            trainer_peak_gpu_gb=round(torch.cuda.max_memory_allocated() / 1e9, 2) if self.par.device.type == "cuda" else None,
            parity_history=[
                ParityRecord(step=h["step"], kind=h["kind"], max_diff=h["max_diff"], per_engine=h["per_engine"])
                for h in self.parity.history
            ],
        )


class TrlAdapter:
    """What TRL's GRPOTrainer builds as its generation backend (trainer.trl_glue, hooks 1 and 2): TRL's sampling
    settings from its keyword arguments; every call goes to the node's rollout."""

    def __init__(self, rollout: NodeRollout, **trl_kwargs: Any) -> None:
        kw = trl_kwargs
        self.rollout = rollout
        self.vllm_client = rollout.client  # TRL asks the main process's client for get_server_info()
        self.sampling = dict(
            max_tokens=kw.get("max_completion_length", 16),
            temperature=kw.get("temperature", 1.0),
            top_p=kw.get("top_p", 1.0),
            top_k=kw.get("top_k", 0) or 0,
            min_p=kw.get("min_p") or 0.0,
            repetition_penalty=kw.get("repetition_penalty", 1.0),
            extra=kw.get("generation_kwargs") or {},
        )

    def generate(self, prompts: list[list[int]], images, num_generations: int, profiler=None):
        if images is not None and any(i is not None for i in images):
            raise NotImplementedError("node-local generation serves text prompts only")
        mine = self.rollout.generate(prompts, self.sampling)
        completion_ids = [c[0] for c in mine]
        logprobs = [[[lp] for lp in c[1]] for c in mine]
        if self.rollout.routes is not None:  # RoutedCompletion: (ids, logprobs, routes)
            routed = cast(list[RoutedCompletion], mine)
            self.rollout.routes.replace((p, c.ids, c.routes) for p, c in zip(prompts, routed, strict=True))
            table = self.rollout.routes
            if table.without_routes or table.misfit:  # those rows keep the trainer's own routing
                log.warning(
                    "trainer.routing_replay: of %d completions %d came back without routed experts and %d with routes "
                    "that do not cover their tokens; they keep the trainer's routing (node %d, step %d)",
                    len(routed),
                    table.without_routes,
                    table.misfit,
                    self.rollout.par.node,
                    self.rollout.step,
                )
        return prompts, completion_ids, logprobs, None

    def sync_weights(self) -> None:
        self.rollout.push(self.rollout.step, probe_in_background=True, forward_in_generation=True)
