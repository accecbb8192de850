"""The data cursor of a resumed run (trainer/data.py): TRL's own RepeatSampler, interrupted after K optimizer steps and
resumed with the indices those steps consumed skipped, yields what the uninterrupted sampler yields from there on,
within the pass and across passes over the data. (The integration tier checks the same on a real run: the prompts
each step trained on, resumed vs uninterrupted.)"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

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


def test_the_skip_is_what_the_steps_consumed_and_it_reaches_the_trainers_sampler():
    args = SimpleNamespace(gradient_accumulation_steps=2, per_device_train_batch_size=8, steps_per_generation=2)
    trainer = SimpleNamespace(
        args=args, accelerator=SimpleNamespace(num_processes=4), _get_train_sampler=lambda d=None: make_sampler()
    )
    assert indices_per_step(trainer) == 2 * 4 * 8 * 2  # micro-steps x processes x dataloader batch per process
    continue_data_order(trainer, 384)
    s = trainer._get_train_sampler()
    assert isinstance(s, FastForward) and s.skip == 384 and len(s) == len(make_sampler())
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
