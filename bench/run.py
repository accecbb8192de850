"""One command for the whole benchmark (about 12-18 minutes on 2 cores):

    python -m bench.run [--out bench/results] [--cluster-env /tmp/slurm-grpo-cluster/env.sh]

1. push and generation, ours vs stock vs floors (bench.workers, 4 gloo ranks, 2 vLLM CPU servers)
2. launcher: dry-run seconds for 1, 16 and 256 nodes (in-process render and the CLI's wall time)
3. start to first step of a local run (and of a 2-node cluster job when --cluster-env is given), by phase
4. the scaling model (`slurm-grpo simulate`) with default and with this run's calibrated figures

Writes results.json, RESULTS.md (the tables) and scaling-default.png / scaling-calibrated.png under --out. Speeds are medians of repeats;
ratios matter more than absolute figures on a shared, noisy machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from launcher.cli import cli_argv
from launcher.core import config as C
from launcher.core.jobdir import JobDir
from launcher.core.plan import plan
from launcher.core.records import read_rows, step_rows
from launcher.node.bootstrap import wait_healthy
from launcher.node.commands import vllm_command
from launcher.node.procs import Proc
from launcher.status import startup_phases

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable


def say(msg: str) -> None:
    print(f"[bench {time.strftime('%T')}] {msg}", flush=True)


def start_servers(model: str, work: Path, ports: list[int]) -> list[Proc]:
    procs = []
    JobDir(work).logs.mkdir(parents=True, exist_ok=True)
    for node, port in enumerate(ports):
        cfg = C.from_dict(
            {
                "job": {"device": "cpu"},
                "slurm": {"nodes": 2, "gpus_per_node": 3},
                "vllm": {"model": model, "port": port, "dtype": "float32", "max_model_len": 256, "cpu_kvcache_gib": 1},
                "trainer": {"dtype": "float32"},
            }
        )
        procs.append(Proc(vllm_command(plan(cfg, str(work)), node, PY), work, node))
    return procs


def bench_push_and_generation(work: Path, repeats: int) -> dict:
    model = work / "model"
    say("building the benchmark model (Qwen2 shape, hidden 768, 8 layers, float32)")
    info = json.loads(
        subprocess.run(
            [
                PY,
                "-c",
                "import json,sys; from trainer.tiny_model import make_tiny_model; "
                "print(json.dumps(make_tiny_model(sys.argv[1], hidden=768, layers=8, vocab=2000)))",
                str(model),
            ],
            check=True,
            capture_output=True,
            text=True,
            cwd=REPO,
        ).stdout.splitlines()[-1]
    )
    say(f"model: {info['params'] / 1e6:.1f} M parameters, {info['params'] * 4 / 1e6:.0f} MB float32")
    ports = [18100, 18101]
    servers = start_servers(str(model), work, ports)
    try:
        t0 = time.time()
        for i, s in enumerate(servers):
            took = wait_healthy(s, f"http://127.0.0.1:{ports[i]}", 900, f"bench server {i}")
            say(f"server {i} healthy ({took:.0f} s)")
        cfgf = work / "workers.json"
        cfgf.write_text(
            json.dumps(
                {
                    "model": str(model),
                    "vocab": info["vocab"],
                    "repeats": repeats,
                    "server_urls": [f"http://127.0.0.1:{p}" for p in ports],
                    "transfer_ports": [18200, 18201],
                    "transfer_ports_unpacked": [18210, 18211],
                    "bucket_mb": C.TrainerConfig.bucket_mb,
                    "generation": {"prompts_per_rank": 16, "prompt_tokens": 16, "max_tokens": 32},
                }
            )
        )
        out = work / "workers-out.json"
        say("push and generation: 4 gloo ranks (2 nodes x 2), ours vs stock vs floors")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        r = subprocess.run(
            [
                PY,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node",
                "4",
                "--master-port",
                "18300",
                "-m",
                "bench.workers",
                str(out),
                str(cfgf),
            ],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=1200,
        )
        if r.returncode != 0:
            raise RuntimeError(f"bench.workers failed:\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}")
        res = json.loads(out.read_text())
        res["model_info"], res["server_start_s"] = info, round(time.time() - t0, 1)
        return res
    finally:
        for s in servers:
            s.stop()


def bench_dry_run() -> dict:
    from launcher.core.jobdir import make_plan
    from launcher.dryrun import render_dry_run

    out = {}
    for n in (1, 16, 256):
        cfg = C.load(REPO / "configs/gpu_7b_4nodes.yaml", [f"slurm.nodes={n}", "job.job_dir=/tmp/bench-dry"])
        runs = []
        for _ in range(5):
            t0 = time.perf_counter()
            render_dry_run(cfg, make_plan(cfg))
            runs.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        subprocess.run(
            [
                *cli_argv(PY, "dry-run", "configs/gpu_7b_4nodes.yaml", f"slurm.nodes={n}", "job.job_dir=/tmp/bench-dry"),
                "--skip-checks",
                "all",
            ],
            check=True,
            capture_output=True,
            cwd=REPO,
        )
        out[str(n)] = {"render_median_s": round(statistics.median(runs), 4), "cli_wall_s": round(time.perf_counter() - t0, 3)}
    return out


def bench_local_run(work: Path, model: str) -> dict:
    job = work / "local-run"
    say("local run (configs/smoke_cpu.yaml, 6 steps) for start-up phases and step time")
    r = subprocess.run(
        cli_argv(
            PY,
            "local",
            "configs/smoke_cpu.yaml",
            f"vllm.model={model}",
            f"job.job_dir={job}",
            "trainer.max_steps=6",
            "trainer.save_steps=0",
        ),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if r.returncode != 0:
        raise RuntimeError(f"local run failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    rows = step_rows(read_rows(JobDir(job).metrics))
    later = rows[1:] or rows  # step 1 includes one-time warm-up
    return {
        "phases": startup_phases(job, 0),
        "step_s_median": statistics.median(x.step_s or 0.0 for x in later),
        "gen_tokens_per_s_median": statistics.median(x.gen_tokens_per_s for x in later if x.gen_tokens_per_s),
    }


def write_results(out: str | None, result: dict) -> None:
    """A bench's --out: its result as indented JSON (nothing when --out was not given)."""
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=1) + "\n")


