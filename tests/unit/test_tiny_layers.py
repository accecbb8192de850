"""make-tiny-model at any --layers and widths, every family (trainer.tiny_layers, trainer.tiny_families.SIZED): the
config make-tiny-model makes (transformers validates it; config.json round trip) builds, on the meta device (no weights),
a model of N decoder layers whose layers differ exactly where the config's per-layer fields say they do, and those
fields follow the family's rule: every kind of the released pattern, short bodies included."""

from __future__ import annotations

from typing import Any

import pytest

from trainer.tiny_families import FAMILIES, MOE
from trainer.tiny_layers import FULL, LAYER_RULES, LINEAR, SLIDING, TRANSFORMERS_RULES, layer_fields

BODIES: dict[str, dict[str, int]] = {
    "5 layers": {"layers": 5},  # a multiple of no period (2, 3, 4, 6, 8, 9, 10)
    "8 layers, wide": {"layers": 8, "hidden": 512, "head_dim": 128, "kv_heads": 2, "intermediate": 1024},
}
WIDE_EXPERTS = {"experts": 8, "experts_per_token": 2, "expert_intermediate": 96}
"""The MoE flags of the wide body (MoE families)."""

PER_LAYER = {
    "layer_types",
    "mlp_layer_types",
    "layers_block_type",
    "hybrid_layer_pattern",
    "moe_layer_freq",
    "no_rope_layers",
    "indexer_types",
    "intermediate_size",  # Gemma-3n: one width per layer
    "activation_sparsity_pattern",
    "layer_rope_theta",
    "num_attention_heads_per_layer",
}
"""Config fields with one entry per layer."""
LAYER_INDICES = {"full_attn_idxs", "mlp_only_layers", "moe_layers", "hybrid_layer_ids"}
"""Config fields listing layer indices."""
NOT_PER_LAYER = {"time_step_limit", "mlp_multipliers", "ssm_multipliers", "mtp_layers_block_type", "architectures"}
KINDS = ("layer_types", "mlp_layer_types", "indexer_types", "no_rope_layers", "layers_num_experts")
"""The per-layer fields that make layers differ (Jamba's layers_num_experts: a property of its periods)."""


def tiny(family: str, layers: int, **sizes: int) -> Any:
    """make-tiny-model's config (trainer.tiny_model.tiny_config) with its defaults, the vocabulary 300."""
    from trainer.tiny_model import tiny_config

    args = {"hidden": 128, "kv_heads": 1, "intermediate": 0, "head_dim": 64, "experts": 0, "experts_per_token": 0}
    args |= {"expert_intermediate": 0, **sizes}
    return tiny_config(family, vocab=300, token_id=0, layers=layers, tie=False, dtype="float32", **args)


def config_kinds(cfg: Any) -> list[tuple]:
    """Each layer's kind as the config states it: its entry in each per-layer field, and whether it is one of an MoE
    family's dense first layers or of qwen2_moe's mlp_only_layers."""
    n = cfg.num_hidden_layers
    lists = [v for f in KINDS if isinstance(v := getattr(cfg, f, None), list)]
    dense = max(getattr(cfg, f, 0) or 0 for f in ("first_k_dense_replace", "num_dense_layers", "moe_layer_start_index"))
    only = getattr(cfg, "mlp_only_layers", None) or []
    return [(*(v[i] for v in lists), i < dense, i in only) for i in range(n)]


def each_kind(kinds: list[tuple]) -> list[set]:
    """The kinds a body holds, field by field (Jamba's 2 layers: Mamba and attention, dense and MoE)."""
    return [set(column) for column in zip(*kinds, strict=True)]


def signature(layer: Any) -> tuple:
    """What makes a built layer of one kind: its modules' classes and their attention kind."""
    attrs = ("is_sliding", "sliding_window", "attention_type", "layer_type", "use_rope")
    return tuple(sorted((type(m).__name__, *(repr(getattr(m, a, None)) for a in attrs)) for m in layer.modules()))


