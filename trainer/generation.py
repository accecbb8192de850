"""Node-local generation backend for TRL's GRPOTrainer, in place of trl's `VLLMGeneration`.

Stock TRL server mode: global rank 0 gathers every prompt of the world, asks one server, broadcasts
everything back, and pushes every weight. Here every node works alone:

  generate:     gather the node's prompts on the node leader (node process group only), one request to
                the node's own server with one completion per prompt entry (n=1: duplicate prompts and
                groups split across ranks/nodes keep their own samples, nothing is deduplicated), then
                scatter each rank's completions back in order.
  sync_weights: every rank takes part in the FSDP2 gather, parameter by parameter; each node leader
                streams them to its own server (trainer.weight_push), then checks parity (trainer.parity).

The trainer swaps this class in for the name `VLLMGeneration` in trl.trainer.grpo_trainer (see
trainer.grpo); the constructor takes TRL's keyword arguments and uses the generation settings.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from trainer.parallel import Parallel
from trainer.parity import ParityChecker
from trainer.server_client import ServerClient, ServerError
from trainer.weight_push import NodePusher


def node_generate(par: Parallel, prompts: list[list[int]], ask_server: Callable[[list[list[int]]], list]):
    """Gather the node's prompts on its leader (node group only), ask the node's server once for one
    completion per entry, scatter each rank its own completions in its own order. Collective over
    the node's ranks. Returns (this rank's completions, tokens generated on the node: leader only)."""
    gathered: list[Any] | None = [None] * len(par.node_ranks) if par.is_leader else None
    dist.gather_object(prompts, gathered, dst=par.leader, group=par.node_group)
    out: list[Any] | None = None
    tokens = 0
    if par.is_leader:
        flat = [p for rank_prompts in gathered for p in rank_prompts]
        try:
            comps = ask_server(flat)
            assert len(comps) == len(flat), (len(comps), len(flat))
            out, i = [], 0
            for rank_prompts in gathered:
                out.append(comps[i:i + len(rank_prompts)])
                i += len(rank_prompts)
            tokens = sum(len(c) for c, _ in comps)
        except Exception as e:  # hand the error to every rank of the node, so none waits forever
            out = [RuntimeError(f"generation of {len(flat)} completions on node {par.node} failed: {e}")] * len(par.node_ranks)
    mine: list[Any] = [None]
    dist.scatter_object_list(mine, out, src=par.leader, group=par.node_group)
    if isinstance(mine[0], Exception):
        raise mine[0]
    return mine[0], tokens


class NodeLocalGeneration:
    # set by trainer.grpo before GRPOTrainer builds us (TRL's constructor call cannot pass them)
    context: dict[str, Any] = {}

    def __init__(self, model, accelerator, processing_class, **kw):
        ctx = self.context
        self.par: Parallel = ctx["parallel"]
        self.settings = ctx["settings"]
        self.on_stats = ctx["on_stats"]
        self.model, self.accelerator = model, accelerator
        self.temperature = kw.get("temperature", 1.0)
        self.top_p, self.top_k = kw.get("top_p", 1.0), kw.get("top_k", 0) or 0
        self.min_p = kw.get("min_p") or 0.0
        self.repetition_penalty = kw.get("repetition_penalty", 1.0)
        self.max_completion_length = kw.get("max_completion_length", 16)
        self.generation_kwargs = kw.get("generation_kwargs") or {}
        s = self.settings
        self.vllm_client: ServerClient | None = None
        if self.par.is_leader:
            self.vllm_client = ServerClient(s["server_url"], s["model"], self.par.node, s["request_timeout_s"])
        self.pusher = NodePusher(model, self.vllm_client, s["backend"], s["weight_transfer_port"], s["server_world"],
                                 s["push_timeout_s"], self.par.device, s["push_dtype"])
        self.parity = ParityChecker(model, self.vllm_client, self.par, processing_class, s["parity_tolerance"],
                                    s["parity_action"], s["parity_probe"], s["push_dtype"])
        self.step = 0
        self.stats: dict[str, Any] = {}

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: list[list[int]], images, num_generations: int, profiler=None):
        if images is not None and any(i is not None for i in images):
            raise NotImplementedError("node-local generation serves text prompts only")
        t0 = time.time()

        def ask_server(flat: list[list[int]]):
            self.vllm_client.step = self.step
            return self.vllm_client.complete(
                flat, max_tokens=self.max_completion_length, temperature=self.temperature, top_p=self.top_p,
                top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                extra=self.generation_kwargs)

        mine, node_tokens = node_generate(self.par, prompts, ask_server)
        if self.par.is_leader:
            self.stats.update(gen_tokens=node_tokens, gen_s=time.time() - t0,
                              server_requests=self.vllm_client.requests_sent)
        self.on_stats(self.stats)
        completion_ids = [c for c, _ in mine]
        logprobs = [[[lp] for lp in lps] for _, lps in mine]
        return prompts, completion_ids, logprobs, None

    # ------------------------------------------------------------------ weights
    def sync_weights(self) -> None:
        step = self.step
        try:
            stale = self.parity.check(step, kind="stale") if step > 0 else None
            push_s = self.pusher.push(step)
            after = self.parity.check(step, kind="after_push")
        except ServerError as e:
            raise ServerError(f"weight push at step {step} (node {self.par.node}) failed: {e}") from None
        if self.par.is_leader:
            self.stats.update(push_s=push_s, parity=after, parity_stale=stale)
