"""What the CLI tells a new user before anything is queued, as one path: every dry-run (dry-run, submit/resume/sweep
--dry-run, dry-run --grid) runs the checks submit runs and fails where submit would refuse; a refusal is one line per
problem and leaves no job folder; a layout that cannot run (vLLM's weights over its GPUs' memory, a trainer rank over
its GPU) is refused or never recommended, by dry-run and simulate alike; `status` reads as lines. SLURM is faked at
the process boundary (conftest's fake_slurm); the 70B is its published config.json, nothing is loaded."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from launcher import cli
from launcher.core import config as C
from launcher.core.inputs import parse_skip
from launcher.core.jobdir import write_job_dir
from launcher.core.plan import plan
from launcher.core.records import FinalRow, NodeFinal, ParityRecord, StepRow
from launcher.core.shape import ModelShape
from launcher.dryrun import render_dry_run, utilization_note
from launcher.memory import memory_problems, plan_report, vllm_weights_gb
from launcher.simulate import layout_verdict
from launcher.status import status
from tests.conftest import FakeSlurm
from tests.unit.test_memory import QWEN3_30B_A3B as MEMORY_QWEN3_30B_A3B

REPO = Path(__file__).resolve().parents[2]
SMOKE = str(REPO / "configs" / "smoke_cpu.yaml")
GPU = str(REPO / "configs" / "gpu_7b_4nodes.yaml")  # 8 x H100 (80 GB) nodes, vLLM TP 1 on GPU 0, hsdp, 16 x 1024 tokens

LLAMA_31_70B = {  # the published config.json's shape fields (meta-llama/Llama-3.1-70B-Instruct)
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 8192,
    "num_hidden_layers": 80,
    "intermediate_size": 28672,
    "vocab_size": 128256,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "tie_word_embeddings": False,
    "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
}


QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], **MEMORY_QWEN3_30B_A3B, "max_position_embeddings": 40960}
"""The published config.json's shape fields (Qwen/Qwen3-30B-A3B): 128 experts, 8 per token."""