def cluster_env(env_file: str) -> dict[str, str]:
    """This environment plus the test cluster's (SLURM_CONF, PATH, ...) from its env.sh."""
    env = dict(os.environ)
    for line in Path(env_file).read_text().splitlines():
        m = re.match(r"export (\w+)=(.*)", line)
        if m:
            env[m.group(1)] = m.group(2).strip("'")
    return env


def submit_and_wait(config: str, job: Path, env_file: str, sets: list[str], timeout: float = 900) -> tuple[str, str]:
    """`slurm-grpo submit` on the test cluster, then wait for the job to leave PENDING/RUNNING. Returns (job id, state)."""
    env = cluster_env(env_file)
    argv = cli_argv(PY, "submit", config, f"job.job_dir={job}", f"job.python={PY}", *sets)
    r = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise RuntimeError(f"submit failed: {r.stderr}")
    m = re.search(r"submitted job (\d+)", r.stdout)
    assert m, r.stdout
    jid, st = m.group(1), ""
    deadline = time.time() + timeout
    while time.time() < deadline:
        st = subprocess.run(
            ["sacct", "-j", jid, "-X", "-n", "-P", "-o", "State"], env=env, capture_output=True, text=True
        ).stdout.strip()
        if st and st.split()[0] not in ("PENDING", "RUNNING"):
            break
        time.sleep(3)
    return jid, st


def bench_cluster_run(work: Path, model: str, env_file: str) -> dict:
    job = Path(tempfile.mkdtemp(prefix="bench-cluster-", dir="/tmp"))
    say("2-node cluster job (configs/cluster_cpu.yaml, 3 steps) for start-up phases")
    sets = [f"vllm.model={model}", "trainer.max_steps=3", f"trainer.dataset={REPO}/data/letters.jsonl"]
    jid, st = submit_and_wait("configs/cluster_cpu.yaml", job, env_file, sets)
    return {"job": jid, "state": st, "phases": {n: startup_phases(job, n) for n in (0, 1)}}


