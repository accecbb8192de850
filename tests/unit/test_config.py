"""Config: precedence, strict keys, and a table of bad configs, each a one-line error with the fix."""

from __future__ import annotations

import dataclasses
import json
import os
import typing
from pathlib import Path

import pytest
import yaml

from launcher.core import config as C
from launcher.core.config import ConfigError
from launcher.core.jobdir import make_plan
from launcher.core.plan import plan
from launcher.node.commands import vllm_command
from tests.conftest import REPO, cli

BASE = {"vllm": {"model": "/models/m"}, "slurm": {"gpus_per_node": 4}}
SLURM_COMMANDS = ("sbatch", "srun", "scontrol", "squeue", "sacct", "scancel", "sinfo")


@pytest.fixture
def fake_slurm(tmp_path: Path) -> tuple[dict, Path]:
    """Every SLURM command as a fake on PATH (before the real ones, if any) that records its call and fails: the
    tests that must submit nothing assert the calls file never appeared."""
    bin_dir, calls = tmp_path / "fake-slurm-bin", tmp_path / "slurm-calls"
    bin_dir.mkdir()
    for name in SLURM_COMMANDS:
        (bin_dir / name).write_text(f'#!/bin/sh\necho "{name} $*" >> "{calls}"\nexit 1\n')
        (bin_dir / name).chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}, calls


def test_defaults_yaml_then_set_precedence(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump({**BASE, "trainer": {"max_steps": 7, "learning_rate": 1e-4}}))
    cfg = C.load(f, ["trainer.max_steps=9", "slurm.nodes=3"])
    assert cfg.trainer.max_steps == 9  # --set beats YAML
    assert cfg.trainer.learning_rate == 1e-4  # YAML beats default
    assert cfg.trainer.beta == 0.0  # default
    assert cfg.slurm.nodes == 3


def test_scientific_notation_is_a_number_as_written_in_yaml_and_set(tmp_path):
    # PyYAML reads 1e-5 (no dot) as the string "1e-5"; a float field takes it as the number it means
    f = tmp_path / "c.yaml"
    f.write_text("vllm: {model: /models/m}\nslurm: {gpus_per_node: 4}\ntrainer: {learning_rate: 1e-5}\n")
    assert C.load(f, []).trainer.learning_rate == 1e-5
    assert C.load(f, ["trainer.learning_rate=3E-4"]).trainer.learning_rate == 3e-4
    with pytest.raises(ConfigError, match="must be a number"):
        C.load(f, ["trainer.learning_rate=fast"])


def test_unknown_key_names_the_nearest_and_where_the_list_is():
    with pytest.raises(ConfigError) as e:
        C.from_dict({**BASE, "trainer": {"learnig_rate": 1e-6}})
    assert str(e.value) == "unknown key 'trainer.learnig_rate'; did you mean 'trainer.learning_rate'?"
    with pytest.raises(ConfigError) as e:
        C.from_dict({**BASE, "vllm": {"model": "m", "tpsize": 2}})  # nothing near: the command with the full list
    assert str(e.value) == "unknown key 'vllm.tpsize'; keys of vllm: slurm-grpo config-reference vllm"
    # another library's name for a key (peft's rank, vLLM's tp, TRL's lr) names ours
    for where, key, ours in (("vllm", "tp", "tensor_parallel_size"), ("trainer", "lr", "learning_rate")):
        with pytest.raises(ConfigError, match=f"unknown key '{where}.{key}'; did you mean '{where}.{ours}'"):
            C.load(None, ["vllm.model=/m", f"{where}.{key}=1"])
    with pytest.raises(ConfigError, match="did you mean 'trainer.lora.r'"):
        C.load(None, ["vllm.model=/m", "trainer.lora.rank=8"])
    with pytest.raises(ConfigError, match="unknown key 'slurm.container.imag'; did you mean 'slurm.container.image'"):
        C.load(None, ["vllm.model=/m", "slurm.container.imag=x"])


def test_every_field_documented():
    for cls in C.SECTIONS.values():
        docs = C.field_docs(cls)
        missing = [f for f in cls.__dataclass_fields__ if f not in docs]
        assert not missing, f"{cls.__name__} fields without a docstring: {missing}"


def _with(section: str, **kw):
    raw = {k: dict(v) for k, v in BASE.items()}  # type: ignore[call-overload]
    raw.setdefault(section, {}).update(kw)
    return raw


