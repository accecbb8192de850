"""The built-in verifiable rewards (trainer/verifiable_rewards.py) called as TRL calls them: math_accuracy through
math_verify on numbers, fractions, LaTeX, \\boxed{} and <answer> tags, None for a row whose solution does not parse,
0.0 (never an exception) for garbage; the format rewards; and every shipped math row scores 1.0 on its own answer."""

from __future__ import annotations

import json
import threading
import time

import pytest

from tests.conftest import REPO
from trainer import rewards

pytest.importorskip("math_verify", reason="the math extra: pip install -e '.[math]' (scripts/install.sh installs it)")


def score(name: str, completions: list, **columns) -> list:
    """The reward as the trainer resolves it, called with TRL's keywords."""
    fn = rewards.resolve(name)
    return fn(prompts=["q"] * len(completions), completions=completions, completion_ids=[[1]] * len(completions), **columns)


@pytest.mark.parametrize(
    "completion, solution, want",
    [
        ("The answer is 42.", "42", 1.0),
        ("<think>6 times 7</think><answer>42</answer>", "42", 1.0),
        ("<think>maybe 41</think><answer>42</answer>", "42", 1.0),  # the answer tag wins over numbers before it
        ("<answer>41</answer>", "42", 0.0),
        ("so it is \\boxed{\\frac{84}{2}}", "42", 1.0),
        ("$\\frac{1}{2}$", "0.5", 1.0),
        ("<answer>2/4</answer>", "1/2", 1.0),
        ("<answer>1/3</answer>", "1/2", 0.0),
        ("42.0", "42", 1.0),
        ("I do not know", "42", 0.0),
        ("", "42", 0.0),
    ],
)
def test_math_accuracy_checks_the_final_answer(completion, solution, want):
    assert score("math_accuracy", [completion], solution=[solution]) == [want]


def test_math_accuracy_scores_conversational_completions_and_skips_unparseable_solutions():
    conv = [[{"role": "assistant", "content": "<answer>7</answer>"}], [{"role": "assistant", "content": None}]]
    assert score("math_accuracy", conv, solution=["7", "7"]) == [1.0, 0.0]
    # a solution that is no number: the data's fault; None makes TRL leave the row out instead of scoring 0
    assert score("math_accuracy", ["7"], solution=["see the book"]) == [None]


def test_garbage_never_raises_and_a_runaway_completion_is_cut(monkeypatch):
    garbage = ["}}}{{\\boxed{", "\\frac{" * 200, "<answer></answer>", "\x00\xff" * 50, "9" * 5000, "a" * 200_000]
    t0 = time.time()
    assert score("math_accuracy", garbage, solution=["42"] * len(garbage)) == [0.0] * len(garbage)
    assert time.time() - t0 < 20  # the tail rule: 200k characters are not parsed whole (measured ~0.2 s for all)


def test_math_accuracy_runs_in_a_worker_thread_without_timeouts():
    """math_verify's timeouts use signal.alarm, which only the main thread may set (TRL's accuracy_reward does the
    same): in a thread the reward runs with them off instead of raising."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(score("math_accuracy", ["<answer>5</answer>", "4"], solution=["5", "5"])))
    t.start()
    t.join(60)
    assert out == [[1.0, 0.0]]


def test_the_format_rewards():
    completions = [
        "<think>a</think><answer>b</answer>",
        "a</think>\n<answer>b</answer>\n",  # the template opened <think> in the prompt
        "<think>a</think><answer>b</answer> more",
        "<answer>b</answer>",
        "<think>a</think><answer> </answer>",
        "<think><think>a</think><answer>b</answer>",
    ]
    assert score("think_answer_format", completions) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    boxed = ["\\boxed{4}", "\\boxed{}", "x \\boxed{\\frac{1}{2}} y", "\\boxed{1} or \\boxed{2}", "\\boxed{1", "4"]
    assert score("boxed_format", boxed) == [1.0, 0.0, 1.0, 0.0, 0.0, 0.0]


def test_every_shipped_math_row_scores_one_on_its_answer_and_zero_on_a_wrong_one():
    rows = [json.loads(x) for x in (REPO / "data" / "math_small.jsonl").read_text().splitlines() if x.strip()]
    assert len(rows) >= 50 and all(set(r) == {"question", "answer"} for r in rows)
    answers = [r["answer"] for r in rows]
    right = [f"<think>...</think><answer>{a}</answer>" for a in answers]
    assert score("math_accuracy", right, solution=answers) == [1.0] * len(rows)
    assert score("math_accuracy", ["<answer>100000</answer>"] * len(rows), solution=answers) == [0.0] * len(rows)
