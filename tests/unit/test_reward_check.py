"""Rewards checked at submit down to the function and its signature, read from the source without importing it
(launcher.core.reward_check): the function exists (also through a re-export), TRL's keyword call fits its signature,
the dataset columns it requires, and a module it imports that is not installed, with the install command. The same
signature rule on the live object in the `slurm-grpo local` child (trainer.rewards.problems)."""

from __future__ import annotations

import re
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from launcher.core import config as C
from launcher.core import reward_check as R
from launcher.core.inputs import local_problems
from trainer import rewards

MODULE = """
    import json

    try:
        import no_such_optional_dep  # optional at module level: not reported
    except ImportError:
        no_such_optional_dep = None

    def good(prompts, completions, **kwargs):
        return [0.0] * len(completions)

    def needs_solution(prompts, completions, solution, difficulty=1, *, level, **kwargs):
        return [0.0] * len(completions)

    def no_kwargs(prompts, completions):
        return [0.0] * len(completions)

    def positional_only(completions, /, **kwargs):
        return [0.0] * len(completions)

    def lazy_dep(completions, **kwargs):
        import no_such_dep_inside
        return [0.0] * len(completions)

    class Scorer:
        def __call__(self, completions):  # no **kwargs: only the live object shows it
            return [1.0] * len(completions)

    scorer = Scorer()
    IMPORTED_AT_CHECK = json.dumps(1)
"""


@pytest.fixture
def pkg(tmp_path: Path, monkeypatch) -> Iterator[str]:
    """A package `chk_<n>`: funcs.py (MODULE), a re-export in __init__ (`from .funcs import good as exported`),
    deps.py (a module-level import that is not installed) and raises.py, which fails when imported (the source
    check must never import it)."""
    name = "chk_" + re.sub(r"\W", "_", tmp_path.name)
    root = tmp_path / "src" / name
    root.mkdir(parents=True)
    (root / "__init__.py").write_text("from .funcs import good as exported\n")
    (root / "funcs.py").write_text(textwrap.dedent(MODULE))
    (root / "deps.py").write_text(
        "if True:\n    from no_such_dep_at_module_level import thing\ndef f(prompts, completions, **kwargs):\n    return []\n"
    )
    (root / "raises.py").write_text("raise RuntimeError('imported!')\ndef f(prompts, completions, **kwargs):\n    return []\n")
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    yield name
    for m in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[m]


def test_the_source_check_finds_functions_and_the_columns_they_need_without_importing(pkg):
    assert R.reward_needs(f"{pkg}.funcs:good") == R.RewardNeeds()
    # parameters without a default that TRL does not pass are dataset columns
    assert R.reward_needs(f"{pkg}.funcs:needs_solution").columns == ("solution", "level")
    assert R.reward_needs(f"{pkg}:exported") == R.RewardNeeds()  # followed through `from .funcs import good as exported`
    assert R.reward_needs(f"{pkg}.raises:f") == R.RewardNeeds()
    assert not [m for m in sys.modules if m.startswith(pkg)], "a reward's module was imported by the source check"
    with pytest.raises(ValueError, match="raised RuntimeError: imported!"):  # the negative control: importing it fails
        rewards.resolve(f"{pkg}.raises:f")


def test_the_built_in_rewards_read_from_their_source():
    assert R.reward_needs("math_accuracy").columns == ("solution",)
    for name in ("letter_a_fraction", "short_completion", "think_answer_format", "boxed_format"):
        assert R.reward_needs(name) == R.RewardNeeds(), name
    assert set(R.BUILTIN) == set(rewards.BUILTIN)


