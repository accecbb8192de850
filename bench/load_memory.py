"""Peak resident memory of each trainer rank while it loads the model, the old loader ("full": from_pretrained of
the whole fp32 model on every rank, then shard) against the sharded one (meta device, shard, read this rank's
rows), on 2 and 4 gloo ranks of this machine:

    python -m bench.load_memory [--out bench/results/<date>-load-memory] [--hidden 1024 --layers 8]

Per rank it prints the growth of the peak (VmHWM after the load minus VmRSS before it) next to the bound the
sharded loader must keep: fp32 model / ranks + the largest tensor's rows in the stored dtype.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.support.ranks import cpu_parallel, run_ranks
from trainer.procmem import reset_peak, status_mb

MB = 1024 * 1024


def model_figures(model_dir: str) -> dict:
    """fp32 size of the model and its largest tensor in the stored dtype, in MB, from the safetensors headers."""
    from trainer.loading import SafetensorsDir

    store = SafetensorsDir(model_dir)
    largest = max(store.tensors, key=lambda n: store.tensors[n].numel)
    return {
        "model_fp32_mb": round(sum(t.numel for t in store.tensors.values()) * 4 / MB, 1),
        "largest_tensor": largest,
        "largest_tensor_mb": round(store.tensors[largest].nbytes / MB, 1),
        "params": sum(t.numel for t in store.tensors.values()),
    }


def measure_load(rank: int, world: int, _port: int, model_dir: str, loader: str, nodes: int = 1) -> dict:
    """One rank: load with `loader`, return its peak growth while loading and the load time."""
    import torch
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config  # noqa: B018  (the lazy import of the modeling code, ~100 MB, is not the loader's)

    from trainer.loading import load_model

    par = cpu_parallel(rank, world, nodes)
    gc.collect()
    base = status_mb("VmRSS")
    reset_peak()
    t0 = time.time()
    model, report = load_model(model_dir, par, torch.float32, loader=loader)
    seconds = time.time() - t0
    peak = status_mb("VmHWM")
    shard_mb = sum(p.to_local().numel() * 4 for p in model.parameters()) / MB  # DTensors
    return {
        "rank": rank,
        "peak_growth_mb": round(peak - base, 1),
        "shard_mb": round(shard_mb, 1),
        "load_s": round(seconds, 2),
        "read_mb": round(report.bytes_read / MB, 1),
    }


def run(model_dir: str, worlds=(2, 4)) -> dict:
    fig = model_figures(model_dir)
    rows = []
    for world in worlds:
        for loader in ("full", "sharded"):
            res = run_ranks(world, functools.partial(measure_load, model_dir=model_dir, loader=loader), timeout_s=600)
            bound = fig["model_fp32_mb"] / world + fig["largest_tensor_mb"]
            for r in sorted(res.values(), key=lambda r: r["rank"]):
                rows.append({"world": world, "loader": loader, "bound_mb": round(bound, 1), **r})
    return {"model": fig, "rows": rows}


def table(result: dict) -> str:
    m = result["model"]
    out = [
        f"model: {m['params'] / 1e6:.0f}M parameters, {m['model_fp32_mb']} MB in fp32; largest tensor {m['largest_tensor']} "
        f"{m['largest_tensor_mb']} MB as stored",
        "",
        "| ranks | loader | rank | peak growth while loading (MB) | x of fp32 model | sharded bound: model/ranks + largest (MB) | load s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        out.append(
            f"| {r['world']} | {r['loader']} | {r['rank']} | {r['peak_growth_mb']} | "
            f"{r['peak_growth_mb'] / m['model_fp32_mb']:.2f} | {r['bound_mb']} | {r['load_s']} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.load_memory", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="", help="folder for results.json and RESULTS.md (default: print only)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="stored dtype (default bfloat16)")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "-m", "trainer.tiny_model", d, "--hidden", str(a.hidden), "--layers", str(a.layers)]
        cmd += ["--intermediate", str(a.intermediate), "--kv-heads", "2", "--dtype", a.dtype, "--untied"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        result = run(d)
    result["command"] = "python -m bench.load_memory " + " ".join(argv if argv is not None else sys.argv[1:])
    result["machine"] = f"{platform.node()} {platform.machine()}, {platform.python_version()}"
    result["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    text = table(result)
    print(text)
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(result, indent=1))
        (out / "RESULTS.md").write_text(
            f"# Peak memory of a rank while loading ({result['date']})\n\n`{result['command']}` on {result['machine']}\n\n{text}\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
