"""Parity check: does the node's server now hold the trainer's weights?

The node leader asks its server for the prompt logprobs of a fixed probe sequence (`prompt_logprobs`,
so the tokens are the same every time, no sampling involved); every rank of the node runs the FSDP
model on the same tokens (the forward is a collective over the mesh); the leader compares. After a
push the largest difference must be within the tolerance (by dtype unless set), else it fails or
warns as configured. Before a push (`stale`) it measures how far the server's weights lag behind. With vLLM data parallelism the
probe goes to every engine of the server (each holds its own copy of the weights) and the figure is the worst.
"""

from __future__ import annotations

import torch

from trainer.parallel import Parallel
from trainer.rollout.server import VllmServer

DEFAULT_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.25, torch.float16: 0.1}


class ParityError(RuntimeError):
    pass


@torch.no_grad()
def trainer_prompt_logprobs(model: torch.nn.Module, ids: list[int], device) -> list[float]:
    x = torch.tensor([ids], device=device)
    logits = model(input_ids=x).logits[0, :-1].float()
    lp = torch.log_softmax(logits, -1)
    return lp[torch.arange(len(ids) - 1, device=device), x[0, 1:]].tolist()


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
    ):
        self.model, self.client, self.par, self.action = model, client, par, action
        self.engines = engines
        """The server's vLLM engines (vllm.data_parallel_size): each is probed on its own."""
        self.ids = tokenizer(probe_text)["input_ids"][:48]
        assert len(self.ids) >= 2, "parity probe text tokenizes to fewer than 2 tokens"
        self.tolerance = tolerance or DEFAULT_TOLERANCE.get(compute_dtype, 0.5)
        self.history: list[dict] = []

    def check(self, step: int, kind: str) -> float | None:
        """Collective over every rank (the FSDP forward). Returns max |diff| on the node leader, None elsewhere."""
        was_training = self.model.training
        self.model.eval()
        mine = trainer_prompt_logprobs(self.model, self.ids, self.par.device)
        if was_training:
            self.model.train()
        if self.client is None:  # not the node leader
            return None
        targets = [None] if self.engines == 1 else list(range(self.engines))
        per_engine, theirs = [], []
        for engine in targets:
            theirs = self.client.prompt_logprobs(self.ids, step, engine)
            per_engine.append(max(abs(a - b) for a, b in zip(mine, theirs, strict=True)))
        diff = max(per_engine)
        self.history.append(
            {"step": step, "kind": kind, "max_diff": diff, "per_engine": per_engine, "server": theirs, "trainer": mine}
        )
        if kind == "after_push" and diff > self.tolerance:
            worst = f" (engine {per_engine.index(diff)} of {self.engines})" if self.engines > 1 else ""
            msg = (
                f"node {self.par.node}: parity check failed at step {step}: the server at {self.client.base_url}{worst} "
                f"disagrees with the trainer by {diff:.3g} in logprob (tolerance {self.tolerance:g}); the weight push "
                f"did not land. Set trainer.parity_action: warn to go on anyway."
            )
            if self.action == "fail":
                raise ParityError(msg)
            print("WARNING: " + msg, flush=True)
        return diff