@pytest.mark.parametrize(
    "entry, needle",
    [
        ("{pkg}.funcs:nope", "module '{pkg}.funcs' has no function 'nope'"),
        ("{pkg}.funcs:no_kwargs", "takes no **kwargs, so TRL's completion_ids, trainer_state, log_extra, log_metric"),
        ("{pkg}.funcs:positional_only", "parameter 'completions' is positional-only"),
        ("{pkg}.funcs:lazy_dep", "imports 'no_such_dep_inside', which is not installed here"),
        ("{pkg}.deps:f", "imports 'no_such_dep_at_module_level', which is not installed here"),
        ("no_such_pkg_rc.mod:f", "module 'no_such_pkg_rc.mod' is not importable here"),
        ("accuracy_reward", "not a built-in reward (letter_a_fraction"),
    ],
)
def test_each_problem_is_one_line_naming_the_reward(pkg, entry, needle):
    entry, needle = entry.format(pkg=pkg), needle.format(pkg=pkg)
    found = R.reward_needs(entry).problems
    hits = [p for p in found if needle in p]
    assert len(hits) == 1, found
    assert hits[0].startswith(f"trainer.reward_funcs {entry!r}") and "\n" not in hits[0]
    assert not any("no_such_optional_dep" in p for p in found)  # a guarded optional import is the module's business


def test_a_missing_math_verify_names_the_extra_that_installs_it(monkeypatch):
    """TRL's accuracy_reward passes every import-free check and fails at step 1 without math_verify (NEWCOMER §2)."""
    monkeypatch.setitem(sys.modules, "math_verify", None)  # what an environment without the package answers
    for entry in ("math_accuracy", "trl.rewards:accuracy_reward"):
        needs = R.reward_needs(entry)
        assert needs.columns == ("solution",)
        assert needs.problems == (
            f"trainer.reward_funcs {entry!r} imports 'math_verify', which is not installed here: "
            "pip install 'slurm-grpo[math]' (from a checkout: pip install -e '.[math]')",
        )
    assert R.reward_needs("think_answer_format").problems == ()


def test_the_local_child_checks_the_live_signature_too(pkg):
    """A callable instance is only found in the source; `python -m trainer.rewards` (slurm-grpo local) resolves it and
    checks its signature as for a function."""
    assert R.reward_needs(f"{pkg}.funcs:scorer") == R.RewardNeeds()
    (line,) = rewards.problems([f"{pkg}.funcs:scorer"])
    assert line.startswith(f"trainer.reward_funcs '{pkg}.funcs:scorer' takes no **kwargs")
    assert rewards.problems([f"{pkg}.funcs:good", "math_accuracy"]) == []


def test_local_run_problems_of_the_eval_rewards_name_the_eval_key(pkg, tmp_path, monkeypatch):
    """`slurm-grpo local` checks trainer.eval.reward_funcs as the training rewards (source, then the child's import)
    and labels what it finds with the eval key."""
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path / 'src'}:{Path.cwd()}")
    cfg = C.from_dict(
        {"vllm": {"model": "/m"}, "trainer": {"eval": {"reward_funcs": [f"{pkg}.funcs:missing", f"{pkg}.funcs:scorer"]}}}
    )
    found = [p for p in local_problems(cfg) if "reward_funcs" in p]
    assert len(found) == 2, found
    assert all(p.startswith("trainer.eval.reward_funcs ") for p in found), found
    assert "takes no **kwargs" in found[1]  # only the child's import finds it


@pytest.mark.parametrize(
    "source, where",
    [
        ("def correct(prompts, completions, ans, **kwargs)\n    return []\n", "line 1: SyntaxError: expected ':'"),
        ("import numpyy\ndef correct(prompts, completions, **kwargs):\nreturn []\n", "line 3: IndentationError: expected"),
        ("def correct(prompts, completions, **kwargs):\n    pass\nreturn []\n", "line 3: SyntaxError: 'return' outside"),
    ],
)
def test_a_reward_module_that_does_not_compile_is_a_problem_with_its_file_and_line(tmp_path, monkeypatch, source, where):
    """Before: an unparsable module was 'found' (the nodes died importing it after the queue). Now compile()'s error,
    file and line, as the import on the nodes would report it; a syntax error also behind a re-export."""
    name = "syn_" + re.sub(r"\W", "_", tmp_path.name)
    (tmp_path / name).mkdir()
    (tmp_path / name / "__init__.py").write_text("from .score import correct\n")
    (tmp_path / name / "score.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    for entry in (f"{name}.score:correct", f"{name}:correct"):
        (problem,) = R.reward_needs(entry).problems
        assert problem.startswith(f"trainer.reward_funcs {entry!r}: {tmp_path / name / 'score.py'} {where}"), problem
        assert "\n" not in problem
    with pytest.raises(SyntaxError):  # the negative control: importing it fails the same way
        compile(source, "score.py", "exec")