def simulate(calibration: dict | None, out: Path, tag: str, extra: tuple | list = ()) -> list[dict]:
    args = [
        PY,
        "-m",
        "launcher",
        "simulate",
        "configs/gpu_7b_4nodes.yaml",
        "--nodes",
        "1,2,4,8,16,32,64,128,256",
        "--json",
        str(out / f"simulate-{tag}.json"),
        *extra,
    ]
    args += ["--plot", str(out / f"scaling-{tag}.png")]
    if calibration:
        (out / "calibration.json").write_text(json.dumps({"calibration": calibration}))
        args += ["--calibration", str(out / "calibration.json")]
    r = subprocess.run(args, check=True, capture_output=True, text=True, cwd=REPO)
    (out / f"simulate-{tag}.txt").write_text(r.stdout)
    return json.loads((out / f"simulate-{tag}.json").read_text())


def ratio(a: float, b: float) -> float:
    return round(a / b, 2) if b else float("nan")


def _md_header(res: dict) -> list[str]:
    p = res["push_gen"]
    return [
        f"# Benchmark results ({res['date']}, {res['machine']})",
        "",
        f"Command: `{res['command']}`; medians of {p['repeats']} repeats; total {res['total_s']:.0f} s.",
    ]


def _md_push(res: dict) -> list[str]:
    p = res["push_gen"]
    mb = p["bytes"] / 1e6
    lines = [
        f"## Weight push: {p['params'] / 1e6:.1f} M parameters, {mb:.0f} MB float32, gloo over loopback",
        "",
        "| path | median s | GB/s | rank 0 peak extra memory |",
        "|---|---|---|---|",
    ]
    for k, name in (
        ("push_ours", "ours: 2 nodes push to their own servers at once (sharing these CPUs)"),
        (
            "push_ours_one_node",
            f"ours, one node (the other idle): each node's time on its own hardware, packed in {p['bucket_mb']} MiB buckets",
        ),
        ("push_ours_one_node_unpacked", "the same, unpacked (one broadcast and one load per tensor: the push before packing)"),
        ("push_stock", "stock: rank 0 gathers all and pushes to one server"),
        ("gather_one_node", "part of ours, one node: the node-local all-gather alone"),
        ("floor_gloo_broadcast", "floor: raw gloo broadcast rank 0 -> 1, same bytes"),
        ("floor_memcpy", "floor: in-memory copy, same bytes"),
    ):
        x = p[k]
        extra = (
            f"{x['rank0_peak_extra_mb']} MB ({x['rank0_peak_extra_mb'] / mb:.0%} of the model)"
            if "rank0_peak_extra_mb" in x
            else ""
        )
        lines.append(f"| {name} | {x['median_s']} | {x['gb_per_s']} | {extra} |")
    r = res["ratios"]
    return lines + [
        "",
        f"Ratios: stock over ours, one node: {r['push_stock_over_ours_one_node']}x; stock over ours, both nodes at "
        f"once on these shared CPUs: {r['push_stock_over_ours']}x (ours delivers {2 * mb:.0f} MB, a full copy to each "
        f"server: {r['push_delivered_gbs_ours']} GB/s delivered vs {r['push_delivered_gbs_stock']} GB/s for stock); "
        f"ours (one node) over the gloo floor {r['push_ours_over_gloo_floor']}x, over the memcpy floor "
        f"{r['push_ours_over_memcpy']}x.",
    ]


def _md_generation(res: dict) -> list[str]:
    p, r = res["push_gen"], res["ratios"]
    lines = [
        f"## Generation path: {p['generation']['ranks']} ranks x {p['generation']['prompts_per_rank']} prompts x "
        f"{p['generation']['max_tokens']} tokens ({p['generation']['tokens_per_batch']} tokens per batch)",
        "",
        "| path | median s | tokens/s |",
        "|---|---|---|",
    ]
    for k, name in (
        ("gen_direct", "direct: each node's batch straight to its server"),
        ("gen_ours", "ours: gather in node, request, scatter"),
        ("gen_stock", "stock: global gather to rank 0, one server, broadcast"),
        ("gen_ours_one_node", "ours, one node (the other idle): half the batch on its own server"),
    ):
        lines.append(f"| {name} | {p[k]['median_s']} | {p[k]['tokens_per_s']} |")
    return lines + [
        "",
        f"Ours over direct: {r['gen_ours_over_direct']}x (the gather/scatter overhead); stock over ours, one node: "
        f"{r['gen_stock_over_ours_one_node']}x; stock over ours, both nodes at once on these shared CPUs: "
        f"{r['gen_stock_over_ours']}x.",
        "",
        "Both emulated nodes run on the same cores here, so 'both at once' cannot be faster than one server doing "
        "all the work; 'one node' is what each node takes when it has its own hardware, as on a cluster.",
    ]


