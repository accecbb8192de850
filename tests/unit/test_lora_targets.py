"""trainer.lora.target_modules checked against the model's weight names, read from its safetensors headers at submit
(launcher.core.lora.target_problems via inputs.check_lora_targets): peft adapts the modules whose name ends in a target
and errors only when no target matches at all, so before this a typo beside a good name, or the default targets on
phi3's fused qkv_proj/gate_up_proj, trained silently with fewer adapters (REVIEW-newcomer item 5); the default is resolved per model
(tests/unit/test_lora_default_targets.py). 'all-linear' is
peft's special value, passed to peft as the string it must be."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from launcher.core import config as C
from launcher.core.inputs import PreflightError, check_lora_targets, input_notes, submit_checks

LAYER = "model.layers.{i}.{m}.weight"
LLAMA = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
         "mlp.down_proj", "input_layernorm"]  # fmt: skip
PHI3 = ["self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj", "input_layernorm"]
GPT2 = ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"]


def model(tmp_path: Path, modules: list[str], name: str = "m") -> str:
    """A model folder whose safetensors hold two decoder layers of `modules` (a norm: 1-D), the embedding and the head."""
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    (d / "tokenizer.json").write_text("{}")
    tensors = {LAYER.format(i=i, m=m): np.zeros((4,) if "norm" in m else (4, 4), np.float32) for i in (0, 1) for m in modules}
    tensors |= {"model.embed_tokens.weight": np.zeros((8, 4), np.float32), "lm_head.weight": np.zeros((8, 4), np.float32)}
    save_file(tensors, str(d / "model.safetensors"))
    return str(d)


def cfg(path: str, **lora) -> C.JobConfig:
    return C.from_dict({"vllm": {"model": path}, "trainer": {"lora": {"r": 8, **lora}}})


def refusal(config: C.JobConfig) -> str:
    with pytest.raises(PreflightError) as got:
        check_lora_targets(config)
    assert "\n" not in str(got.value)
    return str(got.value)


def test_a_target_that_matches_no_layer_is_refused_naming_the_models_layers(tmp_path):
    m = model(tmp_path, LLAMA)
    layers = "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"
    assert refusal(cfg(m, target_modules=["query_key_value"])) == (
        f"trainer.lora.target_modules: 'query_key_value' matches no module of {m} (its linear layers: {layers}); "
        "name those to adapt"
    )
    assert "'qkv_proj' matches no module" in refusal(cfg(m, target_modules=["q_proj", "qkv_proj"]))  # peft: silent
    assert "'all-linear' is peft's special value only alone" in refusal(cfg(m, target_modules=["q_proj", "all-linear"]))
    assert "'input_layernorm' matches no module" in refusal(cfg(m, target_modules=["input_layernorm"]))  # not linear
    for fine in ([], ["all-linear"], ["self_attn.q_proj", "v_proj"]):  # [] = the defaults; a dotted suffix as peft's
        config = cfg(m, **({"target_modules": fine} if fine else {}))
        check_lora_targets(config)
        assert not [n for n in input_notes(config) if "lora" in n]
    check_lora_targets(cfg(m, r=0, target_modules=["query_key_value"]))  # LoRA off: targets unused
    problems = submit_checks(cfg(m, target_modules=["query_key_value"]))["model"]()
    assert [p for p in problems if "'query_key_value' matches no module" in p], problems


def test_a_users_list_is_warned_where_a_fused_projection_gets_no_adapter_and_the_defaults_reach_every_layer(tmp_path):
    phi3 = model(tmp_path, PHI3, "phi3")
    mine = cfg(phi3, target_modules=["o_proj", "down_proj"])
    check_lora_targets(mine)  # both match: peft would train on, silently without qkv/gate_up
    assert [n for n in input_notes(mine) if "lora" in n] == [
        f"WARNING: trainer.lora.target_modules reach only down_proj, o_proj of {phi3}: its fused gate_up_proj, qkv_proj "
        "get no adapter; add them: trainer.lora.target_modules=[o_proj, down_proj, gate_up_proj, qkv_proj]"
    ]
    # the defaults are resolved for the model (launcher.core.lora.resolve_targets): every linear layer of its decoder
    # layers (Phi-3's fused ones, Phi-2's dense/fc1/fc2, GPT-2's Conv1D c_*), nothing to warn; an MoE's user list of
    # attention layers is not warned either
    phi2 = model(
        tmp_path, ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.dense", "mlp.fc1", "mlp.fc2"], "phi2"
    )
    moe = model(tmp_path, ["self_attn.q_proj", "self_attn.o_proj", "mlp.gate", "mlp.experts.0.up_proj"], "moe")
    for config in (
        cfg(phi3),
        cfg(phi2),
        cfg(phi2, target_modules=["q_proj", "v_proj"]),
        cfg(moe, target_modules=["q_proj", "o_proj"]),
    ):
        check_lora_targets(config)
        assert not [n for n in input_notes(config) if "lora" in n]
    gpt2 = model(tmp_path, GPT2, "gpt2")
    check_lora_targets(cfg(gpt2))  # before: "the default targets match no module"


def test_all_linear_reaches_peft_as_its_special_value(tmp_path):
    """As a list (what the config holds) peft would look for a module named all-linear; the string adapts every
    linear layer but the output layer."""
    import torch
    from peft import get_peft_model

    from trainer.lora import peft_config

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.qkv_proj, self.norm = torch.nn.Linear(4, 4), torch.nn.Linear(4, 12), torch.nn.LayerNorm(4)

        def prepare_inputs_for_generation(self, *args, **kwargs):  # what peft's causal-LM wrapper looks up
            return kwargs

    lora = C.LoraConfig(r=2, target_modules=["all-linear"])
    assert peft_config(lora).target_modules == "all-linear"
    adapted = {n.split(".lora_A")[0].split(".")[-1] for n, _ in get_peft_model(Tiny(), peft_config(lora)).named_parameters()
               if ".lora_A." in n}  # fmt: skip
    assert adapted == {"q_proj", "qkv_proj"}
    assert peft_config(C.LoraConfig(r=2, target_modules=["q_proj"])).target_modules == {"q_proj"}
