"""Figures of a GPU local run, from its own outputs: generation tokens/s, push seconds and GB/s against the
device-to-device copy floor, training seconds per step, parity per push, peak GPU memory of the trainer
(torch's max allocated) and of vLLM (what its log reports for weights + KV cache), and the whole GPU's
peak use (nvidia-smi). Writes gpu_results.json and gpu_results.md under OUT."""

import json
import re
import statistics
import sys
from pathlib import Path

from launcher.core.jobdir import JobDir
from launcher.core.plan import Plan
from launcher.core.records import Event, FinalRow, read_events, read_rows, step_rows
from launcher.core.shape import ModelShape
from launcher.memory import estimate as memory_estimate
from launcher.memory import layout, options
from launcher.status import startup_phases
from launcher.vllm_log import node_starts

job, out = Path(sys.argv[1]), Path(sys.argv[2])
jd = JobDir(job)
rows = read_rows(jd.metrics)
steps = step_rows(rows)
later = steps[1:] or steps  # step 1 carries one-time warm-up
final = next((r.nodes.get("0") for r in reversed(rows) if isinstance(r, FinalRow)), None)  # node 0's end figures
summary = json.loads(jd.summary.read_text()) if jd.summary.exists() else {}
d2d = json.loads((out / "d2d.json").read_text()) if (out / "d2d.json").exists() else {}  # FLOOR=0 skips it
versions = json.loads((out / "versions.json").read_text())
plan = Plan.load(jd.plan)
push = [r.push_s["0"] for r in later if r.push_s.get("0")]
push_med = statistics.median(push) if push else None
gen_tps = [r.gen_tokens_per_s for r in later if r.gen_tokens_per_s]
vllm_log = jd.log(0, "vllm").read_text(errors="replace")


def _samples(path: Path) -> list[float]:
    return [float(x) for x in path.read_text().split()] if path.exists() else []


mem = _samples(out / "gpu_mem_used_mib.txt")
res = {
    "versions": versions,
    "backend": plan.weight_transfer_backend,
    "shared_gpu": plan.nodes[0].shared_gpu,
    "steps": len(steps),
    "reward_first5": statistics.mean(r.reward for r in steps[:5]) if steps else None,
    "reward_last5": statistics.mean(r.reward for r in steps[-5:]) if steps else None,
    "gen_tokens_per_s_median": statistics.median(gen_tps) if gen_tps else None,
    "step_s_median": statistics.median(r.step_s or 0.0 for r in later) if later else None,
    "push_s_median": push_med,
    "push_bytes": d2d.get("bytes"),
    "push_gb_per_s": round(d2d["bytes"] / push_med / 1e9, 2) if push_med and d2d else None,
    "d2d_copy_gb_per_s": d2d.get("gb_per_s"),
    "push_over_copy_floor": round(push_med / d2d["copy_s_median"], 1) if push_med and d2d else None,
    "parity_per_push": [r.parity_max for r in steps],
    "parity_stale": [r.parity_stale.get("0") for r in steps],
    "parity_final": final.parity_final if final else None,
    "trainer_peak_gpu_gb": final.trainer_peak_gpu_gb if final else None,
    "vllm_memory_lines": re.findall(
        r"(Model loading took [^\n]*|Available KV cache memory[^\n]*|GPU KV cache size[^\n]*)", vllm_log
    )[:4],
    "gpu_peak_used_gib": round(max(mem) / 1024, 1) if mem else None,
    "peak_memory_per_rank": summary.get("peak_memory_per_rank"),
    "host_peak_used_gib": round(max(hm) / 1024, 1) if (hm := _samples(out / "host_mem_used_mib.txt")) else None,
    # GPU busy while training ran (nvidia-smi samples every 0.5 s; the samples before the first step are vLLM's start)
    "gpu_busy_pct_mean": round(statistics.mean(b[-int(2 * sum(r.step_s or 0.0 for r in steps)) :]), 1)
    if (b := _samples(out / "gpu_busy_pct.txt")) and steps
    else None,
    "staleness": [max((v for v in r.staleness.values() if v is not None), default=None) for r in steps],
    "logp_mismatch_mean": [r.logp_mismatch_mean for r in steps],
    "startup_phases_s": startup_phases(job, 0),  # the latest start (after RESTART_STEPS: the restart)
    "startup_first_start_s": startup_phases(job, 0, 0),
    # vLLM's own phases from its log (launcher.vllm_log): imports, inspection, engine core start, compile, graphs
    "vllm_start_first_s": vs[0] if (vs := node_starts(jd.log(0, "vllm"))) else None,
    "vllm_start_latest_s": vs[-1] if len(vs) > 1 else None,
    "model_loaded": next((e.to_dict() for e in read_events(jd.events(0)) if e.event == Event.MODEL_LOADED), None),
}
shape = ModelShape.read(plan.config.vllm.model)
if shape:  # the estimate dry-run prints for this run, next to what was measured
    e = memory_estimate(shape, layout(plan), options(plan))
    res["model_params_b"] = round(shape.params / 1e9, 3)
    res["options"] = options(plan).describe()
    res["estimate_gpu_gb_per_rank"] = round(e.gpu_gb, 1)
    res["estimate_host_gb_offloaded"] = round(e.host_gb_per_node, 1)
# training seconds per step: the step minus its generation, its push and its parity probe (each measured per step)
train = [(r.step_s or 0.0) - (r.gen_s.get("0") or 0) - (r.push_s.get("0") or 0) - (r.parity_s.get("0") or 0) for r in later]
res["train_s_median"] = round(statistics.median(train), 3) if train else None
res["gen_s_median"] = statistics.median(r.gen_s["0"] for r in later if r.gen_s.get("0")) if later else None
# side by side with TRL colocate on the same work (gpu/trl_colocate.py's trl.json), phase by phase
parity = [r.parity_s["0"] for r in later if r.parity_s.get("0") is not None]
res["parity_s_median"] = round(statistics.median(parity), 4) if parity else None
trl_file = out / "trl.json"
if trl_file.exists() and res["step_s_median"]:
    trl = json.loads(trl_file.read_text())
    res["step_ratio_vs_trl"] = round(res["step_s_median"] / trl["step_s_median"], 3)
    rows_md = ["| phase (median s, steps 2..) | slurm-grpo | TRL colocate | ratio |", "|---|---|---|---|"]
    for label, ours, theirs in (
        ("step", res["step_s_median"], trl["step_s_median"]),
        ("generation", res["gen_s_median"], trl["gen_s_median"]),
        ("weight push", res["push_s_median"], trl.get("push_s_median")),
        ("parity probes", res["parity_s_median"], 0.0),
        ("training (step - the rest)", res["train_s_median"], trl["train_s_median"]),
    ):
        ratio = f"{ours / theirs:.2f}x" if ours is not None and theirs else ""
        rows_md.append(
            f"| {label} | {'' if ours is None else f'{ours:.3f}'} | {'' if theirs is None else f'{theirs:.3f}'} | {ratio} |"
        )
    (out / "phases.md").write_text("\n".join(rows_md) + "\n")
    print("\n".join(rows_md))
(out / "gpu_results.json").write_text(json.dumps(res, indent=1))
print(json.dumps(res, indent=1))
