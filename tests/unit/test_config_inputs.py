"""The bad inputs a new user types (shared/NEWCOMER.md section 4, issue 36): each one reaches the sbatch text and the
node commands as meant, or is refused before the queue in one short line that names the key and the fix."""

from __future__ import annotations

import argparse
import ast
import json
import re
from pathlib import Path

import pytest

from launcher import cli
from launcher.core import config as C
from launcher.core.config import ConfigError
from launcher.core.inputs import check_context_length, looks_local
from launcher.core.plan import plan
from launcher.node.commands import vllm_command
from launcher.submit import sbatch_text
from tests.conftest import REPO
from tests.conftest import cli as cli_run
from tests.unit.test_sbatch import sbatch_header

BASE = ["vllm.model=/m", "job.job_dir=/tmp/j"]


def header(*sets: str, text: str = "") -> dict[str, str | None]:
    cfg = C.from_dict(C.merge_raw(C.read_yaml(text) or {}, [*BASE, *sets]))
    return sbatch_header(sbatch_text(cfg, plan(cfg, "/tmp/j")))


@pytest.mark.parametrize("how", ["yaml", "set"])
def test_times_and_numeric_names_reach_sbatch_as_typed(how):
    typed = {"time": "24:00:00", "account": "012345", "partition": "1.10", "qos": "0x1f", "constraint": "2026-01-01"}
    if how == "yaml":  # unquoted, as in most SLURM configs
        h = header(text="slurm:\n" + "".join(f"  {k}: {v}\n" for k, v in typed.items()))
    else:
        h = header(*(f"slurm.{k}={v}" for k, v in typed.items()))
    assert {k: h[f"--{k}"] for k in typed} == typed
    assert header("slurm.time=30:00")["--time"] == "30:00"  # MM:SS, as SLURM reads it
    assert C.load(None, [*BASE, "vllm.extra_args=[--max-num-seqs, 0256]"]).vllm.extra_args == ["--max-num-seqs", "0256"]


