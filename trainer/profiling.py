"""trainer.profile_steps: torch.profiler over a few steps on each node leader, its tables written to the job folder.

Where a step's seconds go beyond the per-phase figures of every metrics row (generation, push, parity, the rest):
operator by operator, on the CPU (Python, hooks, launches: what dominates a small model's step) and on the device."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile


class StepProfiler:
    def __init__(self, steps: list[int], out: Path, enabled: bool) -> None:
        self.first, self.last = (steps[0], steps[1]) if steps and enabled else (0, -1)
        self.out = out
        self.prof: profile | None = None

    def begin(self, step: int) -> None:
        """step: the step about to run, counted from 1."""
        if step == self.first and self.prof is None:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self.prof = profile(activities=activities, record_shapes=False, with_stack=False)
            self.prof.__enter__()

    def end(self, step: int) -> None:
        if self.prof is None or step != self.last:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.prof.__exit__(None, None, None)
        averages = self.prof.key_averages()
        device_key = "device_time_total" if torch.cuda.is_available() else "cpu_time_total"
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(
            f"steps {self.first}..{self.last}\n\n== by CPU time (self + children) ==\n"
            + averages.table(sort_by="cpu_time_total", row_limit=40)
            + f"\n\n== by {device_key} ==\n"
            + averages.table(sort_by=device_key, row_limit=40)
        )
        print(f"profile of steps {self.first}..{self.last} written to {self.out}", flush=True)
        self.prof = None
