"""An MoE's model at the end and its `slurm-grpo export`, on two spawned gloo ranks with tiny Qwen3-MoE, Mixtral and
gpt-oss bodies (3 experts, FSDP2 shards them on dim 0): the folder holds the original checkpoint's names and layout (one
tensor per expert, Mixtral's `block_sparse_moe.experts.{e}.w1`; gpt-oss's fused `experts.gate_up_proj`), the very tensors transformers' save_pretrained
writes; from_pretrained of it computes the trainer's logits; vLLM's own loader (strict: every parameter must come from
the folder) builds its model from it; the run's trainer.chat_template is the folder's template."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from launcher.core.records import CheckpointMeta
from tests.support.ranks import run_ranks
from tests.unit.test_export import IDS, job_config, perturb, tensors

FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss")
SMALL_FILES = 200_000
"""Several safetensors files per folder, so a fused tensor's experts can land in different files."""
LORA_TARGETS = ["q_proj", "v_proj"]
TEMPLATE = "{% for m in messages %}<<{{ m['role'] }}>>{{ m['content'] }}\n{% endfor %}"


def trainer_side(rank: int, world: int, _port: int, dirs: dict[str, str], root: str) -> bool:
    import torch.distributed as dist

    from launcher.core.config import LoraConfig
    from tests.support.ranks import cpu_parallel
    from trainer import checkpoint, final_model, loading
    from trainer import lora as trainer_lora

    par = cpu_parallel(rank, world)
    for family, d in dirs.items():
        job = Path(root) / family
        model, _ = loading.load_model(d, par, torch.float32)
        perturb(model, seed=4)
        opt = torch.optim.AdamW(model.parameters())
        checkpoint.save(job / "checkpoints", model, opt, None, CheckpointMeta(step=3, world_size=world))
        final_model.save(model, torch.float32, d, job / "model", max_bytes=SMALL_FILES, chat_template=TEMPLATE)
        with torch.no_grad():
            logits = model(torch.tensor(IDS)).logits
        if rank == 0:
            torch.save(logits, job / "logits.pt")
    # a LoRA run on an MoE (attention adapters): JOB/merged and the merged export hold the base's expert tensors
    lora = LoraConfig(r=4, alpha=8, target_modules=LORA_TARGETS, save_merged=True)
    job = Path(root) / "lora"
    lm, _ = loading.load_model(dirs["mixtral"], par, torch.float32, lora=lora, seed=3)
    perturb(lm, seed=5)
    opt = torch.optim.AdamW([p for p in lm.parameters() if p.requires_grad])
    checkpoint.save(job / "checkpoints", lm, opt, None, CheckpointMeta(step=2, world_size=world))
    trainer_lora.save_outputs(lm, lora, dirs["mixtral"], job, torch.float32, chat_template=TEMPLATE)
    dist.barrier()
    return True


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    from trainer.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("export_moe")
    dirs = {}
    for family in FAMILIES:
        make_tiny_model(root / "base" / family, family=family)
        dirs[family] = str(root / "base" / family)
    run_ranks(2, functools.partial(trainer_side, dirs=dirs, root=str(root)), timeout_s=300)
    template_file = root / "template.jinja"
    template_file.write_text(TEMPLATE)
    for family, d in dirs.items():
        job_config(root / family, d, f"trainer.chat_template={template_file}")
    targets = f"trainer.lora.target_modules=[{','.join(LORA_TARGETS)}]"
    job_config(root / "lora", dirs["mixtral"], "trainer.lora.r=4", "trainer.lora.alpha=8", targets)
    return root, dirs


def names_on_disk(folder: str | Path) -> set[str]:
    from safetensors import safe_open

    out: set[str] = set()
    for f in Path(folder).glob("*.safetensors"):
        with safe_open(str(f), "pt") as g:
            out |= set(g.keys())
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_an_moes_final_model_and_export_have_the_checkpoints_names_and_the_trainers_logits(written, family, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from launcher.core.export import resolve
    from trainer.export import export

    root, dirs = written
    final = root / family / "model"
    got = tensors(final)
    assert set(got) == names_on_disk(dirs[family]), "JOB/model's names are not the original checkpoint's"
    fused = any(n.endswith(("gate_up_proj", "experts.down_proj")) for n in got)
    assert fused == (family == "gpt_oss"), "fused experts were written (gpt-oss's checkpoints hold them fused)"
    assert len(set(json.loads((final / "model.safetensors.index.json").read_text())["weight_map"].values())) > 1
    assert not (final / "fused").exists()

    m = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    with torch.no_grad():
        diff = (m(torch.tensor(IDS)).logits - torch.load(root / family / "logits.pt")).abs().max().item()
    assert diff < 1e-4, diff
    m.save_pretrained(tmp_path / "ref")  # transformers' own writer of the same weights: same names, same tensors
    ref = {}
    for f in (tmp_path / "ref").glob("*.safetensors"):
        from safetensors.torch import load_file

        ref.update(load_file(f))
    assert sorted(ref) == sorted(got) and all(torch.equal(ref[n], got[n]) for n in ref)

    exported_dir = export(resolve(root / family, None, str(root / family / "export")))
    exported = tensors(exported_dir)
    assert sorted(exported) == sorted(got) and all(torch.equal(exported[n], got[n]) for n in got)

    for folder in (final, exported_dir):  # the run's template, and no other one beside it
        assert (folder / "chat_template.jinja").read_text() == TEMPLATE
        assert "chat_template" not in json.loads((folder / "tokenizer_config.json").read_text())
        assert AutoTokenizer.from_pretrained(folder).chat_template == TEMPLATE


def vllm_loads(rank: int, world: int, _port: int, base: dict[str, str], saved: dict[str, str]) -> dict[str, list[str]]:
    from tests.support.vllm_inproc import InProcessVllm

    vllm = InProcessVllm()
    out = {}
    for family in FAMILIES:
        before = {n: p.detach().clone() for n, p in vllm.build(base[family])[0].named_parameters()}
        trained = dict(vllm.build(saved[family])[0].named_parameters())  # strict: every parameter from the folder
        out[family] = sorted(n for n, p in trained.items() if torch.equal(p, before[n]))
    return out


def test_vllms_own_loader_builds_an_moe_from_the_final_model(written):
    root, dirs = written
    saved = {f: str(root / f / "model") for f in FAMILIES}
    unchanged = run_ranks(1, functools.partial(vllm_loads, base=dirs, saved=saved), timeout_s=300)[0]
    assert unchanged == {f: [] for f in FAMILIES}, f"vLLM's parameters equal the base model's: {unchanged}"


def test_an_moes_merged_lora_export_is_jobs_merged_under_the_checkpoints_names(written):
    from launcher.core.export import resolve
    from trainer.export import export

    root, dirs = written
    merged = tensors(root / "lora" / "merged")
    assert set(merged) == names_on_disk(dirs["mixtral"]), "JOB/merged's names are not the original checkpoint's"
    exported = tensors(export(resolve(root / "lora", None, str(root / "lora" / "export"), merged=True)))
    assert sorted(exported) == sorted(merged) and all(torch.equal(exported[n], merged[n]) for n in merged)
    assert (root / "lora" / "merged" / "chat_template.jinja").read_text() == TEMPLATE