BAD = [
    (["slurm.nodes=010"], "slurm.nodes '010' has a leading zero"),
    (["slurm.time=24:61:00"], "slurm.time '24:61:00': minutes and seconds must be below 60"),
    (["slurm.time=00:10:00", "vllm.health_timeout_s=60", "slurm.signal_seconds=600"], "signal_seconds (600) is not below slurm"),
    (["slurm.mem=200GB"], "slurm.mem '200GB' is not a SLURM size"),
    (["slurm.mem=-5G"], "slurm.mem '-5G' is not a SLURM size"),
    (["slurm.account=projé"], "slurm.account 'projé' is not a SLURM name: ASCII only"),
    (["slurm.extra_sbatch={nodes: 2}"], "slurm.extra_sbatch.nodes is written by slurm-grpo from slurm.nodes"),
    (["slurm.extra_sbatch={time: '00:10:00'}"], "slurm.extra_sbatch.time is written by slurm-grpo from slurm.time"),
    (["slurm.extra_sbatch={gres: 'gpu:4'}"], "slurm.extra_sbatch.gres is written by slurm-grpo from slurm.gpus_per_node"),
    (["slurm.extra_sbatch={ntasks-per-node: 8}"], "ntasks-per-node is written by slurm-grpo from the launcher (one task"),
    (["slurm.extra_sbatch={ntasks_per_node: 8}"], "sbatch flags use dashes; write ntasks-per-node"),
    (["slurm.extra_sbatch={nod: 2}"], "slurm.extra_sbatch.nod is written by slurm-grpo from slurm.nodes"),  # an abbreviation
    (["slurm.extra_sbatch={mem-per-gpu: 8G}", "slurm.mem=200G"], "mem-per-gpu and slurm.mem exclude each other"),
    (["slurm.setup_vars={venvv: /v}"], None),  # checked where the profile is rendered: see the sbatch test below
    (["vllm.extra_args=[--port, '9000']"], "vllm.extra_args[0] '--port' is set by slurm-grpo from vllm.port"),
    (["vllm.extra_args=[--host=0.0.0.0]"], "'--host=0.0.0.0' is set by slurm-grpo from slurm-grpo (127.0.0.1 only"),
    (["vllm.extra_args=[-tp, '2']"], "'-tp' is set by slurm-grpo from vllm.tensor_parallel_size"),
    (["vllm.extra_args=[--tensor_parallel_size=2]"], "from vllm.tensor_parallel_size"),
    (["vllm.max_model_len=4096", "trainer.max_completion_length=8192"], "leaves no room for the prompt in vllm.max_model_len"),
    (["vllm.dtype=float32"], "vllm.dtype float32 differs from trainer.dtype bfloat16"),
    (["trainer.grpo.logging_steps=10"], "trainer.grpo.logging_steps: slurm-grpo logs every step"),
    (["trainer.grpo.push_to_hub=true"], "trainer.grpo.push_to_hub: the nodes run offline; the trained model is JOB/model"),
    (
        ["trainer.grpo.hub_revision=main"],
        "hub_revision: the nodes run offline; the trained model is JOB/model (or `slurm-grpo export`)",
    ),
    (
        ["trainer.grpo.save_total_limit=2"],
        "trainer.grpo.save_total_limit is set by slurm-grpo itself from trainer.keep_checkpoints",
    ),
    (
        ["trainer.grpo.eval_strategy=steps"],
        "trainer.grpo.eval_strategy is set by slurm-grpo itself from trainer.eval.every_steps",
    ),
    (["trainer.grpo.eval_steps=5"], "from trainer.eval.every_steps"),
    (["trainer.grpo.do_eval=true"], "from trainer.eval.every_steps"),
    (["trainer.grpo.eval_on_start=true"], "from trainer.eval.before_training"),
    (["trainer.grpo.num_generations_eval=4"], "from trainer.eval.samples_per_prompt"),
    (
        ["trainer.grpo.per_device_eval_batch_size=4"],
        "slurm-grpo runs the evaluation itself (on the vLLM servers); set trainer.eval",
    ),
    (["trainer.grpo.eval_dataset=e.jsonl"], "trainer.grpo.eval_dataset is not a trl.GRPOConfig field; set trainer.eval.dataset"),
    (["trainer.grpo.remove_unused_columns=true"], "remove_unused_columns: True is not supported: the rewards read the dataset's"),
    (
        ["trainer.grpo.vllm_max_model_length=4096"],
        "trainer.grpo.vllm_max_model_length is set by slurm-grpo itself from vllm.max_model_len",
    ),
    (["trainer.grpo.auto_find_batch_size=true"], "planned from trainer.per_device_train_batch_size"),
    (
        ["trainer.eval.reward_funcs=[math_acurracy]"],
        "trainer.eval.reward_funcs entry 'math_acurracy' is not a built-in reward; did you mean 'math_accuracy'?",
    ),
    (["trainer.eval.reward_funcs=[nope]"], "trainer.eval.reward_funcs entry 'nope' is not a built-in reward (letter_a_fraction"),
    (["trainer.eval.reward_funcs=['a b:c']"], "trainer.eval.reward_funcs entry 'a b:c' is not a dotted path"),
    (["vllm.extra_args=[--tensor-parallel, '2']"], "'--tensor-parallel' is set by slurm-grpo from vllm.tensor_parallel_size"),
    (["vllm.extra_args=[-ep]"], "'-ep' is set by slurm-grpo from vllm.enable_expert_parallel"),
    (["vllm.extra_args=['--weight-transfer-config.backend=nccl']"], "from vllm.weight_transfer_backend"),
    (
        ["slurm.extra_sbatch={export: NONE}"],
        "slurm.extra_sbatch.export is written by slurm-grpo from the launcher (the job needs",
    ),
    (["slurm.extra_sbatch={cpus-per-gpu: 8}", "slurm.cpus_per_task=16"], "cpus-per-gpu and slurm.cpus_per_task exclude each"),
    (["trainer.grpo.num_train_epochs=3"], "from trainer.max_steps"),
    (["trainer.grpo.fp16=true"], "from trainer.dtype"),
    (["trainer.grpo.deepspeed=ds.json"], "from trainer.fsdp"),
    (["trainer.grpo.use_vllm=false"], "trainer.grpo.use_vllm: slurm-grpo points TRL at its own vLLM server on each node"),
    (["trainer.grpo.vllm_tensor_parallel_size=2"], "is set by slurm-grpo itself from vllm.tensor_parallel_size"),
    (["trainer.grpo.max_steps=3"], "trainer.grpo.max_steps is a trainer key of its own: set trainer.max_steps instead"),
    (["trainer.grpo.loss_type=daop"], "trainer.grpo.loss_type must be one of grpo, dr_grpo, dapo"),
    (["trainer.grpo.epsilon=wide"], "trainer.grpo.epsilon must be float, got 'wide'"),
    (["trainer.grpo.epsilom=0.3"], "trainer.grpo.epsilom is not a trl.GRPOConfig field; did you mean 'epsilon'?"),
    (["slurm.gpus_per_node=3", "trainer.per_device_train_batch_size=3"], "completions per generation (3 per rank x 2 ranks"),
    (["trainer.learnig_rate=1e-6"], "unknown key 'trainer.learnig_rate'; did you mean 'trainer.learning_rate'?"),
    (["trainr.max_steps=3"], "unknown section 'trainr'; did you mean 'trainer'?"),
    (["slurm.container.workdir=work"], "slurm.container.workdir 'work' must be an absolute path"),
    (["slurm.time=00:10:00"], "vllm.health_timeout_s (900) is not below slurm.time (00:10:00 = 600 s)"),
    (["trainer.profile_steps=[3, 40]"], "trainer.profile_steps [3, 40] ends after trainer.max_steps (20)"),
    (["trainer.learning_rate=.nan"], "trainer.learning_rate must be a finite number, got .nan"),
    (["trainer.save_steps=-1"], "trainer.save_steps must be >= 0 (0 = only at the end), got -1"),
    (["trainer.stall_timeout_s=-5"], "trainer.stall_timeout_s must be >= 0 (0 = off), got -5"),
    (["trainer.parity_tolerance=-0.1"], "trainer.parity_tolerance must be >= 0 (0 = by dtype), got -0.1"),
    (["trainer.max_steps=5 # five"], "--set 'trainer.max_steps=5 # five': YAML reads '# five' as a comment and would drop"),
    (["slurm.gpu_memory_gb=.inf"], "slurm.gpu_memory_gb must be a finite number, got .inf"),
    (["trainer.grpo.generation_batch_size=60"], "generation_batch_size (60) must be a multiple of per_device_train_batch_size"),
    (["trainer.grpo={generation_batch_size: 56, steps_per_generation: 2}"], "sets generation_batch_size and steps_per_gen"),
    (["trainer.max_staleness=1", "trainer.grpo.generation_batch_size=112"], "generation_batch_size (112) makes one every 2"),
]


