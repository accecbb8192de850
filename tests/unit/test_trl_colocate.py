"""gpu/trl_colocate.py, TRL's side of the GPU comparison (gpu/device.sh TRL=1), on CPU: what it hands TRL's
GRPOTrainer for an agents config is the project's run's work (the same GRPOConfig values, tools / environment with
their deadlines, the environment's reward, the dataset's columns), and TRL plays the countdown with it. TRL's colocated
vLLM cannot run on CPU, so the step here generates through transformers (use_vllm off); the rest is what the GPU runs."""

from __future__ import annotations

import importlib.util

import pytest

from launcher.core import config as C
from launcher.core.plan import plan
from tests.conftest import REPO
from trainer.trl_glue import grpo_config


def trl_colocate():
    spec = importlib.util.spec_from_file_location("trl_colocate", REPO / "gpu" / "trl_colocate.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_kind_of_run_that_side_by_side_figures_are_matched_by():
    assert C.load(REPO / "configs/gpu_1gpu.yaml").trainer.run_kind == "dense"
    assert C.load(REPO / "configs/gpu_1gpu.yaml", ["trainer.lora.r=16"]).trainer.run_kind == "lora"
    assert C.load(REPO / "configs/agents_1gpu.yaml").trainer.run_kind == "agents"
    assert C.load(REPO / "configs/agents_1gpu.yaml", ["trainer.lora.r=8"]).trainer.run_kind == "agents+lora"


def test_one_step_off_the_importance_correction_is_per_token_unless_the_user_chose(tmp_path):
    """TRL's per-sequence default masks every completion one optimizer step old (config.TrainerConfig.grpo_settings):
    max_staleness >= 1 gets token_truncate; synchronous runs and a user's own choice are left alone."""
    mode = lambda *sets: (
        grpo_config(  # noqa: E731
            tmp_path, C.load(REPO / "configs/gpu_1gpu.yaml", list(sets)).trainer, "cpu"
        ).vllm_importance_sampling_mode
    )
    assert mode() == "sequence_mask"  # TRL's own default, synchronous
    assert mode("trainer.max_staleness=1") == "token_truncate"
    assert mode("trainer.max_staleness=2") == "token_truncate"
    assert mode("trainer.max_staleness=1", "trainer.grpo.vllm_importance_sampling_mode=sequence_truncate") == (
        "sequence_truncate"
    )
    # clip_max null without clip_min leaves nothing to truncate at (TRL would refuse token_truncate): TRL's own choice
    assert mode("trainer.max_staleness=1", "trainer.grpo.vllm_importance_sampling_clip_max=null") == "sequence_mask"
    plan_lines = "\n".join(plan(C.load(REPO / "configs/smoke_cpu.yaml", ["trainer.max_staleness=1"]), str(tmp_path)).derivation)
    assert "vllm_importance_sampling_mode = token_truncate (per token unless clip_max" in plan_lines


def test_trls_colocate_run_of_the_agents_config_is_the_projects_work_and_plays_the_countdown(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from trainer.agents.tiny_tool_model import make_tool_model

    mod = trl_colocate()
    model_path = tmp_path / "m"
    make_tool_model(model_path)  # saved in float32: vLLM's auto dtype serves it in bfloat16, as the config's server does
    sets = [
        f"vllm.model={model_path}",
        "trainer.max_steps=1",
        "trainer.per_device_train_batch_size=2",
        "trainer.num_generations=2",
    ]
    cfg = C.load(REPO / "configs/agents_1gpu.yaml", sets)
    mod.check_dtype(str(model_path), cfg.vllm.dtype)
    with pytest.raises(ValueError, match="--dtype float32"):  # TRL's vLLM would generate in bfloat16: unfair
        mod.check_dtype(str(model_path), "float32")

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_path)
    tok = AutoTokenizer.from_pretrained(model_path)
    kw = mod.trainer_kwargs(cfg, model, tok, device="cpu", use_vllm=False, output_dir=str(tmp_path / "trl"))
    a, ours = kw["args"], grpo_config(tmp_path / "job", cfg.trainer, "cpu")
    for name in ("per_device_train_batch_size", "num_generations", "max_completion_length", "learning_rate", "beta"):
        assert getattr(a, name) == getattr(ours, name), name
    assert (a.max_tool_calling_iterations, a.temperature) == (4, ours.temperature)
    assert (a.vllm_mode, a.vllm_gpu_memory_utilization, a.vllm_max_model_length) == ("colocate", 0.35, 2048)
    assert kw["reward_funcs"] == [] and kw["peft_config"] is None  # the environment's get_reward is the reward
    env = kw["environment_factory"]()
    assert type(env).__name__ == "Countdown"
    assert "calls" in kw["train_dataset"].column_names  # reset(**row) reads it

    logs: list[dict] = []

    class Logs(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **k):
            rows.append(dict(logs or {}))

    rows = logs
    tr = GRPOTrainer(**kw, callbacks=[Logs()])
    tr.train()
    step = next(x for x in logs if "reward" in x)
    assert step["reward"] == 1.0  # every episode counted down to DONE, then answered
    assert step["tools/call_frequency"] in (1.0, 2.0, 3.0) and step["tools/failure_frequency"] == 0.0
