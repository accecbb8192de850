"""trainer.profile_steps: the profiler covers exactly the configured steps on a node leader and writes its tables."""

import pytest
import torch

from launcher.core.config import ConfigError, TrainerConfig
from trainer.profiling import StepProfiler


def test_the_profiled_steps_tables_name_the_work_they_ran(tmp_path):
    out = tmp_path / "profile" / "node0-rank0.txt"
    prof = StepProfiler([2, 3], out, enabled=True)
    a = torch.randn(64, 64)
    for step in range(1, 5):
        prof.begin(step)
        (a @ a).sum() if step != 2 else torch.softmax(a, dim=-1)
        prof.end(step)
        if step < 3:
            assert not out.exists(), f"written before the last profiled step (after step {step})"
    text = out.read_text()
    assert text.startswith("steps 2..3") and "aten::softmax" in text and "aten::mm" in text


def test_only_a_leader_profiles_and_off_by_default(tmp_path):
    for prof in (StepProfiler([1, 1], tmp_path / "a.txt", enabled=False), StepProfiler([], tmp_path / "b.txt", enabled=True)):
        prof.begin(1)
        prof.end(1)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("steps", [[3], [0, 2], [4, 3], [1, 2, 3]])
def test_bad_profile_steps_are_refused_with_the_form(steps):
    t = TrainerConfig(dataset="d.jsonl", reward_funcs=["letter_a_fraction"], profile_steps=steps)
    with pytest.raises(ConfigError, match=r"\[first, last\]"):
        t.check()
