"""`slurm-grpo simulate`: predicted step time against node count, one vLLM server per node (ours) vs
one global server reached by rank 0 (stock TRL server mode). A model, not a measurement: it states its
assumptions and takes this machine's measured figures with --calibration bench/results.json.

Per step, with N nodes, G trainer ranks per node and B completions per rank of L tokens:
  generation  ours: (G*B*L) / tps_server             (every node generates its own share in parallel)
              stock: (N*G*B*L) / tps_server           (one server generates for the whole world)
  push        ours: bP / intra_bw                      (each node pushes to its own server over NVLink; b bytes/param)
              stock: bP / inter_bw                     (rank 0 gathers every weight; the server sits on a node,
                                                       the gather and push cross the network) + gather bP / inter_bw
  training    t_train, the same for both (data parallel, per-rank batch fixed)
  tps_server  tokens_per_s_server x min(1, tps_anchor_params_b / P): a saturated server, decode memory-bound
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from launcher.memory import ModelShape

DEFAULTS = {
    "tokens_per_s_server": 40_000.0,  # one H200, 0.36B bf16: measured 40-44k (shared/gpu); scale by 1/params for big models
    "tps_anchor_params_b": 0.36,  # the model size tokens_per_s_server was measured at
    "bytes_per_param": 2.0,  # bf16 push
    "intra_bw_gbs": 450.0,  # NVLink per direction, H100/H200
    "inter_bw_gbs": 50.0,  # one 400 Gb/s NIC
    "train_s": 10.0,  # seconds of forward/backward/optimizer per step
}


@dataclass
class Row:
    nodes: int
    ours_gen_s: float
    ours_push_s: float
    ours_step_s: float
    stock_gen_s: float
    stock_push_s: float
    stock_step_s: float
    speedup: float


def predict(nodes: list[int], params_b: float, ranks_per_node: int, batch: int, tokens: int, f: dict) -> list[Row]:
    # generation throughput of one server falls with model size (decode is memory-bound), from its anchor
    tps = f["tokens_per_s_server"] * min(1.0, f["tps_anchor_params_b"] / max(params_b, 1e-6))
    push_bytes = f["bytes_per_param"] * params_b * 1e9
    rows = []
    for n in nodes:
        per_node_tokens = ranks_per_node * batch * tokens
        og, sg = per_node_tokens / tps, n * per_node_tokens / tps
        op = push_bytes / (f["intra_bw_gbs"] * 1e9)
        sp = 2 * push_bytes / (f["inter_bw_gbs"] * 1e9) if n > 1 else op
        o, s = og + op + f["train_s"], sg + sp + f["train_s"]
        rows.append(Row(n, og, op, o, sg, sp, s, s / o))
    return rows


def main(a) -> int:
    from launcher import config as C
    from launcher.memory import Layout

    cfg = C.load(a.config, a.overrides)
    figures = dict(DEFAULTS)
    if a.calibration:
        figures.update(json.loads(open(a.calibration).read()).get("calibration", {}))
    shape = ModelShape.read(cfg.vllm.model)
    params = a.params_b or (shape.params / 1e9 if shape else 7.0)
    per = cfg.slurm.gpus_per_node - cfg.vllm.tensor_parallel_size or 1
    nodes = [int(x) for x in a.nodes.split(",")]
    rows = predict(nodes, params, per, cfg.trainer.per_device_train_batch_size, cfg.trainer.max_completion_length, figures)
    print(
        f"assumptions: model {params:.3g}B params (push = {figures['bytes_per_param'] * params:.3g} GB), {per} trainer ranks/node, "
        f"{cfg.trainer.per_device_train_batch_size} completions/rank x {cfg.trainer.max_completion_length} tokens; "
        + ", ".join(f"{k}={v:g}" for k, v in figures.items())
    )
    print(__doc__.split("Per step", 1)[1].strip().split("\n", 1)[1])
    print(f"{'nodes':>6} {'ours gen':>9} {'push':>7} {'step':>8} | {'stock gen':>9} {'push':>7} {'step':>8} | {'speedup':>7}")
    for r in rows:
        print(
            f"{r.nodes:>6} {r.ours_gen_s:>9.2f} {r.ours_push_s:>7.3f} {r.ours_step_s:>8.2f} | {r.stock_gen_s:>9.2f} "
            f"{r.stock_push_s:>7.3f} {r.stock_step_s:>8.2f} | {r.speedup:>6.1f}x"
        )
    from launcher.memory import fit_table, layout
    from launcher.topology import plan

    lay = layout(plan(cfg, ""))
    if not lay.gpu_gb:
        lay = Layout(**{**lay.__dict__, "gpu_gb": 80.0})
        print("(GPU memory not in the config: the memory table assumes 80 GB; set slurm.gpu_memory_gb)")
    print()
    print("\n".join(fit_table(lay)))
    if a.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(nodes, [r.ours_step_s for r in rows], marker="o", label="one server per node (slurm-grpo)")
        ax.plot(nodes, [r.stock_step_s for r in rows], marker="o", label="one global server (stock TRL)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("nodes")
        ax.set_ylabel("predicted step seconds")
        ax.legend()
        fig.tight_layout()
        fig.savefig(a.plot, dpi=90)
        print(f"plot: {a.plot}")
    if getattr(a, "json", ""):
        open(a.json, "w").write(json.dumps([asdict(r) for r in rows], indent=1))
    return 0
