"""trainer.lora.target_modules left at its default (a Llama's names) is resolved at plan time for the model, from its
weight names (launcher.core.lora.resolve_targets): every linear layer of the decoder layers, on an MoE those outside
its MLP block. Before, LFM2's default adapted q/k/v only (its out_proj, conv and w1-w3 without adapters), GPT-NeoX's
matched nothing (refused), DeepSeek-V3's MLA was refused for a q_proj the user never named. Each family's tiny body
(trainer.tiny_families) is loaded; the resolved names are then given to peft on transformers' own module tree, the
trainer's way (trainer.lora.apply): the modules peft adapts must be exactly the decoder layers' linear layers (the
MoE's outside its MLP block; those launcher.core.lora.bypassed names left out: Mamba's out_proj, which peft refuses,
dt_proj, whose weight transformers reads directly), so the launcher's reading of weight names is the model's; and one
backward pass with every lora_B non-zero must give every adapter a gradient (before, Mamba's and Jamba's dt_proj got
none). A sweep of all 77 families of trainer.tiny_families through the same checks (2026-12-06): gradients everywhere
but mamba/falcon_mamba/jamba's dt_proj (now left out) and gemma3n_text's correction_coefs (read directly in training:
left out) and per_layer_input_gate/projection (the tiny body's correct_output_scale is zero, a real checkpoint's not);
left without adapters by design, zamba2's own adapter lists (gate_up_proj_adapter_list.N.M: no leaf name to target)
and afmoe's and hy_v4's attention gate, named gate_proj (an MoE's MOE_REFUSED_TARGETS: peft would put it on the fused
experts too). A hub-named model is not resolved, and the plan's LoRA targets line says so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher.core import config as C
from launcher.core.inputs import input_notes, input_problems
from launcher.core.lora import MOE_BLOCK
from launcher.core.plan import Plan, plan

RESOLVED = {
    "qwen3": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],  # the default as it was
    "lfm2": ["q_proj", "k_proj", "v_proj", "in_proj", "out_proj", "w1", "w2", "w3"],
    "gpt_neox": ["dense", "dense_4h_to_h", "dense_h_to_4h", "query_key_value"],
    "deepseek_v3": ["o_proj", "kv_a_proj_with_mqa", "kv_b_proj", "q_a_proj", "q_b_proj"],  # MLA; experts left out
    "lfm2_moe": ["q_proj", "k_proj", "v_proj", "in_proj", "out_proj"],  # LFM2's conv kept, its feed_forward not
    "mamba": ["in_proj"],  # not out_proj/conv1d (peft refuses them), dt_proj (bypassed), x_proj (mamba-ssm bypasses it)
    "jamba": ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "out_proj", "x_proj"],  # its dt_proj bypassed
    "gpt2": ["c_attn", "c_fc", "c_proj"],  # transformers' Conv1D
}
"""What the default adapts per family (the MoE rows: attention and the short convolutions, never the MLP block)."""

MOE_FAMILIES = {"deepseek_v3", "lfm2_moe", "jamba"}


def cfg(model: str, **lora) -> C.JobConfig:
    return C.from_dict({"vllm": {"model": model}, "slurm": {"gpus_per_node": 2}, "trainer": {"lora": {"r": 8, **lora}}})


@pytest.fixture(scope="module")
def bodies(tmp_path_factory) -> dict[str, str]:
    from trainer.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("lora-bodies")
    for family in RESOLVED:
        make_tiny_model(root / family, family=family)
    return {family: str(root / family) for family in RESOLVED}


def adapted_linear_and_untrained(model_dir: str, targets: list[str], moe: bool) -> tuple[set[str], set[str], set[str]]:
    """(modules peft adapts with `targets`, the linear layers of the decoder's numbered blocks [an MoE's outside its
    MLP block; those launcher.core.lora.bypassed leaves out: peft refuses them, or transformers or a kernel reads their
    weight past an adapter], the adapted modules whose adapters got no gradient), on the family's own module tree
    (transformers, the tiny body's weights): one forward and backward in training mode with every lora_B non-zero
    (peft starts B at zero), so an adapter the forward never reaches shows as a zero gradient."""
    import re

    import torch
    from transformers import AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D

    from launcher.core.lora import bypassed
    from trainer.lora import apply

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gone = bypassed(model.config.model_type)
    linear = {
        n
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear | Conv1D)
        and re.search(r"\.\d+\.", n)
        and not (moe and MOE_BLOCK.search(n))
        and n.rpartition(".")[2] not in gone
    }
    peft_model = apply(model, C.LoraConfig(r=8, target_modules=targets), torch.float32)  # raises where peft refuses
    adapted = {n.removeprefix("base_model.model.") for n, m in peft_model.named_modules() if hasattr(m, "lora_A")}
    for n, w in peft_model.named_parameters():
        if ".lora_B." in n:
            w.data.normal_(0, 0.02)
    peft_model.train()
    ids = torch.randint(0, model.config.vocab_size, (1, 12))
    peft_model(input_ids=ids, use_cache=False).logits.pow(2).mean().backward()
    untrained = {
        n.removeprefix("base_model.model.").split(".lora_")[0]
        for n, w in peft_model.named_parameters()
        if ".lora_" in n and (w.grad is None or not w.grad.abs().sum())
    }
    return adapted, linear, untrained


@pytest.mark.parametrize("family", list(RESOLVED))
def test_the_default_targets_become_every_linear_layer_of_the_familys_decoder_layers(bodies, family):
    p = plan(cfg(bodies[family]), "/jobs/x")
    targets = p.config.trainer.lora.target_modules
    assert targets == RESOLVED[family]
    assert f"LoRA targets = {', '.join(targets)}" in "\n".join(p.derivation)
    assert not [x for x in input_problems(p.config) + input_notes(p.config) if "lora" in x]  # nothing left to warn
    adapted, linear, untrained = adapted_linear_and_untrained(bodies[family], targets, moe=family in MOE_FAMILIES)
    assert adapted == linear and linear, sorted(linear ^ adapted)
    assert not untrained, sorted(untrained)  # before: mamba's dt_proj (transformers reads dt_proj.weight directly)


def test_a_users_own_targets_are_kept_and_checked(bodies):
    lfm2 = bodies["lfm2"]
    assert plan(cfg(lfm2, target_modules=["q_proj", "v_proj"]), "/jobs/x").config.trainer.lora.target_modules == [
        "q_proj",
        "v_proj",
    ]
    problems = input_problems(cfg(lfm2, target_modules=["q_proj", "o_proj"]))  # LFM2's attention output is out_proj
    assert [x for x in problems if "'o_proj' matches no module" in x and "out_proj" in x], problems
    with pytest.raises(C.ConfigError, match=r"on a mixture of experts LoRA adapts attention only"):
        plan(cfg(bodies["deepseek_v3"], target_modules=["q_a_proj", "gate_proj"]), "/jobs/x")
    with pytest.raises(C.ConfigError, match=r"'out_proj': peft 0.21 refuses LoRA on out_proj, conv1d of a Mamba-based"):
        plan(cfg(bodies["mamba"], target_modules=["in_proj", "out_proj"]), "/jobs/x")  # before: peft's error on the nodes
    with pytest.raises(C.ConfigError, match=r"'mixer.dt_proj': transformers reads mamba's dt_proj.weight directly"):
        plan(cfg(bodies["mamba"], target_modules=["in_proj", "mixer.dt_proj"]), "/jobs/x")  # before: a dead adapter
    with pytest.raises(C.ConfigError, match=r"'all-linear' reaches out_proj, conv1d, dt_proj, x_proj of mamba, refused.*default"):
        plan(cfg(bodies["mamba"], target_modules=["all-linear"]), "/jobs/x")  # before: peft's error on the nodes
    kernel = cfg(bodies["mamba"], target_modules=["in_proj", "x_proj"])  # trains on CPU, not where mamba-ssm runs it
    assert plan(kernel, "/jobs/x").config.trainer.lora.target_modules == ["in_proj", "x_proj"]
    assert [n for n in input_notes(kernel) if "'x_proj': where mamba-ssm is installed" in n], input_notes(kernel)


def test_a_model_without_decoder_linear_layers_is_refused_and_a_node_resolves_what_the_submit_host_could_not(bodies, tmp_path):
    from safetensors.numpy import save_file

    np = pytest.importorskip("numpy")
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    save_file({"model.embed_tokens.weight": np.zeros((8, 4), np.float32)}, str(bare / "model.safetensors"))
    with pytest.raises(C.ConfigError, match=r"no linear layer in the decoder layers of .*set trainer.lora.target_modules="):
        plan(cfg(str(bare)), "/jobs/x")
    # a multimodal release (Qwen3.5's vision tower beside the text layers): the tower's numbered blocks are not the
    # decoder's (transformers' causal LM drops them), so its linear layers are not among the default's
    # and DeepSeek-V3's multi-token-prediction layer (model.layers.N at N = num_hidden_layers), which it drops too
    w = np.zeros((4, 4), np.float32)
    save_file(
        {
            "model.visual.blocks.0.attn.qkv.weight": w,
            "model.language_model.layers.0.self_attn.o_proj.weight": w,
            "model.language_model.layers.1.eh_proj.weight": w,
        },
        str(bare / "model.safetensors"),
    )
    shape = {"hidden_size": 4, "num_hidden_layers": 1, "intermediate_size": 8, "vocab_size": 8, "num_attention_heads": 1}
    (bare / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], **shape}))
    assert plan(cfg(str(bare)), "/jobs/x").config.trainer.lora.target_modules == ["o_proj"]
    # the submit host saw no weights (a folder the nodes fill, *.bin only here): the default stays in plan.json, and
    # Plan.load on a node that reads the model resolves it
    later = tmp_path / "later"
    later.mkdir()
    (later / "config.json").write_text((Path(bodies["gpt_neox"]) / "config.json").read_text())
    p = plan(cfg(str(later)), str(tmp_path / "job"))
    assert tuple(p.config.trainer.lora.target_modules) == C.LORA_TARGETS
    (tmp_path / "plan.json").write_text(p.to_json())
    (later / "model.safetensors").symlink_to(Path(bodies["gpt_neox"]) / "model.safetensors")
    assert Plan.load(tmp_path / "plan.json").config.trainer.lora.target_modules == RESOLVED["gpt_neox"]
    # what the LoRA targets line says where the default is left as it is: resolved later, or never (a hub name)
    line = next(x for x in p.derivation if x.startswith("LoRA targets"))
    assert "(not resolved here: no safetensors weights in vllm.model on this host; the nodes resolve it at start" in line
    line = next(x for x in plan(cfg(str(tmp_path / "absent")), "/jobs/x").derivation if x.startswith("LoRA targets"))
    assert "(not resolved here: no safetensors" in line and "set trainer.lora.target_modules=" in line, line
    hub = plan(cfg("EleutherAI/pythia-70m"), "/jobs/x")
    line = next(x for x in hub.derivation if x.startswith("LoRA targets"))
    assert "(not resolved: vllm.model is a hub name" in line and "set trainer.lora.target_modules=" in line, line
    assert tuple(hub.config.trainer.lora.target_modules) == C.LORA_TARGETS
    assert "not resolved" not in next(x for x in plan(cfg(bodies["qwen3"]), "/jobs/x").derivation if x.startswith("LoRA t"))


def test_gpt2s_default_conv1d_targets_push_merged_as_peft_merges_them(tmp_path):
    """GPT-2's linear layers are Conv1D (weight [in, out]; peft adapts them with fan_in_fan_out): the default now
    reaches them, and the merged push (its vLLM class has no LoRA) must add (B A)^T. Before, the merge added B A:
    a shape error on c_attn, and a wrong weight on the square c_proj."""
    import torch

    from tests.unit.test_lora_push import trained
    from trainer.push.adapter import MergedPusher
    from trainer.push.pusher import PushSettings
    from trainer.tiny_model import make_tiny_model

    make_tiny_model(tmp_path, family="gpt2")
    p = plan(cfg(str(tmp_path)), "/jobs/x")
    assert p.config.trainer.lora.target_modules == ["c_attn", "c_fc", "c_proj"] and p.lora_push == "merged"
    lora = C.LoraConfig(r=4, alpha=16, target_modules=p.config.trainer.lora.target_modules)
    settings = PushSettings("gloo", 0, 1, 10.0, torch.float32, 1 << 20)
    sent = dict(MergedPusher(trained(str(tmp_path), lora), None, settings, torch.device("cpu"), lora).params())
    want = dict(trained(str(tmp_path), lora).merge_and_unload().named_parameters())
    assert sorted(sent) == sorted(want)
    worst = max((t - want[n]).abs().max().item() for n, t in sent.items())
    assert worst <= 1e-6, worst
