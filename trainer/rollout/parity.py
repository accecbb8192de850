"""Parity check: does the node's server now hold the trainer's weights?

The node leader asks its server for the prompt logprobs of a fixed probe sequence (`prompt_logprobs`,
so the tokens are the same every time, no sampling involved); every rank of the node runs the FSDP
model on the same tokens (the forward is a collective over the mesh); the leader compares. After a
push every token's difference must be within the tolerance (by dtype unless set) plus the rounding of that
token's logits in the compute dtype (`ProbeLogprobs.allowed`), else it fails or warns as configured. Before a
push (`stale`) it measures how far the server's weights lag behind. With vLLM data parallelism the probe goes to
every engine of the server (each holds its own copy of the weights) and the figure is the worst.

What it costs, and why it is cheap (`trainer.parity_every`): the trainer's side runs once per push, before it (the
weights the push sends are the weights the trainer holds until the next optimizer step, so the one forward serves
both comparisons; its host sync also orders the optimizer's writes before the push's gather). The proof that the
push landed (after the push) is asked of every push, one request per engine, all engines at once. The stale probe
only measures how far the server lagged: it runs at the first push of an attempt (a resumed server starts from the
base model) and every `parity_every` steps.

During training neither side holds the step (trainer.rollout.node NodeRollout.push and settle_parity): the
after-push probe goes out on its own client in the background the moment the push is done (`start_after_push`), so
the server prefills its 48 tokens beside the step's first generation requests; the stale probe's server side is asked
before the push (`probe_stale`); the trainer's side (an FSDP forward, which costs what gathering the model costs) runs
while the node's server generates the step's batch (single-turn; TRL's tool loop: beside each rank's first turn), and `settle`
compares both after the batch is back, before anything trains on it. On one GPU the probes were 4-5 % of every step
(0.05-0.1 s of 0.9-2.5 s, growing with the model: the forward, 2026-12-06, `gpu/results/2026-12-06-lora-shapes/`).
"""

from __future__ import annotations

import math
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch.distributed.fsdp import FSDPModule

from trainer.parallel import Parallel
from trainer.rollout.server import VllmServer

DEFAULT_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.25, torch.float16: 0.1}
REORDERED_ATTENTION_TOLERANCE = 0.5
"""The half-precision default for a model whose attention vLLM computes in another order than transformers (MLA,
sinks: reordered_attention). Measured on an H100 in bf16 with pushes that landed: DeepSeek-V3 at the released MLA widths
0.03-0.29 in six steps, gpt-oss 0.10-0.29, where dense and Qwen3-MoE bodies stay under 0.2; a push that did not land gave
1.99 (gpu/results/2026-12-07-ds3-lora-restart/). In float32 both orders agree to 1e-3 (the CPU family matrix)."""


def reordered_attention(model: torch.nn.Module) -> str | None:
    """Why vLLM's attention rounds differently from the trainer's for this model, or None. MLA (a `kv_lora_rank` in
    the config: DeepSeek-V2/V3, Kimi, GLM-4.7-Flash, MiniCPM3, ...): vLLM absorbs kv_b_proj into the query and the
    output, transformers multiplies the latent out first. Sinks (a parameter named `sinks`: gpt-oss, MiMo-V2-Flash,
    ...): transformers' eager attention softmaxes with them in the compute dtype, vLLM's kernels in float32."""
    config = getattr(model, "config", None)
    if getattr(config, "kv_lora_rank", None):
        return "multi-head latent attention"
    if any(name == "sinks" or name.endswith(".sinks") for name, _ in model.named_parameters()):
        return "attention sinks"
    return None


def default_tolerance(compute_dtype: torch.dtype, model: torch.nn.Module) -> float:
    """trainer.parity_tolerance 0: by the push's dtype, wider in half precision where the attention is reordered."""
    base = DEFAULT_TOLERANCE.get(compute_dtype, 0.5)
    if compute_dtype != torch.float32 and reordered_attention(model):
        return max(base, REORDERED_ATTENTION_TOLERANCE)
    return base


class ParityError(RuntimeError):
    pass


