"""The family matrix, unit tier: a tiny random body of every family in trainer.tiny_families (dense and MoE; those in
SWEEP_ONLY with SLURM_GRPO_TEST_ALL_FAMILIES=1 only) through
the default sharded loader on 2 gloo ranks, bit for bit what `from_pretrained` makes (Gemma's non-persistent embedding
scale, MoE per-expert checkpoints into transformers' fused experts with 3 experts on 2 ranks), each checkpoint byte
read by exactly one rank; and each MoE family trains under FSDP2 and resumes from a checkpoint bit for bit."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest

from tests.support.ranks import cpu_parallel, run_ranks
from trainer.tiny_families import FAMILIES, MOE, PUSH_NOT_CHECKED, SWEEP_ONLY

ALL_FAMILIES = os.environ.get("SLURM_GRPO_TEST_ALL_FAMILIES") == "1"
"""Every family of trainer.tiny_families, SWEEP_ONLY included (the unit tier runs without them)."""
NO_STATE = "the in-process forward keeps no recurrent state (linear attention, short convolutions, SSMs)"
MLA = "MLA: the in-process forward drives plain attention layers (vLLM's CPU MLA serves only a 512-wide latent)"
FORWARD_NOT_CHECKED = {
    **dict.fromkeys(("deepseek_v3", "deepseek_v2", "glm4_moe_lite", "axk1"), MLA),
    **dict.fromkeys(
        ("qwen3_next", "lfm2", "lfm2_moe", "nemotron_h", "granitemoehybrid", "falcon_h1", "zamba2", "jamba"), NO_STATE
    ),
    **dict.fromkeys(("mamba", "mamba2", "falcon_mamba"), NO_STATE),
    "minimax_m2": "vLLM 0.32's CPU router takes softmax scores only (its sigmoid router serves on a GPU)",
    "gemma3n_text": "vLLM 0.32's Gemma3nForCausalLM leaves out the per-layer token embeddings (0.38 off): refused at "
    "plan time (plan.UNSUPPORTED_ARCHITECTURES)",
}
"""Families whose pushed model's forward is not compared with transformers' here, and why (GPU or server runs only)."""
assert set(FORWARD_NOT_CHECKED) <= set(FAMILIES), set(FORWARD_NOT_CHECKED) - set(FAMILIES)
FORWARD_CHECKED = set(FAMILIES) - set(FORWARD_NOT_CHECKED) - set(PUSH_NOT_CHECKED)
"""Every other family: vLLM's forward on the pushed weights gives transformers' prompt logprobs of PROBE (fp32, within
FORWARD_TOLERANCE). Found by it (2026-12-06, when it covered every family): MiMo-V2-Flash's sliding-window sinks, which
vLLM drops without a config field transformers lacks (launcher.core.plan.SERVED_FIELDS), Cohere2-MoE's untied tiny
body (vLLM ties it), Apertus's xIELU after a push (trainer.push.vllm_plugin.xielu_from_its_constants); earlier
GPT-NeoX's kv heads."""
XIELU_CONSTANTS = ("act_fn.beta", "act_fn.eps")
"""Apertus's xIELU buffers: a push's layerwise reload leaves them uninitialised (no push carries buffers), and vLLM's
xIELU computes from its float constants instead (trainer.push.vllm_plugin.xielu_from_its_constants)."""
FORWARD_TOLERANCE = {"gemma2": 1e-3, "bloom": 1e-3, "apertus": 5e-3}
"""Where fp32 on both sides still differs by more than rounding (1e-4): Gemma-2's logit soft-capping 3.4e-4, Bloom's
ALiBi 3.2e-4, Apertus 2.7e-3 (vLLM builds xIELU's alphas in bf16 whatever the model's dtype, as transformers' default)."""
PROBE = [3, 17, 42, 99, 5, 250, 7, 11, 64, 128, 31, 200]
"""A token sequence for the forward comparison (the tiny bodies' vocabulary is 300)."""


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict[str, str]:
    from trainer.tiny_model import make_tiny_model

    assert SWEEP_ONLY <= set(FAMILIES), SWEEP_ONLY - set(FAMILIES)
    assert set(PUSH_NOT_CHECKED) <= set(FAMILIES), set(PUSH_NOT_CHECKED) - set(FAMILIES)
    root = tmp_path_factory.mktemp("families")
    out = {}
    for family in (f for f in FAMILIES if ALL_FAMILIES or f not in SWEEP_ONLY):
        make_tiny_model(root / family, family=family, tie=family.startswith("gemma"))
        out[family] = str(root / family)
    return out


