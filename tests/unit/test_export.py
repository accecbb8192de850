"""The model at the end and `slurm-grpo export`, on two spawned gloo ranks with the tiny Qwen2 (tied embedding): the
end-of-run writer (trainer.final_model, torch's DCP Hugging Face writer and consolidation) and the offline converter
of a checkpoint the two ranks wrote (trainer.export, one process, no world) give the trainer's tensors in the saved
dtype, in several safetensors files with an index; from_pretrained of the folder computes the trainer's logits; a LoRA
run's exported adapter equals the trainer's own adapter/ and loads with peft, its merged export equals the trainer's
merged/. Retention and the request's checks need no ranks."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import pytest
import torch

from launcher.core.records import CheckpointMeta
from tests.support.ranks import run_ranks

IDS = [[1, 5, 9, 42, 7, 100, 3, 250]]
SMALL_FILES = 100_000
"""max_bytes of a safetensors file in these tests: the tiny model (1.3 MB in fp32) spreads over several files."""


def perturb(model, seed: int) -> None:
    """A step's worth of change on every trained parameter (the same on any number of ranks: drawn whole, each rank
    adds its own rows), so an export of the base model could not pass for the trained one."""
    from torch.distributed.tensor import DTensor

    from trainer.loading import rows_owned

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted((n, p) for n, p in model.named_parameters() if p.requires_grad):
            delta = torch.randn(tuple(p.shape), generator=g) * 0.05
            first, stop = rows_owned(p)
            local = p.to_local() if isinstance(p, DTensor) else p
            local.add_(delta[first:stop].reshape(local.shape).to(local.dtype))


def trainer_side(rank: int, world: int, _port: int, tiny: str, root: str, neox: str) -> bool:
    """What the trainer writes: a checkpoint of two ranks' shards, JOB/model in fp32 and a bf16 copy, a LoRA run's
    checkpoint, adapter/ and merged/; rank 0 keeps the full tensors and logits to compare with."""
    import torch.distributed as dist

    from launcher.core.config import LoraConfig
    from tests.support.ranks import cpu_parallel
    from trainer import checkpoint, final_model, loading
    from trainer import lora as trainer_lora

    r = Path(root)
    par = cpu_parallel(rank, world)
    model, _ = loading.load_model(tiny, par, torch.float32)
    perturb(model, seed=1)
    opt = torch.optim.AdamW(model.parameters())
    checkpoint.save(r / "full" / "checkpoints", model, opt, None, CheckpointMeta(step=5, world_size=world))
    final_model.save(model, torch.float32, tiny, r / "full" / "model", max_bytes=SMALL_FILES)
    final_model.save(model, torch.bfloat16, tiny, r / "bf16", max_bytes=SMALL_FILES)
    full = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        logits = model(torch.tensor(IDS)).logits
    if rank == 0:
        torch.save({"params": full, "logits": logits}, r / "trainer.pt")

    lora = LoraConfig(r=4, alpha=8)
    lm, _ = loading.load_model(tiny, par, torch.float32, lora=lora, seed=3)
    perturb(lm, seed=2)  # B is zero at the start: without a change the merged model would be the base
    opt = torch.optim.AdamW([p for p in lm.parameters() if p.requires_grad])
    checkpoint.save(r / "lora" / "checkpoints", lm, opt, None, CheckpointMeta(step=7, world_size=world))
    trainer_lora.save_outputs(lm, LoraConfig(r=4, alpha=8, save_merged=True), tiny, r / "lora", torch.float32)
    neox_side(par, neox, r / "neox")
    dist.barrier()
    return True


def neox_side(par, neox: str, out: Path) -> None:
    """GPT-NeoX (untied): its checkpoint's head is embed_out.weight, transformers' module lm_head (a renaming keyed by
    the class name GPTNeoXForCausalLM), and FSDP2 renames the sharded root's class FSDPGPTNeoXForCausalLM. The final
    model, the push and the names of a root sharded without a load (built from the config) must all say embed_out."""
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer import final_model, loading
    from trainer.checkpoint_names import saved_layout, served_names

    model, _ = loading.load_model(neox, par, torch.float32)
    perturb(model, seed=4)
    final_model.save(model, torch.float32, neox, out / "model", max_bytes=SMALL_FILES)
    head = model.lm_head.weight.full_tensor().clone()
    built = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(neox))
    fully_shard(built, mesh=par.mesh)
    names = {
        "pushed": served_names(model, ["lm_head.weight"])["lm_head.weight"],
        "built": [n for n, _ in saved_layout(built, [(n, tuple(p.shape)) for n, p in built.named_parameters()])],
    }
    if par.rank == 0:
        torch.save({"head": head, "names": names}, out / "trainer.pt")


def job_config(folder: Path, tiny: str, *sets: str) -> None:
    from launcher.core import config as config_mod

    cfg = config_mod.load(None, [f"vllm.model={tiny}", "job.device=cpu", "trainer.dtype=float32", *sets])
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.yaml").write_text(config_mod.to_yaml(cfg))


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = json.loads((folder / "model.safetensors.index.json").read_text())
    out: dict[str, torch.Tensor] = {}
    for f in sorted(set(index["weight_map"].values())):
        out.update(load_file(folder / f))
    assert sorted(out) == sorted(index["weight_map"]), "the index names other tensors than the files hold"
    return out


@pytest.fixture(scope="module")
def written(tiny_model, tmp_path_factory) -> Path:
    from trainer.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("export")
    make_tiny_model(root / "neox-base", family="gpt_neox", tie=False)
    (root / "neox").mkdir()
    run_ranks(2, functools.partial(trainer_side, tiny=tiny_model, root=str(root), neox=str(root / "neox-base")), timeout_s=240)
    job_config(root / "full", tiny_model)
    job_config(root / "lora", tiny_model, "trainer.lora.r=4", "trainer.lora.alpha=8")
    return root


def test_the_final_model_and_an_export_of_a_two_rank_checkpoint_are_the_trainers_tensors(written, tiny_model):
    from launcher.core.export import resolve
    from trainer.export import export

    want = torch.load(written / "trainer.pt")
    params = want["params"]
    canonical = {n: t for n, t in params.items() if n != "lm_head.weight"}  # tied: saved once, as save_pretrained does
    final = written / "full" / "model"
    got = tensors(final)
    assert len(set(json.loads((final / "model.safetensors.index.json").read_text())["weight_map"].values())) > 1
    assert sorted(got) == sorted(canonical)
    assert all(torch.equal(got[n], canonical[n]) for n in canonical), "JOB/model differs from the trainer's fp32 tensors"
    bf16 = tensors(written / "bf16")
    assert all(bf16[n].dtype == torch.bfloat16 and torch.equal(bf16[n], canonical[n].to(torch.bfloat16)) for n in canonical)
    assert not (final / "sharded").exists() and not final.with_name("model.tmp").exists()
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"} <= {
        f.name for f in final.iterdir()
    }
    assert json.loads((written / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"

    # the offline converter, one process, from the checkpoint both ranks wrote (each tensor's rows from two files)
    req = resolve(written / "full", None, str(written / "export-bf16"), dtype="bfloat16")
    assert (req.step, req.kind) == (5, "model")
    exported = tensors(export(req))
    assert sorted(exported) == sorted(canonical)
    assert all(torch.equal(exported[n], bf16[n]) for n in canonical), "the export differs from the trainer's bf16 tensors"


def test_from_pretrained_of_the_final_model_computes_the_trainers_logits(written):
    from transformers import AutoModelForCausalLM

    want = torch.load(written / "trainer.pt")["logits"]
    m = AutoModelForCausalLM.from_pretrained(written / "full" / "model", dtype=torch.float32)
    with torch.no_grad():
        got = m(torch.tensor(IDS)).logits
    assert (got - want).abs().max().item() < 1e-4, (got - want).abs().max().item()
    assert AutoModelForCausalLM.from_pretrained(written / "bf16").dtype == torch.bfloat16  # config.json's dtype, "auto"


def test_a_sharded_gpt_neox_is_saved_and_pushed_under_its_checkpoints_head_name(written):
    """GPT-NeoX's head is embed_out.weight in its checkpoint (the name vLLM's loader and from_pretrained read): before,
    the final model of the FSDP2-sharded root named it lm_head.weight (transformers' class-keyed renaming missed the
    FSDP class), a folder whose head from_pretrained leaves at random."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    with safe_open(str(written / "neox-base" / "model.safetensors"), "pt") as f:
        checkpoint = sorted(f.keys())
    assert "embed_out.weight" in checkpoint and "lm_head.weight" not in checkpoint
    want = torch.load(written / "neox" / "trainer.pt")
    got = tensors(written / "neox" / "model")
    assert sorted(got) == checkpoint
    assert torch.equal(got["embed_out.weight"], want["head"])
    assert sorted(want["names"]["built"]) == checkpoint  # a sharded root that was never loaded: the same names
    assert want["names"]["pushed"] == "embed_out.weight"  # what vLLM's load_weights is sent
    m = AutoModelForCausalLM.from_pretrained(written / "neox" / "model", dtype=torch.float32)
    assert torch.equal(m.lm_head.weight, want["head"])  # the trained head, not a fresh one