@pytest.mark.parametrize("sets,needle", [b for b in BAD if b[1]], ids=[b[0][-1][:40] for b in BAD if b[1]])
def test_each_bad_input_is_refused_in_one_short_line_with_the_key(sets, needle):
    with pytest.raises(ConfigError) as e:
        cfg = C.load(None, [*BASE, *sets])
        plan(cfg, "/tmp/j")
    msg = str(e.value)
    assert needle in msg and "\n" not in msg and len(msg) <= 200, msg


def test_gradient_accumulation_counts_in_the_completions_per_generation():
    """TRL generates per_device x ranks x steps_per_generation (default: gradient_accumulation_steps) completions at a
    time: 3 x 2 x 4 = 24 is 3 groups of 8, though 3 x 2 = 6 per optimizer step is not."""
    sets = [*BASE, "slurm.gpus_per_node=3", "trainer.per_device_train_batch_size=3"]
    p = plan(C.load(None, [*sets, "trainer.grpo.gradient_accumulation_steps=4"]), "/tmp/j")
    line = next(d for d in p.derivation if d.startswith("completions per step"))
    assert "one generation of 24 completions = 3 prompts x 8 feeds 4 steps" in line, line
    with pytest.raises(ConfigError, match=r"\(3 per rank x 2 ranks x 3 steps_per_generation = 18\) is not a multiple"):
        plan(C.load(None, [*sets, "trainer.grpo.steps_per_generation=3"]), "/tmp/j")