BAD = [
    ({"vllm": {}}, "vllm.model is required"),
    ({"nope": {}}, "unknown section 'nope'"),
    (_with("slurm", node=2), "unknown key 'slurm.node'"),
    (_with("slurm", nodes=0), "slurm.nodes must be positive"),
    (_with("slurm", nodes=-3), "slurm.nodes must be positive"),
    (_with("slurm", nodes="two"), "slurm.nodes must be an integer"),
    (_with("slurm", nodes=2.5), "slurm.nodes must be an integer"),
    (_with("slurm", gpus_per_node="8"), "slurm.gpus_per_node must be an integer, got the string '8': write 8 unquoted"),
    (_with("slurm", gpus_per_node=0), "slurm.gpus_per_node must be positive"),
    (_with("slurm", time="1 hour"), "not a SLURM time"),
    (_with("slurm", time="10:7"), "not a SLURM time"),
    (_with("slurm", exclusive="yes"), "slurm.exclusive must be true or false"),
    (_with("slurm", setup_profile="../etc/passwd"), "slurm.setup_profile"),
    (_with("slurm", extra_sbatch={"--mail": "x"}), "sbatch flag name without the dashes"),
    (_with("slurm", extra_sbatch=["a"]), "must be a mapping"),
    (_with("slurm", cpus_per_task=-1), "slurm.cpus_per_task"),
    (_with("slurm", signal_seconds=99999), "slurm.signal_seconds"),
    (_with("vllm", tensor_parallel_size=4), "leaves no trainer GPU on a 4-GPU node"),
    (_with("vllm", tensor_parallel_size=0), "vllm.tensor_parallel_size must be positive"),
    (_with("slurm", container={"image": "x.sif", "runtime": "docker"}), "must be pyxis (srun --container-image) or apptainer"),
    (_with("slurm", container={"image": "x.sif", "mounts": ["/data"]}), "entry '/data' must be SRC:DST or SRC:DST:ro"),
    (_with("slurm", container={"mounts": ["/a:/a"]}), "no image; set slurm.container.image"),
    (_with("slurm", container={"imag": "x"}), "unknown key 'slurm.container.imag'"),
    (_with("vllm", gpu_memory_utilization=1.5), "gpu_memory_utilization must be in (0, 1]"),
    (_with("vllm", dtype="fp8"), "vllm.dtype"),
    (_with("vllm", port=80), "ports below 1024 need root"),
    (_with("vllm", port=29500), "both 29500"),
    (_with("vllm", weight_transfer_backend="rdma"), "weight_transfer_backend"),
    (_with("vllm", health_timeout_s=0), "health_timeout_s must be positive"),
    (_with("trainer", num_generations=1), "at least 2"),
    (_with("trainer", max_steps=0), "trainer.max_steps must be positive"),
    (_with("trainer", learning_rate=-1.0), "learning_rate must be positive"),
    (_with("trainer", reward_funcs=[]), "reward_funcs is empty"),
    (_with("trainer", reward_funcs=["pkg.mod:"]), "not a dotted path"),
    (_with("trainer", reward_funcs=["not a name"]), "is not a built-in reward"),
    # NEWCOMER §4: an unknown built-in name passed dry-run and submit
    (_with("trainer", reward_funcs=["accuracy_reward"]), "'accuracy_reward' is not a built-in reward (letter_a_fraction"),
    (_with("trainer", columns={"my prompt": "question"}), "trainer.columns 'my prompt'"),
    (_with("trainer", columns={"prompt": "q", "solution": "q"}), "maps one dataset column to two names"),
    (_with("trainer", chat_template="  "), "trainer.chat_template is blank"),
    (_with("trainer", dtype="int8"), "trainer.dtype"),
    (_with("trainer", fsdp="ddp"), "trainer.fsdp"),
    (_with("trainer", parity_action="ignore"), "parity_action"),
    (_with("trainer", request_timeout_s=0), "every wait needs a deadline"),
    (_with("trainer", grpo={"use_vllm": False}), "slurm-grpo points TRL at its own vLLM server on each node"),
    (_with("trainer", grpo={"learning_rat": 1}), "not a trl.GRPOConfig field"),
    (_with("trainer", dataset=""), "trainer.dataset is required"),
    (_with("job", name="my job"), "job.name"),
    (_with("job", name="x$(rm -rf ~)"), "job.name"),
    (_with("job", name="a\nb"), "job.name"),
    (_with("job", name="it's"), "job.name"),
    (_with("job", job_dir="/tmp/a\nb"), "newline"),
    (_with("job", device="tpu"), "job.device"),
    ({**_with("job", device="cpu"), "trainer": {"dtype": "bfloat16"}}, "float32 with job.device cpu"),
]


