"""Environments for the multi-turn integration tier, played by the tool-calling tiny model
(trainer.agents.tiny_tool_model), which calls countdown() until a result says DONE.

RankCountdown: rank 0's episodes need 1 successful call, rank 1's need 3, so the two ranks of a node make different
numbers of generation requests in the same step (2 turns per episode against 6). On rank 1 the second call of every
episode hangs past trainer.tool_timeout_s and the third raises: both must become recorded failures the model reads,
within the deadline. The reward is the number of successful calls (1 on rank 0, 3 on rank 1)."""

from __future__ import annotations

import os
import time

HANG_S = 120.0
"""How long the hanging call sleeps: far past the test's trainer.tool_timeout_s."""


class RankCountdown:
    def reset(self, **row) -> None:
        self.rank = int(os.environ.get("RANK", "0"))
        self.left = 1 + 2 * self.rank
        self.calls = self.done = 0

    def countdown(self) -> str:
        """Counts one down on this episode's counter.

        Returns:
            AGAIN while the count goes on; the last call says it is over.
        """
        self.calls += 1
        if self.rank == 1 and self.calls == 2:
            time.sleep(HANG_S)
        if self.rank == 1 and self.calls == 3:
            raise ValueError("the counter is jammed")
        self.left -= 1
        self.done += 1
        return "DONE" if self.left <= 0 else "AGAIN"

    def get_reward(self) -> float:
        return float(self.done)