def _md_launcher(res: dict) -> list[str]:
    lines = [
        "## Launcher",
        "",
        "| nodes | render s (median) | CLI wall s |",
        "|---|---|---|",
    ]
    for n, x in res["dry_run"].items():
        lines.append(f"| {n} | {x['render_median_s']} | {x['cli_wall_s']} |")
    lines += [
        "",
        "Start to first step, by phase (seconds):",
        "",
        "| run | " + " | ".join(k for k in res["local_run"]["phases"]) + " |",
        "|---" * (1 + len(res["local_run"]["phases"])) + "|",
        "| local (1 node) | " + " | ".join(str(v) for v in res["local_run"]["phases"].values()) + " |",
    ]
    for n, ph in (res.get("cluster_run") or {}).get("phases", {}).items():
        lines.append(f"| cluster node {n} | " + " | ".join(str(ph.get(k, "")) for k in res["local_run"]["phases"]) + " |")
    return lines


def _md_scaling(res: dict) -> list[str]:
    lines = [
        "## Scaling model (`slurm-grpo simulate`)",
        "",
        "Defaults: `configs/gpu_7b_4nodes.yaml` (7B, 8 GPUs per node) with public H100/H200 figures. Calibrated: this "
        "benchmark's own workload (the model above, 2 trainer ranks per node, its batch, float32, no training) with "
        "this run's one-node figures.",
        "",
        "| nodes | ours step s (defaults) | stock step s | speedup | ours (calibrated here) | stock (calibrated) | speedup |",
        "|---|---|---|---|---|---|---|",
    ]
    for d, c in zip(res["simulate_default"], res["simulate_calibrated"], strict=True):
        lines.append(
            f"| {d['nodes']} | {d['ours_step_s']:.2f} | {d['stock_step_s']:.2f} | {d['speedup']:.1f}x | "
            f"{c['ours_step_s']:.3g} | {c['stock_step_s']:.3g} | {c['speedup']:.1f}x |"
        )
    mc = res["model_check"]
    return lines + [
        "",
        "Calibration from this run: " + ", ".join(f"{k}={v}" for k, v in res["calibration"].items()),
        "",
        "Model check, stock topology at 2 nodes, predicted from the one-node figures vs measured above: generation "
        f"{mc['stock_gen_s']['predicted']} s vs {mc['stock_gen_s']['measured']} s, push {mc['stock_push_s']['predicted']} s "
        f"vs {mc['stock_push_s']['measured']} s.",
        "",
        "Assumptions: `simulate-default.txt` and `simulate-calibrated.txt` (printed by the simulate command).",
    ]


