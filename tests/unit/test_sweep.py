"""`slurm-grpo sweep --grid` (launcher/sweep.py): a grid's values split at the commas outside brackets and quotes, so
a list is one value; a value that cannot be read is one line naming the --grid and the syntax."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.cli import main as cli_main
from launcher.core.config import ConfigError, load
from launcher.sweep import grid_points, parse_grid

REPO = Path(__file__).resolve().parents[2]
SMOKE = str(REPO / "configs" / "smoke_cpu.yaml")


def test_a_list_is_one_value_of_the_grid():
    """The audit's case: --grid 'trainer.reward_funcs=[a,b],[c]' split at every comma gave the points '[a' and 'b]'."""
    grid = parse_grid(["trainer.reward_funcs=[letter_a_fraction, short_completion],[short_completion]"])
    assert grid == [("trainer.reward_funcs", ["[letter_a_fraction, short_completion]", "[short_completion]"])]
    points = grid_points(grid)
    assert [load(SMOKE, pt).trainer.reward_funcs for pt in points] == [
        ["letter_a_fraction", "short_completion"],
        ["short_completion"],
    ]
    # braces and quotes hold their commas too; plain values split as before
    assert parse_grid(["trainer.grpo.generation_kwargs={top_k: 5, top_p: 0.9},{}"])[0][1] == ["{top_k: 5, top_p: 0.9}", "{}"]
    assert parse_grid(['trainer.system_prompt=\'Be brief, be right.\',"Say \\"a, b\\".",plain'])[0][1] == [
        "'Be brief, be right.'",
        '"Say \\"a, b\\"."',
        "plain",
    ]
    assert parse_grid(["trainer.learning_rate=1e-6, 3e-6"]) == [("trainer.learning_rate", ["1e-6", "3e-6"])]
    # as in YAML a quote or bracket opens only where a value starts: an apostrophe or a bracket inside text is text
    assert parse_grid(["trainer.system_prompt=Let's think, it's easy,Answer [briefly]"])[0][1] == [
        "Let's think",
        "it's easy",
        "Answer [briefly]",
    ]
    # a text key's value is taken as typed, as --set takes it: a prompt may hold ': ' and ' #'
    prompts = parse_grid(["trainer.system_prompt=Format: think first,End with #### and the number"])
    assert [load(SMOKE, pt).trainer.system_prompt for pt in grid_points(prompts)] == [
        "Format: think first",
        "End with #### and the number",
    ]


@pytest.mark.parametrize(
    ("grid", "said"),
    [
        ("trainer.reward_funcs=[a,b", "a bracket is not closed (']' missing)"),
        ("trainer.reward_funcs=[a},[b]", "'}' at character 3 of the values closes no bracket"),
        ("trainer.system_prompt='a,b", "the quote ' is not closed"),
        (
            "trainer.learning_rate=1e-6,a: b: c",
            "'a: b: c' cannot be read (--set 'trainer.learning_rate=a: b: c': the value is not valid YAML",
        ),
        (
            "trainer.learning_rate=1e-6,2e-6 # x",
            "'2e-6 # x' cannot be read (--set 'trainer.learning_rate=2e-6 # x': YAML reads '# x' as a comment",
        ),
        ("trainer.beta=0,,1", "empty or repeated values"),
    ],
)
def test_a_grid_value_that_cannot_be_read_is_one_line_with_the_syntax(grid, said, tmp_path, capsys):
    with pytest.raises(ConfigError) as e:
        parse_grid([grid])
    syntax = "e.g. --grid trainer.beta=0,0.04 or --grid 'trainer.reward_funcs=[a,b],[c]'"
    assert str(e.value).startswith(f"--grid {grid!r}: {said}") and str(e.value).endswith(syntax), str(e.value)
    assert cli_main(["sweep", SMOKE, "--grid", grid, "--set", f"job.job_dir={tmp_path / 'sweep'}", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"slurm-grpo sweep: error: {e.value}"], err
    assert not (tmp_path / "sweep").exists()
