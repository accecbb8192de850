"""vllm.extra_args and slurm.extra_sbatch may not repeat what the launcher renders itself. The owned flags are taken
from what it renders (vLLM's argv for several plans, the sbatch header), not from the refusal tables, so a flag the
launcher starts to pass without a table entry fails here; each is then tried in every spelling the parser takes
(vLLM's own short aliases read from its source, --x=1, --x_y, --no-x, --x.sub, an argparse abbreviation)."""

from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path

import pytest

from launcher.core import config as C
from launcher.core import vllm_start
from launcher.core.plan import plan
from launcher.node.commands import vllm_command
from launcher.submit import sbatch_text
from tests.unit.test_moe_config import MOE  # a tiny Qwen3-MoE config.json
from tests.unit.test_sbatch import sbatch_header

DENSE = {"architectures": ["Qwen2ForCausalLM"], "num_attention_heads": 4, "num_key_value_heads": 2}
PLANS: dict[str, tuple[dict, dict]] = {
    "plain split, vLLM DP": (DENSE, {"vllm": {"data_parallel_size": 2, "max_model_len": 512}}),
    "MoE, expert parallel": (MOE, {"vllm": {"tensor_parallel_size": 2, "enable_expert_parallel": True}}),
    "MoE, routing replay": (MOE, {"trainer": {"routing_replay": True}}),
    "LoRA adapter": (DENSE, {"trainer": {"lora": {"r": 8}}}),
    "emulated TP2": (DENSE, {"job": {"emulate_gpus": True}, "vllm": {"tensor_parallel_size": 2}}),
}


def job(tmp_path: Path, model: dict, over: dict) -> C.JobConfig:
    (tmp_path / "config.json").write_text(json.dumps(model))
    d: dict = {"vllm": {"model": str(tmp_path)}, "slurm": {"gpus_per_node": 4}, "job": {"job_dir": str(tmp_path / "j")}}
    for section, values in over.items():
        d[section] = {**d.get(section, {}), **values}
    return C.from_dict(d)


def rendered_vllm_flags(tmp_path: Path) -> set[str]:
    """Every --flag of the vLLM server's command line, over the plans above."""
    out: set[str] = set()
    for model, over in PLANS.values():
        argv = vllm_command(plan(job(tmp_path, model, over), str(tmp_path / "j")), 0).argv
        server = argv[argv.index("vllm.entrypoints.openai.api_server") + 1 :]
        out |= {a for a in server if a.startswith("-")}
    return out