@pytest.mark.parametrize("body", list(BODIES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_builds_its_layers_at_any_count_and_width(family, body, tmp_path):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    sizes = BODIES[body] | (WIDE_EXPERTS if family in MOE and "wide" in body else {})
    n = sizes.pop("layers")
    cfg = tiny(family, n, **sizes)
    cfg.save_pretrained(tmp_path)
    again = AutoConfig.from_pretrained(tmp_path)  # what the loader and vLLM read
    assert again.num_hidden_layers == cfg.num_hidden_layers == n and config_kinds(again) == config_kinds(cfg)
    for field, v in cfg.to_dict().items():
        if isinstance(v, list):
            assert field in PER_LAYER | LAYER_INDICES | NOT_PER_LAYER, f"{family}: list field {field} unclassified: {v}"
            assert field not in PER_LAYER or len(v) == n, f"{family}: {field} has {len(v)} entries, not {n}: {v}"
            assert field not in LAYER_INDICES or all(0 <= i < n for i in v), f"{family}: {field} {v} outside {n} layers"
    for field, v in layer_fields(family, n).items():  # the rule's fields are what the config holds
        assert getattr(cfg, field) == v, (family, field, getattr(cfg, field), v)

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    stacks = [
        m for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and name.split(".")[-1] in ("layers", "h")
    ]
    assert len(stacks) == 1 and len(stacks[0]) == n, (family, [len(s) for s in stacks])
    built = [signature(layer) for layer in stacks[0]]
    kinds = config_kinds(cfg)
    pairs = [(i, j) for i in range(n) for j in range(i)]
    differ = [(i, j) for i, j in pairs if (built[i] == built[j]) != (kinds[i] == kinds[j])]
    assert not differ, f"{family}: layers {differ} are built alike/unlike against the config's kinds {kinds}"
    if family in LAYER_RULES:  # every kind of the released pattern, at 5 and 8 layers too
        assert each_kind(kinds) == each_kind(config_kinds(tiny(family, 24))), (family, kinds)
    if "wide" in body:
        assert model.get_input_embeddings().weight.shape == (300, 512), family
        if family in MOE:  # the MoE flags: 8 routed experts (transformers' fused expert tensors: experts first)
            assert any(p.dim() == 3 and p.shape[0] == 8 for p in model.parameters()), family


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_fewest_layers_a_family_takes_hold_each_of_its_kinds(family):
    """make-tiny-model refuses exactly the layer counts that would leave out a kind of the family's pattern (or an MoE
    family's MoE layers), one short line naming the fix; a family whose transformers config derives its pattern keeps
    that derivation's own truncation (Gemma 3's 2 layers both slide, as the released model's first 2)."""
    least = next(n for n in range(1, 5) if not refused(family, n))
    if family not in TRANSFORMERS_RULES:
        assert each_kind(config_kinds(tiny(family, least))) == each_kind(config_kinds(tiny(family, 24))), (family, least)
    if least > 1:
        with pytest.raises(ValueError) as e:
            tiny(family, least - 1)
        assert f"--layers {least - 1} is too few for {family}" in str(e.value) and len(str(e.value)) < 200, e.value
        assert each_kind(config_kinds(unchecked(family, least - 1))) != each_kind(config_kinds(tiny(family, 24))), family


def refused(family: str, n: int) -> bool:
    try:
        tiny(family, n)
    except ValueError:
        return True
    return False


def unchecked(family: str, n: int) -> Any:
    """The config of n layers config_fields refuses: the family's rule applied to n anyway."""
    from transformers import AutoConfig

    from trainer.tiny_families import config_fields

    sizes = {"vocab": 300, "hidden": 128, "heads": 2, "kv_heads": 1, "head_dim": 64, "intermediate": 256}
    fields = config_fields(family, layers=n + 1, tie=False, token_id=0, dtype="float32", **sizes)
    return AutoConfig.for_model(family, **fields | {"num_hidden_layers": n, **layer_fields(family, n)})


def test_the_rules_follow_the_released_layouts_and_keep_the_2_layer_test_bodies():
    def kinds(family: str, n: int, field: str = "layer_types") -> list:
        return layer_fields(family, n)[field]

    assert kinds("qwen3_5_text", 24) == ([LINEAR] * 3 + [FULL]) * 6  # Qwen3.5: full_attention_interval 4
    assert kinds("gpt_oss", 5) == [SLIDING, FULL, SLIDING, FULL, SLIDING]
    nemotron = {
        n: "".join("M-*"[["linear_attention", "mlp", FULL].index(k)] for k in kinds("nemotron_h", n, "layers_block_type"))
        for n in (3, 4, 18)
    }
    assert nemotron == {3: "M*-", 4: "M-*-", 18: "M-M-M-M*-M-M-M-M*-"}  # Nemotron-H-8B's first 9, twice
    assert [i for i, k in enumerate(kinds("zamba2", 20, "layers_block_type")) if k == "hybrid"] == [6, 12, 18]
    assert layer_fields("lfm2", 16)["full_attn_idxs"] == [2, 5, 8, 11, 14]
    assert [i for i, k in enumerate(kinds("lfm2_moe", 24)) if k == FULL] == [2, 6, 10, 14, 18, 22]
    assert [i for i, k in enumerate(kinds("granitemoehybrid", 40)) if k == FULL] == [5, 15, 25, 35]
    assert [i for i, k in enumerate(kinds("mimo_v2_flash", 13)) if k == FULL] == [0, 5, 11]
    assert kinds("gemma4_text", 8) == [SLIDING] * 5 + [FULL, SLIDING, FULL]  # the last layer full
    jamba = tiny("jamba", 16)
    assert [i for i, k in enumerate(jamba.layers_block_type) if k == "attention"] == [4, 12]
    assert [i for i, e in enumerate(jamba.layers_num_experts) if e > 1] == list(range(1, 16, 2))
    # the 2-layer CPU test bodies (nemotron_h's 4) are the ones the family matrix was green with
    two = {f: layer_fields(f, 4 if f == "nemotron_h" else 2) for f in LAYER_RULES}
    assert two["qwen3_5_text"]["layer_types"] == two["qwen3_next"]["layer_types"] == [LINEAR, FULL]
    assert two["lfm2"] == {"layer_types": ["conv", FULL], "full_attn_idxs": [1]} and two["gemma4_text"]["layer_types"] == [
        SLIDING,
        FULL,
    ]
    assert two["mimo_v2_flash"]["hybrid_layer_pattern"] == two["mimo_v2_flash"]["moe_layer_freq"] == [0, 1]
    assert two["jamba"] == {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1}


def test_make_tiny_model_refuses_too_few_layers_before_writing(tmp_path):
    from trainer.tiny_model import main

    assert main([str(tmp_path / "m"), "--family", "nemotron_h", "--layers", "2"]) == 2
    assert not (tmp_path / "m").exists()
