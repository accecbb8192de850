"""The launcher's parameter count (launcher/core/shape.py, launcher/core/layer_kinds.py: config.json only) against the
model transformers builds: every tested family's tiny body (trainer/tiny_families.py) and variants of the hybrid and
SSM layouts, built on the meta device, has the parameters the shape counts, total and active per token, within 1 %;
the families counted approximately say so; released models count to their published sizes."""

from __future__ import annotations

import json

import pytest

from launcher.core import layer_kinds as K
from launcher.core.shape import APPROXIMATE, ModelShape
from launcher.memory import COMMON_HYBRID_CONFIGS, SCAN_NOTE, common_shape
from trainer.tiny_families import FAMILIES, config_fields
from trainer.tiny_layers import TINY_LAYERS

VARIANTS = {
    # Nemotron 3 Nano's layout: relu2 experts (non-gated, up and down) with a shared expert beside Mamba-2 and attention
    "nemotron_h+moe": (
        "nemotron_h",
        {
            "layers_block_type": ["mamba", "moe", "attention", "moe"],
            "n_routed_experts": 3,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "moe_shared_expert_intermediate_size": 64,
        },
    ),
    "nemotron_h+latent": (
        "nemotron_h",
        {"layers_block_type": ["moe", "mamba"], "num_hidden_layers": 2, "n_routed_experts": 3, "moe_latent_size": 64},
    ),
    "nemotron_h+pattern": ("nemotron_h", {"layers_block_type": None, "hybrid_override_pattern": "M-*-"}),
    "granitemoehybrid+moe": ("granitemoehybrid", {"num_local_experts": 3, "num_experts_per_tok": 2, "intermediate_size": 64}),
    "qwen3_next+dense_layer": ("qwen3_next", {"mlp_only_layers": [0]}),
    "qwen2_moe+dense_layer_untied": ("qwen2_moe", {"num_hidden_layers": 3, "mlp_only_layers": [1], "tie_word_embeddings": False}),
    "zamba2+two_blocks": (
        "zamba2",
        {
            "layers_block_type": ["hybrid", "mamba", "hybrid", "hybrid"],
            "num_hidden_layers": 4,
            "num_mem_blocks": 2,
            "use_shared_attention_adapter": True,
        },
    ),
    "falcon+new_architecture": ("falcon", {"new_decoder_architecture": True, "num_kv_heads": 1, "bias": True}),
    "opt+projected": ("opt", {"word_embed_proj_dim": 64}),
    "gemma3n_text+kv_shared": (
        "gemma3n_text",
        {"num_hidden_layers": 4, "num_kv_shared_layers": 2, "layer_types": ["sliding_attention", "full_attention"] * 2},
    ),
    "gemma4_text+moe_k_eq_v_shared": (
        "gemma4_text",
        {
            "num_hidden_layers": 4,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            "per_layer_config": None,
            "global_head_dim": 128,
            "num_global_key_value_heads": 2,
            "attention_k_eq_v": True,
            "num_kv_shared_layers": 2,
            "use_double_wide_mlp": True,
            "enable_moe_block": True,
            "num_experts": 3,
            "top_k_experts": 2,
            "moe_intermediate_size": 32,
        },
    ),
    "llama4_text+interleaved": ("llama4_text", {"num_hidden_layers": 4, "interleave_moe_layer_step": 2, "moe_layers": None}),
    "phi+qk_layernorm": ("phi", {"qk_layernorm": True}),
    "lfm2+untied": ("lfm2", {"tie_word_embeddings": False}),
    "jamba+untied": ("jamba", {"tie_word_embeddings": False, "num_hidden_layers": 4}),
}
"""Layouts the tiny bodies do not reach: experts in the hybrids, shared-block cycles, Falcon's new architecture, ..."""


