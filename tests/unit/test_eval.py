"""trainer.eval: the pass@k estimator and mean@k (against brute-force enumeration), each rank's share of the eval
prompts, the schedule, the typed eval row (metrics.jsonl, status, the plot, a resume's set-aside), the config's
checks; and one evaluation run for real over 4 gloo ranks as 2 nodes, each node's server faked at the HTTP boundary."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest

from launcher.core import config as C
from launcher.core.records import EvalRow, StepRow, format_eval, read_rows, row_from_dict
from tests.support.ranks import run_ranks
from trainer.evaluation.scores import pass_at, reported_ks, score, shard, summed

# ----------------------------------------------------------------------------- the arithmetic


def brute_pass_at(outcomes: list[bool], j: int) -> float:
    """The share of all j-subsets of the n completions that hold a pass (the definition, enumerated)."""
    subsets = list(itertools.combinations(outcomes, j))
    return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_pass_at_j_is_the_share_of_j_subsets_holding_a_pass(n):
    for c in range(n + 1):
        outcomes = [True] * c + [False] * (n - c)
        for j in range(1, n + 1):
            assert pass_at(n, c, j) == pytest.approx(brute_pass_at(outcomes, j)), (n, c, j)


def test_pass_at_1_is_the_pass_rate_and_pass_at_n_is_any_pass():
    assert pass_at(10, 3, 1) == pytest.approx(0.3)
    assert pass_at(10, 1, 10) == 1.0 and pass_at(10, 0, 10) == 0.0
    assert pass_at(200, 7, 100) == pytest.approx(1 - math.comb(193, 100) / math.comb(200, 100))  # no huge binomials needed
    with pytest.raises(ValueError):
        pass_at(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at(4, 1, 5)


def test_reported_ks_are_the_powers_of_two_below_k_and_k():
    assert [reported_ks(n) for n in (1, 2, 3, 4, 6, 16)] == [[1], [1, 2], [1, 2, 3], [1, 2, 4], [1, 2, 4, 6], [1, 2, 4, 8, 16]]


def test_score_averages_over_prompts_and_a_pass_is_reward_at_or_above_the_threshold():
    per_prompt = [[1.0, 0.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 2.0]]
    s = score(per_prompt, threshold=0.5)  # passes: 2, 0, 4 of 4
    assert s.pass_at == pytest.approx({1: (0.5 + 0 + 1) / 3, 2: (pass_at(4, 2, 2) + 0 + 1) / 3, 4: (1 + 0 + 1) / 3})
    assert s.mean_at_k == pytest.approx((1.5 / 4 + 0 + 5 / 4) / 3)
    flat = [r for p in per_prompt for r in p]
    assert s.reward_std == pytest.approx(math.sqrt(sum((r - sum(flat) / 12) ** 2 for r in flat) / 12))
    with pytest.raises(ValueError, match="same number of completions"):
        score([[1.0, 0.0], [1.0]], 0.5)


def test_rewards_of_a_completion_are_summed_as_trl_sums_them_and_none_when_no_reward_applies():
    assert summed([0.5, None, 1.0, float("nan")]) == 1.5 and summed([0.0, None]) == 0.0
    assert summed([None]) is None and summed([None, float("nan")]) is None


def test_a_prompt_without_a_reward_is_left_out_of_the_scores_not_counted_as_a_failure():
    """math_accuracy returns None for a row whose solution does not parse: that prompt is neither a pass nor a fail;
    the row says how many were left out, and a set with no scored prompt gives a row without scores, not a crash."""
    from launcher.core.config import EvalConfig
    from trainer.evaluation.evaluator import Share, build_row

    cfg = EvalConfig(dataset="e.jsonl", samples_per_prompt=2, pass_threshold=1.0)
    shares = [
        Share(node=0, indices=[0, 1], totals=[[1.0, 1.0], [None, None]]),
        Share(node=1, indices=[2, 3], totals=[[0.0, 1.0], [None, 1.0]]),
    ]
    row = build_row(3, shares, cfg, 1.0)
    assert (row.prompts, row.prompts_left_out) == (2, 2)
    assert row.pass_at == {"1": 0.75, "2": 1.0} and row.mean_at_k == 0.75  # prompts 0 and 2 only
    assert "2 prompts x 2 samples, 2 left out: no reward" in format_eval(row)
    assert EvalRow.from_dict(row.to_dict()) == row

    none = build_row(3, [Share(node=0, indices=[0], totals=[[None, None]])], cfg, 1.0)
    assert (none.prompts, none.prompts_left_out, none.pass_at, none.mean_at_k) == (0, 1, {}, None)
    assert format_eval(none).startswith("step 3: no prompt scored; mean@2 n/a")


@pytest.mark.parametrize("count,world", [(8, 4), (10, 4), (3, 4), (1, 2), (0, 3), (37, 8)])
def test_every_prompt_goes_to_exactly_one_rank_in_balanced_contiguous_blocks(count, world):
    shares = [shard(count, world, r) for r in range(world)]
    assert [i for s in shares for i in s] == list(range(count))  # each once, in rank order
    assert max(map(len, shares)) - min(map(len, shares)) <= 1
    assert all(len(a) >= len(b) for a, b in itertools.pairwise(shares))  # the first ranks take the remainder
    # a node's ranks are consecutive: its share is one block (2 nodes of world/2 ranks)
    if world % 2 == 0:
        half = world // 2
        node0 = [i for s in shares[:half] for i in s]
        assert node0 == list(range(len(node0)))


# ----------------------------------------------------------------------------- the schedule and the config


def test_it_evaluates_before_training_every_n_steps_and_after_the_last():
    from trainer.evaluation.evaluator import due

    cfg = C.EvalConfig(dataset="e.jsonl", every_steps=4)
    assert [s for s in range(0, 11) if due(cfg, s, max_steps=10)] == [0, 4, 8, 10]
    cfg = C.EvalConfig(dataset="e.jsonl", before_training=False)
    assert [s for s in range(0, 11) if due(cfg, s, max_steps=10)] == [10]


@pytest.mark.parametrize(
    "keys,needle",
    [
        ({"samples_per_prompt": 0}, "trainer.eval.samples_per_prompt must be 1 to"),
        ({"every_steps": -1}, "trainer.eval.every_steps must be >= 0"),
        ({"reward_funcs": ["no such"]}, "trainer.eval.reward_funcs entry 'no such'"),
        ({"reward_funcs": ["pkg.mod:"]}, "trainer.eval.reward_funcs entry 'pkg.mod:'"),
    ],
)
def test_eval_settings_are_checked_with_the_key_and_the_fix(keys, needle):
    with pytest.raises(C.ConfigError, match=needle):
        C.from_dict({"vllm": {"model": "/m"}, "trainer": {"eval": {"dataset": "e.jsonl", **keys}}})


def test_eval_with_a_users_rollout_func_is_refused_naming_the_key():
    raw = {"vllm": {"model": "/m"}, "trainer": {"rollout_func": "pkg.mod:fn", "eval": {"dataset": "e.jsonl"}}}
    with pytest.raises(C.ConfigError, match=r'trainer.eval with trainer.rollout_func.*trainer.eval.dataset: ""'):
        C.from_dict(raw)
    raw["trainer"]["eval"] = {}
    assert not C.from_dict(raw).trainer.eval.enabled  # off: the rollout_func runs as before


# ----------------------------------------------------------------------------- the row


ROW = EvalRow(
    step=10,
    prompts=8,
    samples_per_prompt=4,
    threshold=1.0,
    pass_at={"1": 0.25, "2": 0.4, "4": 0.6},
    mean_at_k=0.31,
    reward_funcs={"accuracy": 0.25},
    seconds=1.5,
    gen_s={"0": 1.0, "1": 1.1},
    prompts_per_node={"0": 4, "1": 4},
)


def test_the_eval_row_round_trips_as_its_own_kind_and_is_no_step_row(tmp_path):
    from trainer.metrics import MetricsWriter

    w = MetricsWriter(tmp_path)
    w.write(StepRow(step=10, reward=0.3))
    w.write(ROW)
    line = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[1])
    assert line["kind"] == "eval" and "reward" not in line  # readers that tell step rows by "reward" skip it
    rows = read_rows(tmp_path / "metrics.jsonl")
    assert [type(r) for r in rows] == [StepRow, EvalRow]
    assert row_from_dict(line) == ROW.__class__(**{**ROW.to_dict(), "time": line["time"]})


def test_the_row_as_tracker_figures_and_as_the_status_line():
    assert ROW.figures() == {
        "eval_pass@1": 0.25,
        "eval_pass@2": 0.4,
        "eval_pass@4": 0.6,
        "eval_rewards/accuracy": 0.25,
        "eval_mean@k": 0.31,
        "eval_seconds": 1.5,
    }
    assert format_eval(ROW) == (
        "step 10: pass@1 0.250, pass@2 0.400, pass@4 0.600; mean@4 0.3100 (reward >= 1 passes; 8 prompts x 4 samples, 1.5 s)"
    )
    assert format_eval(None) == "no evaluation yet"


def test_a_resume_sets_aside_the_eval_rows_of_the_steps_it_redoes(tmp_path):
    from trainer.metrics import MetricsWriter

    w = MetricsWriter(tmp_path)
    for s in (0, 4, 8):
        w.write(EvalRow(step=s, prompts=1, samples_per_prompt=1, threshold=1.0))
    assert w.set_aside_after(4) == 1
    assert [r.step for r in read_rows(tmp_path / "metrics.jsonl")] == [0, 4]
    assert [r.step for r in read_rows(tmp_path / "metrics.lost.jsonl")] == [8]


def test_the_plot_draws_the_eval_curves_over_the_training_reward(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.axes

    from trainer.metrics import plot

    labels: list[str] = []
    real = matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", lambda self, *a, **k: labels.append(k.get("label")) or real(self, *a, **k))
    steps = [StepRow(step=i, reward=0.1 * i, step_s=1.0) for i in range(1, 5)]
    evals = [
        EvalRow(step=s, prompts=2, samples_per_prompt=4, threshold=1.0, pass_at={"1": 0.1, "4": 0.3}, mean_at_k=0.2)
        for s in (0, 4)
    ]
    plot(steps, tmp_path / "m.png", evals)
    assert {"train reward", "eval mean@4", "eval pass@1", "eval pass@4"} <= set(labels)
    assert (tmp_path / "m.png").stat().st_size > 1000


# ----------------------------------------------------------------------------- one evaluation over 4 ranks, 2 nodes


class FakeTokenizer:
    """Byte ids: what a prompt's text is, its completion decodes back to."""

    def batch_decode(self, ids, skip_special_tokens=True):
        return [bytes(i).decode() for i in ids]


