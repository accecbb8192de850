"""What `slurm-grpo dry-run` prints, and `submit`/`local` show in part: the plan with the rule behind each number
(first: what a reader came for), the per-node table, the memory estimate, the exact sbatch text, the resolved config
and every node's commands (secrets redacted). Pure: it renders, it runs nothing."""

from __future__ import annotations

import json
import shlex

from launcher.core import config as config_mod
from launcher.core.config import JobConfig, redact_argv
from launcher.core.plan import Plan
from launcher.memory import plan_report
from launcher.node.commands import trainer_command, vllm_command


def node_table(p: Plan) -> str:
    rows = [("node", "vLLM GPUs", "trainer GPUs", "global ranks", "server", "weight port")]
    for n in p.nodes:
        ranks = [r.global_rank for r in n.ranks]
        rows.append(
            (
                str(n.node),
                ",".join(map(str, n.vllm_gpus)),
                ",".join(map(str, n.trainer_gpus)),
                f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0]),
                n.server_url,
                str(n.weight_transfer_port),
            )
        )
    if len(rows) > 12:  # 256 nodes: show the pattern, not a wall
        rows = rows[:6] + [("...",) * 6] + rows[-3:]
    widths = [max(len(r[i]) for r in rows) for i in range(6)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def _env_prefix(env: dict[str, str]) -> str:
    return " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()))


SHARED_GPU_UTILIZATION = 0.7
"""Below this vllm.gpu_memory_utilization is a value for a GPU vLLM shares with a trainer rank."""


def utilization_note(p: Plan) -> str | None:
    """A split-layout server on GPUs of its own kept at a shared-GPU memory fraction (the CPU and one-GPU examples'
    0.35, kept by `--set slurm.gpus_per_node=8`): the rest of those GPUs idles, the KV cache is small. One line."""
    v = p.config.vllm
    if p.device != "cuda" or p.config.job.emulate_gpus or p.nodes[0].shared_gpu:
        return None
    if v.gpu_memory_utilization >= SHARED_GPU_UTILIZATION:
        return None
    gpus = ",".join(map(str, p.nodes[0].vllm_gpus))
    return (
        f"NOTE: vllm.gpu_memory_utilization {v.gpu_memory_utilization:g} is a shared-GPU value, but vLLM has GPU(s) "
        f"{gpus} of each node to itself (layout split): set vllm.gpu_memory_utilization=0.9 for its KV cache"
    )


def render_dry_run(cfg: JobConfig, p: Plan) -> str:
    from launcher.core.inputs import input_notes
    from launcher.simulate import layout_verdict, timeout_warning
    from launcher.submit import sbatch_text

    out = ["# plan"]
    out += [f"  {d}" for d in p.derivation]
    for note in (*input_notes(cfg), layout_verdict(cfg), utilization_note(p), timeout_warning(cfg)):
        if note:
            out.append(f"  {note}")
    out += [
        "",
        node_table(p),
        "",
        "# memory estimate (launcher/memory.py; from the model's config.json)",
        *[f"  {ln}" for ln in plan_report(p) or ["model config.json not readable here: no estimate"]],
        "",
        "# sbatch text (what `submit` hands to sbatch)",
        sbatch_text(cfg, p).rstrip(),
        "",
        "# settings not at their defaults (the YAML, its base files, --set; each key: slurm-grpo config-reference)",
        *[f"  {k}: {json.dumps(v)}" for k, v in config_mod.non_defaults(p.config, redact=True)],
        "",
        "# resolved config (every setting)",
        config_mod.to_yaml(p.config, redact=True).rstrip(),
        "",
        "# per-node commands (run by launcher.node.bootstrap on each node)",
    ]
    shown = list(range(p.num_nodes)) if p.num_nodes <= 4 else [0, 1, p.num_nodes - 1]
    for n in shown:
        host = "$FIRST_NODE" if p.num_nodes > 1 else "127.0.0.1"
        for cmd in (vllm_command(p, n, cfg.job.python), trainer_command(p, n, host, cfg.job.python)):
            out.append(f"node {n} {cmd.name} (log {cmd.log}):")
            out.append(f"  {_env_prefix(cmd.env)} {shlex.join(redact_argv(cmd.argv))}")
    if len(shown) < p.num_nodes:
        out.append(f"(nodes 2..{p.num_nodes - 2} differ only in --node-rank)")
    return "\n".join(out)