def _built(family: str, extra: dict) -> tuple[dict, int, int]:
    """(config.json, parameters, parameters a token runs through) of the family's tiny body with `extra` fields, built
    on the meta device; active: each fused expert tensor (dim 0 = the experts) counts top-k of its experts."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = config_fields(
        family, vocab=300, hidden=128, layers=TINY_LAYERS.get(family, 2), heads=2, kv_heads=1, head_dim=64, intermediate=256, tie=True, token_id=0,
        dtype="float32",
    )  # fmt: skip
    fields = {k: v for k, v in {**fields, **extra}.items() if v is not None}
    cfg = AutoConfig.for_model(family, **fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    shape = json.loads(cfg.to_json_string())
    experts = ModelShape.from_config(shape)
    e, k = (experts.experts, experts.experts_per_token) if isinstance(experts, ModelShape) else (0, 0)
    total = active = 0
    for name, p in model.named_parameters():
        total += p.numel()
        routed = ".experts." in name and e and p.dim() == 3 and p.shape[0] == e
        active += p.numel() * k // e if routed else p.numel()
    return shape, total, active


CASES = {**{f: (f, {}) for f in FAMILIES}, **VARIANTS}


@pytest.mark.parametrize("case", list(CASES))
def test_the_shape_counts_the_model_transformers_builds(case):
    family, extra = CASES[case]
    config, total, active = _built(family, extra)
    shape = ModelShape.from_config(config)
    assert isinstance(shape, ModelShape), shape
    assert bool(shape.experts) == (active < total), (shape.experts, active, total)  # an MoE exactly where experts are
    if family in APPROXIMATE:  # counted as the Llama/MoE layout: it says so, and that the figure is low
        assert shape.approximate == APPROXIMATE[family] and shape.params < total
        return
    assert not shape.approximate
    assert shape.params == pytest.approx(total, rel=0.01), (shape.params, total)
    assert shape.active_params == pytest.approx(active, rel=0.01), (shape.active_params, active)
    if shape.kinds:
        assert sum(k.count for k in shape.kinds) == shape.layers
        assert shape.layer_params == max(k.params for k in shape.kinds) < shape.params


@pytest.mark.parametrize("family", [f for f in FAMILIES if f in K.READERS or f in K.MOE_AWARE])
def test_a_config_json_without_the_fields_at_their_defaults_counts_the_same(family):
    """Released config.json files leave fields out where transformers' configuration class has the default: the
    count takes the same defaults (tie_word_embeddings, biases, LFM2's MLP rounding, ...)."""
    from transformers import AutoConfig

    config, _, _ = _built(family, {})
    defaults = json.loads(AutoConfig.for_model(family).to_json_string())
    sparse = {k: v for k, v in config.items() if k == "model_type" or defaults.get(k, ...) != v}
    full, short = ModelShape.from_config(config), ModelShape.from_config(sparse)
    assert isinstance(short, ModelShape) and isinstance(full, ModelShape), short
    assert (short.params, short.active_params) == (full.params, full.active_params)


def test_gemma4s_full_layers_count_from_either_form_of_their_overrides():
    """Gemma 4's config.json gives the full-attention layers' head_dim and kv heads as per_layer_config (transformers
    writes it) or as global_head_dim / num_global_key_value_heads (which transformers turns into it): one count."""
    config, total, _ = _built(*VARIANTS["gemma4_text+moe_k_eq_v_shared"])
    assert config["per_layer_config"]["1"] == {"head_dim": 128, "num_key_value_heads": 2}
    short = {k: v for k, v in config.items() if k != "per_layer_config"} | {"global_head_dim": 128}
    shape = ModelShape.from_config(short | {"num_global_key_value_heads": 2})
    assert getattr(shape, "params", shape) == total


def test_released_models_count_to_their_published_sizes():
    """From their config.json values (memory.COMMON_HYBRID_CONFIGS, simulate's rows): Qwen3-Next-80B-A3B "80B in total
    and 3B activated" (the card's 3B leaves out the embedding and lm_head; its 81.3B of safetensors add the MTP layer,
    which transformers does not build), Jamba-v0.1 "52B total, 12B active", Mamba-Codestral-7B 7,285,403,648."""
    nxt, jamba, codestral = (common_shape(n) for n in COMMON_HYBRID_CONFIGS)
    embeddings = 2 * nxt.vocab * nxt.hidden
    assert round(nxt.params / 1e9) == 80 and round((nxt.active_params - embeddings) / 1e9) == 3
    assert round(jamba.params / 1e9) == 52 and round(jamba.active_params / 1e9) == 12
    assert codestral.params == 7_285_403_648
    # the hand-written GPT-NeoX-20B (the paper's 20,554,567,680) and Falcon-7B (6,921,720,704) bodies
    neox = {"model_type": "gpt_neox", "hidden_size": 6144, "num_hidden_layers": 44, "intermediate_size": 24576}
    neox |= {"vocab_size": 50432, "num_attention_heads": 64, "tie_word_embeddings": False}
    falcon = {"model_type": "falcon", "hidden_size": 4544, "num_hidden_layers": 32, "num_attention_heads": 71}
    falcon |= {"vocab_size": 65024, "multi_query": True, "parallel_attn": True, "bias": False}
    counts = [getattr(ModelShape.from_config(c), "params", c) for c in (neox, falcon)]
    assert counts == [20_554_567_680, 6_921_720_704]


def test_ssm_layers_keep_more_activations_and_no_attention_scores():
    """The memory estimate's terms for a hybrid: a Mamba layer under transformers' PyTorch scan keeps far more per token
    than an attention + MLP layer of the same hidden size, and eager attention's scores count in attention layers
    only."""
    jamba = common_shape("Jamba-v0.1")
    kinds = {k.name: k for k in jamba.kinds}
    assert kinds["mamba+mlp"].act_bytes > 2 * kinds["attention+mlp"].act_bytes
    assert jamba.attention_layers == kinds["attention+mlp"].count == 4
    assert common_shape("MambaCodestral").attention_layers == 0


def test_dry_run_names_the_layer_kinds_or_says_why_there_is_no_estimate(tmp_path, capsys):
    from launcher.cli import main as cli_main
    from tests.conftest import REPO

    def section(config: dict) -> str:
        model = tmp_path / str(len(list(tmp_path.iterdir())))
        model.mkdir()
        (model / "config.json").write_text(json.dumps(config))
        argv = [
            "dry-run",
            str(REPO / "configs/gpu_7b_4nodes.yaml"),
            "--set",
            f"vllm.model={model}",
            "--skip-checks",
            "all,memory",
        ]
        assert cli_main(argv) == 0
        return capsys.readouterr().out.split("# memory estimate")[1].split("# sbatch")[0]

    jamba = section(COMMON_HYBRID_CONFIGS["Jamba-v0.1"])
    assert "model 51.57B parameters (12.11B active per token: 2 of 16 experts)" in jamba, jamba
    assert "(layers: 12 mamba+mlp, 16 mamba+moe, 4 attention+mlp)" in jamba and SCAN_NOTE in jamba, jamba
    gpt2 = section({"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257})
    assert "model 0.12B parameters (layers: 12 attention+mlp)" in gpt2 and SCAN_NOTE not in gpt2, gpt2
    broken = {**COMMON_HYBRID_CONFIGS["MambaCodestral"], "model_type": "nemotron_h", "num_attention_heads": 32}
    assert "no estimate: nemotron_h: its config.json cannot be counted" in section(broken)
    hy_v4 = {"model_type": "hy_v4", "hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 12288}
    hy_v4 |= {"vocab_size": 129280, "num_attention_heads": 32, "num_key_value_heads": 32, "n_routed_experts": 64}
    hy_v4 |= {"num_experts_per_tok": 8, "moe_intermediate_size": 2048}
    assert f"approximate: {APPROXIMATE['hy_v4']}, so every figure here is low" in section(hy_v4)


MIXERS = {
    # family: (layer 0's mixer module, its Part as the tiny config sizes it: trainer/tiny_families.py, hidden 128)
    "mamba": ("mixer", lambda: K.mamba(128, 256, 16, 8, 4, conv_bias=True, bias=False)),
    "mamba2": ("mixer", lambda: K.mamba2(128, 256, 4, 1, 16, 4, 64, conv_bias=True, bias=False)),
    "qwen3_5_text": ("linear_attn", lambda: K.gated_deltanet(128, 2, 32, 4, 32, 4)),
    "lfm2": ("conv", lambda: K.short_conv(128, 3, False)),
}


@pytest.mark.parametrize("family", list(MIXERS))
def test_an_ssm_mixers_activation_term_is_what_its_pytorch_path_keeps(family):
    """The activations an SSM, Gated DeltaNet or short-conv mixer keeps for the backward (bf16, transformers' PyTorch
    path, as the trainer runs it without mamba-ssm/fla kernels): the tensors saved in its forward, per token, within
    10 % of the estimate's term (LayerKind.act_bytes less the layer's norm and residual share)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    module, part = MIXERS[family]
    fields = config_fields(
        family, vocab=300, hidden=128, layers=TINY_LAYERS.get(family, 2), heads=2, kv_heads=1, head_dim=64, intermediate=256, tie=True, token_id=0,
        dtype="bfloat16",
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **fields)).to(torch.bfloat16).train()
    mixer = model.get_submodule(next(n for n, _ in model.named_modules() if n.endswith(f"layers.0.{module}")))
    saved: dict[int, int] = {}
    inside = [False]
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}  # saved for the backward, not activations

    def keep(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if inside[0] and ptr not in weights:  # one count per storage: views of one tensor are saved once
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    mixer.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
    mixer.register_forward_hook(lambda *_: inside.__setitem__(0, False))
    ids = torch.randint(0, 300, (2, 128))
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        model(input_ids=ids, use_cache=False)
    expected = part()[3] - K.NORM_RESIDUAL * 128
    assert sum(saved.values()) / ids.numel() == pytest.approx(expected, rel=0.1)