def test_a_key_given_twice_in_a_yaml_file_is_refused_naming_both_lines(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("vllm: {model: /m}\ntrainer:\n  max_steps: 5\n  beta: 0\n  max_steps: 50\n")
    with pytest.raises(ConfigError, match=r"c.yaml': key 'max_steps' is given twice in one mapping \(line 3 and line 5\)"):
        C.load(f)
    f.write_text("vllm: {model: /m}\nslurm: {nodes: 2}\nslurm: {nodes: 4}\n")
    with pytest.raises(ConfigError, match="key 'slurm' is given twice"):
        C.load(f)


def test_allowed_pass_through_still_passes():
    sets = ["slurm.extra_sbatch={reservation: big, gres: 'nvme:1', overcommit: ''}", "vllm.extra_args=[--enforce-eager]"]
    cfg = C.load(None, [*BASE, *sets])
    h = sbatch_header(sbatch_text(cfg, plan(cfg, "/tmp/j")))
    assert h["--reservation"] == "big" and h["--gres"] == "nvme:1" and h["--overcommit"] is None  # '' = a bare flag
    argv = vllm_command(plan(cfg, "/tmp/j"), 0).argv
    assert argv.count("--port") == 1 and argv.count("--host") == 1 and argv[-1] == "--enforce-eager"
    assert C.load(None, [*BASE, "trainer.grpo={loss_type: dr_grpo, epsilon: 0.3, scale_rewards: false}"]).trainer.grpo == {
        "loss_type": "dr_grpo",
        "epsilon": 0.3,
        "scale_rewards": False,
    }


def test_a_setup_var_no_profile_uses_is_refused_with_the_nearest():
    cfg = C.load(None, [*BASE, "slurm.setup_vars.venvv=/v"])
    with pytest.raises(ConfigError, match=r"^slurm.setup_vars.venvv is used by no setup profile; did you mean 'venv'\?$"):
        sbatch_text(cfg, plan(cfg, "/tmp/j"))


def test_a_generation_longer_than_the_request_timeout_is_warned(tmp_path):
    from launcher.simulate import timeout_warning
    from tests.unit.test_memory import QWEN7B

    (tmp_path / "config.json").write_text(json.dumps(QWEN7B))
    sets = [f"vllm.model={tmp_path}", "vllm.max_model_len=9000", "trainer.max_completion_length=8192"]
    cfg = C.load(REPO / "configs/gpu_7b_4nodes.yaml", sets)
    note = timeout_warning(cfg)
    assert note and re.match(
        r"WARNING: one step's generation is predicted at \d+ s .* above trainer.request_timeout_s \(300\)", note
    )
    assert timeout_warning(C.load(REPO / "configs/gpu_7b_4nodes.yaml", [f"vllm.model={tmp_path}"])) is None


def test_the_generation_warning_counts_an_moes_active_parameters_and_a_shared_nodes_ranks(tmp_path):
    """Qwen3-30B-A3B generates at the speed of its 3.35 B active parameters, not its 30.5 B: the warning's prediction
    is the step model's with the active count, for the node's trainer ranks (every GPU's in the shared layout)."""
    from launcher.simulate import DEFAULTS, predict, timeout_warning
    from tests.unit.test_memory import QWEN3_30B_A3B

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    sets = [f"vllm.model={tmp_path}", "vllm.max_model_len=4096", "trainer.max_completion_length=2048"]
    cfg = C.load(REPO / "configs/gpu_7b_4nodes.yaml", sets)
    t, per = cfg.trainer, cfg.slurm.gpus_per_node - 1
    active = predict([1], 30.53, per, t.per_device_train_batch_size, 2048, DEFAULTS, 3.35)[0].ours_gen_s
    total = predict([1], 30.53, per, t.per_device_train_batch_size, 2048, DEFAULTS)[0].ours_gen_s
    assert total > 3 * active  # what counting every expert would predict
    between = int((active + total) / 2)
    assert timeout_warning(C.load(REPO / "configs/gpu_7b_4nodes.yaml", [*sets, f"trainer.request_timeout_s={between}"])) is None
    low = int(active / 2)
    note = timeout_warning(C.load(REPO / "configs/gpu_7b_4nodes.yaml", [*sets, f"trainer.request_timeout_s={low}"]))
    assert note and f"predicted at {active:.0f} s" in note, (note, active)


def test_the_completion_must_fit_the_models_own_context(tmp_path):
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 512}')
    cfg = C.load(None, [f"vllm.model={tmp_path}", "trainer.max_completion_length=512"])
    with pytest.raises(ValueError, match=r"max_completion_length \(512\) leaves no room for the prompt in the model's context"):
        check_context_length(cfg)


