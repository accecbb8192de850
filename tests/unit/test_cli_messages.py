"""One-line CLI errors for a wrong argument: a key config-reference does not know, a folder given as the config."""

from __future__ import annotations

from launcher import cli


def test_config_reference_of_an_unknown_key_fails_with_the_nearest(capsys):
    assert cli.main(["config-reference", "trainer.nope"]) == 2
    assert capsys.readouterr().err.strip() == (
        "slurm-grpo config-reference: error: config-reference 'trainer.nope': trainer has no key 'nope' "
        "(`slurm-grpo config-reference trainer` lists its keys)"
    )
    assert cli.main(["config-reference", "trainer.max_step"]) == 0  # the start of a key: its rows
    assert "| `max_steps` |" in capsys.readouterr().out
    assert cli.main(["config-reference", "trainer.lerning_rate"]) == 2
    assert "trainer has no key 'lerning_rate'; did you mean 'learning_rate'?" in capsys.readouterr().err
    assert cli.main(["config-reference", "trainer.lr"]) == 2  # another library's name for it
    assert "did you mean 'learning_rate'?" in capsys.readouterr().err
    assert cli.main(["config-reference", "slurm.container.imag"]) == 0  # a nested group's key
    assert "| `container.image` |" in capsys.readouterr().out


def test_a_directory_given_as_the_config_is_named_a_directory_with_its_yaml_files(tmp_path, capsys):
    (tmp_path / "b.yaml").write_text("job: {}\n")
    (tmp_path / "a.yml").write_text("job: {}\n")
    (tmp_path / "notes.txt").write_text("")
    assert cli.main(["dry-run", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"slurm-grpo dry-run: error: {tmp_path} is a directory; give one of its YAML configs, e.g. {tmp_path / 'a.yml'} "
        "(it holds a.yml, b.yaml)"
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli.main(["submit", str(empty)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"slurm-grpo submit: error: {empty} is a directory with no .yaml file in it; give a YAML config, e.g. "
        "configs/smoke_cpu.yaml"
    )
