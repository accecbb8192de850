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
  tps_server  tokens_per_s_server x min(1, tps_anchor_params_b / P_active): a saturated server, decode memory-bound
              (P_active: the parameters a token runs through, an MoE's routed experts; P, total, for the push)

Then, for one node of the config (G GPUs, TP t, the config's completions per node fixed), every split of its GPUs
between vLLM (v = TP x DP GPUs, one server) and training (G - v ranks), synchronous and asynchronous, against the
layouts a user would pick instead (see split_rows).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from launcher.core.config import ConfigError, JobConfig, load
from launcher.core.inputs import prompt_length
from launcher.core.plan import plan, shared_runs
from launcher.core.shape import ModelShape
from launcher.memory import (
    Layout,
    Options,
    fit_table,
    gpu_name,
    layout,
    options,
    smallest_vllm_tp,
    split_fits,
    vllm_tp_choices,
    vllm_weights_fit,
    vllm_weights_gb,
)
from launcher.startup import STARTUP_DEFAULTS, predict_startup, processes_per_node, startup_table

DEFAULTS = {
    "tokens_per_s_server": 40_000.0,  # one H200, 0.36B bf16: measured 40-44k (shared/gpu); scale by 1/params for big models
    "tps_anchor_params_b": 0.36,  # the model size tokens_per_s_server was measured at
    "bytes_per_param": 2.0,  # bf16 push
    "intra_bw_gbs": 450.0,  # NVLink per direction, H100/H200
    "inter_bw_gbs": 50.0,  # one 400 Gb/s NIC
    "train_s": 10.0,  # seconds of forward/backward/optimizer per step
}


GPU_FIGURES = {
    # decode is memory-bound: a server's tokens/s scale from the H200 anchor (4.8 TB/s of HBM) by HBM bandwidth
    "mi250x": {  # one GCD: 1.6 TB/s; GCD to GCD over Infinity Fabric 50-100 GB/s (200 within a package); 25 GB/s NICs
        "tokens_per_s_server": 40_000.0 * 1.6 / 4.8,
        "intra_bw_gbs": 50.0,
        "inter_bw_gbs": 25.0,
    },
    "mi300x": {  # 5.3 TB/s; xGMI 64 GB/s per peer link and direction; a 400 Gb/s NIC per GPU
        "tokens_per_s_server": 40_000.0 * 5.3 / 4.8,
        "intra_bw_gbs": 64.0,
        "inter_bw_gbs": 50.0,
    },
}
GPU_FIGURES["mi250"] = GPU_FIGURES["mi250x"]
"""Figures of a known non-default GPU (the defaults are an H100/H200's), from the vendors' data sheets: assumptions."""


def gpu_of(cfg: JobConfig) -> str:
    """The config's GPU, for its figures: named in slurm.constraint/partition, or a ROCm job's GPU by its memory."""
    s = cfg.slurm
    name = gpu_name(s.constraint, s.partition)
    if not name and cfg.job.platform == "rocm":
        name = {64: "mi250x", 192: "mi300x"}.get(int(s.gpu_memory_gb), "")
    return name


ASSUMED_PARAMS_B = 7.0
ASSUMED_SIZE = "a 7 B model assumed, its config.json is not readable here"
"""The size the step model takes when vllm.model's config.json is not readable here (a hub id not downloaded yet),
and the words dry-run and simulate say it with."""


LAYOUT_DEFAULTS = {
    "colocate_gen_efficiency": 0.6,  # assumption: vLLM inside each trainer process holds a memory fraction (KV-bound)
    "async_overhead": 0.05,  # assumption: an overlapped step loses this fraction (pause/resume around a push, jitter)
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


def server_tps(active_b: float, f: dict) -> float:
    """Generation throughput of one saturated server: falls with the parameters a token runs through (decode is
    memory-bound), from its anchor. An MoE's active parameters, not its total: each token reads its routed experts."""
    return f["tokens_per_s_server"] * min(1.0, f["tps_anchor_params_b"] / max(active_b, 1e-6))


def predict(
    nodes: list[int], params_b: float, ranks_per_node: int, batch: int, tokens: int, f: dict, active_b: float | None = None
) -> list[Row]:
    tps = server_tps(active_b or params_b, f)
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


@dataclass
class SplitRow:
    layout: str
    vllm_gpus: int
    trainer_gpus: int
    gen_s: float
    train_s: float
    push_s: float
    sync_s: float
    async_s: float | None
    """None: the layout cannot overlap generation with training (TRL colocate time-shares each GPU)."""
    fits: bool = True
    """False: vLLM's weights or a trainer rank do not fit this split's GPUs (launcher/memory.py): never recommended."""


def split_rows(
    gpus: int,
    tp: int,
    nodes: int,
    params_b: float,
    completions: int,
    tokens: int,
    train_rank_s: float,
    f: dict,
    active_b: float | None = None,
    fits: Callable[[int], bool] | None = None,
):
    """Step seconds of one node (the job's nodes run the same in parallel) for each split of its G GPUs, and the
    alternatives, all on the same work: `completions` of `tokens` per node per step, `train_rank_s` seconds for one
    rank to train on all of them (training is data parallel: divided by the ranks). fits(v): whether the split with v
    GPUs serving runs in memory (memory_fit); a split that does not is listed, marked, and never the best.
      per-node split  v GPUs serve (tps per GPU x v), G - v train, push over NVLink; sync = gen + train + push,
                      async (max_staleness >= 1, per node) = max(gen, train + push) x (1 + async_overhead)
      TRL colocate    all G GPUs train and serve in turns, vLLM at colocate_gen_efficiency; no overlap
      separate nodes  (TRL server mode on other nodes, prime-rl) as many GPUs serving as the best split, on their own
                      nodes; the push crosses the network twice (gather to one rank, send): 2 bP / inter_bw; async
                      as prime-rl does it
    Staleness above 1 does not change the steady state here; it absorbs jitter between the two sides."""
    tps = server_tps(active_b or params_b, f)
    work = completions * tokens
    push_local = f["bytes_per_param"] * params_b * 1e9 / (f["intra_bw_gbs"] * 1e9)
    over = 1 + f["async_overhead"]
    rows = []
    for v in range(tp, gpus, tp):
        gen, train = work / (tps * v), train_rank_s / (gpus - v)
        rows.append(
            SplitRow(
                f"per-node, {v} serve (TP {tp} x DP {v // tp})",
                v,
                gpus - v,
                gen,
                train,
                push_local,
                gen + train + push_local,
                max(gen, train + push_local) * over,
                fits(v) if fits else True,
            )
        )
    best = min((r for r in rows if r.fits), key=lambda r: r.async_s or r.sync_s, default=None)
    gen = work / (tps * gpus * f["colocate_gen_efficiency"])
    rows.append(
        SplitRow("TRL colocate", gpus, gpus, gen, train_rank_s / gpus, push_local, gen + train_rank_s / gpus + push_local, None)
    )
    if best is not None:
        push_far = 2 * f["bytes_per_param"] * params_b * 1e9 / (f["inter_bw_gbs"] * 1e9)
        gen, train = work / (tps * best.vllm_gpus), train_rank_s / best.trainer_gpus
        label = f"separate inference nodes ({best.vllm_gpus}/{gpus} of the GPUs)"
        rows.append(
            SplitRow(
                label,
                best.vllm_gpus,
                best.trainer_gpus,
                gen,
                train,
                push_far,
                gen + train + push_far,
                max(gen, train + push_far) * over,
            )
        )
    return rows


SHARED_CALIBRATION = {
    # every figure from gpu/RESULTS.md (one H200, pinned stack, configs/gpu_1gpu.yaml: the shared layout with one GPU,
    # 64 completions of up to 128 tokens, side by side with TRL colocate on the same work)
    "shared_gen_efficiency": 0.6 * (0.889 / 0.777 + 0.604 / 0.644) / 2,
    # vLLM at a memory fraction of a GPU it shares: TRL colocate's efficiency (colocate_gen_efficiency, 0.6) times
    # TRL's generation seconds over ours on the same work (0.36 B: 0.889 / 0.777, 1.3 B: 0.604 / 0.644), mean
    "shared_push_s_per_gb": 0.399 / 2.600,
    # our push into the engine on the rank's own GPU (gather + packed ipc + vLLM's load), per GB of bf16 weights:
    # 1.3 B, 2.6 GB in 0.399 s (the per-byte regime; 0.36 B: 0.226 s for 0.72 GB is per-call bound)
    "trl_load_s_per_gb": 0.213 / 2.600,
    # TRL colocate's in-process load_weights, same shape: 0.213 s for 2.6 GB
    "shared_async_contention": ((0.777 + 0.583 + 0.303) / 1.47 - max(0.777, 0.583 + 0.303)) / min(0.777, 0.583 + 0.303),
    # max_staleness 1 on a GPU both sides share: step = max(gen, train + push) + c x min(...); c from the measured
    # 1.47x steps per hour of k = 1 over k = 0 at 0.36 B (gen 0.777, train 0.583, push 0.303 s)
}
"""The shared layout's figures, each derived from a one-GPU measurement (the formula is the derivation)."""


def shared_rows(
    gpus: int,
    tp: int,
    params_b: float,
    completions: int,
    tokens: int,
    train_rank_s: float,
    f: dict,
    active_b: float | None = None,
):
    """The shared layout: the node's one server runs vLLM data parallel over all G GPUs (G / TP engines, each at a
    memory fraction), every GPU also holds a trainer rank (G ranks), and each rank pushes the units it has just
    gathered (FSDP2 all-gather over NVLink) to the engine on its own GPU by ipc, all ranks at once: the push costs one
    gather of the model plus one engine's load, whatever G. Generation and training time-share every GPU:
      sync   = gen + train + push        gen = work / (tps x G x shared_gen_efficiency), train = train_rank_s / G
      async  = max(gen, train + push) + shared_async_contention x min(gen, train + push)   (max_staleness 1)
    and TRL colocate with its measured load (the split table's TRL row moves bP over NVLink only)."""
    tps = server_tps(active_b or params_b, f)
    gb = f["bytes_per_param"] * params_b
    gather = gb * 1e9 / (f["intra_bw_gbs"] * 1e9) if gpus > 1 else 0.0
    gen = completions * tokens / (tps * gpus * f["shared_gen_efficiency"])
    train = train_rank_s / gpus
    push = gather + gb * f["shared_push_s_per_gb"]
    c = f["shared_async_contention"]
    label = f"shared, {gpus} GPUs: vLLM TP {tp} x DP {gpus // tp} + {gpus} ranks"
    shared = SplitRow(
        label, gpus, gpus, gen, train, push, gen + train + push, max(gen, train + push) + c * min(gen, train + push)
    )
    trl_gen = completions * tokens / (tps * gpus * f["colocate_gen_efficiency"])
    trl_push = gather + gb * f["trl_load_s_per_gb"]
    trl = SplitRow("TRL colocate, with its measured load", gpus, gpus, trl_gen, train, trl_push, trl_gen + train + trl_push, None)
    return [shared, trl]


def layout_choice(rows: list[SplitRow], shared: SplitRow, shared_can_run: bool = True) -> tuple[str, str]:
    """Which layout wins (split or shared) and why, on the model's numbers: the shortest step of each, sync and async.
    shared_can_run False (GPU nodes of 2+ GPUs, launcher.core.plan.shared_runs): split, whatever the numbers say.
    Call it only where a split fits (recommend is not None)."""
    best = recommend(rows)
    assert best is not None, "layout_choice needs a split that fits"
    best_sync, best_async = best
    split_async = best_async.async_s or best_async.sync_s
    shared_async = shared.async_s or shared.sync_s
    if not shared_can_run:
        return "split", (
            f"shared cannot run on {shared.vllm_gpus} GPUs of a CUDA node (its IPC push reaches one GPU only), whatever its "
            f"modelled {shared.sync_s:.1f} s; best split {best_sync.sync_s:.1f} s synchronous, {split_async:.1f} s at max_staleness 1"
        )
    both = (
        f"synchronous {shared.sync_s:.1f} s (shared) vs {best_sync.sync_s:.1f} s (best split, {best_sync.vllm_gpus} serving); "
        f"max_staleness 1 {shared_async:.1f} s vs {split_async:.1f} s"
    )
    return ("shared" if min(shared.sync_s, shared_async) < min(best_sync.sync_s, split_async) else "split"), both


def timeout_warning(cfg: JobConfig) -> str | None:
    """A WARNING line when the predicted generation of one step (default figures, GPU runs, the model's config.json
    readable here) exceeds trainer.request_timeout_s: every generation request would time out after the queue."""
    shape = ModelShape.read(cfg.vllm.model)
    if cfg.job.device != "cuda" or shape is None:
        return None
    g = cfg.slurm.gpus_per_node
    # the node's trainer ranks: one per GPU in the shared layout (and on a one-GPU node), the GPUs vLLM leaves otherwise
    per = g if cfg.slurm.layout == "shared" or g == 1 else g - cfg.vllm.tensor_parallel_size * cfg.vllm.data_parallel_size
    t = cfg.trainer
    # generation runs at the speed of the parameters a token goes through: an MoE's active ones
    gen_s = predict(
        [1], shape.params / 1e9, max(per, 1), t.per_device_train_batch_size, t.max_completion_length, DEFAULTS,
        shape.active_params / 1e9,
    )[0].ours_gen_s  # fmt: skip
    for key, limit in (("request_timeout_s", t.request_timeout_s), ("stall_timeout_s", t.stall_timeout_s)):
        if limit and gen_s > limit:
            return (
                f"WARNING: one step's generation is predicted at {gen_s:.0f} s (slurm-grpo simulate), above "
                f"trainer.{key} ({limit:g}); raise it to {2 * gen_s:.0f} or generate less per step"
            )
    return None


def layout_verdict(cfg: JobConfig) -> str | None:
    """dry-run's word on the layout: the config's, and which one this model predicts faster for its node (with the
    default figures; `slurm-grpo simulate` prints the tables). None on CPU and one-GPU nodes (no choice to make)."""
    g, tp = cfg.slurm.gpus_per_node, cfg.vllm.tensor_parallel_size
    if cfg.job.device != "cuda" or g <= tp or g % tp:
        return None
    shape = ModelShape.read(cfg.vllm.model)
    params = shape.params / 1e9 if shape else ASSUMED_PARAMS_B
    active = shape.active_params / 1e9 if shape else None
    per = g - tp * cfg.vllm.data_parallel_size if cfg.slurm.layout == "split" else g - tp
    f = {**DEFAULTS, **LAYOUT_DEFAULTS, **SHARED_CALIBRATION}
    completions = cfg.trainer.per_device_train_batch_size * max(per, 1)
    tokens = cfg.trainer.max_completion_length
    p = plan(cfg, "")
    fits = memory_fit(shape, layout(p, prompt_length(cfg)), options(p), g, tp, completions) if shape else None
    rows = split_rows(g, tp, cfg.slurm.nodes, params, completions, tokens, f["train_s"] * max(per, 1), f, active, fits)
    shared = shared_rows(g, tp, params, completions, tokens, f["train_s"] * max(per, 1), f, active)[0]
    size = "" if shape else f"; {ASSUMED_SIZE}"
    if recommend(rows) is None:
        return (
            f"layout = {cfg.slurm.layout} (slurm.layout); no split of this node's {g} GPUs at vllm.tensor_parallel_size "
            f"{tp} fits in memory (the memory estimate below): no layout to recommend"
        )
    which, why = layout_choice(rows, shared, shared_runs(cfg.job.device, g))
    return (
        f"layout = {cfg.slurm.layout} (slurm.layout); the step model (`slurm-grpo simulate`{size}) predicts {which} "
        f"faster per step on this node: {why}"
    )


def memory_fit(
    shape: ModelShape, lay: Layout, base: Options, gpus: int, tp: int, completions: int
) -> Callable[[int], bool] | None:
    """fits(v) for split_rows: the memory estimate of a split with v of the node's GPUs serving at TP tp (None where
    the GPU's memory is unknown: nothing to filter on)."""
    if not lay.gpu_gb:
        return None
    return lambda v: split_fits(shape, lay, gpus, v, tp, completions, base)


def recommend(rows: list[SplitRow]) -> tuple[SplitRow, SplitRow] | None:
    """The per-node splits with the shortest synchronous and asynchronous steps, among those that fit in memory
    (None: none fits)."""
    ours = [r for r in rows if r.layout.startswith("per-node") and r.fits]
    if not ours:
        return None
    return min(ours, key=lambda r: r.sync_s), min(ours, key=lambda r: r.async_s or r.sync_s)


def split_table(rows: list[SplitRow]) -> list[str]:
    best_sync, best_async = recommend(rows) or (None, None)
    out = [f"  {'layout':<44} {'gen s':>7} {'train s':>8} {'push s':>7} {'sync step':>10} {'async step':>11}"]
    for r in rows:
        mark = (" <- best sync" if r is best_sync else "") + (" <- best async" if r is best_async else "")
        mark += "" if r.fits else "  (does not fit in memory)"
        a = f"{r.async_s:>11.2f}" if r.async_s is not None else f"{'-':>11}"
        out.append(f"  {r.layout:<44} {r.gen_s:>7.2f} {r.train_s:>8.2f} {r.push_s:>7.3f} {r.sync_s:>10.2f} {a}{mark}")
    return out


def parse_nodes(text: str) -> list[int]:
    try:
        nodes = [int(x) for x in text.split(",")]
    except ValueError:
        nodes = []
    if not nodes or min(nodes) < 1:
        raise ConfigError(f"--nodes {text}: give comma-separated node counts of 1 or more, e.g. --nodes 1,2,4")
    return nodes


def read_calibration(path: str) -> dict[str, float]:
    """The figures `bench` measured ({"calibration": {figure: value}} in its results JSON); every key must be one of
    DEFAULTS (a misspelt one would leave the default in place without a word)."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"--calibration {path}: cannot read it ({e.strerror}); give the results JSON bench wrote") from None
    except ValueError as e:
        raise ConfigError(f"--calibration {path} is not JSON ({e}); give the results JSON bench wrote") from None
    cal = data.get("calibration") if isinstance(data, dict) else None
    if not isinstance(cal, dict) or not cal:
        raise ConfigError(
            f"--calibration {path} has no 'calibration' object; bench writes one with the figures {', '.join(DEFAULTS)}"
        )
    unknown = sorted(set(cal) - set(DEFAULTS))
    if unknown:
        raise ConfigError(f"--calibration {path}: unknown figure(s) {', '.join(unknown)}; known: {', '.join(DEFAULTS)}")
    bad = [
        f"{k}={v!r}"
        for k, v in cal.items()
        if isinstance(v, bool) or not isinstance(v, int | float) or v < 0 or (v == 0 and k != "train_s")
    ]
    if bad:
        raise ConfigError(f"--calibration {path}: {', '.join(bad)}: every figure must be above 0 (train_s: 0 or more)")
    return {k: float(v) for k, v in cal.items()}


def print_scaling(
    rows: list[Row],
    params: float,
    per: int,
    cfg: JobConfig,
    figures: dict[str, float],
    active: float | None = None,
    size: str = "",
) -> None:
    """The node-count table: one server per node against one global server. size: where the model's size came from
    when not its config.json (ASSUMED_SIZE)."""
    moe = f", {active:.3g}B active per token (MoE)" if active is not None and active < params else ""
    size = f" ({size}; --params-b N gives the size)" if size else ""
    print(
        f"assumptions: model {params:.3g}B params{moe}{size} (push = {figures['bytes_per_param'] * params:.3g} GB), {per} trainer ranks/node, "
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


def print_split(
    cfg: JobConfig,
    nodes: int,
    params: float,
    per: int,
    figures: dict[str, float],
    active: float | None = None,
    mem: tuple[ModelShape, Layout, Options] | None = None,
) -> None:
    """The split of one node's GPUs between vLLM and training, and the recommended one (nothing on a TP-wide node).
    mem (the model's shape, the config's layout and options): splits that do not fit in memory are never recommended,
    and a TP too small for vLLM's weights is replaced by the smallest that holds them."""
    g, tp = cfg.slurm.gpus_per_node, cfg.vllm.tensor_parallel_size
    f2 = {**figures, **LAYOUT_DEFAULTS}
    # the split table trains the config's own batch on every split: the node's completions per step stay fixed
    completions = cfg.trainer.per_device_train_batch_size * per
    fits = None
    if mem and g > tp:
        shape, lay, base = mem
        vllm_gb, dp, ep = lay.gpu_gb * lay.vllm_fraction, cfg.vllm.data_parallel_size, cfg.vllm.enable_expert_parallel
        if not vllm_weights_fit(shape, tp, vllm_gb, dp, ep):
            tps = [t for t in vllm_tp_choices(shape.heads, g, dp, False) if t > tp]
            bigger = smallest_vllm_tp(shape, vllm_gb, tps, dp, ep)
            print(
                f"\nvllm.tensor_parallel_size {tp} cannot hold vLLM's weights ({vllm_weights_gb(shape, tp, dp, ep):.0f} GB per GPU "
                f"in {vllm_gb:.0f} GB): "
                + (f"the splits below serve at TP {bigger}, the smallest that does" if bigger else "no TP of this node does")
            )
            tp = bigger or tp
        fits = memory_fit(shape, lay, base, g, tp, completions)
    rows2 = split_rows(
        g, tp, nodes, params, completions, cfg.trainer.max_completion_length, figures["train_s"] * per, f2, active, fits
    )
    if g <= tp:
        return
    best = recommend(rows2)
    print()
    print(
        f"split of one node's {g} GPUs between vLLM (TP {tp} x DP) and training, the same {completions} completions of "
        f"{cfg.trainer.max_completion_length} tokens per node per step (train_s {figures['train_s']:g} s with {per} ranks; "
        + ", ".join(f"{k}={v:g}" for k, v in LAYOUT_DEFAULTS.items())
        + "):"
    )
    print("\n".join(split_table(rows2)))
    if best is None:
        print(
            f"recommended: none: no split of the node's {g} GPUs fits in memory at {completions} completions per node "
            "(the memory table below; fewer: trainer.per_device_train_batch_size)"
        )
        return
    best_sync, best_async = best
    f3 = {**f2, **SHARED_CALIBRATION}
    shared = shared_rows(g, tp, params, completions, cfg.trainer.max_completion_length, figures["train_s"] * per, f3, active)
    print(
        "the shared layout (every GPU serves and trains; calibrated on one H200, gpu/RESULTS.md: "
        + ", ".join(f"{k}={v:.3g}" for k, v in SHARED_CALIBRATION.items())
        + "):"
    )
    for r in shared:
        a = f"{r.async_s:>11.2f}" if r.async_s is not None else f"{'-':>11}"
        print(f"  {r.layout:<44} {r.gen_s:>7.2f} {r.train_s:>8.2f} {r.push_s:>7.3f} {r.sync_s:>10.2f} {a}")
    which, why = layout_choice(rows2, shared[0], shared_runs(cfg.job.device, g))
    print(f"layout by this model: {which} is faster per step ({why})")
    now = next((r for r in rows2 if r.vllm_gpus == tp * cfg.vllm.data_parallel_size and r.async_s), None)
    print(
        f"recommended: synchronous: {best_sync.vllm_gpus} of {g} GPUs serving (--set vllm.tensor_parallel_size={tp} "
        f"vllm.data_parallel_size={best_sync.vllm_gpus // tp}); asynchronous: {best_async.vllm_gpus} serving "
        f"(--set vllm.data_parallel_size={best_async.vllm_gpus // tp} trainer.max_staleness=1), "
        f"{best_sync.sync_s / (best_async.async_s or best_async.sync_s):.2f}x the steps per hour of the best synchronous split"
        + (f", {now.sync_s / (best_async.async_s or best_async.sync_s):.2f}x this config's" if now else "")
    )
    if cfg.job.platform == "rocm" and best_async.vllm_gpus > tp:
        print(
            "  on rocm vllm.data_parallel_size stays 1 (vLLM masks each DP engine's devices, which breaks RCCL there): "
            f"serve on {best_async.vllm_gpus} GCDs as vllm.tensor_parallel_size={best_async.vllm_gpus} if the model's heads "
            "divide it (TP scales decode less than DP: read the gain as an upper bound)"
        )


def print_startup(cfg: JobConfig, nodes: list[int]) -> None:
    """Start-up at the config's node counts and at 64-256 nodes: shared-FS imports vs slurm.stage_env."""
    s, v = cfg.slurm, cfg.vllm
    counts = sorted(set(nodes) | {64, 128, 256})
    packed = s.stage_env.endswith((".tar", ".tar.gz", ".tgz"))
    procs = processes_per_node(s.gpus_per_node, v.tensor_parallel_size, v.data_parallel_size)
    print()
    print("\n".join(startup_table(predict_startup(counts, procs, packed, STARTUP_DEFAULTS), STARTUP_DEFAULTS, packed)))


def plot(path: str, nodes: list[int], rows: list[Row]) -> None:
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
    fig.savefig(path, dpi=90)
    print(f"plot: {path}")


def check_output(option: str, path: str) -> None:
    """A file simulate writes at the end (--plot, --json), checked before the work: its folder exists, it is no folder."""
    if not path:
        return
    p = Path(path).resolve()
    if not p.parent.is_dir():
        raise ConfigError(f"{option} {path}: its folder does not exist; create it or give another path")
    if p.is_dir():
        raise ConfigError(f"{option} {path} is a folder; give the path of a file to write")


def main(a) -> int:
    if not math.isfinite(a.params_b) or a.params_b < 0:
        raise ConfigError(f"--params-b {a.params_b:g}: give the model's parameters in billions, e.g. 7 (0 = from the config)")
    cfg = load(a.config, a.overrides)
    nodes = parse_nodes(a.nodes)
    gpu = gpu_of(cfg)
    figures = {**DEFAULTS, **GPU_FIGURES.get(gpu, {}), **(read_calibration(a.calibration) if a.calibration else {})}
    if gpu in GPU_FIGURES:
        print(f"GPU {gpu}: its figures replace the H100/H200 defaults (launcher/simulate.py GPU_FIGURES)")
    for option, path in (("--plot", a.plot), ("--json", getattr(a, "json", ""))):
        check_output(option, path)
    shape = ModelShape.read(cfg.vllm.model)
    params = a.params_b or (shape.params / 1e9 if shape else ASSUMED_PARAMS_B)
    active = shape.active_params / 1e9 if shape and not a.params_b else None
    per = cfg.slurm.gpus_per_node - cfg.vllm.tensor_parallel_size * cfg.vllm.data_parallel_size or 1
    batch, tokens = cfg.trainer.per_device_train_batch_size, cfg.trainer.max_completion_length
    rows = predict(nodes, params, per, batch, tokens, figures, active)
    print_scaling(rows, params, per, cfg, figures, active, "" if shape or a.params_b else ASSUMED_SIZE)
    p = plan(cfg, "")
    lay = layout(p, prompt_length(cfg))
    assumed = not lay.gpu_gb
    if assumed:
        lay = Layout(**{**lay.__dict__, "gpu_gb": 80.0})
    # the split's memory filter: the config's model and GPU (at --params-b the shape is not this model's)
    print_split(cfg, nodes[-1], params, per, figures, active, (shape, lay, options(p)) if shape and not a.params_b else None)
    if assumed:
        print("(GPU memory not in the config: the memory tables assume 80 GB; set slurm.gpu_memory_gb)")
    print()
    print("\n".join(fit_table(lay, base=options(p))))
    print_startup(cfg, nodes)
    if a.plot:
        plot(a.plot, nodes, rows)
    if getattr(a, "json", ""):
        Path(a.json).write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 0