def test_grpo_choices_are_trls_own():
    """GRPO_CHOICES against the help text of the pinned TRL's GRPOConfig, read from its source (no torch import)."""
    src = Path(C._package_dir("trl") / "trainer/grpo_config.py").read_text()  # type: ignore[operator]
    cls = next(n for n in ast.parse(src).body if isinstance(n, ast.ClassDef) and n.name == "GRPOConfig")
    helps = {
        n.target.id: ast.unparse(n.value)
        for n in cls.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.value is not None
    }
    for key, values in C.GRPO_CHOICES.items():
        for v in values:
            if isinstance(v, str):
                assert re.search(rf"['`\"]{v}['`\"]", helps[key]), (key, v)
    assert C.grpo_config_annotations()["loss_type"] == "str"  # type: ignore[index]
    assert set(C.GRPO_OWNED) <= set(C.grpo_config_fields() or ())  # each refused key is a real field


def test_a_missing_relative_model_folder_is_a_path_not_a_hub_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    assert looks_local("models/qwen7b") and looks_local("a/b/c") and looks_local("./x")
    assert not looks_local("Qwen/Qwen2.5-7B-Instruct")


def test_cli_set_takes_several_pairs_and_config_reference_prints_keys(capsys, tmp_path):
    a = cli.build_parser().parse_args(
        cli.expand_sets(["dry-run", "c.yaml", "--set", "slurm.nodes=2", "vllm.data_parallel_size=4"])
    )
    assert a.overrides == ["slurm.nodes=2", "vllm.data_parallel_size=4"]
    a = cli.build_parser().parse_args(cli.expand_sets(["resume", "--set", "slurm.nodes=2", "runs/x", "--dry-run"]))
    assert a.overrides == ["slurm.nodes=2"] and a.job == "runs/x" and a.dry_run
    assert cli.main(["config-reference", "trainer.lora"]) == 0
    out = capsys.readouterr().out
    assert "| `lora.r` |" in out and "| `max_steps` |" not in out
    assert cli.main(["config-reference", "slurm"]) == 0 and "| `extra_sbatch` |" in capsys.readouterr().out
    assert cli.main(["config-reference", "trainr"]) == 2
    assert "did you mean 'trainer'" in capsys.readouterr().err


def test_make_tiny_model_help_is_the_builders_own(monkeypatch):
    seen = []
    monkeypatch.setattr(cli, "cmd_make_tiny_model", lambda a: seen.append(a.args) or 0)
    assert cli.main(["make-tiny-model", "--help"]) == 0 and seen == [["--help"]]


def test_simulate_refuses_a_negative_size(capsys):
    from launcher.simulate import main

    for bad in (-7.0, float("nan")):
        with pytest.raises(ConfigError, match="--params-b .*: give the model's parameters in billions"):
            main(argparse.Namespace(params_b=bad, config=None, overrides=[]))


def test_dry_run_runs_the_submit_checks_and_skips_each_kind_on_its_own(tmp_path, capsys):
    sets = ["--set", f"vllm.model={tmp_path / 'nope'}", f"trainer.dataset={tmp_path / 'none.jsonl'}"]
    assert cli.main(["dry-run", "configs/smoke_cpu.yaml", *sets]) == 2
    out, err = capsys.readouterr()
    assert re.search(r"  model +PROBLEM", out) and re.search(r"  data +PROBLEM", out) and re.search(r"  rewards +ok", out)
    assert "--skip-checks model,data" in err and len(err.strip().splitlines()) == 1
    assert cli.main(["dry-run", "configs/smoke_cpu.yaml", *sets, "--skip-checks", "model"]) == 2
    out, err = capsys.readouterr()
    assert re.search(r"  model +skipped", out) and "--skip-checks data" in err
    assert cli.main(["dry-run", "configs/smoke_cpu.yaml", *sets, "--skip-checks", "model,data"]) == 0
    assert cli.main(["dry-run", "configs/smoke_cpu.yaml", *sets, "--skip-checks", "modle"]) == 2
    assert "did you mean 'model'" in capsys.readouterr().err


