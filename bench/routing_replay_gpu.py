"""Routing replay's effect on the vLLM-vs-trainer logprob mismatch (trainer.routing_replay), CUDA only: a random MoE
body (Qwen3-MoE by default, built from a config: no download) trained by `slurm-grpo local` on one GPU
(configs/gpu_1gpu.yaml: vLLM and the FSDP2 rank share it), the same steps without and with replay; prints each step's
logp_mismatch_mean (TRL's |vLLM logprob - trainer logprob| over completion tokens) side by side and writes
$OUT/routing_replay.json. vLLM returns routed experts only from Model Runner V2 (Triton), hence GPU only.

On the device after the carry calls of gpu/carry.sh (the pinned stack in /tmp/parts):
    log() { echo "$*"; }; . gpu/stack.sh && python3 -m bench.routing_replay_gpu --out $OUT
or one arm per device call (--run off, then --run on on the same warm machine: the table then has both).
Without CUDA it says so and exits 0 (skipped)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

SHAPE = {"hidden": 1024, "layers": 8, "vocab": 4096, "kv_heads": 2, "intermediate": 2048, "head_dim": 128}
EXPERTS = {"experts": 64, "experts_per_token": 8, "expert_intermediate": 256}
"""Qwen3-30B-A3B's routing (128 experts, top 8) at a tenth of the width: many near ties, so routing flips show. Every
family gets these experts in its own fields (mixtral's and olmoe's width is their intermediate_size)."""


STOP_GRACE_S = 60
"""A run past its limit: how long `slurm-grpo local` gets after SIGTERM to stop its vLLM server and trainer."""


BUILD_TIMEOUT_S = 300
"""The model's build (about 20 s on a GPU)."""


def build_model(path: Path, family: str, device: str = "cuda") -> None:
    """A random bf16 MoE body with the project's tokenizer (`make-tiny-model`, experts resized), built in a child
    process: a CUDA context left in this one would make the launcher refuse the GPU as in use (2026-12-06)."""
    size = {**SHAPE, **EXPERTS}
    flags = {"hidden": "--hidden", "layers": "--layers", "vocab": "--vocab", "kv_heads": "--kv-heads",
             "intermediate": "--intermediate", "head_dim": "--head-dim", "experts": "--experts",
             "experts_per_token": "--top-k", "expert_intermediate": "--moe-intermediate"}  # fmt: skip
    argv = [a for key, flag in flags.items() for a in (flag, str(size[key]))]
    cmd = [sys.executable, "-m", "trainer.tiny_model", str(path), "--family", family, "--dtype", "bfloat16", "--device", device]
    try:
        subprocess.run(cmd + argv, check=True, timeout=BUILD_TIMEOUT_S, cwd=Path(__file__).resolve().parent.parent)
    except subprocess.TimeoutExpired as e:
        raise SystemExit(f"bench.routing_replay_gpu: building the model in {path} took over {BUILD_TIMEOUT_S} s") from e