def train_save_resume(par, model_dir: str, ckpt: str) -> dict:
    """MoE under FSDP2 (experts sharded on dim 0): two AdamW steps, a checkpoint after the first, a fresh load resumed
    from it and stepped once: the same weights as the uninterrupted run, bit for bit."""
    import torch
    from torch.distributed.tensor import DTensor

    from launcher.core.records import CheckpointMeta
    from trainer import checkpoint
    from trainer.loading import load_model

    ids = torch.arange(2 * 12).reshape(2, 12) % 200

    def step(model, opt) -> None:
        model.train()
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()

    def experts(model) -> dict:
        return {n: p.full_tensor() for n, p in model.named_parameters() if isinstance(p, DTensor) and p.dim() == 3}

    model, _ = load_model(model_dir, par, torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    start = experts(model)
    step(model, opt)
    checkpoint.save(Path(ckpt), model, opt, None, CheckpointMeta(step=1, world_size=par.world))
    step(model, opt)
    again, _ = load_model(model_dir, par, torch.float32)
    opt2 = torch.optim.AdamW(again.parameters(), lr=1e-2)
    checkpoint.load(Path(ckpt) / "step-000001", again, opt2, None)
    step(again, opt2)
    want, got = experts(model), experts(again)
    return {
        "experts_moved": bool(want) and all(not torch.equal(want[n], start[n]) for n in want),
        "resumed_equal": bool(want) and all(torch.equal(want[n], got[n]) for n in want),
    }


def load_and_compare(rank: int, world: int, _port: int, dirs: dict[str, str], ckpt_root: str) -> dict[str, dict]:
    import torch
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    from trainer.loading import load_model

    par = cpu_parallel(rank, world)
    out = {}
    for family, d in dirs.items():
        model, report = load_model(d, par, torch.float32)
        ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)

        def full(t):
            return t.full_tensor() if isinstance(t, DTensor) else t

        got = {k: full(v) for k, v in model.state_dict().items()}
        got.update({f"buffer:{k}": full(b) for k, b in model.named_buffers()})
        want = {**ref.state_dict(), **{f"buffer:{k}": b for k, b in ref.named_buffers()}}
        out[family] = {
            "missing": sorted(set(want) ^ set(got)),
            "differ": [k for k in want if k in got and not torch.equal(got[k], want[k])],
            "fused_experts": [n for n, p in model.named_parameters() if p.dim() == 3],
            "bytes_read": report.bytes_read,
        }
        if family in MOE:
            out[family] |= train_save_resume(par, d, f"{ckpt_root}/{family}")
    return out


def test_every_family_loads_sharded_bit_for_bit_as_from_pretrained(family_dirs, tmp_path):
    res = run_ranks(2, functools.partial(load_and_compare, dirs=family_dirs, ckpt_root=str(tmp_path)), timeout_s=300)
    for family, d in family_dirs.items():
        r0, r1 = res[0][family], res[1][family]
        assert not r0["missing"] and not r0["differ"], f"{family}: sharded load differs from from_pretrained: {r0}"
        assert not r1["differ"], f"{family}, rank 1: {r1['differ']}"
        on_disk = sum(f.stat().st_size for f in Path(d).glob("*.safetensors"))
        # the headers are the only bytes nobody reads; each tensor byte is read by one rank (the owner of its rows)
        assert 0 < on_disk - (r0["bytes_read"] + r1["bytes_read"]) < 32_000, f"{family}: {on_disk} on disk, read {r0}, {r1}"
        if family in MOE:
            assert r0["fused_experts"], f"{family}: no fused expert parameter was built: {r0}"
            assert r0["experts_moved"] and r0["resumed_equal"] and r1["resumed_equal"], f"{family}: train/resume: {r0}, {r1}"