def vllm_aliases() -> dict[str, list[str]]:
    """Long flag -> all its option strings, from the add_argument calls of vLLM's arg_utils.py (read, not imported)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return {}
    src = Path(next(iter(spec.submodule_search_locations))) / "engine" / "arg_utils.py"
    out: dict[str, list[str]] = {}
    for node in ast.walk(ast.parse(src.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            for n in names:
                if n.startswith("--"):
                    out[n] = names
    return out


def refusal(extra_args: list[str]) -> str:
    with pytest.raises(C.ConfigError) as e:
        C.from_dict({"vllm": {"model": "/m", "extra_args": extra_args}})
    msg = str(e.value)
    assert "\n" not in msg and len(msg) <= 200, msg
    return msg


def test_every_flag_the_launcher_passes_to_vllm_is_refused_in_every_spelling(tmp_path):
    flags = rendered_vllm_flags(tmp_path)
    deferring = flags & set(vllm_start.DEFERRING_FLAGS)  # added only where the user's extra_args hold none of their kind
    assert vllm_start.LORA_ONE_GRAPH_SET in deferring, deferring
    for flag in vllm_start.DEFERRING_FLAGS:
        assert C.owned_vllm_flag(flag) is None, f"{flag} defers to the user's own: it must not be refused"
    flags -= deferring
    # the plans above do render what they are meant to (else this test would check less than it says)
    assert {"--enable-expert-parallel", "--enable-lora", "--max-lora-rank", "--worker-cls", "--data-parallel-size"} <= flags
    assert "--enable-return-routed-experts" in flags
    aliases = vllm_aliases()
    for flag in sorted(flags):
        name = flag.removeprefix("--")
        spellings = {flag, f"{flag}=1", f"--{name.replace('-', '_')}", f"--no-{name}", f"{flag}.backend", flag[:-2]}
        spellings |= set(aliases.get(flag, []))
        for s in sorted(spellings):
            assert "set by slurm-grpo" in refusal([s, "1"]), s
    if aliases:  # vLLM's short forms of the owned flags exist where we think they do
        assert {"-tp", "-dp", "-ep"} <= {a for f in flags for a in aliases.get(f, [])}


@pytest.mark.parametrize(
    "arg,owner",
    [
        ("-pp", "no pipeline parallelism"),
        ("--pipeline-parallel-size=2", "no pipeline parallelism"),
        ("--tensor-parallel", "vllm.tensor_parallel_size"),  # argparse's allow_abbrev takes it for the full flag
        ("--weight-transfer-config.backend=nccl", "vllm.weight_transfer_backend"),
        ("--distributed-executor-backend", "job.emulate_gpus"),
        ("--data-parallel-size-local", "one server per node"),
        ("--nnodes", "one server per node"),
    ],
)
def test_placement_flags_and_abbreviations_name_the_owner(arg, owner):
    assert owner in refusal([arg, "2"])


@pytest.mark.parametrize("arg", ["--enforce-eager", "--max-num-seqs=64", "--enable-prefix-caching", "-O3", "--quantization"])
def test_the_users_own_vllm_flags_pass(arg):
    assert C.owned_vllm_flag(arg) is None
    assert C.from_dict({"vllm": {"model": "/m", "extra_args": [arg]}}).vllm.extra_args == [arg]


SBATCH_EVERYTHING = {
    "partition": "gpu",
    "account": "acct",
    "qos": "high",
    "constraint": "h100",
    "mem": "0",
    "cpus_per_task": 16,
    "exclusive": True,
    "requeue": True,
}


USERS_TO_REPLACE = {"--wckey"}
"""Directives submitit writes as a default the user's extra_sbatch replaces (checked below: one line, the user's)."""


def header_of(tmp_path: Path, slurm: dict) -> dict[str, str | None]:
    cfg = job(tmp_path, DENSE, {"slurm": slurm})
    return sbatch_header(sbatch_text(cfg, plan(cfg, str(tmp_path / "j"))))


@pytest.mark.parametrize("requeue", [True, False])
def test_every_sbatch_directive_the_launcher_writes_is_refused_in_extra_sbatch(tmp_path, requeue):
    header = header_of(tmp_path, {**SBATCH_EVERYTHING, "requeue": requeue})
    assert {"--partition", "--cpus-per-task", "--exclusive", "--gpus-per-node"} <= set(header)
    for flag in sorted(set(header) - USERS_TO_REPLACE):
        with pytest.raises(C.ConfigError, match=r"slurm.extra_sbatch\.\S+ (is written by slurm-grpo|and slurm\.)") as e:
            C.from_dict({"vllm": {"model": "/m"}, "slurm": {**SBATCH_EVERYTHING, "extra_sbatch": {flag[2:]: "1"}}})
        assert len(str(e.value)) <= 200, str(e.value)


def test_a_default_submitit_writes_is_replaced_by_the_users_own(tmp_path):
    for flag in USERS_TO_REPLACE:
        header = header_of(tmp_path, {"extra_sbatch": {flag[2:]: "mine"}})  # sbatch_header asserts each flag once
        assert header[flag] == "mine"


@pytest.mark.parametrize(
    "key,slurm,owner",
    [
        ("cpus-per-gpu", {"cpus_per_task": 8}, "slurm.cpus_per_task exclude each other"),
        ("ntasks-per-gpu", {}, "one task per node"),
        ("tres-per-task", {}, "one task per node"),
        ("gpus-per-socket", {}, "slurm.gpus_per_node"),
        ("export", {}, "the job needs its environment"),
        ("mem-per-gpu", {"mem": "0"}, "slurm.mem exclude each other"),
    ],
)
def test_sbatch_flags_that_contradict_the_launchers_are_refused(key, slurm, owner):
    with pytest.raises(C.ConfigError, match=f"slurm.extra_sbatch.{key}.*{owner}"):
        C.from_dict({"vllm": {"model": "/m"}, "slurm": {**slurm, "extra_sbatch": {key: "1"}}})


def test_cpus_per_gpu_is_the_users_when_cpus_per_task_is_not_set():
    cfg = C.from_dict({"vllm": {"model": "/m"}, "slurm": {"extra_sbatch": {"cpus-per-gpu": "8"}}})
    assert cfg.slurm.extra_sbatch == {"cpus-per-gpu": "8"}