def test_a_lora_export_is_the_trainers_adapter_for_peft_and_merged_on_request(written, tiny_model):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from launcher.core.export import resolve
    from trainer.export import export

    job = written / "lora"
    adapter = export(resolve(job))
    assert adapter == job / "exports" / "step-000007-adapter"
    want, got = load_file(job / "adapter" / "adapter_model.safetensors"), load_file(adapter / "adapter_model.safetensors")
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)
    merged = export(resolve(job, merged=True))
    trainer_merged = tensors(job / "merged")
    got_merged = tensors(merged)
    assert sorted(got_merged) == sorted(trainer_merged)
    assert all(torch.allclose(got_merged[n], trainer_merged[n], atol=1e-6) for n in trainer_merged)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    ids = torch.tensor(IDS)
    with torch.no_grad():
        plain = base(ids).logits
        via_peft = PeftModel.from_pretrained(base, str(adapter)).eval()(ids).logits
        via_merged = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)(ids).logits
    assert (via_peft - via_merged).abs().max().item() < 1e-4
    assert (via_peft - plain).abs().max().item() > 1e-3  # the adapter changes what the model computes


def test_the_request_names_the_steps_that_exist_and_refuses_what_cannot_be(tmp_path, tiny_model):
    from launcher.core.config import ConfigError
    from launcher.core.export import resolve

    job = tmp_path / "job"
    job_config(job, tiny_model)
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        resolve(job)
    for step in (10, 20):
        d = job / "checkpoints" / f"step-{step:06d}"
        d.mkdir(parents=True)
        CheckpointMeta(step=step, world_size=2).write(d / "meta.json")
    (job / "checkpoints" / "step-000030.tmp").mkdir()  # being written: not a checkpoint yet
    with pytest.raises(ConfigError, match=r"--step 30: .* steps 10, 20"):
        resolve(job, step=30)
    with pytest.raises(ConfigError, match="--merged is for LoRA runs"):
        resolve(job, merged=True)
    req = resolve(job)
    assert (req.step, req.out, req.dtype) == (20, job / "exports" / "step-000020-model", "float32")
    assert req.child_argv("py")[:3] == ["py", "-m", "trainer.export"]