def kept_by_vllm(served: list[str], buffers: set[str]) -> set[str]:
    """vLLM's parameters fed by transformers' persistent buffers, which the trainer neither trains nor pushes: the same
    names, and the router's score-correction bias under vLLM's own name in each layer that has such a buffer (LFM2's
    `feed_forward.expert_bias` is vLLM's `feed_forward.gate.e_score_correction_bias`)."""
    import re

    layers = {m.group() for b in buffers if (m := re.search(r"layers\.\d+\.", b))}
    return buffers | {n for n in served if n.endswith("e_score_correction_bias") and any(x in n for x in layers)}


def push_and_compare(rank: int, world: int, _port: int, dirs: dict[str, str], out_root: str) -> dict[str, dict]:
    import torch
    from transformers import AutoModelForCausalLM

    from tests.support.vllm_inproc import InProcessVllm
    from trainer.checkpoint_names import served_names
    from trainer.loading import persistent_buffers

    def as_pushed(model) -> list[tuple[str, torch.Tensor]]:
        names = served_names(model, [n for n, _ in model.named_parameters()])
        return [(names[n], p.detach().clone()) for n, p in model.named_parameters()]

    before, after, frozen, want_logprobs = {}, {}, {}, {}
    torch.manual_seed(1)
    # every HF model before vLLM's classes are imported: vLLM's olmo2 decorates transformers' Olmo2Model in place
    for family, d in dirs.items():
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
        before[family] = as_pushed(model)
        with torch.no_grad():
            for p in model.parameters():  # "a training step": every parameter moves
                p.add_(0.1 * torch.randn_like(p))
        after[family] = as_pushed(model)
        if family in FORWARD_CHECKED:
            with torch.no_grad():
                lp = torch.log_softmax(model(torch.tensor([PROBE])).logits[0].float(), -1)
            want_logprobs[family] = [lp[i, PROBE[i + 1]].item() for i in range(len(PROBE) - 1)]
        # persistent buffers (DeepSeek's e_score_correction_bias) are not trained, so not pushed: vLLM keeps its own
        frozen[family] = set(served_names(model, [n for n, _ in persistent_buffers(model)]).values())
        model.save_pretrained(f"{out_root}/{family}")  # the same weights as a checkpoint vLLM loads from scratch
    vllm = InProcessVllm()
    out = {}
    for family in sorted(dirs, key=lambda f: f not in MOE):  # vLLM makes its expert-parallel group with the first model
        served, cfg = vllm.build(f"{out_root}/{family}")
        frozen[family] = kept_by_vllm([n for n, _ in served.named_parameters()], frozen[family])
        fresh = {n: p.detach().clone() for n, p in served.named_parameters()}  # as loaded from the trained checkpoint
        fresh_buffers = {n: b.detach().clone() for n, b in served.named_buffers()}
        vllm.push(served, cfg, before[family])  # the server's weights move away from the trained ones...
        moved = [n for n, p in served.named_parameters() if not torch.equal(p, fresh[n])]
        vllm.push(served, cfg, after[family])  # ...and a push of the trained weights must land exactly on the fresh load
        out[family] = {
            "renamed": sorted({n.split(".")[3] for n, _ in after[family] if ".block_sparse_moe." in n}),
            "unmoved": sorted(set(fresh) - set(moved) - frozen[family]),
            "differ": [n for n, p in served.named_parameters() if not torch.equal(p, fresh[n])],
            # no push carries buffers: each must be as loaded (rotary caches, constants), Apertus's unused pair aside
            "buffers_differ": [
                n
                for n, b in served.named_buffers()
                if n in fresh_buffers and not n.endswith(XIELU_CONSTANTS) and not torch.equal(b, fresh_buffers[n])
            ],
            "params": len(fresh),
            "split": "load_weights" in vars(served),  # the plugin's per-expert split (trainer.push.vllm_plugin)
        }
        if family in FORWARD_CHECKED:  # the trained weights in vLLM's model: its forward is transformers'
            got = vllm.prompt_logprobs(served, cfg, PROBE)
            out[family]["logprob_diff"] = max(abs(a - b) for a, b in zip(got, want_logprobs[family], strict=True))
    return out


