"""An example environment: the episode's counter starts at the dataset row's `calls`; the model must call
countdown() until it is told the count is over, then answer. Its reward is the share of the count done. The tiny
tool model (trainer.agents.tiny_tool_model) plays it perfectly, so an episode takes exactly `calls` tool calls and
`calls` + 1 turns: tests and the CPU example know what every rank must see.

    trainer:
      dataset: data/countdown.jsonl              # {"prompt": [{"role": "user", "content": ...}], "calls": 2}
      environment: trainer.agents.countdown:Countdown
      reward_funcs: []                           # get_reward() is the reward

How to write your own: a class (or a function returning one) with reset(**row) -> str | None (called at each
episode's start with the dataset row's columns; a string is appended to the prompt), public methods the model may
call (type hints and a Google-style docstring: TRL renders them into the prompt), and optionally get_reward() -> float.
One instance per episode, reused across steps (reset each time). Methods run on the rank's CPU, each call within
trainer.tool_timeout_s.
"""

from __future__ import annotations


class Countdown:
    """Counts the model's tool calls down to zero."""

    def reset(self, calls: int = 1, **row) -> None:
        self.calls = int(calls)
        self.left = self.calls

    def countdown(self) -> str:
        """Counts one down on this episode's counter.

        Returns:
            AGAIN while the count goes on; the last call says it is over.
        """
        self.left -= 1
        return "DONE" if self.left <= 0 else "AGAIN"

    def get_reward(self) -> float:
        """The share of the count done (1.0 when the model called exactly as often as it had to, less if it stopped
        early; calls past the end do not add)."""
        return min(self.calls, self.calls - self.left) / max(1, self.calls)