@dataclass(frozen=True)
class ProbeLogprobs:
    """The trainer's side of a probe: each token's logprob and the size of what rounding acts on to give it.

    A logprob is logit(token) - logsumexp(logits). Both sides compute the logits in the compute dtype, which holds a
    value of size |x| to within eps/2 * |x| (torch.finfo(dtype).eps: 2^-7 in bf16), and the layers before them differ
    relative to their values too; the logsumexp's error is the softmax-weighted mean of its logits' errors. So the two
    sides differ by about eps * (|logit(token)| + E_softmax |logit|), which the flat tolerance (measured on models whose
    logits are small) does not cover once training sharpens the model: on an H100, Qwen2.5-3B's shape in bf16 whose
    reward had saturated (entropy 0, its probe's logprobs 28 lower than at step 0) read 0.01-0.26 from step to step
    with every push landed, and an absolute 0.25 stopped it twice (gpu/results/2026-12-07-7b-start-parity/). There,
    the server one step behind read 0.27-0.48: a single missed push of a model that no longer moves cannot be told
    from rounding by any threshold, and costs nothing; a push that keeps failing is caught as the drift grows, and
    weights loaded wrong differ by far more (1.99 for DeepSeek-V3's router read wrong)."""

    logprobs: list[float]
    scale: list[float]
    """Per token: |logit(token)| + the softmax-weighted mean |logit| at its position: what the compute dtype rounds."""

    def allowed(self, tolerance: float, eps: float) -> list[float]:
        """Per token: the largest difference a landed push may show."""
        return [tolerance + eps * s for s in self.scale]


@torch.no_grad()
def trainer_prompt_logprobs(model: torch.nn.Module, ids: list[int], device) -> ProbeLogprobs:
    x = torch.tensor([ids], device=device)
    logits = model(input_ids=x).logits[0, :-1].float()
    lp = torch.log_softmax(logits, -1)
    rows, tokens = torch.arange(len(ids) - 1, device=device), x[0, 1:]
    scale = logits[rows, tokens].abs() + (torch.softmax(logits, -1) * logits.abs()).sum(-1)
    return ProbeLogprobs(lp[rows, tokens].tolist(), scale.tolist())