def test_every_familys_push_lands_in_vllms_model_as_a_fresh_load(family_dirs, tmp_path):
    """The trainer's push (names from trainer.checkpoint_names.served_names, HF's fused experts as they are) through
    vLLM's own load_weights and layerwise reload, with the project's plugin: every parameter of vLLM's model then
    equals a fresh load of the same weights (Mixtral's experts under vLLM's names; Qwen3-MoE's expert width 48 padded
    and re-prepacked by the CPU kernel; DeepSeek's and gpt-oss's fused experts split per expert by the plugin, DeepSeek's MLA's absorbed
    W_UK_T / W_UV recomputed, gpt-oss's attention sinks loaded through their weight loader; its router's e_score_correction_bias, a buffer the trainer neither trains nor pushes, kept). One vLLM model per family: loaded from the trained weights, pushed the
    untrained ones (every parameter must move), then the trained ones (every parameter must be back, bit for bit, and
    every buffer as loaded: no push carries one).
    PUSH_NOT_CHECKED's families are left out (vLLM's CPU build cannot build them; the reason is beside each). For
    FORWARD_CHECKED's families, vLLM's forward on the pushed weights gives transformers' prompt logprobs."""
    dirs = {f: d for f, d in family_dirs.items() if f not in PUSH_NOT_CHECKED}  # the reason is beside each
    res = run_ranks(1, functools.partial(push_and_compare, dirs=dirs, out_root=str(tmp_path)), timeout_s=600)[0]
    for family, r in res.items():
        assert r["params"] > 0 and not r["unmoved"], f"{family}: a push left vLLM's parameters {r['unmoved']} as they were"
        assert not r["differ"], f"{family}: after a push, vLLM's parameters differ from a fresh load: {r}"
        assert not r["buffers_differ"], f"{family}: a push changed vLLM's buffers {r['buffers_differ']}"
    # fp32 on both sides: the same numbers up to rounding
    off = {
        f: r["logprob_diff"]
        for f, r in res.items()
        if f in FORWARD_CHECKED and not r["logprob_diff"] < FORWARD_TOLERANCE.get(f, 1e-4)
    }
    assert not off, f"vLLM's prompt logprobs differ from transformers' (max |diff| per family): {off}"
    assert res["mixtral"]["renamed"] == ["block_sparse_moe"], res["mixtral"]  # vLLM's module name, not HF's mlp
    # only the loaders without fused expert names (DeepSeek, GLM-4.7-Flash, HY-V3, A.X-K1, MiMo-V2-Flash) or that write
    # them past the reload (gpt-oss) get the fused tensors split; the others keep one tensor per layer
    split = {"deepseek_v2", "deepseek_v3", "glm4_moe_lite", "gpt_oss", "hy_v3", "axk1", "mimo_v2_flash"} & set(res)
    assert {f for f, r in res.items() if r["split"]} == split and "deepseek_v3" in split, res


