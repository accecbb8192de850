"""RankGeneration (multi-turn mode) on two real gloo ranks against a fake vLLM at the HTTP boundary: each rank sends
its own requests, as many as its episodes need, and none waits for the other (the single-turn path's gather on the
node leader would hang here); the completions and logprobs come back in TRL's shapes."""

from __future__ import annotations

import functools
from types import SimpleNamespace

from tests.support.fakes import JsonHandler, LocalHttpServer
from tests.support.ranks import run_ranks


class FakeVllm(LocalHttpServer):
    def __init__(self) -> None:
        super().__init__(Handler)
        self.prompts: list[list[int]] = []
        self.start()


class Handler(JsonHandler):
    server: FakeVllm

    def do_POST(self) -> None:
        body = self.read_json()
        self.server.prompts.extend(body["prompt"])
        choices = [
            {"index": i, "token_ids": [p[-1] + 1, 7], "logprobs": {"token_logprobs": [-0.25, -0.5]}}
            for i, p in enumerate(body["prompt"])
        ]
        self.answer({"choices": choices})


def turns_of_rank(url: str, rank: int, world: int, port: int) -> list:
    """Rank r takes 1 + 2r turns, each a generate call on the previous turn's output, as TRL's tool loop does."""
    import torch.distributed as dist

    from trainer.agents.generation import RankGeneration

    settings = SimpleNamespace(server_url=url, model="m", node=0, request_timeout_s=30.0)
    rollout = SimpleNamespace(settings=settings, step=0, client=None, probe_forward_due=False)
    backend = RankGeneration(rollout, max_completion_length=2, temperature=1.0)  # type: ignore[arg-type]
    prompts, seen = [[10 * (rank + 1)], [10 * (rank + 1) + 1]], []
    for _ in range(1 + 2 * rank):
        _, completions, logprobs, _ = backend.generate(prompts, images=None, num_generations=1)
        assert logprobs == [[[-0.25], [-0.5]]] * 2  # TRL's [sequence][token][top-k]
        seen.append(completions)
        prompts = [p + c for p, c in zip(prompts, completions, strict=True)]
    figures = backend.take_figures()
    dist.barrier()  # both ranks got here: neither waited on the other's turns
    return [seen, figures["requests"], figures["tokens"]]


def test_each_rank_generates_its_own_turns_without_waiting_for_the_other():
    server = FakeVllm()
    try:
        out = run_ranks(2, functools.partial(turns_of_rank, server.url), timeout_s=120)
    finally:
        server.close()
    assert out[0][1:] == [1, 4] and out[1][1:] == [3, 12]  # requests and tokens since the last take
    assert out[0][0] == [[[11, 7], [12, 7]]]
    assert out[1][0] == [[[21, 7], [22, 7]], [[8, 7], [8, 7]], [[8, 7], [8, 7]]]  # each turn continues its own history
    assert len(server.prompts) == 2 + 6  # every rank's every turn reached the server, one entry per episode
