"""`slurm-grpo export JOB [--step N] [--out DIR] [--merged] [--dtype D]`: a checkpoint of a job as a model Hugging Face
and vLLM load, on the login node (CPU, one process). This side resolves and checks the request (which checkpoint,
what to write where, in which dtype) without torch; the conversion runs in a child `python -m trainer.export`
(launcher/ never imports torch; launcher/cli.py starts it), which resolves the same request through `resolve`."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from launcher.core import config as config_mod
from launcher.core.config import ConfigError, JobConfig
from launcher.core.jobdir import JobDir

DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class ExportRequest:
    job_dir: Path
    step: int
    checkpoint: Path
    kind: str
    """model (a full fine-tune), adapter (LoRA, peft's format) or merged (LoRA merged into the base)."""
    out: Path
    dtype: str
    """The saved dtype of a model or merged export (the adapter is written in fp32, as trained)."""
    config: JobConfig

    @property
    def what(self) -> str:
        return {
            "model": "the model",
            "adapter": "the LoRA adapter (peft format)",
            "merged": "the base with the LoRA adapter merged in",
        }[self.kind]

    def child_argv(self, python: str = sys.executable) -> list[str]:
        argv = [python, "-m", "trainer.export", str(self.job_dir), "--step", str(self.step), "--out", str(self.out)]
        return argv + ["--dtype", self.dtype] + (["--merged"] if self.kind == "merged" else [])


def resolve(
    job_dir: Path, step: int | None = None, out: str | None = None, merged: bool = False, dtype: str = ""
) -> ExportRequest:
    """The request, checked: a job folder with complete checkpoints, `step` one of them (default the newest), --merged
    only for a LoRA run, the base model's folder readable here (its config and tokenizer go with the weights)."""
    jd = JobDir(Path(job_dir))
    if not jd.config.is_file():
        raise ConfigError(f"{job_dir} is not a job folder (no config.yaml); give the folder `submit` or `local` printed")
    done = dict(jd.complete_checkpoints())
    if not done:
        raise ConfigError(
            f"{jd.checkpoints} holds no complete checkpoint (step-N with meta.json) to export; "
            "checkpoints are written every trainer.save_steps and at the end"
        )
    if step is None:
        step = max(done)
    elif step not in done:
        raise ConfigError(
            f"--step {step}: no complete checkpoint of that step; the job has steps {', '.join(map(str, sorted(done)))}"
        )
    cfg = config_mod.load(jd.config)
    lora = cfg.trainer.lora.enabled
    if merged and not lora:
        raise ConfigError("--merged is for LoRA runs (trainer.lora.r > 0); a full fine-tune's export is the whole model already")
    if dtype and dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: one of {', '.join(DTYPES)} (default: the run's trainer.dtype)")
    base = Path(cfg.vllm.model)
    if not (base / "config.json").is_file():
        raise ConfigError(
            f"the run's base model folder {base} (vllm.model) has no config.json here: export copies its config and "
            "tokenizer files; run it where that folder is readable"
        )
    kind = ("merged" if merged else "adapter") if lora else "model"
    target = Path(out).absolute() if out else jd.export(step, kind)
    return ExportRequest(jd.root, step, done[step], kind, target, dtype or cfg.trainer.dtype, cfg)
