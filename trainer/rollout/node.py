"""Node-local generation backend for TRL's GRPOTrainer, in place of trl's `VLLMGeneration`.

Stock TRL server mode: global rank 0 gathers every prompt of the world, asks one server, broadcasts
everything back, and pushes every weight. Here every node works alone:

  generate:     gather the node's prompts on the node leader (node process group only), one request to
                the node's own server with one completion per prompt entry (n=1: duplicate prompts and
                groups split across ranks/nodes keep their own samples, nothing is deduplicated), then
                scatter each rank's completions back in order.
  sync_weights: every rank takes part in the FSDP2 gather, parameter by parameter; each node leader
                streams them to its own server (trainer.push.pusher), then checks parity (trainer.rollout.parity).
  k steps off:  with trainer.max_staleness k, right after a step's generation the node's ranks hand the prompts of
                their next k steps (trainer.data.Lookahead) to the leader, which sends those not yet sent to the server
                in the background while the ranks train; step s+k uses the completions started with step s's weights.
                Before a push the leader waits for the batch the next step needs. With k = 1 nothing else is in flight
                then; with k >= 2 later batches are outstanding (running or done): the push runs between
                pause_keep and resume (vLLM 0.32
                freezes them in its queue: nothing lost, nothing aborted), and reset_prefix_cache with
                reset_running_requests recomputes their KV under the new weights, so their remaining tokens come from
                the new weights (vLLM returns each token's own logprob, which TRL's importance-sampling correction
                uses). `abort` would lose them and `wait` would hold the push until they finish, idling the trainer.
                server_requests counts the main client's requests only.

The trainer swaps this class in for the name `VLLMGeneration` in trl.trainer.grpo_trainer (see
trainer.grpo): TRL calls it with its own keyword arguments; ours (the node's settings, the parallel world,
the step clock, the stats gather) are bound beforehand with functools.partial.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from launcher.core.plan import Plan
from trainer.parallel import Parallel
from trainer.push.pusher import NodePusher, PushSettings
from trainer.rollout.parity import ParityChecker
from trainer.rollout.server import ServerError, VllmServer

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
    """0 = by dtype (trainer.rollout.parity.DEFAULT_TOLERANCE)."""
    parity_action: str
    parity_probe: str = PARITY_PROBE
    max_staleness: int = 0
    """k: the node's prompts of the next k steps go to its server right after this step's generation (trainer.max_staleness)."""
    max_steps: int = 0
    server_engines: int = 1
    """vLLM engines behind the node's server (vllm.data_parallel_size): parity is checked on each."""

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
        )
        return GenerationSettings(
            server_url=n.server_url,
            model=plan.config.vllm.model,
            node=node,
            request_timeout_s=t.request_timeout_s,
            push=push,
            parity_tolerance=t.parity_tolerance,
            parity_action=t.parity_action,
            max_staleness=t.max_staleness,
            max_steps=t.max_steps,
            server_engines=plan.data_parallel_size,
        )


class StepClock:
    """The optimizer step the trainer is at: set by the callback at each step's start (TRL calls the backend's
    generate/sync_weights without one), read by the backend, which passes it down as an argument."""

    def __init__(self) -> None:
        self.step = 0


def node_generate(par: Parallel, prompts: list[list[int]], ask_server: Callable[[list[list[int]]], list]):
    """Gather the node's prompts on its leader (node group only), ask the node's server once for one
    completion per entry, scatter each rank its own completions in its own order. Collective over
    the node's ranks. Returns (this rank's completions, tokens generated on the node: leader only)."""
    gathered: list[Any] | None = [None] * len(par.node_ranks) if par.is_leader else None
    dist.gather_object(prompts, gathered, dst=par.leader, group=par.node_group)
    out: list[Any] | None = None
    tokens = 0
    if gathered is not None:  # the node leader
        flat = [p for rank_prompts in gathered for p in rank_prompts]
        try:
            comps = ask_server(flat)
            assert len(comps) == len(flat), (len(comps), len(flat))
            out, i = [], 0
            for rank_prompts in gathered:
                out.append(comps[i : i + len(rank_prompts)])
                i += len(rank_prompts)
            tokens = sum(len(c) for c, _ in comps)
        except Exception as e:  # hand the error to every rank of the node, so none waits forever
            out = [RuntimeError(f"generation of {len(flat)} completions on node {par.node} failed: {e}")] * len(par.node_ranks)
    mine: list[Any] = [None]
    dist.scatter_object_list(mine, out, src=par.leader, group=par.node_group)
    if isinstance(mine[0], Exception):
        raise mine[0]
    return mine[0], tokens