def test_export_never_overwrites_a_folder_it_did_not_write_nor_the_base_model(tmp_path, tiny_model, capsys):
    """The audit's case: --out at an existing model folder replaced its config.json; at the run's base model it would
    have replaced the base. Both are refused before the converter starts, in one line with the fix; a new or empty
    folder and the job's own exports/step-N-KIND (an earlier export, replaced) are taken."""
    from launcher import cli
    from launcher.core.config import ConfigError
    from launcher.core.export import resolve
    from trainer.export import main as converter

    job = tmp_path / "job"
    job_config(job, tiny_model)
    (job / "plan.json").write_text("{}")
    d = job / "checkpoints" / "step-000005"
    d.mkdir(parents=True)
    CheckpointMeta(step=5, world_size=1).write(d / "meta.json")
    other = tmp_path / "other-model"
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "theirs"}')
    base_config = (Path(tiny_model) / "config.json").read_text()
    for out, said in [
        (other, "exists and is not empty; export never overwrites: name a new folder"),
        (Path(tiny_model), "is the run's base model folder"),
        (Path(tiny_model).parent, "holds the run's base model folder"),
    ]:
        assert cli.main(["export", str(job), "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("slurm-grpo export: error: --out ") and said in err[0], err
        assert f"(without --out: {job / 'exports' / 'step-000005-model'})" in err[0], err
        assert converter([str(job), "--out", str(out)]) == 2  # the converter resolves the same request
        assert said in capsys.readouterr().err
    assert (other / "config.json").read_text() == '{"model_type": "theirs"}'
    assert (Path(tiny_model) / "config.json").read_text() == base_config
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(ConfigError, match="exists and is not empty"):
        resolve(job, out=str(tmp_path / "a-file"))
    (tmp_path / "empty").mkdir()
    assert resolve(job, out=str(tmp_path / "empty")).out == tmp_path / "empty"
    assert resolve(job, out=str(tmp_path / "new")).out == tmp_path / "new"
    own = job / "exports" / "step-000005-model"
    own.mkdir(parents=True)
    (own / "config.json").write_text("{}")  # an earlier export of the same step: export's own, replaced
    assert resolve(job).out == own and resolve(job, out=str(own)).out == own


def test_retention_keeps_the_newest_and_deletes_only_complete_older_ones(tmp_path):
    from trainer.checkpoint import prune

    root = tmp_path / "checkpoints"

    def complete(step: int) -> Path:
        d = root / f"step-{step:06d}"
        d.mkdir(parents=True)
        (d / "shard.distcp").write_bytes(b"x")
        CheckpointMeta(step=step, world_size=1).write(d / "meta.json")
        return d

    for s in (1, 2, 3):
        complete(s)
    half = root / "step-000000"  # a deletion cut short: meta.json gone first, so resume never counted it
    half.mkdir()
    writing = root / "step-000005.tmp"
    writing.mkdir()
    newest = complete(4)
    assert prune(root, 0, newest) == [] and len(list(root.iterdir())) == 6  # 0 = keep all
    gone = prune(root, 2, newest)
    assert sorted(d.name for d in gone) == ["step-000000", "step-000001", "step-000002"]
    assert sorted(d.name for d in root.iterdir()) == ["step-000003", "step-000004", "step-000005.tmp"]
    # a checkpoint just written is never deleted, even when it is not the newest (keep 1)
    older = complete(2)
    assert prune(root, 1, older) == [root / "step-000003"]
    assert sorted(d.name for d in root.iterdir()) == ["step-000002", "step-000004", "step-000005.tmp"]


def test_the_dry_run_states_a_checkpoints_size_on_disk():
    from launcher.memory import Layout, Options, common_shape, disk_line

    shape = common_shape("Qwen2.5-7B")  # 7.6B parameters
    lay = Layout(1, 8, 1, 8, False, 80.0, 0.9, 2, 8, 256)
    line = disk_line(shape, lay, Options(), keep=3, save_model=True)
    p = shape.params
    # pruning runs once a new checkpoint is complete: keep + 1 exist at the peak, and the last ones stay beside model/
    assert f"a checkpoint ~{12 * p / 1e9:.1f} GB" in line and "up to 4 at once" in line
    assert f"~{4 * 12 * p / 1e9:.1f} GB" in line and f"final model ~{2 * p / 1e9:.1f} GB" in line
    assert line.endswith(f"peak ~{(4 * 12 + 2) * p / 1e9:.1f} GB"), line
    lora = disk_line(shape, lay, Options(lora_r=8, lora_targets=("q_proj",)), keep=1, save_model=True)
    assert "up to 2 at once" in lora and "final adapter" in lora and "peak" in lora, lora
    assert "one more each save" in disk_line(shape, lay, Options(), keep=0, save_model=False)


def test_the_dry_run_names_the_job_folders_free_space_and_how_far_short_it_falls(tmp_path):
    """The job folder does not exist at dry-run: its nearest existing folder's file system is the one measured."""
    from launcher.core.jobdir import free_space
    from launcher.memory import Layout, Options, common_shape, disk_line, room

    job = tmp_path / "runs" / "not-yet"
    where, free = free_space(job)
    assert where == tmp_path and free > 0
    enough = room(str(job), need=free / 2)  # (the figures themselves move as other tests write files)
    assert enough.startswith(f"; {tmp_path} has ") and enough.endswith(" GB free") and "short" not in enough, enough
    short = room(str(job), need=free + 7e9)
    got = re.search(r"has only ([\d.]+) GB free, ([\d.]+) GB short", short)
    assert got and abs(float(got[1]) - free / 1e9) < 1 and abs(float(got[2]) - 7.0) < 1, short
    assert "trainer.keep_checkpoints" in short and str(tmp_path) in short
    line = disk_line(common_shape("Qwen2.5-7B"), Layout(1, 8, 1, 8, False, 80.0, 0.9, 2, 8, 256), Options(), 2, True, str(job))
    assert f"; {tmp_path} has" in line and room(None, 1.0) == ""


@pytest.mark.parametrize(
    ("child", "rc", "said"),
    [
        ("import sys; sys.exit(3)", 3, "exited with code 3"),
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", 137, "killed by signal SIGKILL (SIGKILL: the OOM killer?"),
        ("import time; time.sleep(30)", 124, "ran past its deadline of 1 s and was killed"),
    ],
)
def test_export_says_how_its_converter_failed_and_what_to_rerun(written, tmp_path, monkeypatch, capsys, child, rc, said):
    """The converter is a child process: a fake one (the process boundary) that fails, is killed or hangs."""
    import sys

    from launcher import cli
    from launcher.core import export as export_mod

    monkeypatch.setattr(export_mod, "EXPORT_BASE_S", 1.0)
    monkeypatch.setattr(export_mod, "EXPORT_MIN_BYTES_PER_S", 1e15)
    monkeypatch.setattr(export_mod.ExportRequest, "child_argv", lambda self, python=sys.executable: [python, "-c", child])
    job = tmp_path / "job"  # the job folder as `submit` leaves it: plan.json beside config.yaml and checkpoints/
    job.mkdir()
    (job / "plan.json").write_text("{}")
    (job / "config.yaml").write_text((written / "full" / "config.yaml").read_text())
    (job / "checkpoints").symlink_to(written / "full" / "checkpoints")
    assert cli.main(["export", str(job), "--out", str(tmp_path / "out")]) == rc
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and said in err[0], err
    assert err[0].endswith(f"rerun: slurm-grpo export {job} --step 5 --out {tmp_path / 'out'} --dtype float32"), err


FOREIGN = {"model.visual.proj.weight": (6, 4), "mtp.layers.0.norm.weight": (16,)}
"""Tensors a release holds beside its causal LM (a vision tower, multi-token-prediction layers): transformers' causal LM
drops them on load, so no rank trains them."""


def with_foreign_tensors(tiny: str, out: Path) -> str:
    """A copy of the tiny model whose checkpoint also holds FOREIGN (random values), beside a Mistral-style
    consolidated.safetensors (another copy under other names, which transformers and vLLM do not load)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny, out)
    (f,) = out.glob("*.safetensors")
    weights = load_file(f)
    g = torch.Generator().manual_seed(5)
    weights |= {n: torch.randn(s, generator=g) for n, s in FOREIGN.items()}
    save_file(weights, f, metadata={"format": "pt"})
    save_file({"layers.0.attention.wq.weight": torch.zeros(4, 4)}, out / "consolidated.safetensors")
    return str(out)


def foreign_side(rank: int, world: int, _port: int, base: str, root: str) -> bool:
    import torch.distributed as dist

    from launcher.core.config import LoraConfig
    from tests.support.ranks import cpu_parallel
    from trainer import checkpoint, final_model, loading
    from trainer import lora as trainer_lora

    par = cpu_parallel(rank, world)
    model, _ = loading.load_model(base, par, torch.float32)
    perturb(model, seed=1)
    checkpoint.save(
        Path(root) / "checkpoints", model, torch.optim.AdamW(model.parameters()), None, CheckpointMeta(step=2, world_size=world)
    )
    final_model.save(model, torch.float32, base, Path(root) / "model", max_bytes=SMALL_FILES)
    lora = LoraConfig(r=4, alpha=8, save_merged=True)
    lm, _ = loading.load_model(base, par, torch.float32, lora=lora, seed=3)
    perturb(lm, seed=2)
    opt = torch.optim.AdamW([p for p in lm.parameters() if p.requires_grad])
    checkpoint.save(Path(root) / "lora" / "checkpoints", lm, opt, None, CheckpointMeta(step=2, world_size=world))
    trainer_lora.save_outputs(lm, lora, base, Path(root) / "lora", torch.float32)
    dist.barrier()
    return True


def test_the_final_model_and_an_export_carry_the_tensors_the_trainer_does_not_hold(tiny_model, tmp_path):
    """A multimodal release's vision tower and its MTP layers come back, as they were, beside the trained weights: the
    folder is the whole model its config.json names (vLLM's loader of such an architecture wants them)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from launcher.core.export import resolve
    from trainer.export import export

    base = with_foreign_tensors(tiny_model, tmp_path / "base")
    run_ranks(2, functools.partial(foreign_side, base=base, root=str(tmp_path / "job")), timeout_s=240)
    job_config(tmp_path / "job", base)
    job_config(tmp_path / "job" / "lora", base, "trainer.lora.r=4", "trainer.lora.alpha=8")
    original = load_file(Path(base) / "model.safetensors")
    exported = export(resolve(tmp_path / "job", None, str(tmp_path / "export")))
    merged = export(resolve(tmp_path / "job" / "lora", None, str(tmp_path / "merged"), merged=True))
    for folder in (tmp_path / "job" / "model", exported, tmp_path / "job" / "lora" / "merged", merged):
        weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
        assert {n for n, f in weight_map.items() if f.startswith("model-extra-")} == set(FOREIGN), (folder, weight_map)
        got = tensors(folder)
        assert all(torch.equal(got[n], original[n]) for n in FOREIGN), folder
        trained = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
        q = "model.layers.0.self_attn.q_proj.weight"  # trained in both runs (LoRA adapts it by default)
        assert not torch.equal(trained[q], original[q]), folder
        assert set(got) - set(FOREIGN) == set(original) - set(FOREIGN) - {"lm_head.weight"}, sorted(set(got) ^ set(original))