def test_families_whose_push_cannot_reach_vllm_are_refused_at_plan_time(tmp_path):
    """OLMo-Hybrid and HRM-Text: transformers and vLLM name their fused tensors differently in ways no renaming bridges
    (launcher.core.plan.UNSUPPORTED_FAMILIES); the plan refuses them in one line, a family of the matrix plans."""
    import json

    from launcher.core import config as C
    from launcher.core.plan import UNSUPPORTED_FAMILIES, plan
    from tests.unit.test_moe_config import MOE as QWEN3_MOE  # a tiny Qwen3-MoE config.json

    def planned(model_type: str) -> None:
        (tmp_path / "config.json").write_text(json.dumps(QWEN3_MOE | {"model_type": model_type}))
        plan(C.from_dict({"vllm": {"model": str(tmp_path)}, "slurm": {"gpus_per_node": 2}}), str(tmp_path / "j"))

    assert set(UNSUPPORTED_FAMILIES) == {"olmo_hybrid", "hrm_text", "kimi_linear", "longcat_flash"} and not set(
        UNSUPPORTED_FAMILIES
    ) & set(FAMILIES)
    for family in UNSUPPORTED_FAMILIES:
        with pytest.raises(C.ConfigError) as e:
            planned(family)
        msg = str(e.value)
        assert msg.startswith(f"vllm.model: {family} is not supported: ") and "\n" not in msg and len(msg) <= 200, msg
    planned("qwen3_moe")
    # an architecture vLLM serves unlike transformers (Gemma-3n's text-only class: tests of FORWARD_NOT_CHECKED)
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_MOE | {"architectures": ["Gemma3nForCausalLM"]}))
    with pytest.raises(C.ConfigError) as e:
        plan(C.from_dict({"vllm": {"model": str(tmp_path)}, "slurm": {"gpus_per_node": 2}}), str(tmp_path / "j"))
    msg = str(e.value)
    assert msg.startswith("vllm.model: Gemma3nForCausalLM is not supported: ") and "per-layer token embeddings" in msg, msg
    assert "\n" not in msg and len(msg) <= 260, msg


def test_configs_vllm_would_serve_unlike_transformers_are_refused_at_plan_time(tmp_path):
    """GPT-NeoX has no GQA: transformers ignores a num_key_value_heads in its config.json, vLLM 0.32 serves with it (the
    tiny body's 1 kv head put prompt logprobs 0.2 off before any training); such a config is refused in one line, the
    field absent (Pythia's configs) or equal to the heads plans. An untied Cohere (vLLM always ties it) is refused too."""
    import json

    from launcher.core import config as C
    from launcher.core.plan import plan

    body = {  # Pythia-70M's config.json, the fields a plan reads
        "architectures": ["GPTNeoXForCausalLM"],
        "model_type": "gpt_neox",
        "hidden_size": 512,
        "intermediate_size": 2048,
        "num_attention_heads": 8,
        "num_hidden_layers": 6,
        "vocab_size": 50304,
        "rotary_pct": 0.25,
        "use_parallel_residual": True,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
    }

    def planned(**fields) -> None:
        (tmp_path / "config.json").write_text(json.dumps(body | fields))
        plan(C.from_dict({"vllm": {"model": str(tmp_path)}, "slurm": {"gpus_per_node": 2}}), str(tmp_path / "j"))

    with pytest.raises(C.ConfigError) as e:
        planned(num_key_value_heads=1)
    msg = str(e.value)
    assert msg.startswith("vllm.model: its gpt_neox config.json sets num_key_value_heads 1") and len(msg) <= 200, msg
    planned()
    planned(num_key_value_heads=8)
    # Cohere: vLLM 0.32 drops the checkpoint's lm_head and computes logits from the embedding
    body = {
        "architectures": ["CohereForCausalLM"],
        "model_type": "cohere",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "num_hidden_layers": 2,
        "vocab_size": 1000,
        "tie_word_embeddings": True,
    }
    planned()
    with pytest.raises(C.ConfigError) as e:
        planned(tie_word_embeddings=False)
    assert str(e.value).startswith("vllm.model: cohere with tie_word_embeddings false is not supported"), e.value


def vllm_class_source(family: str, *, whole_files: bool = False) -> str:
    """The source of the class vLLM serves the family's architecture with and of its vLLM bases, or with whole_files
    the files they are in (Qwen3.5's module imports torchvision, which the CPU venv lacks: its whole file then)."""
    import importlib
    import importlib.util
    import inspect

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from vllm.model_executor.models.registry import _VLLM_MODELS

    module, cls = _VLLM_MODELS[MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family]]
    module = module if module.startswith("vllm.") else f"vllm.model_executor.models.{module}"
    try:
        served = getattr(importlib.import_module(module), cls)
    except ImportError:
        return Path(importlib.util.find_spec(module).origin).read_text()  # type: ignore[union-attr, arg-type]
    bases = [k for k in served.__mro__ if k.__module__.startswith("vllm.")]
    return "".join(inspect.getsource(inspect.getmodule(k) if whole_files else k) for k in bases)  # type: ignore[arg-type]