def markdown(res: dict) -> str:
    """RESULTS.md: one section per measurement, separated by blank lines."""
    sections = (_md_header, _md_push, _md_generation, _md_launcher, _md_scaling)
    return "\n\n".join("\n".join(section(res)) for section in sections) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.run", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", default=str(REPO / "bench" / "results"), help="output folder (default bench/results)")
    ap.add_argument("--repeats", type=int, default=5, help="repeats per measurement (default 5)")
    ap.add_argument("--cluster-env", default="", help="env.sh of a running test cluster: also time a 2-node job")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    work = Path(tempfile.mkdtemp(prefix="slurm-grpo-bench-"))
    res: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.node()}, {os.cpu_count()} CPUs, {platform.machine()}",
        "command": "bash scripts/bench.sh",
    }
    res["push_gen"] = p = bench_push_and_generation(work, a.repeats)
    say(
        f"push ours {p['push_ours']['median_s']} s (one node {p['push_ours_one_node']['median_s']} s), stock {p['push_stock']['median_s']} s; "
        f"generation ours {p['gen_ours']['median_s']} s, direct {p['gen_direct']['median_s']} s, stock {p['gen_stock']['median_s']} s"
    )
    res["dry_run"] = bench_dry_run()
    tiny = work / "tiny"
    subprocess.run([PY, "-m", "launcher", "make-tiny-model", str(tiny)], check=True, capture_output=True, cwd=REPO)
    res["local_run"] = bench_local_run(work, str(tiny))
    if a.cluster_env:
        res["cluster_run"] = bench_cluster_run(work, str(tiny), a.cluster_env)
    res["ratios"] = {
        "push_stock_over_ours": ratio(p["push_stock"]["median_s"], p["push_ours"]["median_s"]),
        "push_stock_over_ours_one_node": ratio(p["push_stock"]["median_s"], p["push_ours_one_node"]["median_s"]),
        "push_delivered_gbs_ours": round(2 * p["bytes"] / p["push_ours"]["median_s"] / 1e9, 3),
        "push_delivered_gbs_stock": round(p["bytes"] / p["push_stock"]["median_s"] / 1e9, 3),
        "push_ours_over_gloo_floor": ratio(p["push_ours_one_node"]["median_s"], p["floor_gloo_broadcast"]["median_s"]),
        "push_unpacked_over_gloo_floor": ratio(
            p["push_ours_one_node_unpacked"]["median_s"], p["floor_gloo_broadcast"]["median_s"]
        ),
        "push_unpacked_over_packed": ratio(p["push_ours_one_node_unpacked"]["median_s"], p["push_ours_one_node"]["median_s"]),
        "push_ours_over_memcpy": ratio(p["push_ours_one_node"]["median_s"], p["floor_memcpy"]["median_s"]),
        "gen_ours_over_direct": ratio(p["gen_ours"]["median_s"], p["gen_direct"]["median_s"]),
        "gen_stock_over_ours": ratio(p["gen_stock"]["median_s"], p["gen_ours"]["median_s"]),
        "gen_stock_over_ours_one_node": ratio(p["gen_stock"]["median_s"], p["gen_ours_one_node"]["median_s"]),
    }
    # this machine's figures for the scaling model, from the one-node measurements only (each node on its own
    # hardware): the server's tokens/s at this model size, the push's effective bandwidth, float32. The stock
    # figures at 2 nodes, measured too, are then a check of the model, not an input to it.
    one = p["gen_ours_one_node"]
    res["calibration"] = {
        "tokens_per_s_server": one["tokens_per_s"],
        "tps_anchor_params_b": round(p["params"] / 1e9, 4),
        "bytes_per_param": 4.0,
        "intra_bw_gbs": p["push_ours_one_node"]["gb_per_s"],
        "inter_bw_gbs": p["push_ours_one_node"]["gb_per_s"],
        "train_s": 0.0,
    }
    res["simulate_default"] = simulate(None, out, "default")
    g = p["generation"]
    res["simulate_calibrated"] = simulate(
        res["calibration"],
        out,
        "calibrated",
        [
            "--params-b",
            str(p["params"] / 1e9),
            "--set",
            "slurm.gpus_per_node=3",
            "--set",
            "vllm.tensor_parallel_size=1",
            "--set",
            f"trainer.per_device_train_batch_size={g['prompts_per_rank']}",
            "--set",
            f"trainer.max_completion_length={g['max_tokens']}",
        ],
    )
    two = res["simulate_calibrated"][1]
    res["model_check"] = {  # predicted from one node vs measured, 2 nodes, stock topology
        "stock_gen_s": {"predicted": round(two["stock_gen_s"], 3), "measured": p["gen_stock"]["median_s"]},
        "stock_push_s": {"predicted": round(two["stock_push_s"], 3), "measured": p["push_stock"]["median_s"]},
    }
    res["total_s"] = round(time.time() - t0, 1)
    (out / "results.json").write_text(json.dumps(res, indent=1))
    (out / "RESULTS.md").write_text(markdown(res))
    print(markdown(res))
    say(f"wrote {out}/results.json, RESULTS.md, scaling-*.png in {res['total_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