@pytest.mark.parametrize("raw,needle", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_config(raw, needle):
    with pytest.raises(ConfigError) as e:
        C.from_dict(raw)
    msg = str(e.value)
    assert needle in msg, msg
    assert "\n" not in msg, "errors must be one line"


CHOICE_ERRORS = [
    ("slurm", {"container": {"image": "x.sif", "runtime": "docker"}},
     "slurm.container.runtime 'docker' must be pyxis (srun --container-image) or apptainer"),
    ("slurm", {"layout": "mixed"}, "slurm.layout 'mixed' must be split or shared"),
    ("slurm", {"node_loss_action": "now"}, "slurm.node_loss_action 'now' must be auto (cancel without slurm.requeue, else "
     "SLURM's own requeue), requeue_now (requeue without the lost nodes) or wait"),
    ("vllm", {"dtype": "fp8"}, "vllm.dtype 'fp8' must be one of auto, bfloat16, float32"),
    ("vllm", {"weight_transfer_backend": "rdma"}, "vllm.weight_transfer_backend 'rdma' must be auto, nccl, gloo or ipc"),
    ("vllm", {"engine_start": "forkserver"}, "vllm.engine_start 'forkserver' must be auto, fork or spawn"),
    ("vllm", {"kv_cache": "auto"}, "vllm.kv_cache 'auto' must be work (every sequence in flight, no profiling) or measure (vLLM's profile)"),
    ("trainer", {"dtype": "int8"}, "trainer.dtype 'int8' must be bfloat16 or float32"),
    ("trainer", {"fsdp": "ddp"}, "trainer.fsdp 'ddp' must be hsdp (shard in a node, replicate across nodes) or fsdp"),
    ("trainer", {"model_loading": "lazy"}, "trainer.model_loading 'lazy' must be sharded (each rank reads its shard) or full"),
    ("trainer", {"report_to": ["wandb", "mlflow", "comet"]},
     "trainer.report_to entry 'comet' must be wandb, tensorboard or none, e.g. [wandb, tensorboard]"),
    ("trainer", {"wandb_mode": "cloud"}, "trainer.wandb_mode 'cloud' must be offline (then `slurm-grpo sync JOB`), online or disabled"),
    ("trainer", {"parity_action": "ignore"}, "trainer.parity_action 'ignore' must be fail or warn"),
    ("job", {"device": "tpu"}, "job.device 'tpu' must be cuda or cpu"),
    ("job", {"platform": "metal"}, "job.platform 'metal' must be cuda or rocm"),
    ("trainer", {"lora": {"r": 8, "push": "fast"}},
     "trainer.lora.push 'fast' must be auto, adapter (only the adapter moves) or merged (base + adapter, full weights)"),
    ("trainer", {"lora": {"r": 8, "adapter_transport": "http"}},
     "trainer.lora.adapter_transport 'http' must be engine (the weight-transfer engine, no file) or disk (a peft folder per push)"),
    ("trainer", {"dtype": 16}, "trainer.dtype '16' must be bfloat16 or float32"),
]  # fmt: skip


@pytest.mark.parametrize("section,values,message", CHOICE_ERRORS, ids=[m.split(" ")[0] for _, _, m in CHOICE_ERRORS])
def test_a_value_off_a_choice_fields_menu_is_refused_naming_the_menu(section, values, message):
    with pytest.raises(ConfigError) as e:
        C.from_dict(_with(section, **values))
    assert str(e.value) == message


def _choice_fields(cls: type, where: str) -> dict[str, typing.Any]:
    out: dict[str, typing.Any] = {}
    for name, ann in typing.get_type_hints(cls).items():
        if isinstance(ann, type) and dataclasses.is_dataclass(ann):
            out.update(_choice_fields(ann, f"{where}.{name}"))
        elif C.choices(ann):
            out[f"{where}.{name}"] = ann
    return out


CHOICE_FIELDS = {k: v for name, cls in C.SECTIONS.items() for k, v in _choice_fields(cls, name).items()}


def test_every_choice_field_is_a_literal_with_its_error_pinned_and_its_menu_naming_only_its_values():
    assert sorted(CHOICE_FIELDS) == sorted(m.split(" ")[0] for _, _, m in CHOICE_ERRORS[:-1])
    for key, menu in C.MENUS.items():
        assert key in CHOICE_FIELDS, f"MENUS names {key}, which is not a choice field"
        assert set(menu.notes) <= set(C.choices(CHOICE_FIELDS[key])), f"{key}: a note for a value it does not have"


def _value(cfg: C.JobConfig, key: str) -> typing.Any:
    value: typing.Any = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


# a value that another key must agree with (check_job's rules), set beside it
NEEDS = {
    ("vllm.weight_transfer_backend", "ipc"): ("slurm.gpus_per_node", 1),
    ("job.device", "cpu"): ("trainer.dtype", "float32"),
    ("vllm.dtype", "float32"): ("trainer.dtype", "float32"),
}


def test_every_choice_fields_default_is_on_its_menu_and_every_value_is_accepted():
    defaults = C.JobConfig()
    for key, ann in CHOICE_FIELDS.items():
        many = typing.get_origin(ann) is list
        assert set(_value(defaults, key) if many else [_value(defaults, key)]) <= set(C.choices(ann)), key
        for value in C.choices(ann):
            given = [value] if many else value
            raw = _raw_with(key, given)
            if (key, value) in NEEDS:
                other, v = NEEDS[key, value]
                section, name = other.split(".")
                raw.setdefault(section, {})[name] = v
            assert _value(C.from_dict(raw), key) == given


def test_the_reference_lists_each_choice_fields_values_from_its_literal():
    tables = dict(zip(C.SECTIONS, C.reference_markdown().split("**`")[1:]))
    for key, ann in CHOICE_FIELDS.items():
        section, rest = key.split(".", 1)
        row = next(line for line in tables[section].splitlines() if line.startswith(f"| `{rest}` |"))
        lead = "Any of " if typing.get_origin(ann) is list else "One of "
        assert f"| {lead}" + ", ".join(f"`{c}`" for c in C.choices(ann)) + ". " in row, row


def test_max_staleness_bound_is_the_trainers():
    assert C.TrainerConfig.MAX_STALENESS == 4
    assert "MAX_STALENESS" not in {f.name for f in dataclasses.fields(C.TrainerConfig)}  # a bound, not a key
    C.from_dict(_with("trainer", max_staleness=C.TrainerConfig.MAX_STALENESS))
    with pytest.raises(ConfigError, match=r"^trainer.max_staleness must be 0 \(synchronous\) to 4 \(steps off\), got 5; "):
        C.from_dict(_with("trainer", max_staleness=5))
    with pytest.raises(ConfigError, match="unknown key 'trainer.MAX_STALENESS'"):
        C.load(None, ["vllm.model=/m", "trainer.MAX_STALENESS=9"])


def test_extra_args_as_one_string_is_a_one_item_list_that_ends_the_server_command():
    cfg = C.from_dict(_with("vllm", extra_args="--x"))
    assert cfg.vllm.extra_args == ["--x"]
    assert vllm_command(plan(cfg, "/j"), 0).argv[-1:] == ["--x"]
    cfg = C.from_dict(_with("vllm", extra_args=["--enforce-eager", "--max-num-seqs", "64"]))
    assert vllm_command(plan(cfg, "/j"), 0).argv[-3:] == ["--enforce-eager", "--max-num-seqs", "64"]


@pytest.mark.parametrize("device,want", [("cpu", "3"), ("cuda", None)])
def test_cpu_kvcache_gib_is_the_cpu_servers_kv_cache_space(device, want):
    raw = _with("vllm", cpu_kvcache_gib=3)
    raw["job"] = {"device": device}
    raw["trainer"] = {"dtype": "float32"}
    env = vllm_command(plan(C.from_dict(raw), "/j"), 0).env
    assert env.get("VLLM_CPU_KVCACHE_SPACE") == want


def test_a_secret_flag_in_extra_args_is_hidden_where_the_config_is_shown_and_kept_where_it_is_stored():
    cfg = C.from_dict(_with("vllm", extra_args=["--hf-token", "hf_SECRET", "--api-key=k3y", "--enforce-eager"]))
    shown = yaml.safe_load(C.to_yaml(cfg, redact=True))["vllm"]["extra_args"]
    assert shown == ["--hf-token", "***", "--api-key=***", "--enforce-eager"]
    assert yaml.safe_load(C.to_yaml(cfg))["vllm"]["extra_args"] == list(cfg.vllm.extra_args)  # the job folder's copy


# ----------------------------------------------------------------------------- control characters (issue 23 item 7)

FIX = "config values reach the sbatch header and command lines, remove it"


def _string_fields(cls: type, where: str) -> list[tuple[str, typing.Any]]:
    """(key, annotation) of every field that holds text, nested groups included: each gets its own newline case, so a
    field added later is covered without touching the test."""
    out: list[tuple[str, typing.Any]] = []
    for name, ann in typing.get_type_hints(cls).items():
        key = f"{where}.{name}"
        if key in C.PASSED_AS_DATA:
            continue
        if isinstance(ann, type) and dataclasses.is_dataclass(ann):
            out += _string_fields(ann, key)
        elif ann is str or typing.get_origin(ann) in (dict, typing.Literal) or typing.get_args(ann) == (str,):
            out.append((key, ann))
    return out


STRING_FIELDS = [kv for name, cls in C.SECTIONS.items() for kv in _string_fields(cls, name)]


def _raw_with(key: str, value: typing.Any) -> dict:
    """BASE with one (possibly nested) key set."""
    raw = json.loads(json.dumps(BASE))
    node = raw
    *groups, last = key.split(".")
    for g in groups:
        node = node.setdefault(g, {})
    node[last] = value
    return raw


def test_the_newline_table_covers_every_value_the_sbatch_text_is_made_of():
    keys = {k for k, _ in STRING_FIELDS}
    header = {"slurm.partition", "slurm.account", "slurm.qos", "slurm.constraint", "slurm.mem", "slurm.time"}
    lines = {"slurm.extra_sbatch", "slurm.setup_vars", "slurm.container.image", "slurm.container.mounts"}
    commands = {"slurm.container.workdir", "vllm.model", "vllm.extra_args", "job.name", "job.job_dir", "job.python"}
    assert header | lines | commands <= keys


@pytest.mark.parametrize("key,ann", STRING_FIELDS, ids=[k for k, _ in STRING_FIELDS])
def test_a_newline_in_any_value_is_refused_naming_its_key(key, ann):
    injected = "acme\necho INJECTED-RAN\n#"
    if ann is str or typing.get_origin(ann) is typing.Literal:
        value, where = injected, key
    elif typing.get_origin(ann) is list:
        value, where = ["ok", injected], f"{key}[1]"
    else:
        value, where = {"reservation": injected}, f"{key}.reservation"
    with pytest.raises(ConfigError) as e:
        C.from_dict(_raw_with(key, value))
    assert str(e.value) == f"{where}: contains a newline (\\n); {FIX}"


@pytest.mark.parametrize("key", ["slurm.extra_sbatch", "slurm.setup_vars"])
def test_a_newline_in_a_mapping_key_is_refused_naming_the_mapping(key):
    with pytest.raises(ConfigError) as e:
        C.from_dict(_raw_with(key, {"a\nb": "x"}))
    assert str(e.value) == f"{key} key 'a\\nb': contains a newline (\\n); {FIX}"


@pytest.mark.parametrize(
    "char,named",
    [
        ("\r", "a carriage return (\\r)"),
        ("\x00", "a NUL character (\\0)"),
        ("\t", "a tab (\\t)"),
        ("\x1b", "a control character (\\x1b)"),
        ("\x7f", "a control character (\\x7f)"),
    ],
)
def test_every_control_character_is_refused(char, named):
    with pytest.raises(ConfigError) as e:
        C.from_dict(_with("slurm", account=f"acme{char}x"))
    assert str(e.value) == f"slurm.account: contains {named}; {FIX}"


def test_trl_passthrough_values_may_hold_a_newline_as_data():
    # trainer.grpo goes to trl.GRPOConfig through plan.json, never onto a command line: a stop string is a newline
    cfg = C.from_dict(_with("trainer", grpo={"generation_kwargs": {"stop": ["\n"]}}))
    assert cfg.trainer.grpo["generation_kwargs"]["stop"] == ["\n"]


def test_a_newline_given_with_set_is_refused_before_anything_is_submitted(fake_slurm):
    env, calls = fake_slurm
    r = cli("submit", "configs/gpu_1node.yaml", "--set", 'slurm.account="acme\\necho INJECTED-RAN\\n#"', env=env)
    assert r.returncode != 0
    assert r.stderr.strip().splitlines() == [f"slurm-grpo submit: error: slurm.account: contains a newline (\\n); {FIX}"]
    assert "INJECTED" not in r.stdout and not calls.exists()


# ----------------------------------------------------------------------------- dotted --set keys (issue 23 item 4)


def _nested_groups() -> list[str]:
    """Every key that holds keys of its own (a nested dataclass or a mapping)."""
    out = []
    for name, cls in C.SECTIONS.items():
        for f, ann in typing.get_type_hints(cls).items():
            if (isinstance(ann, type) and dataclasses.is_dataclass(ann)) or typing.get_origin(ann) is dict:
                out.append(f"{name}.{f}")
    return out


def test_the_nested_groups_are_the_ones_the_dotted_set_tests_cover():
    assert sorted(_nested_groups()) == [
        "slurm.container",
        "slurm.extra_sbatch",
        "slurm.setup_vars",
        "trainer.columns",
        "trainer.eval",
        "trainer.grpo",
        "trainer.lora",
    ]


def test_a_dotted_set_reaches_into_every_nested_group_and_keeps_its_other_keys(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(
        yaml.safe_dump(
            {
                **BASE,
                "slurm": {
                    "gpus_per_node": 4,
                    "container": {"image": "old.sqsh", "mounts": ["/shared:/shared"]},
                    "setup_vars": {"venv": "/v", "modules": "cuda"},
                    "extra_sbatch": {"reservation": "big"},
                },
                "trainer": {
                    "grpo": {"loss_type": "dapo"},
                    "lora": {"r": 8, "dropout": 0.1},
                    "columns": {"prompt": "question"},
                    "eval": {"dataset": "e.jsonl"},
                },
            }
        )
    )
    cfg = C.load(
        f,
        [
            "slurm.container.image=nvcr.io#nvidia/pytorch:25.01-py3",
            "slurm.container.workdir=/w",
            "slurm.setup_vars.venv=/other",
            "slurm.extra_sbatch.comment=hello",
            "trainer.grpo.epsilon=0.3",
            "trainer.grpo.generation_kwargs.top_k=5",
            "trainer.lora.r=16",
            "trainer.columns.solution=answer",
            "trainer.eval.every_steps=5",
        ],
    )
    assert cfg.trainer.columns == {"prompt": "question", "solution": "answer"}
    assert (cfg.trainer.lora.r, cfg.trainer.lora.dropout) == (16, 0.1)
    assert (cfg.trainer.eval.dataset, cfg.trainer.eval.every_steps) == ("e.jsonl", 5)
    c = cfg.slurm.container
    assert (c.image, c.workdir, c.mounts, c.runtime) == ("nvcr.io#nvidia/pytorch:25.01-py3", "/w", ["/shared:/shared"], "pyxis")
    assert cfg.slurm.setup_vars == {"venv": "/other", "modules": "cuda"}
    assert cfg.slurm.extra_sbatch == {"reservation": "big", "comment": "hello"}
    assert cfg.trainer.grpo == {"loss_type": "dapo", "epsilon": 0.3, "generation_kwargs": {"top_k": 5}}
    # the same as the mapping form, from the defaults
    assert (
        C.load(f, ["slurm.container={image: x.sif, runtime: apptainer}"]).slurm.container
        == C.load(f, ["slurm.container={}", "slurm.container.image=x.sif", "slurm.container.runtime=apptainer"]).slurm.container
    )
    # the file's own mappings are not changed by an override
    assert C.load(f).slurm.setup_vars == {"venv": "/v", "modules": "cuda"}


@pytest.mark.parametrize(
    "override,needle",
    [
        (
            "slurm.container.imag=x",
            "unknown key 'slurm.container.imag'; did you mean 'slurm.container.image'?",
        ),
        ("slurm.contaner.image=x", "unknown key 'slurm.contaner'; did you mean 'slurm.container'?"),
        ("slurm.nodes.count=2", "slurm.nodes is a single value, not a group of keys; set it as --set slurm.nodes=VALUE"),
        ("slurm.setup_vars.venv.x=1", "slurm.setup_vars.venv is a single value, not a group of keys"),
        ("slurm.container.image.tag=1", "slurm.container.image is a single value, not a group of keys"),
        ("slurm..image=x", "must be section.key (or section.group.key)"),
        ("slurm.container.runtime=docker", "must be pyxis (srun --container-image) or apptainer"),
    ],
)
def test_a_bad_dotted_set_is_a_one_line_error_naming_the_valid_keys(override, needle):
    with pytest.raises(ConfigError) as e:
        C.load(REPO / "configs/gpu_1node.yaml", [override])
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_sweep_grid_varies_a_key_inside_a_nested_group():
    from launcher.sweep import grid_points, parse_grid

    points = grid_points(parse_grid(["trainer.grpo.epsilon=0.2,0.3"]))
    assert [C.load(REPO / "configs/gpu_1node.yaml", pt).trainer.grpo["epsilon"] for pt in points] == [0.2, 0.3]


def test_a_dotted_set_into_a_group_the_file_holds_as_a_plain_value_is_refused(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump({**BASE, "trainer": {"grpo": {"generation_kwargs": "greedy"}}}))
    with pytest.raises(ConfigError, match=r"trainer.grpo.generation_kwargs is 'greedy' in the config, not a mapping"):
        C.load(f, ["trainer.grpo.generation_kwargs.top_k=5"])


PLAN_BAD = [
    (_with("trainer", per_device_train_batch_size=3, num_generations=8), "not a multiple of trainer.num_generations"),
    ({**_with("slurm", gpus_per_node=1), "job": {"device": "cpu"}, "trainer": {"dtype": "float32"}}, "leaves no slot"),
    ({**_with("slurm", gpus_per_node=1), "vllm": {"model": "m", "weight_transfer_backend": "nccl"}}, "NCCL refuses"),
    (_with("vllm", weight_transfer_backend="ipc"), "ipc needs vLLM and the trainer on the same GPU"),
]


@pytest.mark.parametrize("raw,needle", PLAN_BAD)
def test_bad_plan(raw, needle):
    with pytest.raises(ConfigError) as e:
        make_plan(C.from_dict(raw))
    assert needle in str(e.value)


def test_tp_must_divide_heads(tmp_path):
    shape = {"hidden_size": 384, "num_hidden_layers": 2, "intermediate_size": 768, "vocab_size": 300}
    (tmp_path / "config.json").write_text(json.dumps({**shape, "num_attention_heads": 6, "num_key_value_heads": 2}))
    cfg = C.from_dict({"vllm": {"model": str(tmp_path), "tensor_parallel_size": 4}, "slurm": {"gpus_per_node": 8}})
    with pytest.raises(ConfigError, match="does not divide the model's 6 attention heads"):
        make_plan(cfg)


@pytest.mark.parametrize(
    "args,needle",
    [
        (["dry-run", "configs/does-not-exist.yaml"], "not found"),
        (["dry-run", "configs/smoke_cpu.yaml", "--set", "trainer.max_staleness=5"], "must be 0 (synchronous) to 4"),
        (
            [
                "dry-run",
                "configs/smoke_cpu.yaml",
                "--set",
                "trainer.max_staleness=1",
                "--set",
                "trainer.grpo={steps_per_generation: 2}",
            ],
            "one generation per optimizer step: set steps_per_generation",
        ),
        (["dry-run", "configs/smoke_cpu.yaml", "--set", "slurm.nodes=0"], "slurm.nodes must be positive"),
        (["dry-run", "configs/smoke_cpu.yaml", "--set", "trainer.maxsteps=3"], "unknown key 'trainer.maxsteps'"),
        (["dry-run", "configs/smoke_cpu.yaml", "--set", "noequals"], "not of the form"),
        (["submit", "configs/smoke_cpu.yaml", "--set", "job.name=a b"], "job.name"),
        (
            ["submit", "configs/smoke_cpu.yaml", "--set", "job.emulate_gpus=true", "job.job_dir=/nonexistent/emu"],
            "job.emulate_gpus lays a cluster out on this machine's one GPU, for tests; SLURM cannot run it",
        ),
        (["status", "/nonexistent/job"], "neither a job folder"),
    ],
)
def test_cli_errors_are_one_line_and_submit_nothing(args, needle, fake_slurm):
    env, calls = fake_slurm
    r = cli(*args, env=env)
    assert r.returncode != 0
    err = r.stderr.strip()
    assert needle in err and len(err.splitlines()) == 1, err
    assert "Traceback" not in r.stderr
    assert not calls.exists(), f"a SLURM command was called: {calls.read_text()}"


def test_readme_config_reference_is_current():

    readme = (REPO / "README.md").read_text()
    assert C.reference_markdown() in readme, (
        "README's config reference is stale; regenerate it with python scripts/config_reference.py"
    )


def test_base_files_deep_merge_in_order_and_the_job_folder_gets_the_flat_result(tmp_path):
    """`base:` (one path or a list, relative to the file) deep-merges under the file's own keys, later bases over
    earlier ones; dry-run's resolved config has no base: left; a cycle or a missing base is a one-line error."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "cluster.yaml").write_text(
        "slurm: {partition: gpu, gpus_per_node: 8, setup_vars: {venv: /v, modules: cuda}}\ntrainer: {grpo: {loss_type: dapo, epsilon: 0.2}}\n"
    )
    (tmp_path / "model.yaml").write_text("vllm: {model: /m, dtype: bfloat16}\nslurm: {partition: big}\n")
    (tmp_path / "job.yaml").write_text(
        "base: [site/cluster.yaml, model.yaml]\nslurm: {nodes: 4, setup_vars: {modules: ''}}\ntrainer: {grpo: {epsilon: 0.3}}\n"
    )
    cfg = C.load(tmp_path / "job.yaml", ["slurm.time=01:00:00"])
    assert cfg.slurm.partition == "big"  # the later base wins over the earlier
    assert cfg.slurm.nodes == 4 and cfg.slurm.gpus_per_node == 8 and cfg.vllm.model == "/m"
    assert cfg.slurm.setup_vars == {"venv": "/v", "modules": ""}  # mappings merge key by key
    assert cfg.trainer.grpo == {"loss_type": "dapo", "epsilon": 0.3}
    assert cfg.slurm.time == "01:00:00"  # --set still comes last
    r = cli("dry-run", str(tmp_path / "job.yaml"), "--skip-checks", "all")
    assert r.returncode == 0, r.stderr
    resolved = r.stdout.split("# resolved config")[1].split("# per-node commands")[0]
    assert "base" not in resolved and "partition: big" in resolved and "loss_type: dapo" in resolved
    # ... and before it, only what the files changed: the bases' and the job file's settings alike
    mine = r.stdout.split("# settings not at their defaults")[1].split("# resolved config")[0].splitlines()[1:]
    assert [ln for ln in mine if ln] == [
        '  slurm.partition: "big"',
        "  slurm.nodes: 4",
        '  slurm.setup_vars: {"venv": "/v", "modules": ""}',  # gpus_per_node 8 is the default: not shown
        '  vllm.model: "/m"',
        '  vllm.dtype: "bfloat16"',
        '  trainer.grpo: {"loss_type": "dapo", "epsilon": 0.3}',
    ], mine

    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(ConfigError, match=r"config base cycle: .*a.yaml -> .*b.yaml -> .*a.yaml"):
        C.load(tmp_path / "a.yaml")
    (tmp_path / "c.yaml").write_text("base: nowhere.yaml\n")
    with pytest.raises(ConfigError, match=r"nowhere.yaml' \(base of .*c.yaml\) not found"):
        C.load(tmp_path / "c.yaml")
    (tmp_path / "d.yaml").write_text("base: {x: 1}\n")
    with pytest.raises(ConfigError, match="base must be a file path or a list"):
        C.load(tmp_path / "d.yaml")


def test_the_shipped_configs_that_use_a_base_resolve_to_their_full_settings():
    cfg = C.load(REPO / "configs/gpu_7b_4nodes.yaml")
    assert (cfg.slurm.partition, cfg.slurm.gpus_per_node, cfg.slurm.setup_profile, cfg.slurm.nodes) == ("gpu", 8, "hpc", 4)
    cpu = C.load(REPO / "configs/cluster_cpu.yaml")
    smoke = C.load(REPO / "configs/smoke_cpu.yaml")
    assert cpu.vllm == smoke.vllm and cpu.trainer.dataset == smoke.trainer.dataset and cpu.slurm.nodes == 2


@pytest.mark.parametrize("key", ["partition", "account", "qos", "mem", "constraint", "extra_sbatch.reservation"])
def test_a_backslash_in_an_sbatch_header_value_is_refused_naming_the_key(key):
    """sbatch's parser of #SBATCH lines unescapes a backslash even inside single quotes: the value would change."""
    with pytest.raises(C.ConfigError) as e:
        C.load(REPO / "configs/smoke_cpu.yaml", [f"slurm.{key}=" + '"a\\\\b"'])
    assert str(e.value).startswith(f"slurm.{key} 'a\\\\b' contains a backslash; #SBATCH lines are read by sbatch"), e.value