class FakeServer:
    """A node's vLLM server at the HTTP client's boundary (VllmServer.complete): the j-th entry of a request gets
    the completion text "<node>:<j % 3>"; it records every prompt it was asked."""

    def __init__(self, node: int) -> None:
        self.node = node
        self.asked: list[str] = []

    def complete(self, prompts, step=0, **sampling):
        self.asked += [bytes(p).decode() for p in prompts]
        return [(list(f"{self.node}:{j % 3}".encode()), [-0.1] * 3) for j in range(len(prompts))]


def one_evaluation(rank: int, world: int, _port: int, job_dir: str) -> dict:
    from types import SimpleNamespace

    from tests.support.ranks import cpu_parallel
    from trainer.evaluation.evaluator import Evaluator

    par = cpu_parallel(rank, world, nodes=2)
    server = FakeServer(par.node) if par.is_leader else None
    pushes: list[int] = []
    parity: list[str] = []  # the push's parity (trainer.rollout.node): its forward during generation, then the check
    rollout = SimpleNamespace(
        client=server,
        step=-1,
        probe_forward=lambda: parity.append("forward"),
        settle_parity=lambda: parity.append("settled"),
    )
    backend = SimpleNamespace(rollout=rollout, sampling={"max_tokens": 4}, sync_weights=lambda: pushes.append(rollout.step))
    reported: list[dict] = []
    trainer = SimpleNamespace(
        processing_class=FakeTokenizer(),
        state=SimpleNamespace(global_step=6),
        _tokenize_prompts=lambda prompts: ([list(p.encode()) for p in prompts],),
        vllm_generation=backend,
        args=None,
        control=None,
        callback_handler=SimpleNamespace(on_log=lambda args, state, control, logs: reported.append(logs)),
    )
    rows = [{"prompt": f"p{i}", "answer": str(i % 3)} for i in range(7)]

    def exact(completions, answer, completion_ids, trainer_state, **kw):
        # 1 when the sample number in the text is the row's answer (the column reaches the reward, per completion)
        assert trainer_state.global_step == 6 and len(completion_ids) == len(completions)
        return [float(c.split(":")[1] == a) for c, a in zip(completions, answer, strict=True)]

    def node_of(completions, **kw):
        return [None if c.startswith("0") else 0.25 for c in completions]  # None: does not apply (node 0's)

    e = Evaluator(C.EvalConfig(dataset="x", samples_per_prompt=3), par, rows, [exact, node_of], Path(job_dir))
    e.attach(trainer)
    row = e.run(6)
    out = {"node": par.node, "asked": server.asked if server else None, "pushes": pushes, "row": row, "reported": reported}
    return {**out, "parity": parity}


