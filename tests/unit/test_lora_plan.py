"""trainer.lora in the launcher: the config's checks (one line with the fix), the plan's push path (adapter, or merged
and why), vLLM's command line with LoRA, and the architectures we call LoRA-servable against the installed vLLM."""

from __future__ import annotations

import json

import pytest

from launcher.core import config as C
from launcher.core.jobdir import Env
from launcher.core.lora import ADAPTER, MERGED, SUPPORTED, lora_push, serving_rank
from launcher.core.plan import plan
from launcher.node.commands import server_engine, vllm_command


def cfg(tmp_path, arch: str = "Qwen2ForCausalLM", vllm: dict | None = None, **lora):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [arch]}))
    return C.from_dict(
        {"vllm": {"model": str(tmp_path), **(vllm or {})}, "slurm": {"gpus_per_node": 4}, "trainer": {"lora": lora}}
    )


@pytest.mark.parametrize(
    "lora,trainer,match",
    [
        ({"r": 1024}, {}, r"trainer.lora.r must be 0 \(off\) to 512"),
        ({"r": 8, "dropout": 1.0}, {}, r"trainer.lora.dropout must be in \[0, 1\)"),
        ({"r": 8, "target_modules": ["q_proj", "lm_head"]}, {}, r"\['lm_head'\].*adapt the linear projections only"),
        ({"r": 8, "target_modules": []}, {}, r"target_modules is empty"),
        ({"r": 8}, {"beta": 0.04}, r"trainer.beta 0.04 with trainer.lora.*set trainer.beta: 0"),
        ({"r": 8, "push": "fast"}, {}, r"push"),
    ],
)
def test_lora_mistakes_fail_with_the_fix(lora, trainer, match):
    with pytest.raises(C.ConfigError, match=match):
        C.from_dict({"vllm": {"model": "/m"}, "trainer": {**trainer, "lora": lora}})


def test_off_by_default_and_set_key_by_key():
    c = C.from_dict({"vllm": {"model": "/m"}})
    assert not c.trainer.lora.enabled and lora_push(c) == ("", "")
    raw = C.merge_raw({"vllm": {"model": "/m"}}, ["trainer.lora.r=16", "trainer.lora.save_merged=true"])
    c = C.from_dict(raw)
    assert c.trainer.lora.r == 16 and c.trainer.lora.save_merged and c.trainer.lora.scale_alpha == 32.0
    with pytest.raises(C.ConfigError, match=r"unknown key 'trainer.lora.rank'"):
        C.merge_raw({}, ["trainer.lora.rank=16"])


def test_the_adapter_path_starts_vllm_with_lora_and_a_rounded_rank_limit(tmp_path):
    p = plan(cfg(tmp_path, r=12), "/jobs/x")
    assert p.lora_push == ADAPTER
    assert any(line.startswith("LoRA push = adapter") for line in p.derivation)
    cmd = vllm_command(p, 0)
    i = cmd.argv.index("--max-lora-rank")
    assert "--enable-lora" in cmd.argv and cmd.argv[i + 1] == "16" == str(serving_rank(12))
    assert cmd.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    assert cmd.env[Env.LORA_LOAD_ONCE] == "1"  # the plugin stops the per-step re-read of the adapter


@pytest.mark.parametrize(
    "backend,lora,engine",
    [
        ("nccl", {"r": 8}, "nccl_adapter"),  # the adapter's tensors through vLLM's nccl engine, which takes one here
        ("nccl", {"r": 8, "adapter_transport": "disk"}, "nccl"),
        ("nccl", {"r": 8, "push": "merged"}, "nccl"),
        ("nccl", {}, "nccl"),
        ("gloo", {"r": 8}, "gloo"),  # the project's own engines (gloo, mapped_ipc) take an adapter as they are
    ],
)
def test_the_server_engine_takes_the_adapter_where_it_moves_through_the_engine(tmp_path, backend, lora, engine):
    p = plan(cfg(tmp_path, vllm={"weight_transfer_backend": backend}, **lora), "/jobs/x")
    assert server_engine(p) == engine
    assert f'{{"backend": "{engine}"}}' in vllm_command(p, 0).argv
    if lora.get("r") and not lora.get("push"):
        how = lora.get("adapter_transport", "engine")
        line = next(x for x in p.derivation if x.startswith("LoRA push = adapter"))
        assert f"trainer.lora.adapter_transport: {how}" in line, line


@pytest.mark.parametrize(
    "arch,vllm,push,why",
    [
        ("Qwen2ForCausalLM", {"data_parallel_size": 2}, "auto", "data_parallel_size 2 > 1"),
        ("GPT2LMHeadModel", {}, "auto", "GPT2LMHeadModel is not among"),
        ("Qwen2ForCausalLM", {}, "merged", "trainer.lora.push: merged"),
    ],
)
def test_where_adapters_cannot_be_served_the_push_merges_and_says_why(tmp_path, arch, vllm, push, why):
    p = plan(cfg(tmp_path, arch, vllm, r=8, push=push), "/jobs/x")
    assert p.lora_push == MERGED
    assert why in lora_push(p.config)[1]
    cmd = vllm_command(p, 0)
    assert "--enable-lora" not in cmd.argv and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in cmd.env
    assert Env.LORA_LOAD_ONCE not in cmd.env
    full = plan(cfg(tmp_path, arch, vllm), "/jobs/x")
    assert full.lora_push == "" and "--enable-lora" not in vllm_command(full, 0).argv


def test_asking_for_the_adapter_path_where_it_cannot_be_served_is_refused(tmp_path):
    with pytest.raises(C.ConfigError, match=r"trainer.lora.push adapter cannot be served: vllm.data_parallel_size 2"):
        plan(cfg(tmp_path, vllm={"data_parallel_size": 2}, r=8, push="adapter"), "/jobs/x")


def test_the_architectures_called_servable_support_lora_in_the_installed_vllm():
    pytest.importorskip("vllm")
    from vllm.model_executor.models.interfaces import supports_lora
    from vllm.model_executor.models.registry import ModelRegistry

    for arch in SUPPORTED:
        assert supports_lora(ModelRegistry._try_load_model_cls(arch)), arch
    assert not supports_lora(ModelRegistry._try_load_model_cls("GPT2LMHeadModel"))


def test_the_data_parallel_size_the_plan_derives_decides_the_push_too(tmp_path):
    """slurm.layout shared sets vLLM's DP from the node's GPUs in the plan, not in the config: the LoRA push path must
    follow the plan's figure (an adapter load is one request, not known to reach every engine)."""
    c = cfg(tmp_path, r=8)
    assert lora_push(c)[0] != MERGED
    how, why = lora_push(c, data_parallel_size=4)
    assert how == MERGED and "data_parallel_size 4 > 1" in why
