"""Config: precedence, strict keys, and a table of bad configs, each a one-line error with the fix."""

from __future__ import annotations

import json

import pytest
import yaml

from launcher import config as C
from launcher.config import ConfigError
from launcher.jobdir import make_plan

from .conftest import REPO, cli

BASE = {"vllm": {"model": "/models/m"}, "slurm": {"gpus_per_node": 4}}


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


def test_unknown_key_lists_the_menu():
    with pytest.raises(ConfigError) as e:
        C.from_dict({**BASE, "vllm": {"model": "m", "tp": 2}})
    msg = str(e.value)
    assert "unknown key 'vllm.tp'" in msg and "tensor_parallel_size (default 1)" in msg and "port (default 8000)" in msg


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
    (_with("slurm", gpus_per_node=0), "slurm.gpus_per_node must be positive"),
    (_with("slurm", time="1 hour"), "not a SLURM time"),
    (_with("slurm", time="10:7"), "not a SLURM time"),
    (_with("slurm", exclusive="yes"), "slurm.exclusive must be true or false"),
    (_with("slurm", setup_profile="../etc/passwd"), "slurm.setup_profile"),
    (_with("slurm", extra_sbatch={"--mail": "x"}), "sbatch flag name without dashes"),
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
    (_with("vllm", extra_args="--x"), None),  # a string is accepted as a one-item list: not an error
    (_with("trainer", num_generations=1), "at least 2"),
    (_with("trainer", max_steps=0), "trainer.max_steps must be positive"),
    (_with("trainer", learning_rate=-1.0), "learning_rate must be positive"),
    (_with("trainer", reward_funcs=[]), "reward_funcs is empty"),
    (_with("trainer", reward_funcs=["pkg.mod:"]), "not a dotted path"),
    (_with("trainer", reward_funcs=["not a name"]), "neither a built-in"),
    (_with("trainer", dtype="int8"), "trainer.dtype"),
    (_with("trainer", fsdp="ddp"), "trainer.fsdp"),
    (_with("trainer", parity_action="ignore"), "parity_action"),
    (_with("trainer", request_timeout_s=0), "every wait needs a deadline"),
    (_with("trainer", grpo={"use_vllm": False}), "set by slurm-grpo itself"),
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
    if needle is None:
        C.from_dict(raw)
        return
    with pytest.raises(ConfigError) as e:
        C.from_dict(raw)
    msg = str(e.value)
    assert needle in msg, msg
    assert "\n" not in msg, "errors must be one line"


def test_at_least_30_bad_inputs():
    assert sum(1 for _, n in BAD if n) >= 30


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
            "one generation per optimizer step",
        ),
        (["dry-run", "configs/smoke_cpu.yaml", "--set", "slurm.nodes=0"], "slurm.nodes must be positive"),
        (["dry-run", "configs/smoke_cpu.yaml", "--set", "trainer.maxsteps=3"], "unknown key 'trainer.maxsteps'"),
        (["dry-run", "configs/smoke_cpu.yaml", "--set", "noequals"], "not of the form"),
        (["submit", "configs/smoke_cpu.yaml", "--set", "job.name=a b"], "job.name"),
        (["status", "/nonexistent/job"], "neither a job folder"),
    ],
)
def test_cli_errors_are_one_line_and_submit_nothing(args, needle):
    r = cli(*args, env={"PATH": "/nonexistent-no-sbatch:" + __import__("os").environ["PATH"]})
    assert r.returncode != 0
    err = r.stderr.strip()
    assert needle in err and len(err.splitlines()) == 1, err
    assert "Traceback" not in r.stderr


def test_readme_config_reference_is_current():
    from pathlib import Path

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    assert C.reference_markdown() in readme, (
        "README's config reference is stale; regenerate it with "
        "python -c 'from launcher.config import reference_markdown as r; print(r())'"
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
    r = cli("dry-run", str(tmp_path / "job.yaml"))
    assert r.returncode == 0, r.stderr
    resolved = r.stdout.split("# plan")[0]
    assert "base" not in resolved and "partition: big" in resolved and "loss_type: dapo" in resolved

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
