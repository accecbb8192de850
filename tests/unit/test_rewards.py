"""Rewards as the trainer resolves and calls them (trainer/rewards.py): built-ins and 'pkg.module:function' rewards
from a real module file on sys.path, several at once; a reward that raises names itself, the exception, the step and
the node, in the line the node's bootstrap reports as the trainer's root cause."""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import subprocess
import sys
import textwrap
import traceback
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from launcher.node.diagnose import root_cause
from tests.conftest import PY, REPO
from trainer import rewards

MODULE = """
    def a_count(completions, **kwargs):
        return [float(c.count("a")) for c in completions]

    def length(completions, **kwargs):
        return [float(len(c)) for c in completions]

    def check_positive(value):
        if value < 0:
            raise ValueError(f"negative length {value}")

    def picky(completions, **kwargs):
        for c in completions:
            check_positive(-len(c))
        return [0.0 for _ in completions]

    async def slow_len(completions, **kwargs):
        return [float(len(c)) for c in completions]

    async def async_picky(completions, **kwargs):
        raise KeyError("missing field")

    class Scorer:
        def __call__(self, completions, **kwargs):
            return [1.0 for _ in completions]

    scorer = Scorer()
    not_a_function = 3
"""


@pytest.fixture
def user_pkg(tmp_path: Path, monkeypatch) -> Iterator[str]:
    """A package `myrewards_<n>` with a `funcs` module, importable from a folder on sys.path (a unique name: the
    module cache must not hand one test's module to another)."""
    name = "myrewards_" + re.sub(r"\W", "_", tmp_path.name)
    pkg = tmp_path / "src" / name
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "funcs.py").write_text(textwrap.dedent(MODULE))
    (pkg / "broken.py").write_text("def f(completions, **kwargs)\n    return []\n")  # a syntax error
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    yield name
    for m in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[m]


COMPLETIONS = ["aab", "a", "bbbb"]
CONVERSATION = [[{"role": "assistant", "content": "aab"}], [{"role": "assistant", "content": "a"}]]


def test_several_rewards_at_once_builtin_and_dotted_resolve_and_score(user_pkg):
    names = ["letter_a_fraction", "short_completion", f"{user_pkg}.funcs:a_count", f"{user_pkg}.funcs:length"]
    fns = [rewards.resolve(n) for n in names]
    # TRL names each reward's metrics by __name__ (rewards/<name>/mean): the wrapper keeps the function's own
    assert [f.__name__ for f in fns] == ["letter_a_fraction", "short_completion", "a_count", "length"]
    state = SimpleNamespace(global_step=4)  # what TRL passes as trainer_state: a TrainerState
    scores = [f(completions=COMPLETIONS, prompts=["p"] * 3, trainer_state=state) for f in fns]
    assert scores[0] == pytest.approx([2 / 3, 1.0, 0.0])
    assert scores[1] == pytest.approx([1 / (1 + 3 / 32), 1 / (1 + 1 / 32), 1 / (1 + 4 / 32)])
    assert scores[2] == [2.0, 1.0, 0.0]
    assert scores[3] == [3.0, 1.0, 4.0]
    # conversational completions ([{"role", "content"}]) score on their text
    assert rewards.resolve("letter_a_fraction")(CONVERSATION) == pytest.approx([2 / 3, 1.0])


def test_async_and_callable_instance_rewards_keep_what_trl_looks_at(user_pkg):
    slow = rewards.resolve(f"{user_pkg}.funcs:slow_len")
    assert inspect.iscoroutinefunction(slow)  # TRL gathers async rewards; a sync wrapper would hand it a coroutine
    assert asyncio.run(slow(completions=COMPLETIONS)) == [3.0, 1.0, 4.0]
    inst = rewards.resolve(f"{user_pkg}.funcs:scorer")
    assert not inspect.iscoroutinefunction(inst)
    assert inst.__name__ == "Scorer" and inst(completions=COMPLETIONS) == [1.0, 1.0, 1.0]