def config_folder(folder: Path, config: dict) -> str:
    """A model folder holding only its config.json: all the estimate and the plan read."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.fixture
def q30(tmp_path: Path) -> str:
    return config_folder(tmp_path / "qwen3-30b-a3b", QWEN3_30B_A3B)


@pytest.fixture
def m70(tmp_path: Path) -> str:
    return config_folder(tmp_path / "llama-70b", LLAMA_31_70B)


def gpu_plan(model: str, *sets: str):
    cfg = C.load(GPU, [f"vllm.model={model}", "slurm.nodes=16", *sets])
    return plan(cfg, "/j")


# ------------------------------------------------------------------------------------------------ one check path


@pytest.mark.parametrize(
    "argv",
    [
        ["dry-run", SMOKE],
        ["submit", SMOKE, "--dry-run"],
        ["sweep", SMOKE, "--grid", "trainer.beta=0,0.04", "--dry-run"],
        ["dry-run", SMOKE, "--grid", "trainer.beta=0,0.04"],
    ],
    ids=["dry-run", "submit--dry-run", "sweep--dry-run", "dry-run--grid"],
)
def test_every_dry_run_runs_the_submit_checks_and_fails_where_submit_would(argv, tmp_path, capsys, fake_slurm: FakeSlurm):
    job = tmp_path / "job"
    sets = ["--set", f"vllm.model={tmp_path / 'nope'}", f"job.job_dir={job}"]
    assert cli.main([*argv, *sets]) == 2
    out, err = capsys.readouterr()
    assert re.search(r"^  model +PROBLEM", out, re.M), out[-2000:]
    assert len(re.findall(r"no such folder on this host", out)) == 1  # a sweep's points share it: listed once
    assert "submit would refuse this: the model check found problems" in err and "--skip-checks model" in err
    # the way out it names works, and says what it skipped
    assert cli.main([*argv, *sets, "--skip-checks", "model"]) == 0, capsys.readouterr().err
    assert re.search(r"^  model +skipped", capsys.readouterr().out, re.M)
    assert fake_slurm.calls() == [] and not job.exists()  # a dry-run asks SLURM nothing and writes nothing


def test_a_refused_submit_prints_one_line_per_problem_and_writes_nothing(tmp_path, capsys, fake_slurm: FakeSlurm):
    job = tmp_path / "job"
    sets = ["--set", f"vllm.model={tmp_path / 'nope'}", f"trainer.dataset={tmp_path / 'none.jsonl'}", f"job.job_dir={job}"]
    assert cli.main(["submit", SMOKE, *sets]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2, lines
    assert "vllm.model" in lines[0] and "no such folder" in lines[0] and "trainer.dataset" not in lines[0]
    assert "trainer.dataset" in lines[1] and "--skip-checks model,data" in lines[1]
    assert fake_slurm.calls() == [] and not job.exists()


def test_a_job_sbatch_refuses_leaves_no_job_folder(tmp_path, capsys, fake_slurm: FakeSlurm):
    """slurmctld's refusal (sbatch exits nonzero, here "Batch job submission failed"): no job exists, no folder is
    kept, and the error line is sbatch's reason (not its first line, often a warning). A timeout (the job may be queued
    all the same) keeps the folder, whose job.sbatch says what was sent (tests/unit/test_submit_outcomes.py)."""
    refused = (
        "sbatch: warning: can't honor --ntasks-per-node set to 1\nsbatch: error: invalid partition specified: gpux\n"
        "sbatch: error: Batch job submission failed: Invalid partition name specified"
    )
    fake_slurm.answer("sbatch", stderr=refused, rc=1)
    job = tmp_path / "job"
    argv = ["submit", SMOKE, "--set", f"job.job_dir={job}", "--skip-path-checks"]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert "slurm-grpo submit: sbatch: error: invalid partition specified: gpux\nno job folder kept" in err, err
    assert [c["cmd"] for c in fake_slurm.calls()] == ["sbatch"] and not job.exists()
    fake_slurm.answer("sbatch", stderr="sbatch: error: Socket timed out on send/recv operation", rc=1)
    assert cli.main(argv) == 1
    assert "Socket timed out" in capsys.readouterr().err and (job / "job.sbatch").is_file()


def test_dry_run_takes_skip_path_checks_and_each_command_reports_its_own_usage(tmp_path, capsys):
    assert cli.main(["dry-run", SMOKE, "--set", f"vllm.model={tmp_path / 'nope'}", "--skip-path-checks"]) == 0
    assert re.search(r"^  model +skipped", capsys.readouterr().out, re.M)
    with pytest.raises(SystemExit) as e:
        cli.main(["dry-run", SMOKE, "--set", "slurm.nodes", "16"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("usage: slurm-grpo dry-run "), err
    assert "--set slurm.nodes 16: --set takes KEY=VALUE, e.g. --set slurm.nodes=16" in err
    with pytest.raises(SystemExit):
        cli.main(["local", SMOKE, "--dry-run"])
    err = capsys.readouterr().err
    assert err.startswith("usage: slurm-grpo local ") and "unrecognized arguments: --dry-run" in err, err


# ------------------------------------------------------------------------------------------- layouts that run


def test_vllm_weights_that_cannot_load_are_refused_with_the_tp_that_holds_them(m70, tmp_path, capsys, fake_slurm):
    shape = ModelShape.read(m70)
    assert shape is not None and abs(shape.params / 1e9 - 70.55) < 0.05  # the published 70.6B
    (line,) = memory_problems(gpu_plan(m70)) or [None]
    # 141 GB of bf16 weights on one 80 GB GPU of which vLLM gets 0.85: TP 4 (35 GB a GPU) is the smallest that holds them
    assert line is not None and "vllm.tensor_parallel_size 1" in line and "141 GB" in line, line
    assert "set vllm.tensor_parallel_size=4" in line, line
    assert memory_problems(gpu_plan(m70, "vllm.tensor_parallel_size=4")) == []
    assert memory_problems(gpu_plan(str(tmp_path / "nope"))) is None  # no config.json here: cannot tell
    # dry-run fails on it (`all` skips the path kinds only), and submit refuses before the folder and sbatch; the
    # refusal names the way past a wrong estimate
    job = tmp_path / "job"
    sets = ["--set", f"vllm.model={m70}", "slurm.nodes=16", f"job.job_dir={job}", "--skip-checks", "all"]
    assert cli.main(["dry-run", GPU, *sets]) == 2
    out, err = capsys.readouterr()
    assert re.search(r"^  memory +PROBLEM", out, re.M) and "the memory check found problems" in err, err
    assert "--skip-checks memory" in err and "--skip-path-checks" not in err, err
    assert cli.main(["submit", GPU, *sets]) == 2
    err = capsys.readouterr().err
    assert "set vllm.tensor_parallel_size=4" in err and "--skip-checks memory" in err, err
    assert fake_slurm.calls() == [] and not job.exists()
    # --skip-checks memory is taken by name (never by all or --skip-path-checks) and the dry-run then passes
    assert parse_skip("all") == parse_skip("model,data,rewards,agents,venv") and "memory" in parse_skip("memory,venv")
    assert cli.main(["dry-run", GPU, *sets[:-1], "all,memory"]) == 0
    assert re.search(r"^  memory +skipped .*--skip-checks memory", capsys.readouterr().out, re.M)


def test_an_moe_with_expert_parallelism_splits_its_experts_over_tp_x_dp(q30, capsys):
    """The reviewer's case: Qwen3-30B-A3B (61 GB of bf16 weights, 58 of them routed experts) served at TP 1 x DP 4
    with vllm.enable_expert_parallel on 40 GB GPUs: each engine holds the dense part and a quarter of the experts
    (~18 GB), which fits the 34 GB vLLM gets (0.85 x 40) with room for a KV cache; without EP every engine holds all
    61 GB."""
    small = ["trainer.per_device_train_batch_size=2", "trainer.max_completion_length=256", "slurm.gpu_memory_gb=40"]
    ep = ["vllm.data_parallel_size=4", "vllm.enable_expert_parallel=true", *small]
    assert memory_problems(gpu_plan(q30, *ep)) == []
    (line,) = memory_problems(gpu_plan(q30, *ep[:1], *small)) or [None]  # no EP: all 61 GB on every engine's GPU
    assert line is not None and "61 GB per GPU" in line, line
    # the dry-run's layout line finds a split that fits (4 serving: the experts over 4 engines) ...
    verdict = layout_verdict(gpu_plan(q30, *ep).config)
    assert verdict is not None and "no split" not in verdict and "best split" in verdict, verdict
    # ... and simulate's TP check takes the config's DP and EP: TP 1 holds the weights, nothing to replace
    assert cli.main(["simulate", GPU, "--nodes", "16", "--set", f"vllm.model={q30}", "slurm.nodes=16", *ep]) == 0
    out = capsys.readouterr().out
    assert "cannot hold vLLM's weights" not in out and "recommended: none" not in out, out
    # the one weights function: 2 bytes x (dense part / TP + routed experts / (TP x DP))
    shape = ModelShape.read(q30)
    assert shape is not None and abs(shape.params / 1e9 - 30.5) < 0.1 and abs(shape.active_params / 1e9 - 3.3) < 0.1
    assert abs(vllm_weights_gb(shape, 1) - 61.1) < 0.2 and abs(vllm_weights_gb(shape, 1, 4, True) - 17.6) < 0.2
    assert vllm_weights_gb(shape, 2, 1, True) == pytest.approx(vllm_weights_gb(shape, 2))  # DP 1: EP is TP's split


def test_the_trainer_advice_tries_fsdp_at_the_current_node_count_and_holds_when_followed(m70):
    """The reviewer's case: hsdp over a node's 7 ranks needs ~224 GB a rank; sharded over all 112 ranks of the same
    16 nodes it fits, so the advice is fsdp, not more nodes; followed, the estimate has no trainer warning left."""
    (warning,) = [ln for ln in plan_report(gpu_plan(m70)) if ln.startswith("WARNING: a trainer rank needs")]
    assert "it fits with trainer.fsdp=fsdp" in warning and "more nodes" not in warning, warning
    advice = warning.split("it fits with ", 1)[1].split(", ")
    followed = plan_report(gpu_plan(m70, *advice))
    assert not [ln for ln in followed if ln.startswith("WARNING: a trainer rank needs")], followed
    assert "shards over 112 ranks" in followed[0], followed[0]


def test_simulate_and_the_dry_run_never_recommend_a_split_that_cannot_run(m70, capsys):
    small = ["trainer.per_device_train_batch_size=2", "trainer.max_completion_length=256"]
    argv = ["simulate", GPU, "--nodes", "16", "--set", f"vllm.model={m70}", "slurm.nodes=16", *small]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    (rec,) = [ln for ln in out.splitlines() if ln.startswith("recommended:")]
    serving = int(re.search(r"synchronous: (\d+) of 8 GPUs serving", rec).group(1))  # type: ignore[union-attr]
    # at TP 1 the 141 GB cannot load: the table serves at TP 4 and recommends a multiple of it
    assert "--set vllm.tensor_parallel_size=4 " in rec and serving % 4 == 0, rec
    assert "the splits below serve at TP 4" in out
    assert re.search(r"per-node, 4 serve \(TP 4 x DP 1\).*<- best sync", out), out
    # the config's own batch (16 x 1024 per rank) fits no split at all: none recommended rather than one that OOMs
    assert cli.main(argv[:-2]) == 0
    (rec,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("recommended:")]
    assert rec.startswith("recommended: none: no split"), rec
    # the dry-run's step-model line: no best split at TP 1; at TP 4 (small batch) one that the memory model passes
    verdict = layout_verdict(gpu_plan(m70).config)
    assert verdict is not None and "no split of this node's 8 GPUs" in verdict and "best split" not in verdict, verdict
    verdict = layout_verdict(gpu_plan(m70, "vllm.tensor_parallel_size=4", *small).config)
    assert verdict is not None and "best split" in verdict, verdict


def test_a_split_server_at_a_shared_gpu_fraction_gets_one_line_and_the_plan_comes_first():
    math = str(REPO / "configs" / "math_example.yaml")  # 0.35: its one GPU is shared with the trainer
    cfg = C.load(math, ["slurm.nodes=2", "slurm.gpus_per_node=8"])
    p = plan(cfg, "/j")
    note = utilization_note(p)
    assert note is not None and "vllm.gpu_memory_utilization 0.35" in note and "set vllm.gpu_memory_utilization=0.9" in note
    out = render_dry_run(cfg, p)
    assert out.count("vllm.gpu_memory_utilization=0.9") == 1 and out.index("# plan") < out.index("# resolved config")
    assert utilization_note(plan(C.load(math, ["slurm.gpus_per_node=8", "vllm.gpu_memory_utilization=0.9"]), "/j")) is None
    assert utilization_note(plan(C.load(math), "/j")) is None  # one GPU, shared: 0.35 is right there


# ---------------------------------------------------------------------------------------------------- status


def test_status_prints_the_last_step_and_the_end_as_lines_without_none(tmp_path):
    cfg = C.load(SMOKE, [f"job.job_dir={tmp_path}"])
    write_job_dir(cfg, plan(cfg, str(tmp_path)))
    history = [ParityRecord(step=s, kind="push", max_diff=1e-6) for s in range(9)]
    rows = [
        StepRow(step=1, reward=0.25, loss=0.5, step_s=2.0, push_s={"0": 0.12}),
        StepRow(step=2, reward=0.5, reward_std=0.1, loss=0.25, kl=0.01, step_s=2.5, push_s={"0": 0.1}, parity={"0": 1e-6}),
        FinalRow(step=2, nodes={"0": NodeFinal(node=0, parity_final=2e-6, push_s_final=0.3, pushes=2, parity_history=history)}),
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r.to_dict()) + "\n" for r in rows))
    text = status(tmp_path)
    assert "None" not in text and '{"' not in text, text  # no raw JSON row, no unrecorded figure
    lines = {ln.split(":", 1)[0]: ln.split(":", 1)[1].strip() for ln in text.splitlines() if ":" in ln}
    assert lines["last step"] == (
        "step 2: reward 0.5000 (std 0.1000), loss 0.25, kl 0.01, 2.50 s; push node 0: 0.100 s; parity node 0: 1e-06"
    )
    assert lines["end"] == "finished at step 2: node 0: 2 pushes, last push 0.300 s, final parity 2e-06, 9 parity checks"
    assert "generation" not in lines["summary"] and re.search(r"; step [0-9.]+ s$", lines["summary"]), lines["summary"]


def test_the_dry_run_counts_the_host_memory_a_background_checkpoint_takes(m70):
    """trainer.async_checkpoint: each rank's share of the checkpoint (12 bytes a parameter over the shard's ranks)
    copied into host memory: under hsdp a node's ranks hold one whole replica; under fsdp over 16 nodes, a 16th."""
    (hsdp,) = [ln for ln in plan_report(gpu_plan(m70)) if ln.startswith("checkpoints written in the background")]
    shape = ModelShape.read(m70)
    assert shape is not None
    assert f"~{12 * shape.params / 1e9:.1f} GB per node" in hsdp, hsdp
    (fsdp,) = [ln for ln in plan_report(gpu_plan(m70, "trainer.fsdp=fsdp")) if ln.startswith("checkpoints written")]
    assert f"~{12 * shape.params / 16 / 1e9:.1f} GB per node" in fsdp, fsdp
    assert not [ln for ln in plan_report(gpu_plan(m70, "trainer.async_checkpoint=false")) if ln.startswith("checkpoints written")]