def run_job(
    model: Path, job: Path, steps: int, replay: bool, timeout_s: int, config: str, extra: list[str] | None = None
) -> list[dict]:
    """One `slurm-grpo local` run; its step rows (metrics.jsonl). extra: more SECTION.KEY=VALUE overrides."""
    sets = [
        f"job.job_dir={job}",
        f"vllm.model={model}",
        f"trainer.max_steps={steps}",
        f"trainer.routing_replay={str(replay).lower()}",
        *(extra or []),
    ]
    cmd = [sys.executable, "-m", "launcher", "local", config] + [a for s in sets for a in ("--set", s)]
    shutil.rmtree(job, ignore_errors=True)  # a rerun starts afresh: an existing job folder would be resumed
    t0 = time.time()
    # both arms on vLLM's Model Runner V2 (the launcher sets it only with replay, which needs it): the same runner's
    # kernels on both sides, so the difference is the replay's
    env = {**os.environ, "VLLM_USE_V2_MODEL_RUNNER": "1"}
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        out, err = p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        # SIGTERM: the bootstrap stops vLLM and the trainer (each in its own session) itself; a SIGKILL would leave them
        # on the GPU for the other run; the steps written so far are kept
        print(f"[replay={replay}] past --timeout-s {timeout_s}: stopping the run", flush=True)
        p.terminate()
        try:
            out, err = p.communicate(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
    print(f"[replay={replay}] exit {p.returncode} after {time.time() - t0:.0f} s", flush=True)
    if p.returncode:
        print(out[-3000:], err[-3000:], sep="\n")
    missing = [
        line
        for f in sorted((job / "logs").glob("*"))
        if f.is_file()  # logs/ also holds the heartbeat folders
        for line in f.read_text(errors="replace").splitlines()
        if "without routed experts" in line
    ]
    if replay:  # TrlAdapter warns when completions came back without routes (they keep the trainer's own routing)
        print(f"[replay=True] generations with completions lacking routes: {len(missing)}", *missing[:3], sep="\n", flush=True)
    return step_rows(job)


def step_rows(job: Path) -> list[dict]:
    """The step rows a run wrote (its metrics.jsonl); [] if none."""
    rows = job / "metrics.jsonl"
    return [r for r in map(json.loads, rows.read_text().splitlines()) if r.get("kind") == "step"] if rows.exists() else []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.routing_replay_gpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    ap.add_argument("--family", default="qwen3_moe", choices=["qwen3_moe", "qwen2_moe", "olmoe", "mixtral"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--timeout-s", type=int, default=230, help="per run (two runs; a device call has 600 s)")
    ap.add_argument(
        "--run",
        choices=["both", "off", "on"],
        default="both",
        help="the arms run in this call (replay off, on); the other's rows are read from its job folder of an earlier "
        "call on this machine: one run per device call leaves each the whole call",
    )
    ap.add_argument("--config", default="configs/gpu_1gpu.yaml")
    ap.add_argument("--work", default="/tmp", help="where the model (model-replay-FAMILY) and the job folders go")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="more overrides of both runs, e.g. trainer.final_checkpoint=false (no optimizer state written at the end)",
    )
    a = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench.routing_replay_gpu: skipped, no CUDA (vLLM's routed experts need Model Runner V2: GPU only)")
        return 0
    out, work = Path(a.out), Path(a.work)
    model = work / f"model-replay-{a.family}"
    out.mkdir(parents=True, exist_ok=True)
    if not (model / "config.json").exists():
        build_model(model, a.family)
    arms = {"both": (False, True), "off": (False,), "on": (True,)}[a.run]
    runs: dict[bool, list[dict]] = {}
    for replay in (False, True):
        job = work / f"job-replay-{replay}"
        runs[replay] = run_job(model, job, a.steps, replay, a.timeout_s, a.config, a.set) if replay in arms else step_rows(job)
    by_step = {r: {row["step"]: row.get("logp_mismatch_mean") for row in rows} for r, rows in runs.items()}
    print(f"{'step':>4}  {'logp_mismatch_mean, no replay':>30}  {'with routing replay':>20}")
    for step in sorted(set(by_step[False]) | set(by_step[True])):
        print(f"{step:>4}  {by_step[False].get(step)!s:>30}  {by_step[True].get(step)!s:>20}")
    means = {
        r: (sum(v) / len(v) if (v := [x for x in steps.values() if x is not None]) else None) for r, steps in by_step.items()
    }
    print(f"mean  {means[False]!s:>30}  {means[True]!s:>20}")
    result = {"family": a.family, "shape": SHAPE, "experts": EXPERTS, "steps": a.steps, "sets": a.set, "by_step": by_step}
    result["model_runner"] = "V2 in both arms (VLLM_USE_V2_MODEL_RUNNER=1)"
    result["mean"] = means
    (out / "routing_replay.json").write_text(json.dumps({**result, "by_step": {str(k): v for k, v in by_step.items()}}, indent=1))
    for replay in (False, True):  # each run's trainer and vLLM logs, for what failed
        subprocess.run(
            ["tar", "-czf", str(out / f"logs-replay-{replay}.tgz"), "-C", str(work / f"job-replay-{replay}"), "logs"], check=False
        )
    return 0 if all(runs[replay] for replay in arms) else 1


if __name__ == "__main__":
    raise SystemExit(main())