class ParityChecker:
    def __init__(
        self,
        model,
        client: VllmServer | None,
        par: Parallel,
        tokenizer,
        tolerance: float,
        action: str,
        probe_text: str,
        compute_dtype: torch.dtype,
        engines: int = 1,
        stale_every: int = 1,
    ):
        self.model, self.client, self.par, self.action = model, client, par, action
        self.engines = engines
        """The server's vLLM engines (vllm.data_parallel_size): each is probed on its own."""
        self.stale_every = stale_every
        """trainer.parity_every: the stale probe's period in steps (0 = only at an attempt's first push)."""
        self.ids = tokenizer(probe_text)["input_ids"][:48]
        assert len(self.ids) >= 2, "parity probe text tokenizes to fewer than 2 tokens"
        self.tolerance = tolerance or default_tolerance(compute_dtype, model)
        self.rounding = torch.finfo(compute_dtype).eps
        """What rounding in the compute dtype may add per unit of logit size (ProbeLogprobs.allowed)."""
        self.history: list[dict] = []
        self.first: list[float] | None = None
        """The trainer's probe logprobs at this attempt's first push: the origin of drift()."""
        self.checks = 0
        """Pushes checked so far in this attempt."""
        # the probes' own clients, one per engine, so the probes go out at once and beside the main client's generation
        # requests (a Session is not shared by threads)
        self._engine_clients: list[VllmServer] = []
        if client is not None:
            self._engine_clients = [
                VllmServer(client.base_url, client.model, client.node, client.timeout_s) for _ in range(engines)
            ]
        self._background = ThreadPoolExecutor(1, thread_name_prefix="parity-probe") if client is not None else None
        self.pending: tuple[int, Future[list[list[float]]]] | None = None
        """An after-push probe in flight (start_after_push): its step and the server's answer to come."""
        self.pending_stale: tuple[int, list[list[float]]] | None = None
        """A stale probe's server side (probe_stale), waiting for the trainer's side."""

    def stale_due(self, step: int) -> bool:
        """Whether the push at `step` is preceded by a stale probe: never before step 0's (nothing trained yet), always
        at an attempt's first push (a resumed server holds the base model), then every `stale_every` steps."""
        if step == 0:
            return False
        return self.checks == 0 or (self.stale_every > 0 and step % self.stale_every == 0)

    def trainer_side(self) -> ProbeLogprobs:
        """The trainer's logprobs of the probe with the weights it holds now. Collective over every rank (the FSDP
        forward); run it once per push, before the push."""
        was_training = self.model.training
        self.model.eval()
        mine = trainer_prompt_logprobs(self.model, self.ids, self.par.device)
        if was_training:
            self.model.train()
        # a forward with no backward leaves units gathered where reshard_after_forward is off (trainer.parallel): give
        # back the sharded parameters, so what reads named_parameters() next (the push, the final adapter) sees them
        for m in self.model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()
        return mine

    def server_side(self, step: int) -> list[list[float]]:
        """Each engine's logprobs of the probe (node leader only): one request per engine, all at once."""
        assert self.client is not None
        if self.engines == 1:
            return [self._engine_clients[0].prompt_logprobs(self.ids, step)]
        with ThreadPoolExecutor(self.engines) as pool:
            futures = [pool.submit(c.prompt_logprobs, self.ids, step, e) for e, c in enumerate(self._engine_clients)]
            return [f.result() for f in futures]

    def drift(self, mine: ProbeLogprobs) -> float:
        """How far the trainer's probe logprobs (`mine`, from trainer_side) have moved since this attempt's first push
        (the largest difference). With the after-push parity holding, the server followed the model this far: a drift
        well above the parity's noise proves updates reach the server, one near 0 after many steps says the model is
        barely learning (a LoRA learning rate too low, say)."""
        if self.first is None:
            self.first = list(mine.logprobs)
        return max(abs(a - b) for a, b in zip(mine.logprobs, self.first, strict=True))

    def start_after_push(self, step: int) -> None:
        """The after-push probe, sent in the background (leader; a count elsewhere): `settle` checks it. The caller
        settles any earlier one first (one probe in flight at most)."""
        assert self.pending is None, "settle() the last push's probe before the next push"
        self.checks += 1
        if self._background is not None:
            self.pending = (step, self._background.submit(self.server_side, step))

    def probe_stale(self, step: int) -> None:
        """The stale probe's server side, now (before the push; leader only): `settle` compares it."""
        if self.client is not None:
            self.pending_stale = (step, self.server_side(step))

    def settle(self, mine: ProbeLogprobs) -> tuple[float | None, float | None]:
        """(stale, after push): the probes probe_stale and start_after_push sent, against the trainer's side of the
        same weights (`mine`); each None when not sent. Waits for the background probe within the client's request
        timeout (the request carries it too); raises ParityError in the caller's thread when an after-push probe disagrees
        by more than it allows (ProbeLogprobs.allowed; trainer.parity_action fail; warn prints it)."""
        stale = after = None
        if self.pending_stale is not None:
            step, theirs = self.pending_stale
            self.pending_stale = None
            stale = self._judge(step, "stale", mine, theirs)
        if self.pending is not None:
            step, answer = self.pending
            self.pending = None
            assert self.client is not None
            after = self._judge(step, "after_push", mine, answer.result(timeout=self.client.timeout_s + 30))
        return stale, after

    def _judge(self, step: int, kind: str, mine: ProbeLogprobs, theirs: list[list[float]]) -> float:
        """The largest difference over the engines (the figure the metrics show); an after-push probe fails where any
        token's difference passes what its logits' size allows."""
        assert self.client is not None
        allowed = mine.allowed(self.tolerance, self.rounding)
        diffs = [[abs(a - b) for a, b in zip(mine.logprobs, t, strict=True)] for t in theirs]
        per_engine = [max(d) for d in diffs]
        diff = max(per_engine)
        self.history.append(
            {
                "step": step,
                "kind": kind,
                "max_diff": diff,
                "per_engine": per_engine,
                "server": theirs[-1],
                "trainer": mine.logprobs,
            }
        )
        # the token furthest past its allowance; a NaN (weights gone bad) is past any
        excess = [[math.inf if math.isnan(x) else x - allowed[i] for i, x in enumerate(d)] for d in diffs]
        engine, token = max(((e, i) for e, d in enumerate(excess) for i in range(len(d))), key=lambda ei: excess[ei[0]][ei[1]])
        if kind == "after_push" and excess[engine][token] > 0:
            where = f" (engine {engine} of {self.engines})" if self.engines > 1 else ""
            msg = (
                f"node {self.par.node}: parity check failed at step {step}: the server at {self.client.base_url}{where} "
                f"disagrees with the trainer by {diffs[engine][token]:.3g} in logprob at the probe's token {token + 1} "
                f"(trainer {mine.logprobs[token]:.3g}, server {theirs[engine][token]:.3g}; allowed {allowed[token]:.3g}: "
                f"tolerance {self.tolerance:g} + rounding {self.rounding:g} x logits' size {mine.scale[token]:.3g}); the "
                f"server does not hold the trainer's weights: the push did not land or loaded them wrong. Set "
                f"trainer.parity_action: warn to go on anyway."
            )
            if self.action == "fail":
                raise ParityError(msg)
            print("WARNING: " + msg, flush=True)
        return diff
