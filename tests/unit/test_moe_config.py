"""MoE in the launcher: vLLM's expert parallelism passed through with the plan's checks, and which modules LoRA
may adapt on a mixture of experts (refused ones fail at plan time with the fix)."""

from __future__ import annotations

import json

import pytest

from launcher.core import config as C
from launcher.core.lora import MERGED
from launcher.core.plan import Plan, plan
from launcher.node.commands import vllm_command

MOE = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "intermediate_size": 256,
    "moe_intermediate_size": 48,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "vocab_size": 300,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}


def cfg(tmp_path, model: dict, vllm: dict | None = None, lora: dict | None = None, gpus: int = 4) -> C.JobConfig:
    (tmp_path / "config.json").write_text(json.dumps(model))
    return C.from_dict(
        {
            "vllm": {"model": str(tmp_path), **(vllm or {})},
            "slurm": {"gpus_per_node": gpus},
            "trainer": {"lora": lora or {}},
        }
    )


def test_expert_parallel_reaches_vllms_command_line_only_where_it_means_something(tmp_path):
    p = plan(cfg(tmp_path, MOE, {"tensor_parallel_size": 2, "enable_expert_parallel": True}), "/jobs/x")
    assert "--enable-expert-parallel" in vllm_command(p, 0).argv
    assert "--enable-expert-parallel" not in vllm_command(plan(cfg(tmp_path, MOE, {"tensor_parallel_size": 2}), "/j"), 0).argv
    with pytest.raises(C.ConfigError, match=r"enable_expert_parallel splits the experts.*TP x DP is 1 x 1"):
        plan(cfg(tmp_path, MOE, {"enable_expert_parallel": True}), "/jobs/x")
    dense = {k: v for k, v in MOE.items() if k not in ("num_experts", "moe_intermediate_size")}
    with pytest.raises(C.ConfigError, match=r"is not a mixture of experts.*remove it"):
        plan(cfg(tmp_path, dense, {"tensor_parallel_size": 2, "enable_expert_parallel": True}), "/jobs/x")


def test_lora_on_an_moe_adapts_attention_and_pushes_merged(tmp_path):
    p = plan(cfg(tmp_path, MOE, lora={"r": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}), "/jobs/x")
    assert p.lora_push == MERGED
    assert "LoRA targets = q_proj, k_proj, v_proj, o_proj (a mixture of experts: attention only)" in p.derivation
    # the default targets (they name the MLP projections, the experts' here) become attention only, in the plan the
    # trainer reads; a user's own MLP or expert names are refused with the fix (peft maps them onto the fused experts)
    default = plan(cfg(tmp_path, MOE, lora={"r": 8}), "/jobs/x")
    assert default.config.trainer.lora.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj"], default.config
    assert default.derivation == p.derivation
    # a submit host that cannot read the model (it lives on the nodes' file system) leaves the default; the nodes,
    # loading the plan where the model is, settle it the same way
    (tmp_path / "later").mkdir()
    later = cfg(tmp_path / "later", MOE, lora={"r": 8})
    (tmp_path / "later" / "config.json").unlink()
    unread = plan(later, "/jobs/x")
    assert "gate_proj" in unread.config.trainer.lora.target_modules
    (tmp_path / "plan.json").write_text(unread.to_json())
    assert "gate_proj" in Plan.load(tmp_path / "plan.json").config.trainer.lora.target_modules
    (tmp_path / "later" / "config.json").write_text(json.dumps(MOE))
    assert Plan.load(tmp_path / "plan.json").config.trainer.lora.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj"]
    for bad in (["q_proj", "experts"], ["gate"], ["mlp.experts.gate_up_proj"], ["v_proj", "down_proj"], ["all-linear"]):
        with pytest.raises(C.ConfigError, match=r"on a mixture of experts LoRA adapts attention only"):
            plan(cfg(tmp_path, MOE, lora={"r": 8, "target_modules": bad}), "/jobs/x")


def test_gpt_oss_plans_with_lora_on_its_attention_pushed_merged(tmp_path):
    """gpt-oss (once refused: vLLM's loader dropped its pushes; trainer.push.vllm_plugin.wrap_gpt_oss_loader) plans
    like the other MoE families: LoRA adapts the attention and pushes merged."""
    oss = MOE | {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "num_local_experts": 4}
    del oss["num_experts"], oss["moe_intermediate_size"]
    p = plan(cfg(tmp_path, oss, lora={"r": 8}), "/jobs/x")
    assert p.config.trainer.lora.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert p.lora_push == MERGED


def test_attention_without_sinks_is_refused_for_gpt_oss_and_a_bad_name_anywhere(tmp_path):
    oss = {k: v for k, v in MOE.items() if k not in ("num_experts", "moe_intermediate_size")}
    oss |= {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "num_local_experts": 4}

    def with_attention(model: dict, attention: str):
        (tmp_path / "config.json").write_text(json.dumps(model))
        return C.from_dict({"vllm": {"model": str(tmp_path)}, "trainer": {"attn_implementation": attention}})

    for attention in ("sdpa", "flash_attention_2", "flash_attention_3"):
        with pytest.raises(C.ConfigError, match=rf"attn_implementation {attention}: .* has attention sinks .*flex_attention"):
            plan(with_attention(oss, attention), "/jobs/x")
    for attention in ("", "eager", "flex_attention", "kernels-community/vllm-flash-attn3"):
        plan(with_attention(oss, attention), "/jobs/x")
    plan(with_attention(MOE, "sdpa"), "/jobs/x")  # a family with SDPA takes it
    with pytest.raises(C.ConfigError, match=r"attn_implementation 'flash-attention' is not one of eager, sdpa"):
        with_attention(MOE, "flash-attention")


@pytest.mark.parametrize(
    ("family", "why"),
    [
        ("kimi_linear", r"kimi_linear is not supported: .*q/k/v short convolutions"),
        ("longcat_flash", r"longcat_flash is not supported: .*zero \(identity\) experts"),
    ],
)
def test_families_the_libraries_disagree_on_are_refused_at_plan_time(tmp_path, family, why):
    """Kimi Linear: transformers fuses the q/k/v short convolutions into one tensor, vLLM loads them apart (no push).
    LongCat-Flash: transformers' gate_up_proj has rows for the identity experts, vLLM's loader has none (no push)."""
    with pytest.raises(C.ConfigError, match=why) as e:
        plan(cfg(tmp_path, MOE | {"model_type": family}), "/jobs/x")
    assert len(str(e.value)) < 300 and "\n" not in str(e.value)
