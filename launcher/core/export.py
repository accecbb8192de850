"""`slurm-grpo export JOB [--step N] [--out DIR] [--merged] [--dtype D]`: a checkpoint of a job as a model Hugging Face
and vLLM load, on the login node (CPU, one process). This side resolves and checks the request (which checkpoint,
what to write where, in which dtype) without torch; the conversion runs in a child `python -m trainer.export`
(launcher/ never imports torch; launcher/cli.py starts it), which resolves the same request through `resolve`."""

from __future__ import annotations

import shlex
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

from launcher.core import config as config_mod
from launcher.core.config import ConfigError, JobConfig
from launcher.core.jobdir import JobDir

DTYPES = ("bfloat16", "float16", "float32")
EXPORT_BASE_S = 600.0
EXPORT_MIN_BYTES_PER_S = 20e6
"""The converter's deadline: 10 minutes plus its input at 20 MB/s (a 91 GB checkpoint of a 7.6B model: ~86 minutes)."""


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

    def args(self) -> list[str]:
        """The arguments that name this request exactly (`slurm-grpo export` and `python -m trainer.export` take them)."""
        argv = [str(self.job_dir), "--step", str(self.step), "--out", str(self.out), "--dtype", self.dtype]
        return argv + (["--merged"] if self.kind == "merged" else [])

    def child_argv(self, python: str = sys.executable) -> list[str]:
        return [python, "-m", "trainer.export", *self.args()]

    def rerun(self) -> str:
        """The command line that repeats this export."""
        return shlex.join(["slurm-grpo", "export", *self.args()])

    def deadline_s(self) -> float:
        """How long the converter may run: EXPORT_BASE_S plus what it reads (the checkpoint's files, and a merge's
        base weights) at EXPORT_MIN_BYTES_PER_S, far below any disk, so only a hung converter meets it."""
        files = [f for f in self.checkpoint.rglob("*") if f.is_file()]
        if self.kind == "merged":
            files += [f for f in Path(self.config.vllm.model).glob("*.safetensors") if f.is_file()]
        return EXPORT_BASE_S + sum(f.stat().st_size for f in files) / EXPORT_MIN_BYTES_PER_S

    def failure(self, returncode: int | None, deadline_s: float) -> str:
        """The one line said when the converter did not finish: its exit code or signal (None: past the deadline)."""
        if returncode is None:
            how = f"ran past its deadline of {deadline_s:.0f} s and was killed"
        elif returncode < 0:
            name = signal.Signals(-returncode).name if -returncode in signal.valid_signals() else str(-returncode)
            oom = " (SIGKILL: the OOM killer? see dmesg)" if -returncode == signal.SIGKILL else ""
            how = f"was killed by signal {name}{oom}"
        else:
            how = f"exited with code {returncode}"
        return f"slurm-grpo export: error: the converter (python -m trainer.export) {how}; its output is above; rerun: {self.rerun()}"


def resolve(
    job_dir: Path, step: int | None = None, out: str | None = None, merged: bool = False, dtype: str = ""
) -> ExportRequest:
    """The request, checked: a job folder with complete checkpoints, `step` one of them (default the newest), --merged
    only for a LoRA run, the base model's folder readable here (its config and tokenizer go with the weights), --out
    a new or empty folder (check_destination)."""
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
    check_destination(target, base, jd.export(step, kind))
    return ExportRequest(jd.root, step, done[step], kind, target, dtype or cfg.trainer.dtype, cfg)


def check_destination(out: Path, base: Path, own: Path) -> None:
    """Export writes only where nothing is lost: a new or empty folder, or `own` (JOB/exports/step-N-KIND, an earlier
    export of the same request, replaced); never the base model's folder (vllm.model) or one holding it. The converter
    replaces its destination whole, so an existing folder (a model, the base) would be gone: refused, as dequantize
    refuses (trainer/dequantize.py check_destination)."""
    o, b = out.resolve(), base.resolve()
    if o == b or o in b.parents:
        where = "is" if o == b else "holds"
        raise ConfigError(
            f"--out {out} {where} the run's base model folder {base} (vllm.model), which export must never overwrite; "
            f"name a new folder (without --out: {own})"
        )
    if o != own.resolve() and out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(
            f"--out {out} exists and is not empty; export never overwrites: name a new folder (without --out: {own})"
        )
