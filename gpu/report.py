"""Figures of a GPU local run, from its own outputs: generation tokens/s, push seconds and GB/s against the
device-to-device copy floor, training seconds per step, parity per push, peak GPU memory of the trainer
(torch's max allocated) and of vLLM (what its log reports for weights + KV cache), and the whole GPU's
peak use (nvidia-smi). Writes gpu_results.json and gpu_results.md under OUT.

    python3 gpu/report.py JOB_DIR OUT

Multi-turn runs (trainer.tools / environment) have no per-node gen_s: their rows carry the agents' own figures
(StepRow.agents, trainer/agents/figures.py), and step_figures reads the generation time from agents/gen_s (rank 0's
generation requests of the step, summed) when the episodes ran in the step, and reports none when they ran ahead
(max_staleness >= 1: generation is off the step's path; the step's wait for it is in train_s)."""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

from launcher.core.jobdir import JobDir
from launcher.core.plan import Plan
from launcher.core.records import Event, FinalRow, StepRow, read_events, read_rows, step_rows
from launcher.core.shape import ModelShape
from launcher.memory import estimate as memory_estimate
from launcher.memory import layout, options
from launcher.status import startup_phases
from launcher.vllm_log import node_starts

AGENT_GEN_S, AGENT_TOKENS, AGENT_TOOL_S = "agents/gen_s", "agents/gen_tokens", "agents/tool_s"
"""StepRow.agents keys (trainer/agents/figures.py): rank 0's generation seconds and tokens of the step, its tools' seconds."""


def _median(values: list[float], digits: int = 4) -> float | None:
    return round(statistics.median(values), digits) if values else None


def gen_s(row: StepRow) -> float | None:
    """Node 0's generation seconds of the step: the server's time for its batch (single-turn), or rank 0's episode
    generation requests summed (multi-turn, episodes run in the step); None when generation ran ahead."""
    return row.gen_s.get("0") or row.agents.get(AGENT_GEN_S)


def gen_tokens_per_s(row: StepRow) -> float | None:
    if row.gen_tokens_per_s:
        return row.gen_tokens_per_s
    seconds, tokens = row.agents.get(AGENT_GEN_S), row.agents.get(AGENT_TOKENS)
    return round(tokens / seconds, 1) if seconds and tokens is not None else None


def model_figures(shape: ModelShape) -> dict:
    """The body's size as dry-run's estimate counts it: every parameter (an MoE's every expert: what the state, the push
    and vLLM's weights scale with) and those one token runs through (experts_per_token of them: what compute scales
    with; = the total for a dense body)."""
    res: dict[str, Any] = {
        "model_params_b": round(shape.params / 1e9, 3),
        "model_params_active_b": round(shape.active_params / 1e9, 3),
    }
    if shape.experts:
        res["model_experts"] = f"{shape.experts_per_token} of {shape.experts} per token, {shape.moe_layers} MoE layers"
    return res


def step_figures(later: list[StepRow]) -> dict:
    """Medians over the steps after the first of each phase of node 0's step, single-turn or multi-turn rows alike.
    train_s: the step minus its generation, push and parity probe (a multi-turn step's tool calls stay in it, as in
    TRL's figure beside it)."""
    gens = [g for r in later if (g := gen_s(r))]
    res: dict[str, Any] = {
        "step_s_median": _median([r.step_s or 0.0 for r in later], 3),
        "gen_s_median": _median(gens),
        "gen_s_source": None
        if not gens
        else "agents/gen_s (rank 0's generation requests, summed per step)"
        if any(r.agents.get(AGENT_GEN_S) for r in later)
        else "gen_s (the node's server time for the step's batch)",
        "gen_tokens_per_s_median": _median([t for r in later if (t := gen_tokens_per_s(r))], 1),
        "push_s_median": _median([r.push_s["0"] for r in later if r.push_s.get("0")]),
        "parity_s_median": _median([r.parity_s["0"] for r in later if r.parity_s.get("0") is not None]),
        "train_s_median": _median(
            [(r.step_s or 0.0) - (gen_s(r) or 0) - (r.push_s.get("0") or 0) - (r.parity_s.get("0") or 0) for r in later], 3
        ),
    }
    if any(r.agents for r in later):  # multi-turn: what the episodes did (rank 0's)
        res["agents"] = {
            "turns_per_episode_mean": _median([r.agents.get("agents/turns_per_episode", 0.0) for r in later], 2),
            "tool_calls_median": _median([r.agents.get("agents/tool_calls", 0.0) for r in later], 1),
            "tool_s_median": _median([r.agents[AGENT_TOOL_S] for r in later if AGENT_TOOL_S in r.agents]),
            "gen_requests_median": _median([r.agents["agents/requests"] for r in later if "agents/requests" in r.agents], 1),
            "episodes_ran_ahead": not any(r.agents.get(AGENT_GEN_S) for r in later),
            "staleness": [r.agents.get("agents/staleness") for r in later],
        }
    return res