def test_the_config_fields_vllm_reads_and_transformers_ignores_are_built_in_or_refused(tmp_path):
    """plan.SERVED_FIELDS. DeepSeek-V3's router: transformers always scores with sigmoid and adds the score-correction
    bias to every choice (its config class has neither scoring_func nor topk_method); vLLM 0.32's DeepseekV2MoE reads
    scoring_func (default softmax: a tiny body on vLLM's CPU build, fp32, 0.22 apart; with the field 1.9e-6) and keeps
    the bias only for topk_method noaux_tc: every family served through DeepseekV2MoE with such a router in
    transformers is listed. MiMo-V2-Flash's sliding-window sinks likewise (add_swa_attention_sink_bias).
    make-tiny-model writes the fields; the plan refuses a config.json without one (with the line to add) or with
    another value (not supported: transformers computes these families one way only), in one line."""
    import importlib.util
    import json
    import re

    from launcher.core import config as C
    from launcher.core.plan import DEEPSEEK_ROUTER, SERVED_FIELDS, plan
    from trainer.tiny_families import config_fields

    vllm_moe = Path(importlib.util.find_spec("vllm.model_executor.models.deepseek_v2").origin).read_text()  # type: ignore[union-attr, arg-type]
    assert 'scoring_func=getattr(config, "scoring_func", "softmax")' in vllm_moe
    assert 'if getattr(config, "topk_method", None) == "noaux_tc":' in vllm_moe

    def router(family: str) -> str:
        spec = importlib.util.find_spec(f"transformers.models.{family}.modeling_{family}")
        found = re.search(r"class \w+TopkRouter\b[\s\S]*?\n\n\nclass ", Path(spec.origin).read_text())  # type: ignore[union-attr, arg-type]
        return found.group() if found else ""

    def deepseek_like(family: str) -> bool:
        r = router(family)
        return "router_logits.sigmoid()" in r and "+ self.e_score_correction_bias" in r

    served_so = {f for f in FAMILIES if "DeepseekV2MoE(" in vllm_class_source(f, whole_files=True) and deepseek_like(f)}
    assert served_so == {f for f, fields in SERVED_FIELDS.items() if fields is DEEPSEEK_ROUTER}, served_so
    # MiMo-V2-Flash: transformers gives every sliding-window layer sinks, vLLM only when the config says so
    mimo = Path(importlib.util.find_spec("transformers.models.mimo_v2_flash.modeling_mimo_v2_flash").origin).read_text()  # type: ignore[union-attr, arg-type]
    assert "self.sinks = nn.Parameter(torch.empty(num_attention_heads)) if is_swa else None" in mimo
    assert re.search(
        r'getattr\(\s*config, "add_swa_attention_sink_bias", False', vllm_class_source("mimo_v2_flash", whole_files=True)
    )
    assert SERVED_FIELDS["mimo_v2_flash"] == {"add_swa_attention_sink_bias": True}
    for family, fields in SERVED_FIELDS.items():
        built = config_fields(
            family, vocab=300, hidden=128, layers=4, heads=2, kv_heads=1, head_dim=64, intermediate=256, tie=False,
            token_id=0, dtype="float32",
        )  # fmt: skip
        assert {k: built.get(k) for k in fields} == fields, family
    body = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 256, "vocab_size": 1000}
    refusals = [
        ({"topk_method": "noaux_tc"}, "its deepseek_v3 config.json has no scoring_func", '"scoring_func": "sigmoid"'),
        ({"scoring_func": "sigmoid"}, "its deepseek_v3 config.json has no topk_method", '"topk_method": "noaux_tc"'),
        # a model routed by softmax: not one transformers trains as vLLM serves it (no "set it to sigmoid" advice)
        (
            {"topk_method": "noaux_tc", "scoring_func": "softmax"},
            'deepseek_v3 with scoring_func "softmax" is not supported',
            'as with "sigmoid" only',
        ),
    ]
    mimo_body = {"architectures": ["MiMoV2FlashForCausalLM"], "model_type": "mimo_v2_flash", "hidden_size": 256}
    refusals += [(mimo_body, "its mimo_v2_flash config.json has no add_swa_attention_sink_bias", '": true in it')]
    for extra, refused, fix in refusals:
        (tmp_path / "config.json").write_text(json.dumps(body | extra))
        with pytest.raises(C.ConfigError) as e:
            plan(C.from_dict({"vllm": {"model": str(tmp_path)}, "slurm": {"gpus_per_node": 2}}), str(tmp_path / "j"))
        msg = str(e.value)
        assert msg.startswith(f"vllm.model: {refused}") and fix in msg, msg
        assert len(msg) <= 220 and "\n" not in msg, msg
    (tmp_path / "config.json").write_text(json.dumps(body | DEEPSEEK_ROUTER))
    plan(C.from_dict({"vllm": {"model": str(tmp_path)}, "slurm": {"gpus_per_node": 2}}), str(tmp_path / "j"))


