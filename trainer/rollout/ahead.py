"""Generation ahead of the trainer (trainer.max_staleness k): the node leader's queue of requests sent to its server
for the next k steps while the node's ranks train, on a client and a thread of its own (the main thread's client is
busy with pushes and parity). Step s+k uses the completions started with step s's weights.

  send(step, batches, sampling)  batches[j-1]: the node's prompts of step+j; those not yet sent go to the server now,
                                 in the background, with the weights it holds now (this step's).
  take(step)                     the request sent for `step` (removed from the queue), if any; `result` waits for it.
  wait(step)                     before the push of `step`: wait for the batch that step generates; returns (later
                                 batches are outstanding (k >= 2), one of them is still generating). Every push with
                                 later batches outstanding pauses them, running or not: one protocol, whatever the
                                 timing (trainer.push.pusher.NodePusher.push(keep_in_flight=)).
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass
from typing import Any

from trainer.rollout.server import RoutedCompletion, VllmServer

Completions = list[tuple[list[int], list[float]]] | list[RoutedCompletion]
"""One (token ids, logprob of each) per prompt entry, in order; with trainer.routing_replay (ids, logprobs, routes)."""


def timed_complete(
    client: VllmServer, prompts: list[list[int]], sampling: dict[str, Any], step: int
) -> tuple[Completions, float]:
    """One generation request; returns (completions, seconds it took the server)."""
    t0 = time.time()
    comps = client.complete(prompts, **sampling, step=step)
    return comps, time.time() - t0


@dataclass
class Pending:
    """A request sent ahead: the node's prompts of a later step, started with the weights the server had after
    `weights_step` optimizer steps, while the node's ranks train."""

    prompts: list[list[int]]
    weights_step: int
    future: concurrent.futures.Future


class AheadQueue:
    """The node leader's requests sent ahead, by the step whose batch they generate."""

    def __init__(self, client: VllmServer, timeout_s: float) -> None:
        self.client, self.timeout_s = client, timeout_s
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="generate-ahead")
        self.pending: dict[int, Pending] = {}

    def send(self, step: int, batches: list[list[list[int]]], sampling: dict[str, Any]) -> list[int]:
        """Send the batches of steps step+1.. not yet sent; returns the steps sent now. Returns at once."""
        sent = []
        for j, prompts in enumerate(batches, start=1):
            if step + j in self.pending:
                continue
            future = self.pool.submit(timed_complete, self.client, prompts, sampling, step + j)
            self.pending[step + j] = Pending(prompts, step, future)
            sent.append(step + j)
        return sent

    def take(self, step: int) -> Pending | None:
        return self.pending.pop(step, None)

    def result(self, sent: Pending) -> tuple[Completions, float]:
        """The completions of a request sent ahead and the server's seconds for them (within trainer.request_timeout_s)."""
        return sent.future.result(timeout=self.timeout_s)

    def wait(self, step: int) -> tuple[bool, bool]:
        needed = self.pending.get(step)
        if needed is not None:
            concurrent.futures.wait([needed.future], timeout=self.timeout_s)
        later = [p for s, p in self.pending.items() if s > step]
        return bool(later), any(not p.future.done() for p in later)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