def test_one_evaluation_over_two_nodes_each_generating_its_share_on_its_own_server(tmp_path):
    import functools

    res = run_ranks(4, functools.partial(one_evaluation, job_dir=str(tmp_path)))
    assert all(r["pushes"] == [6] for r in res.values())  # every rank pushed the step's weights first, once
    # and settled its parity before returning: no optimizer step can come between the eval push and its check
    assert all(r["parity"] == ["forward", "settled"] for r in res.values())
    # 7 prompts over 4 ranks: 2, 2, 2, 1; node 0 = ranks 0-1 (p0-p3), node 1 = ranks 2-3 (p4-p6), each k = 3 times
    assert sorted(res[0]["asked"]) == sorted(f"p{i}" for i in range(4) for _ in range(3))
    assert sorted(res[2]["asked"]) == sorted(f"p{i}" for i in range(4, 7) for _ in range(3))
    assert res[1]["asked"] is None and res[3]["asked"] is None  # only node leaders talk to a server
    row = res[0]["row"]
    assert all(res[r]["row"] is None for r in (1, 2, 3))
    assert (row.step, row.prompts, row.samples_per_prompt, row.prompts_per_node) == (6, 7, 3, {"0": 4, "1": 3})
    # each prompt's 3 samples are "n:0", "n:1", "n:2" (the server numbers a node's entries, k per prompt in a row):
    # exactly one matches the answer, so 1 pass of 3 at threshold 1.0 for node 0's prompts; node 1's add 0.25 each
    # to every sample, which keeps their passes at 1 of 3 (1.25 and 0.25)
    assert row.pass_at == pytest.approx({"1": 1 / 3, "2": pass_at(3, 1, 2), "3": 1.0})
    assert row.mean_at_k == pytest.approx(1 / 3 + 0.25 * 3 / 7)
    assert row.reward_funcs == pytest.approx({"exact": 1 / 3, "node_of": 0.25})  # node_of's None values left out
    assert row.completion_tokens_mean == 3.0 and set(row.gen_s) == {"0", "1"}
    # rank 0 wrote the row and reported it to the trackers
    assert read_rows(tmp_path / "metrics.jsonl") == [
        EvalRow(**{**row.to_dict(), "time": read_rows(tmp_path / "metrics.jsonl")[0].time})
    ]
    assert res[0]["reported"] == [row.figures()] and res[1]["reported"] == []