def timed_complete(client: VllmServer, prompts: list[list[int]], sampling: dict[str, Any], step: int):
    """One generation request; returns (completions, seconds it took the server)."""
    t0 = time.time()
    comps = client.complete(prompts, **sampling, step=step)
    return comps, time.time() - t0


@dataclass
class Pending:
    """A request sent ahead (max_staleness k): the node's prompts of a later step, started with the weights the server
    had after `weights_step` optimizer steps, while the node's ranks train."""

    prompts: list[list[int]]
    weights_step: int
    future: concurrent.futures.Future


class NodeLocalGeneration:
    def __init__(
        self,
        *,
        model,
        accelerator,
        processing_class,
        par: Parallel,
        settings: GenerationSettings,
        clock: StepClock,
        on_stats: Callable[[dict[str, Any]], None],
        **kw,
    ):
        self.par, self.settings, self.clock, self.on_stats = par, settings, clock, on_stats
        self.model, self.accelerator = model, accelerator
        self.temperature = kw.get("temperature", 1.0)
        self.top_p, self.top_k = kw.get("top_p", 1.0), kw.get("top_k", 0) or 0
        self.min_p = kw.get("min_p") or 0.0
        self.repetition_penalty = kw.get("repetition_penalty", 1.0)
        self.max_completion_length = kw.get("max_completion_length", 16)
        self.generation_kwargs = kw.get("generation_kwargs") or {}
        s = settings
        self.vllm_client: VllmServer | None = None
        if par.is_leader:
            self.vllm_client = VllmServer(s.server_url, s.model, par.node, s.request_timeout_s)
        self.pusher = NodePusher(model, self.vllm_client, s.push, par.device)
        self.parity = ParityChecker(
            model,
            self.vllm_client,
            par,
            processing_class,
            s.parity_tolerance,
            s.parity_action,
            s.parity_probe,
            s.push.dtype,
            s.server_engines,
        )
        self.stats: dict[str, Any] = {}
        self.peek_next: Callable[[], list[list[list[int]]]] = lambda: []
        """This rank's prompt ids of the next max_staleness steps (set by trainer.run.build when max_staleness >= 1)."""
        self.pending: dict[int, Pending] = {}
        """Requests sent ahead, by the step whose batch they generate."""
        self.ahead: tuple[VllmServer, concurrent.futures.ThreadPoolExecutor] | None = None
        if par.is_leader and s.max_staleness:  # its own client: the main thread's is busy with pushes and parity
            self.ahead = (
                VllmServer(s.server_url, s.model, par.node, s.request_timeout_s),
                concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="generate-ahead"),
            )

    def sampling(self) -> dict[str, Any]:
        return dict(
            max_tokens=self.max_completion_length,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            extra=self.generation_kwargs,
        )

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: list[list[int]], images, num_generations: int, profiler=None):
        if images is not None and any(i is not None for i in images):
            raise NotImplementedError("node-local generation serves text prompts only")
        t0 = time.time()
        step = self.clock.step
        client = self.vllm_client

        def ask_server(flat: list[list[int]]):
            assert client is not None  # node_generate asks on the leader only
            # which prompts this node trained on at this step (a resumed run must continue the same order)
            self.stats["prompts_digest"] = hashlib.sha1(repr(flat).encode()).hexdigest()[:12]
            sent = self.pending.pop(step, None)
            if sent is not None and sent.prompts == flat:  # generated during earlier steps' training
                comps, self.stats["gen_s"] = sent.future.result(timeout=self.settings.request_timeout_s)
                self.stats.update(staleness=step - sent.weights_step, ahead_hits=self.stats.get("ahead_hits", 0) + 1)
                return comps
            if sent is not None:  # the lookahead saw other prompts: never train on them, generate these now
                self.stats["ahead_misses"] = self.stats.get("ahead_misses", 0) + 1
            self.stats["staleness"] = 0
            comps, self.stats["gen_s"] = timed_complete(client, flat, self.sampling(), step)
            return comps

        mine, node_tokens = node_generate(self.par, prompts, ask_server)
        if client is not None:
            # gen_s: the server's time for this step's batch; gen_wait_s: what the step waited for it (less when ahead)
            self.stats.update(gen_tokens=node_tokens, gen_wait_s=time.time() - t0, server_requests=client.requests_sent)
        if self.settings.max_staleness:
            self.send_ahead(step)
        self.on_stats(self.stats)
        completion_ids = [c for c, _ in mine]
        logprobs = [[[lp] for lp in lps] for _, lps in mine]
        return prompts, completion_ids, logprobs, None

    def send_ahead(self, step: int) -> None:
        """Collective over the node: gather every rank's prompts of the next max_staleness steps on the leader, which
        sends those not yet sent to the server in the background (the weights it has now: this step's) and returns at
        once. Not past the last step."""
        k = min(self.settings.max_staleness, self.settings.max_steps - step - 1)
        nxt = self.peek_next()[: max(k, 0)]
        gathered: list[Any] | None = [None] * len(self.par.node_ranks) if self.par.is_leader else None
        dist.gather_object(nxt, gathered, dst=self.par.leader, group=self.par.node_group)
        if gathered is None or self.ahead is None:
            return
        client, pool = self.ahead
        for j in range(1, min(len(g) for g in gathered) + 1):
            if step + j in self.pending:
                continue
            flat = [list(p) for g in gathered for p in g[j - 1]]
            future = pool.submit(timed_complete, client, flat, self.sampling(), step + j)
            self.pending[step + j] = Pending(flat, step, future)

    def wait_ahead(self, step: int) -> tuple[bool, bool]:
        """Before the push of `step`: wait for the batch that step generates (sent ahead; its completions were made with
        the weights before this push). Returns (batches of later steps are outstanding (max_staleness >= 2), one of
        them is still generating). Every push with later batches outstanding pauses them, running or not: one
        protocol, whatever the timing."""
        needed = self.pending.get(step)
        if needed is not None:
            concurrent.futures.wait([needed.future], timeout=self.settings.request_timeout_s)
        later = [p for s, p in self.pending.items() if s > step]
        return bool(later), any(not p.future.done() for p in later)

    # ------------------------------------------------------------------ weights
    def sync_weights(self) -> None:
        self.push(self.clock.step)

    def push(self, step: int) -> None:
        """Push and check parity: before (how stale the server was) and after (the push landed). Collective."""
        in_flight, running = self.wait_ahead(step) if self.par.is_leader else (False, False)
        try:
            stale = self.parity.check(step, kind="stale") if step > 0 else None
            push_s = self.pusher.push(step, keep_in_flight=in_flight)
            after = self.parity.check(step, kind="after_push")
        except ServerError as e:
            raise ServerError(f"weight push at step {step} (node {self.par.node}) failed: {e}") from e
        if self.par.is_leader:
            self.stats.update(
                push_s=push_s, parity=after, parity_stale=stale, parity_engines=self.parity.history[-1]["per_engine"]
            )
            if in_flight:  # pushes that paused later steps' requests; _running: one was still generating then
                self.stats["pushes_paused"] = self.stats.get("pushes_paused", 0) + 1
                self.stats["pushes_paused_running"] = self.stats.get("pushes_paused_running", 0) + running

    def finish(self, step: int) -> dict[str, Any] | None:
        """The last optimizer step is never pushed during training (a push precedes each generation): push it,
        so every server ends holding the final weights, proven by parity. Returns the node's figures (leader)."""
        self.push(step)
        if self.ahead is not None:
            self.ahead[1].shutdown(wait=False, cancel_futures=True)
        if not self.par.is_leader:
            return None
        return {
            "node": self.par.node,
            "parity_final": self.stats.get("parity"),
            "push_s_final": self.stats.get("push_s"),
            "pushes": self.pusher.pushes,
            "server_requests": self.vllm_client.requests_sent if self.vllm_client else None,
            "trainer_peak_gpu_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2) if self.par.device.type == "cuda" else None,
            "parity_history": [{k: h[k] for k in ("step", "kind", "max_diff", "per_engine")} for h in self.parity.history],
        }