def test_the_lm_head_each_familys_vllm_class_serves_is_the_one_plan_and_builder_expect(tmp_path):
    """Which head vLLM 0.32 computes each family's logits with, read from its class (and bases): its own lm_head whatever
    the config says (plan.NEVER_TIED_FAMILIES: a tied checkpoint would be served from a head never loaded; a tiny tied
    DeepSeek-V3 gave uniform logprobs on an H100), the embedding whatever it says (within ALWAYS_TIED_FAMILIES), or as
    tie_word_embeddings says. The plan refuses a tied checkpoint of the first kind; make-tiny-model builds them untied."""
    import json

    from launcher.core import config as C
    from launcher.core.plan import ALWAYS_TIED_FAMILIES, NEVER_TIED_FAMILIES, plan
    from trainer.tiny_families import config_fields

    def head(family: str) -> str:
        lines = vllm_class_source(family).splitlines()
        ties = [i for i, line in enumerate(lines) if "tie_word_embeddings" in line or "tie_weights" in line]
        # a tie read where the head is built, not one an MTP head or a helper names on its own
        if any("lm_head" in near or "embed_tokens" in near for i in ties for near in lines[max(0, i - 4) : i + 5]):
            return "as configured"
        return "own" if any("ParallelLMHead(" in line for line in lines) else "embedding"

    heads = {family: head(family) for family in FAMILIES}
    assert {f for f, h in heads.items() if h == "own"} == NEVER_TIED_FAMILIES, heads
    assert {f for f, h in heads.items() if h == "embedding"} <= ALWAYS_TIED_FAMILIES, heads
    for family, tie in [(f, True) for f in NEVER_TIED_FAMILIES] + [(f, False) for f in ALWAYS_TIED_FAMILIES]:
        fields = config_fields(
            family, vocab=300, hidden=128, layers=4, heads=2, kv_heads=1, head_dim=64, intermediate=256, tie=tie,
            token_id=0, dtype="float32",
        )  # fmt: skip
        assert fields["tie_word_embeddings"] is not tie, family  # make-tiny-model builds each as vLLM serves it
    body = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 256, "vocab_size": 1000,
        "scoring_func": "sigmoid", "topk_method": "noaux_tc",
    }  # fmt: skip
    for tied in (True, False):
        (tmp_path / "config.json").write_text(json.dumps(body | {"tie_word_embeddings": tied}))
        cfg = C.from_dict({"vllm": {"model": str(tmp_path)}, "slurm": {"gpus_per_node": 2}})
        if not tied:
            plan(cfg, str(tmp_path / "j"))
            continue
        with pytest.raises(C.ConfigError) as e:
            plan(cfg, str(tmp_path / "j"))
        msg = str(e.value)
        assert msg.startswith("vllm.model: deepseek_v3 with tie_word_embeddings true is not supported") and len(msg) <= 220, msg