class FakeEpisodes:
    """The project's episode loop (trainer.agents.episodes.EpisodeLoop.run) at its boundary: one single-turn episode
    per row, generated by `generate` (the rank's own client), no environment."""

    def run(self, rows, generate):
        from types import SimpleNamespace

        comps = generate([list(r["prompt"].encode()) for r in rows])
        return [SimpleNamespace(env=None, messages=bytes(c).decode(), completion_ids=list(c)) for c, _ in comps]


def one_multi_turn_evaluation(rank: int, world: int, _port: int, job_dir: str) -> list[str]:
    """Every rank runs its episodes on its own client (no collective between turns), then settles the eval push's
    parity: the forward TRL's tool loop would have run beside its first turn, and the comparison."""
    from types import SimpleNamespace

    from tests.support.ranks import cpu_parallel
    from trainer.evaluation.evaluator import Evaluator

    par = cpu_parallel(rank, world, nodes=1)
    parity: list[str] = []
    rollout = SimpleNamespace(step=-1, settle_parity=lambda: parity.append("settled"))
    backend = SimpleNamespace(rollout=rollout, client=FakeServer(0), sampling={}, sync_weights=lambda: parity.append("pushed"))
    trainer = SimpleNamespace(
        processing_class=FakeTokenizer(),
        state=SimpleNamespace(global_step=3),
        vllm_generation=backend,
        args=None,
        control=None,
        callback_handler=SimpleNamespace(on_log=lambda *a, **k: None),
    )
    rows = [{"prompt": f"p{i}", "answer": "0"} for i in range(3)]  # rank 1 of 2 gets 1 row, rank 0 2

    def exact(completions, answer, **kw):
        return [float(c.split(":")[1] == a) for c, a in zip(completions, answer, strict=True)]

    e = Evaluator(C.EvalConfig(dataset="x", samples_per_prompt=1), par, rows, [exact], Path(job_dir))
    e.attach(trainer)
    e.loop = FakeEpisodes()
    e.run(3)
    return parity


def test_a_multi_turn_evaluation_settles_its_push_before_returning(tmp_path):
    """With trainer.agents the eval push's forward is due in the evaluation's generation (RankGeneration defers it):
    every rank settles it after its episodes, so no optimizer step comes between the push and its check."""
    import functools

    res = run_ranks(2, functools.partial(one_multi_turn_evaluation, job_dir=str(tmp_path)))
    assert all(r == ["pushed", "settled"] for r in res.values()), res