def test_a_reward_that_raises_names_itself_the_exception_the_step_and_the_node(user_pkg, monkeypatch):
    monkeypatch.setenv("SLURM_GRPO_NODE", "1")  # what launcher.node.commands gives the trainer ranks
    name = f"{user_pkg}.funcs:picky"
    fn = rewards.resolve(name)
    with pytest.raises(rewards.RewardError) as got:
        fn(completions=COMPLETIONS, trainer_state=SimpleNamespace(global_step=1))
    first, *rest = str(got.value).splitlines()
    assert first == f"reward '{name}' raised ValueError at step 2 on node 1: negative length -3"
    # the reward's own frames follow, down to the helper that raised; not the wrapper's
    tb = "\n".join(rest)
    assert "in picky" in tb and "in check_positive" in tb and 'raise ValueError(f"negative length {value}")' in tb
    assert "in named" not in tb
    assert isinstance(got.value.original, ValueError)
    # an explicit node wins over the environment; without TRL's trainer_state the step is not claimed
    with pytest.raises(rewards.RewardError, match=rf"^reward '{name}' raised ValueError on node 0: negative length"):
        rewards.resolve(name, node=0)(completions=COMPLETIONS)
    a = rewards.resolve(f"{user_pkg}.funcs:async_picky", node=3)
    with pytest.raises(rewards.RewardError, match=r"raised KeyError at step 8 on node 3: 'missing field'"):
        asyncio.run(a(completions=COMPLETIONS, trainer_state=SimpleNamespace(global_step=7)))


def test_the_named_line_is_the_root_cause_the_bootstrap_reports(user_pkg, tmp_path):
    """The trainer prints the traceback of what stopped it (trainer.main) into the node's trainer log; the bootstrap's
    root_cause takes the first exception line from there. That line must be the named one, not the bare ValueError."""
    name = f"{user_pkg}.funcs:picky"
    with pytest.raises(rewards.RewardError) as got:
        rewards.resolve(name, node=0)(completions=COMPLETIONS, trainer_state=SimpleNamespace(global_step=1))
    printed = "".join(traceback.format_exception(got.value))
    log = tmp_path / "node0-trainer.log"
    log.write_text(
        "===== 2026-01-01 00:00:00 node 0 trainer: torchrun ...\n" + "".join(f"[rank0]: {ln}\n" for ln in printed.splitlines())
    )
    assert root_cause(log) == f"RewardError: reward '{name}' raised ValueError at step 2 on node 0: negative length -3"


@pytest.mark.parametrize(
    "entry, needle",
    [
        ("no_such_pkg_xyz.mod:f", "cannot import module 'no_such_pkg_xyz.mod'"),
        ("{pkg}.funcs:missing", "module '{pkg}.funcs' has no function 'missing'"),
        ("{pkg}.funcs:not_a_function", "module '{pkg}.funcs' has no function 'not_a_function'"),
        ("{pkg}.broken:f", "importing module '{pkg}.broken' raised SyntaxError"),
        ("no_colon_reward", "is not built in (letter_a_fraction, short_completion, math_accuracy,"),
    ],
)
def test_a_reward_that_cannot_be_resolved_is_one_line_naming_it(user_pkg, entry, needle):
    entry, needle = entry.format(pkg=user_pkg), needle.format(pkg=user_pkg)
    with pytest.raises(ValueError) as got:
        rewards.resolve(entry)
    assert needle in str(got.value) and f"reward {entry!r}" in str(got.value), got.value
    assert len(str(got.value).splitlines()) == 1
    assert rewards.problems(["letter_a_fraction", entry]) == [f"trainer.reward_funcs: {got.value}"]


def test_the_check_command_resolves_in_a_child_and_ends_with_the_problems_as_json(user_pkg, tmp_path):
    """`python -m trainer.rewards NAME...` (what `slurm-grpo local` runs before it starts anything): exit 1 and the
    problems as the last stdout line, even when the module prints at import."""
    src = tmp_path / "src"
    (src / user_pkg / "noisy.py").write_text("print('hello from import')\ndef ok(completions, **kw):\n    return []\n")
    env = {"PYTHONPATH": f"{src}:{REPO}", "PATH": "/usr/bin:/bin"}
    ok = [f"{user_pkg}.noisy:ok", f"{user_pkg}.funcs:a_count"]
    r = subprocess.run([PY, "-m", "trainer.rewards", *ok], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert r.returncode == 0 and json.loads(r.stdout.splitlines()[-1]) == [], r.stdout + r.stderr
    bad = [*ok, f"{user_pkg}.funcs:missing"]
    r = subprocess.run([PY, "-m", "trainer.rewards", *bad], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert r.returncode == 1
    assert json.loads(r.stdout.splitlines()[-1]) == [
        f"trainer.reward_funcs: reward '{user_pkg}.funcs:missing': module '{user_pkg}.funcs' has no function 'missing'"
    ]