def test_a_home_path_is_expanded_once_so_the_node_commands_and_the_trainer_load_it(tmp_path, tiny_model, monkeypatch):
    """`~` in a path key is expanded where the config is built: the plan checks, the vLLM command (quoted: no shell
    would expand it) and the trainer's from_pretrained all see the one path; a hub name is left as it is."""
    from transformers import AutoTokenizer

    home = tmp_path / "home"
    home.mkdir()
    (home / "tinylink").symlink_to(tiny_model)
    (home / "letters.jsonl").write_text((REPO / "data/letters.jsonl").read_text())
    sets = ["vllm.model=~/tinylink", "trainer.dataset=~/letters.jsonl", f"job.job_dir={tmp_path / 'job'}"]
    r = cli_run("dry-run", "configs/smoke_cpu.yaml", *[x for s in sets for x in ("--set", s)], env={"HOME": str(home)})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr
    assert f"--model {home / 'tinylink'} " in r.stdout and "~/" not in r.stdout
    monkeypatch.setenv("HOME", str(home))
    cfg = C.load(REPO / "configs/smoke_cpu.yaml", [*sets, "trainer.eval.dataset=~/letters.jsonl"])
    p = plan(cfg, str(tmp_path / "job"))
    argv = vllm_command(p, 0).argv
    assert argv[argv.index("--model") + 1] == str(home / "tinylink")
    rebuilt = C.rebuild(json.loads(json.dumps(C.to_dict(p.config))))  # what the ranks read from plan.json
    assert (rebuilt.vllm.model, rebuilt.trainer.dataset, rebuilt.trainer.eval.dataset) == (
        str(home / "tinylink"),
        str(home / "letters.jsonl"),
        str(home / "letters.jsonl"),
    )
    assert AutoTokenizer.from_pretrained(rebuilt.vllm.model).vocab_size > 0  # trainer/run.py's own first load
    other = C.load(
        None,
        ["vllm.model=Qwen/Qwen2.5-0.5B", "job.job_dir=~/j", "slurm.container.image=~/c.sif", "slurm.container.mounts=[~/d:/d]"]
        + ["trainer.chat_template=~{{ messages }}", "trainer.system_prompt=~/not a path"],
    )
    assert other.vllm.model == "Qwen/Qwen2.5-0.5B" and other.job.job_dir == str(home / "j")
    assert other.slurm.container.image == str(home / "c.sif") and other.slurm.container.mounts == [f"{home}/d:/d"]
    assert other.trainer.chat_template == "~{{ messages }}" and other.trainer.system_prompt == "~/not a path"


@pytest.mark.parametrize(
    "value, stored",
    [
        ("Reason, then end with #### and the number.", "Reason, then end with #### and the number."),
        ("Format: think first", "Format: think first"),
        ("'Answer: #### N'", "Answer: #### N"),  # quoted as YAML: unquoted as YAML would
        ('"Think.\\nThen answer."', "Think.\nThen answer."),
        ("'it''s'", "it's"),
        ('"a" and "b"', '"a" and "b"'),  # quotes inside the text, not around it
        ("yes", "yes"),
    ],
)
def test_a_text_key_set_on_the_command_line_keeps_its_text(value, stored):
    assert C.load(None, [*BASE, f"trainer.system_prompt={value}"]).trainer.system_prompt == stored


def test_yaml_that_reads_text_as_a_mapping_or_a_comment_says_to_quote():
    with pytest.raises(ConfigError, match=r"^trainer.system_prompt must be a string, but YAML read a mapping .*quote the"):
        C.from_dict(C.read_yaml("vllm: {model: /m}\ntrainer:\n  system_prompt: {Format: think first}\n"))
    with pytest.raises(ConfigError, match=r"^vllm.extra_args\[1\] must be a string, but YAML read a mapping .*quote"):
        C.load(None, [*BASE, "vllm.extra_args=[--x, a: b]"])
    with pytest.raises(ConfigError, match=r"YAML reads '# b' as a comment and would drop it; quote the text"):
        C.load(None, [*BASE, "vllm.extra_args=[--stop, a] # b"])
    with pytest.raises(ConfigError, match=r"^slurm.qos is false to YAML .*quote it"):  # a file is YAML throughout
        header(text="slurm:\n  qos: no\n")
    assert header("slurm.qos=no")["--qos"] == "no"  # on the command line a text key takes the text