def per_hour(steps: int, step_s_median: float | None, reward_first5: float | None, reward_last5: float | None) -> dict:
    """Steps per hour and reward gained per hour of training at the median step (issue 37: a faster step is worth what
    it buys in reward; the same formula on both sides of a comparison with TRL)."""
    if not step_s_median or not steps:
        return {"steps_per_hour": None, "reward_gain_per_hour": None}
    hours = steps * step_s_median / 3600
    gain = (reward_last5 - reward_first5) if reward_first5 is not None and reward_last5 is not None else None
    return {
        "steps_per_hour": round(3600 / step_s_median, 1),
        "reward_gain_per_hour": round(gain / hours, 2) if gain is not None else None,
    }


def main(job: Path, out: Path) -> None:
    jd = JobDir(job)
    rows = read_rows(jd.metrics)
    steps = step_rows(rows)
    later = steps[1:] or steps  # step 1 carries one-time warm-up
    final = next((r.nodes.get("0") for r in reversed(rows) if isinstance(r, FinalRow)), None)  # node 0's end figures
    summary = json.loads(jd.summary.read_text()) if jd.summary.exists() else {}
    d2d = json.loads((out / "d2d.json").read_text()) if (out / "d2d.json").exists() else {}  # FLOOR=0 skips it
    versions = json.loads((out / "versions.json").read_text())
    plan = Plan.load(jd.plan)
    figures = step_figures(later)
    push_med = figures["push_s_median"]
    vllm_log = jd.log(0, "vllm").read_text(errors="replace")
    mem = _samples(out / "gpu_mem_used_mib.txt")
    res = {
        "kind": plan.config.trainer.run_kind,  # dense, lora, agents: step_ratio_vs_trl compares only the same kind
        "max_staleness": plan.config.trainer.max_staleness,
        "versions": versions,
        "backend": plan.weight_transfer_backend,
        "shared_gpu": plan.nodes[0].shared_gpu,
        "steps": len(steps),
        "reward_first5": statistics.mean(r.reward for r in steps[:5]) if steps else None,
        "reward_last5": statistics.mean(r.reward for r in steps[-5:]) if steps else None,
        **figures,
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
    res.update(per_hour(len(steps), res["step_s_median"], res["reward_first5"], res["reward_last5"]))
    shape = ModelShape.read(plan.config.vllm.model)
    if shape:  # the estimate dry-run prints for this run, next to what was measured
        e = memory_estimate(shape, layout(plan), options(plan))
        res.update(model_figures(shape))
        res["options"] = options(plan).describe()
        res["estimate_gpu_gb_per_rank"] = round(e.gpu_gb, 1)
        res["estimate_host_gb_offloaded"] = round(e.host_gb_per_node, 1)
    # side by side with TRL colocate on the same work (gpu/trl_colocate.py's trl.json), phase by phase
    trl_file = out / "trl.json"
    trl = json.loads(trl_file.read_text()) if trl_file.exists() else None
    if trl is not None and trl.get("kind") != res["kind"]:  # a trl.json of before issue 37 names none
        res["trl_kind_mismatch"] = f"TRL's run was {trl.get('kind', 'of an unnamed kind')}, this one {res['kind']}: no ratio"
        print(f"report.py: {res['trl_kind_mismatch']}", file=sys.stderr)
    elif trl is not None and res["step_s_median"]:
        res["step_ratio_vs_trl"] = round(res["step_s_median"] / trl["step_s_median"], 3)
        res["trl_gen_tokens_per_s_median"] = trl.get("gen_tokens_per_s_median")
        trl_hour = per_hour(trl["steps"], trl["step_s_median"], trl.get("reward_first5"), trl.get("reward_last5"))
        res["trl_steps_per_hour"], res["trl_reward_gain_per_hour"] = trl_hour["steps_per_hour"], trl_hour["reward_gain_per_hour"]
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
        served = (res["vllm_start_first_s"] or {}).get("total")
        res["trl_build_from_process_start_s"] = built = trl.get("build_from_process_start_s")  # trl.json of 2026-12-07 on
        for label, ours, theirs in (
            ("first start: vLLM healthy / TRL's build, from process start (s)", served, built),
            ("steps per hour", res["steps_per_hour"], res["trl_steps_per_hour"]),
            ("reward gained per hour (last 5 - first 5)", res["reward_gain_per_hour"], res["trl_reward_gain_per_hour"]),
        ):
            ratio = f"{ours / theirs:.2f}x" if ours is not None and theirs else ""
            rows_md.append(f"| {label} | {'' if ours is None else ours} | {'' if theirs is None else theirs} | {ratio} |")
        (out / "phases.md").write_text("\n".join(rows_md) + "\n")
        print("\n".join(rows_md))
    (out / "gpu_results.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


def _samples(path: Path) -> list[float]:
    return [float(x) for x in path.read_text().split()] if path.exists() else []


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
