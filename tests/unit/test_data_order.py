"""The data cursor of a resumed run (trainer/data.py): TRL's own RepeatSampler, interrupted after K optimizer steps and
resumed with the indices those steps consumed skipped, yields what the uninterrupted sampler yields from there on,
within the pass and across passes over the data; and a real TRL GRPOTrainer resumed that way generates from the
prompts an uninterrupted one does. (The integration tier checks the same on a real run: the prompts each step
trained on, resumed vs uninterrupted.)"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from transformers import TrainerCallback
from trl.trainer.utils import RepeatSampler

from trainer.data import DataCursor, FastForward, continue_data_order, indices_per_step


def make_sampler() -> RepeatSampler:
    # 10 prompts, 4 generations each, 2 prompts per generation batch, each batch used twice (steps_per_generation 2)
    return RepeatSampler(data_source=list(range(10)), mini_repeat_count=4, batch_size=2, repeat_count=2, seed=7)


def passes(sampler, n: int) -> list[list[int]]:
    """What the dataloader sees: one iter() per pass (epoch)."""
    return [list(sampler) for _ in range(n)]


def test_a_resumed_sampler_continues_the_uninterrupted_order_within_and_across_passes():
    per_pass = len(make_sampler())
    uninterrupted = list(itertools.chain(*passes(make_sampler(), 6)))
    assert len(set(map(tuple, passes(make_sampler(), 3)))) == 3, "the passes must differ for this test to mean anything"
    for skip in (0, 8, per_pass - 8, per_pass, per_pass + 16, 2 * per_pass + 8):
        resumed = passes(FastForward(make_sampler(), skip), 3)
        first_pass_end = (skip // per_pass + 1) * per_pass
        assert resumed[0] == uninterrupted[skip:first_pass_end], skip  # the rest of the interrupted pass
        assert resumed[1] == uninterrupted[first_pass_end : first_pass_end + per_pass], skip  # then the next passes
        assert resumed[2] == uninterrupted[first_pass_end + per_pass : first_pass_end + 2 * per_pass], skip


PROMPTS = [f"p{i}" for i in range(12)]
# per_device 2, num_generations 2, steps_per_generation 4, gradient accumulation 2, num_iterations 2, one process:
# a generation is 8 completions of 4 prompts, trained in 4 slices, each twice: 8 micro-steps = 4 optimizer steps;
# 3 generations make a pass over the 12 prompts
STEPS_PER_GENERATION = 4
GRPO = {"steps_per_generation": 4, "gradient_accumulation_steps": 2, "num_iterations": 2}


class StartAt(TrainerCallback):
    """What trainer.callback.SlurmGrpoCallback does on a resume (the model and optimizer state aside): count on from the
    checkpoint's step."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_begin(self, args, state, control, **kwargs):
        state.global_step = self.step


def train(model_dir: str, job_dir: Path, max_steps: int, resume_step: int = 0, consumed: int | None = None):
    """A real TRL GRPOTrainer (generation by transformers on CPU, a reward that records what it is asked to score)
    with the project's GRPOConfig, resumed the way trainer.run.build does it: the sampler skips the indices the
    first `resume_step` steps consumed (indices_per_step of this trainer, unless `consumed` says otherwise).
    Returns indices_per_step and every generation as (global step, prompts in the sampler's order)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    from tests.conftest import cpu_trainer
    from trainer import trl_glue

    t = cpu_trainer(model_dir, per_device_train_batch_size=2, num_generations=2, max_completion_length=2, grpo=GRPO)
    generations: list[tuple[int, list[str]]] = []
    trainer: list = []

    def reward(prompts, completions, **kwargs):
        generations.append((trainer[0].state.global_step, list(prompts)))
        return [0.0] * len(prompts)

    args = trl_glue.grpo_config(job_dir, t, "cpu", use_vllm=False, max_steps=max_steps, logging_steps=1000)
    tr = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir),
        reward_funcs=[reward],
        args=args,
        train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS]),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        callbacks=[StartAt(resume_step)],
    )
    trainer.append(tr)
    per_step = indices_per_step(tr)
    if resume_step:
        continue_data_order(tr, resume_step * per_step if consumed is None else consumed)
    tr.train()
    return per_step, generations


@pytest.fixture(scope="module")
def small_model(tmp_path_factory) -> str:
    """The smallest model the trainer runs (one layer of width 64): the test is about the data order, not the model."""
    from trainer.tiny_model import make_tiny_model

    d = tmp_path_factory.mktemp("model") / "m"
    make_tiny_model(d, hidden=64, layers=1)
    return str(d)


def test_a_resumed_trainer_generates_from_the_prompts_the_uninterrupted_run_would_have(small_model, tmp_path):
    """steps_per_generation, gradient accumulation and num_iterations all above 1, so the indices a step consumes
    are none of the three alone; resumed at a generation boundary within the first pass and at the pass's end, and
    between two generations."""
    per_step, full = train(small_model, tmp_path / "full", max_steps=16)
    assert [s for s, _ in full] == [0, 4, 8, 12], full  # a generation every 4 optimizer steps (the premise)
    first_pass = [sorted(set(p)) for _, p in full[:3]]
    assert sorted(x for p in first_pass for x in p) == sorted(PROMPTS), full  # 3 generations of 4 prompts: one pass
    for k in (4, 12):
        _, resumed = train(small_model, tmp_path / f"resumed-{k}", max_steps=16, resume_step=k)
        assert resumed == [g for g in full if g[0] >= k], (k, resumed, full)
    # resumed between two generations (TRL regenerates by its micro-step counter, which must count on from the
    # checkpoint): the resumed run regenerates the covering generation's prompts at once, then generates at the
    # uninterrupted run's steps
    for k in (2, 7):
        covering = [g for g in full if g[0] <= k][-1]
        _, resumed = train(small_model, tmp_path / f"resumed-{k}", max_steps=16, resume_step=k)
        assert resumed == [(k, covering[1])] + [g for g in full if g[0] > k], (k, resumed, full)
    # the control: a cursor that ignored steps_per_generation (skipped a quarter) trains other prompts
    _, wrong = train(small_model, tmp_path / "wrong", max_steps=8, resume_step=4, consumed=4 * per_step // STEPS_PER_GENERATION)
    assert wrong[0][1] != full[1][1], (wrong, full)


def test_the_cursor_counts_on_from_the_checkpoints_record():
    # resumed at step 10 on half the ranks, after 10 steps at 128 indices each: the cursor counts on from there
    cursor = DataCursor(base_indices=10 * 128, base_step=10, per_step=64)
    assert cursor.at(10) == 1280 and cursor.at(14) == 1280 + 4 * 64


def test_the_lookahead_knows_the_next_batch_of_the_same_pass_and_changes_nothing_else():
    from trainer.data import Lookahead

    inner = [["a"], ["b"], ["c"]]
    ahead = Lookahead(inner)
    seen = []
    for batch in ahead:
        seen.append((batch, ahead.next_batch))
    assert seen == [(["a"], ["b"]), (["b"], ["c"]), (["c"], None)]  # none across the end of a pass
    assert [b for b in Lookahead(inner)] == inner and len(ahead) == 3
    # max_staleness 2: the next two batches, fewer at the pass's end; the inner loader is read once, in order
    reads = []
    counted = type("Loader", (), {"__iter__": lambda self: (reads.append(b) or b for b in inner), "__len__": lambda self: 3})()
    deep = Lookahead(counted, depth=2)
    seen = [(batch, list(deep.following)) for batch in deep]
    assert seen == [(["a"], [["b"], ["c"]]), (["b"], [["c"]]), (["c"], [])]
    assert reads == inner