def test_nonpersistent_buffers_are_computed_by_the_model_from_pretrained_uses(tmp_path):
    """Buffers no checkpoint holds, set by an ancestor's `_init_weights` (Falcon-H1's model sets each mixer's
    mup_vector) or by an inner transformers model's own (Gemma-3n's text model reads its hidden_size): the loader's
    initialisation gives what from_pretrained gives, on weights it must not touch (one process, no sharding)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.loading import init_nonpersistent_buffers
    from trainer.tiny_model import make_tiny_model

    for family in ("falcon_h1", "gemma3n_text"):
        make_tiny_model(tmp_path / family, family=family, tie=True)
        want = AutoModelForCausalLM.from_pretrained(tmp_path / family, dtype=torch.float32)
        with torch.device("meta"):
            got = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path / family), dtype=torch.float32)
        got.to_empty(device="cpu")
        with torch.no_grad():
            for t in got.state_dict().values():  # "loaded": random, and they must stay as they are
                t.copy_(torch.randn_like(t) if t.is_floating_point() else torch.zeros_like(t))
        weights = {n: t.clone() for n, t in got.state_dict().items()}
        init_nonpersistent_buffers(got, torch.device("cpu"))
        buffers = dict(want.named_buffers())
        differ = [n for n, b in got.named_buffers() if n not in weights and not torch.equal(b, buffers[n])]
        moved = [n for n, t in got.state_dict().items() if not torch.equal(t, weights[n])]
        assert not differ and not moved and any("mup_vector" in n or "per_layer" in n for n in buffers), (family, differ, moved)


def test_a_push_and_a_save_name_tensors_as_the_checkpoint_did(tmp_path):
    """Qwen3.5's text model reads `model.language_model.*` (the released, multimodal checkpoints) and `model.*` alike
    (transformers' PrefixChange): the names a push sends (vLLM serves the checkpoint's own architecture) and a save
    writes are the checkpoint's, whichever it was; a model no checkpoint was placed into gets the plain ones."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.checkpoint_names import as_saved, placement, served_names
    from trainer.tiny_model import make_tiny_model

    make_tiny_model(tmp_path, family="qwen3_5_text")
    config = AutoConfig.from_pretrained(tmp_path)
    for prefix in ("model.language_model.", "model.", None):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        names = [n for n, _ in model.named_parameters()]
        if prefix is not None:
            places = placement(model, [n.replace("model.", prefix, 1) for n in names])
            assert sorted(places) == sorted(names), prefix  # either checkpoint fills every parameter
        pushed = served_names(model, names)
        saved = [k for n, p in model.named_parameters() for k in as_saved(model, n, p)]
        want = [n.replace("model.", prefix or "model.", 1) for n in names]
        assert [pushed[n] for n in names] == want and saved == want, (prefix, pushed, saved)


def test_half_precision_parity_is_wider_only_where_vllm_orders_the_attention_otherwise(family_dirs):
    """trainer.parity_tolerance 0 in bf16: 0.25, and 0.5 for a body with MLA (a kv_lora_rank) or attention sinks,
    read from the model itself; float32 stays 1e-3 for every family (the CPU matrix's parity)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.rollout.parity import default_tolerance, reordered_attention

    seen: dict[str, str | None] = {}
    for family, folder in family_dirs.items():
        config = AutoConfig.from_pretrained(folder)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        why = seen[family] = reordered_attention(model)
        mla = bool(getattr(config, "kv_lora_rank", None))
        sinks = any(n.endswith("sinks") for n, _ in model.named_parameters())
        assert (why == "multi-head latent attention") == mla and (why == "attention sinks") == (sinks and not mla), family
        assert default_tolerance(torch.bfloat16, model) == (0.5 if why else 0.25), family
        assert default_tolerance(torch.float32, model) == 1e-3, family
    assert seen["deepseek_v3"] == seen["glm4_moe_lite"] == "multi-head latent attention"
    assert seen["gpt_oss"] == "attention sinks"
    assert seen["qwen2"] is seen["llama"] is seen["qwen3_moe"] is None
