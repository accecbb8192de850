"""The vLLM server's start (launcher.core.vllm_start, launcher.vllm_log, the plugin's in-process inspection): what the
launcher adds to a GPU server's command and why, a CPU server's eager mode, and the phases of a first start and a restart
read from vLLM's own log lines (copied from the H200 runs of gpu/results/)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from launcher.core import config as C
from launcher.core import vllm_start
from launcher.core.jobdir import Env, JobDir
from launcher.core.plan import plan
from launcher.core.records import Event
from launcher.node.commands import vllm_command
from launcher.status import startup_lines
from launcher.vllm_log import describe, node_starts, phases, starts

# gpu/results/2026-12-04-round2-0.36b (a job folder's first start: cold caches) and 2026-12-03-staleness-0.36b/k2 (the
# compile cache warm), lines verbatim, long ones cut, except the restart's "We must use the `spawn`" warning: vLLM's
# own text (system_utils.py), written in by hand to test the parser's naming of a forced spawn, not seen in those logs; the progress bars as vLLM writes them (\r between updates)
FIRST = """\
===== 2026-12-04 18:27:14 node 0 vllm: /opt/torch/.venv/bin/python3 -m vllm.entrypoints.openai.api_server --model /tmp/model-q05
slurm-grpo vLLM plugin: registered gloo and mapped_ipc weight-transfer engines (pid 1319, plain CPU linear: False)
(APIServer pid=1319) INFO 12-04 18:27:39 [api_utils.py:347]
(APIServer pid=1319) INFO 12-04 18:27:39 [api_utils.py:286] non-default args: {'host': '127.0.0.1', 'model': '/tmp/model-q05'}
(APIServer pid=1319) INFO 12-04 18:28:00 [model.py:733] Resolved architecture: Qwen2ForCausalLM
(EngineCore pid=1691) INFO 12-04 18:28:22 [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: model='/tmp/model-q05'
(EngineCore pid=1691) INFO 12-04 18:28:28 [model_runner.py:424] Model loading took 0.67 GiB memory and 3.226484 seconds
(EngineCore pid=1691) INFO 12-04 18:28:44 [decorators.py:743] [backbone] saved AOT compiled function to /tmp/job-q05/cache/node0/vllm/x
(EngineCore pid=1691) INFO 12-04 18:28:44 [monitor.py:62] [backbone] torch.compile took 15.51 s in total
Capturing CUDA graphs (PIECEWISE):   0%|          | 0/51 [00:00<?, ?it/s]\rCapturing CUDA graphs (PIECEWISE): 100%|██████████| 51/51 [00:02<00:00, 22.19it/s]
Capturing CUDA graphs (FULL):   0%|          | 0/2 [00:00<?, ?it/s]\rCapturing CUDA graphs (FULL): 100%|██████████| 2/2 [00:00<00:00, 42.92it/s]
(EngineCore pid=1691) INFO 12-04 18:28:50 [model_runner.py:1127] Graph capturing finished in 3 secs, took 0.28 GiB
(EngineCore pid=1691) INFO 12-04 18:28:50 [gpu_worker.py:759] Available KV cache memory: 47.24 GiB
Capturing CUDA graphs (PIECEWISE):   0%|          | 0/51 [00:00<?, ?it/s]\rCapturing CUDA graphs (PIECEWISE): 100%|██████████| 51/51 [00:01<00:00, 28.95it/s]
(EngineCore pid=1691) INFO 12-04 18:29:07 [model_runner.py:1127] Graph capturing finished in 4 secs, took 0.17 GiB
(EngineCore pid=1691) INFO 12-04 18:29:08 [core.py:395] init engine (profile, create kv cache, warmup model) took 39.76 s (compilation: 15.51 s)
(APIServer pid=1319) INFO 12-04 18:29:08 [entry.py:140] Starting vLLM server on http://127.0.0.1:8000
"""
RESTART = """\
===== 2026-12-04 18:29:40 node 0 vllm: /opt/torch/.venv/bin/python3 -m vllm.entrypoints.openai.api_server --model /tmp/model-q05
(APIServer pid=4528) INFO 12-04 18:30:09 [api_utils.py:286] non-default args: {'host': '127.0.0.1', 'model': '/tmp/model-k2'}
(APIServer pid=4528) INFO 12-04 18:30:09 [model.py:733] Resolved architecture: Qwen2ForCausalLM
(APIServer pid=4528) WARNING 12-04 18:30:10 [system_utils.py:152] We must use the `spawn` multiprocessing start method. Overriding VLLM_WORKER_MULTIPROC_METHOD to 'spawn'. See https://docs.vllm.ai/en/latest/usage/troubleshooting.html#python-multiprocessing for more information. Reasons: CUDA is initialized
(EngineCore pid=4685) INFO 12-04 18:30:38 [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: model='/tmp/model-k2'
(EngineCore pid=4685) INFO 12-04 18:30:47 [decorators.py:319] [backbone] Directly load AOT compilation from path /tmp/job/cache/x
(EngineCore pid=4685) INFO 12-04 18:30:47 [monitor.py:62] [backbone] torch.compile took 0.40 s in total
(EngineCore pid=4685) INFO 12-04 18:30:52 [model_runner.py:1127] Graph capturing finished in 4 secs, took 0.28 GiB
(EngineCore pid=4685) INFO 12-04 18:30:59 [model_runner.py:1127] Graph capturing finished in 5 secs, took 0.17 GiB
(EngineCore pid=4685) INFO 12-04 18:31:00 [core.py:395] init engine (profile, create kv cache, warmup model) took 14.73 s (compilation: 0.40 s)
(APIServer pid=4528) INFO 12-04 18:31:01 [entry.py:140] Starting vLLM server on http://127.0.0.1:8000
"""


def test_a_first_starts_phases_come_from_vllms_own_lines():
    ph = phases(FIRST)
    assert ph["imports"] == 25 and ph["model inspection"] == 21 and ph["engine core start"] == 22
    assert ph["weights"] == 3.226484 and ph["torch.compile"] == 15.51 and ph["compile cache"] == "compiled"
    assert ph["CUDA graphs"] == 7 and ph["graph sizes"] == 51, "both captures (memory profiling, then for real)"
    assert ph["engine init"] == 39.76 and ph["other init (profiling, KV cache, kernel warm-up)"] == 14.02
    assert ph["server up"] == 0 and ph["total"] == 114
    assert "engine core spawned" not in ph
    assert describe(ph).startswith("imports 25 s, model inspection 21 s, engine core start 22 s, weights 3.2 s")
    assert "CUDA graphs 7 s (51 sizes)" in describe(ph)


def test_a_restart_in_the_same_log_is_its_own_start_and_says_it_loaded_its_compile_cache(tmp_path):
    log = tmp_path / "node0-vllm.log"
    log.write_text("leftover line before any start\n" + FIRST + RESTART)
    assert len(starts(log.read_text())) == 2
    first, again = node_starts(log)
    assert first == phases(FIRST)
    assert again["imports"] == 29 and again["model inspection"] == 0 and again["engine core start"] == 29
    assert again["compile cache"] == "loaded" and again["torch.compile"] == 0.4 and again["total"] == 81
    assert again["engine core spawned"] == "CUDA is initialized", "a fork vLLM overrode is named"
    assert "weights" not in again, "a line that is missing leaves its phase out"


def test_with_several_workers_the_slowest_counts_not_the_sum():
    """TP 2: each worker compiles and captures its own shard at the same time."""
    lines = "".join(
        f"(Worker_TP{w} pid={pid}) INFO 12-04 18:28:44 [monitor.py:62] [backbone] torch.compile took {c} s in total\n"
        f"(Worker_TP{w} pid={pid}) INFO 12-04 18:28:50 [model_runner.py:1127] Graph capturing finished in 3 secs, took 0.2 GiB\n"
        f"(Worker_TP{w} pid={pid}) INFO 12-04 18:29:07 [model_runner.py:1127] Graph capturing finished in {g} secs, took 0.1 GiB\n"
        for w, pid, c, g in ((0, 11, 10.5, 4), (1, 12, 12.25, 5))
    )
    ph = phases(
        FIRST.replace("(EngineCore pid=1691) INFO 12-04 18:28:44 [monitor.py:62]", "x", 1).replace("Graph capturing", "-") + lines
    )
    assert ph["torch.compile"] == 12.25 and ph["CUDA graphs"] == 8


def test_a_start_still_running_shows_how_far_it_came():
    cut = FIRST[: FIRST.index("(EngineCore pid=1691) INFO 12-04 18:28:22")]
    assert list(phases(cut)) == ["imports", "model inspection"]
    assert node_starts(Path("/nonexistent/node0-vllm.log")) == []


def write_events(job: Path, stamps: list[tuple[Event, float]]) -> None:
    (job / "logs").mkdir(parents=True, exist_ok=True)
    with open(JobDir(job).events(0), "a") as f:
        f.writelines(json.dumps({"t": t, "node": 0, "event": str(e)}) + "\n" for e, t in stamps)


def test_status_shows_the_first_start_and_the_restart_side_by_side(tmp_path):
    e = Event
    attempt = [(e.BOOTSTRAP_START, 0.0), (e.VLLM_START, 0.5), (e.VLLM_HEALTHY, 114.7), (e.FIRST_STEP, 118.8)]
    write_events(tmp_path, attempt)
    JobDir(tmp_path).log(0, "vllm").write_text(FIRST)
    lines = startup_lines(tmp_path, 0)
    assert [ln.split(":")[0] for ln in lines] == ["  start-up, first start", "  vLLM start, first start"]
    assert "server start 114.2 s" in lines[0] and "total to step 1 118.8 s" in lines[0]
    write_events(tmp_path, [(e.BOOTSTRAP_START, 500.0), (e.VLLM_START, 500.5), (e.VLLM_HEALTHY, 581.0), (e.FIRST_STEP, 584.0)])
    with open(JobDir(tmp_path).log(0, "vllm"), "a") as f:
        f.write(RESTART)
    lines = startup_lines(tmp_path, 0)
    assert [ln.split(":")[0] for ln in lines] == [
        "  start-up, first start",
        "  vLLM start, first start",
        "  start-up, restart 1",
        "  vLLM start, restart 1",
    ]
    assert "total to step 1 118.8 s" in lines[0] and "total to step 1 84.0 s" in lines[2]
    assert "compile cache: compiled" in lines[1] and "compile cache: loaded" in lines[3]


def job(tmp_path: Path, **over: dict) -> C.JobConfig:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"], "num_attention_heads": 4}))
    d: dict = {
        "vllm": {"model": str(tmp_path)},
        "slurm": {"gpus_per_node": 1},
        "trainer": {"per_device_train_batch_size": 64},
        "job": {"job_dir": str(tmp_path / "j")},
    }
    for section, values in over.items():
        d[section] = {**d.get(section, {}), **values}
    return C.from_dict(d)


def server(tmp_path: Path, **over: dict) -> tuple[list[str], dict[str, str], list[str]]:
    p = plan(job(tmp_path, **over), str(tmp_path / "j"))
    cmd = vllm_command(p, 0)
    return cmd.argv, cmd.env, [d for d in p.derivation if d.startswith("vLLM ")]


def capture(argv: list[str]) -> int | None:
    flag = "--max-cudagraph-capture-size"
    return int(argv[argv.index(flag) + 1]) if flag in argv else None


def test_a_gpu_server_captures_graphs_for_its_work_forks_its_engine_and_inspects_in_process(tmp_path):
    argv, env, why = server(tmp_path)
    assert capture(argv) == 128, "64 completions in flight on the one-GPU node: vLLM's 2 x rule gives 128"
    assert env["VLLM_WORKER_MULTIPROC_METHOD"] == "fork" and env[Env.INSPECT_IN_PROCESS] == "1"
    assert "up to batch 128: 2 x 64 sequences in flight" in why[0] and "= 1 x 64 x 1 x 1 = 64" in why[0]
    assert "forked" in why[1] and "(vllm.engine_start auto)" in why[1] and "API server process" in why[2]
    _, env, why = server(tmp_path, vllm={"engine_start": "spawn"})
    assert env["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn" and "spawned" in why[1]
    # a TP 2 server: auto leaves vLLM's spawn (forked TP workers have not run on GPUs); fork when asked
    tp2 = {"slurm": {"gpus_per_node": 3}, "vllm": {"tensor_parallel_size": 2}}
    _, env, why = server(tmp_path, **tp2)
    assert "VLLM_WORKER_MULTIPROC_METHOD" not in env and "spawned" in why[1] and "2 x 1 workers" in why[1]
    _, env, _ = server(tmp_path, slurm=tp2["slurm"], vllm={**tp2["vllm"], "engine_start": "fork"})
    assert env["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"


def test_a_start_method_the_site_exports_wins_over_auto_and_the_cpu_build_is_not_said_to_fork(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    _, env, why = server(tmp_path)
    assert "VLLM_WORKER_MULTIPROC_METHOD" not in env and "exported on the node wins over auto" in why[1]
    _, env, _ = server(tmp_path, vllm={"engine_start": "fork"})  # asked for by name: the config wins
    assert env["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD")
    cpu = {"job": {"device": "cpu"}, "slurm": {"gpus_per_node": 3}, "trainer": {"dtype": "float32"}}
    _, _, why = server(tmp_path, **cpu, vllm={"engine_start": "fork", "dtype": "float32"})
    assert "its CPU build always spawns" in why[1] and "forked" not in why[1]
    # generated ahead: max_staleness 1 keeps two steps' completions in flight; 3 steps would reach vLLM's 512 default
    assert capture(server(tmp_path, trainer={"max_staleness": 1})[0]) == 256
    argv, _, why = server(tmp_path, trainer={"max_staleness": 3})
    assert capture(argv) is None and "reach its 512" in why[0]
    # a 2-node, 4-GPU split plan: each server carries its own node's 3 ranks x 8 completions = 24 -> 48
    argv, _, _ = server(tmp_path, slurm={"gpus_per_node": 4, "nodes": 2}, trainer={"per_device_train_batch_size": 8})
    assert capture(argv) == 48


@pytest.mark.parametrize(
    ("over", "size", "reason"),
    [
        ({"vllm": {"cudagraph_max_size": -1}}, None, "vLLM's default"),
        ({"vllm": {"extra_args": ["--speculative-config", '{"num_speculative_tokens": 3}']}}, None, "vllm.extra_args decide"),
        ({"vllm": {"cudagraph_max_size": 100}}, 104, "on vLLM's grid: 104"),
        ({"vllm": {"extra_args": ["--enforce-eager"]}}, None, "vllm.extra_args decide"),
        ({"vllm": {"extra_args": ["-cc", '{"cudagraph_capture_sizes": [1, 8]}']}}, None, "vllm.extra_args decide"),
        ({"trainer": {"eval": {"dataset": "data/letters_eval.jsonl"}}}, None, "every prompt of its file"),
        ({"trainer": {"eval": {"dataset": "data/letters_eval.jsonl", "max_prompts": 50, "samples_per_prompt": 4}}}, 400, "eval"),
    ],
)
def test_the_user_and_the_unknowable_keep_vllms_capture(tmp_path, over, size, reason):
    argv, _, why = server(tmp_path, **over)
    assert capture(argv) == size and reason in why[0]


def vllms_capture_sizes(max_size: int | None) -> list[int]:
    """The sizes vLLM 0.32's own rule (VllmConfig._set_cudagraph_sizes) captures for --max-cudagraph-capture-size, on
    an H200's scheduler defaults (max_num_seqs 1024, 8192 batched tokens), run on a stand-in for the config (the CPU
    build never gets there: it has no CUDA graphs)."""
    import types

    from vllm.config import CompilationConfig, VllmConfig
    from vllm.config.compilation import CUDAGraphMode

    cc = CompilationConfig(max_cudagraph_capture_size=max_size)  # type: ignore[arg-type]  # None: vLLM's default
    cc.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    scheduler = types.SimpleNamespace(max_num_seqs=1024, max_num_batched_tokens=8192)
    VllmConfig._set_cudagraph_sizes(
        types.SimpleNamespace(  # type: ignore[arg-type]  # the fields the rule reads
            model_config=types.SimpleNamespace(enforce_eager=False),
            compilation_config=cc,
            scheduler_config=scheduler,
            uniform_decode_query_len=1,
            speculative_config=None,
            performance_mode="throughput",
        )
    )
    return list(cc.cudagraph_capture_sizes)


def test_vllm_captures_exactly_up_to_the_size_given_and_never_truncates_the_top_batch():
    assert len(vllms_capture_sizes(None)) == 51, "vLLM's default on an H200: 51 sizes up to 512 (the H200 logs)"
    assert vllms_capture_sizes(128) == [1, 2, 4, *range(8, 129, 8)], "the one-GPU config: 19 sizes"
    assert vllms_capture_sizes(100)[-1] == 96, "off vLLM's grid, vLLM truncates: a batch of 97-100 gets no graph"
    for n in [*range(1, 40), 100, 129, 200, 255, 256, 257, 300, 511]:
        size = vllm_start.capture_grid(n)
        assert vllms_capture_sizes(size)[-1] == size >= n, n


def test_nothing_changes_on_cpu_and_each_choice_can_be_turned_back(tmp_path):
    argv, env, why = server(
        tmp_path,
        job={"device": "cpu"},
        slurm={"gpus_per_node": 3},
        trainer={"dtype": "float32", "per_device_train_batch_size": 8},
        vllm={"dtype": "float32"},
    )
    assert capture(argv) is None and "VLLM_WORKER_MULTIPROC_METHOD" not in env
    assert "CPU build: no CUDA graphs" in why[0] and "its CPU build always spawns" in why[1]
    _, env, why = server(tmp_path, vllm={"engine_start": "spawn", "inspect_in_process": False})
    assert env["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn" and Env.INSPECT_IN_PROCESS not in env
    assert "fresh Python process" in why[2]
    _, env, _ = server(tmp_path, job={"platform": "rocm"})
    assert "VLLM_WORKER_MULTIPROC_METHOD" not in env, "ROCm: vLLM's own choice"
    with pytest.raises(C.ConfigError, match="vllm.cudagraph_max_size"):
        job(tmp_path, vllm={"cudagraph_max_size": -2})
    with pytest.raises(C.ConfigError, match="set by slurm-grpo from vllm.cudagraph_max_size"):
        job(tmp_path, vllm={"extra_args": ["--max-cudagraph-capture-size", "8"]})


CPU = {"job": {"device": "cpu"}, "slurm": {"gpus_per_node": 3}, "trainer": {"dtype": "float32"}}


def test_a_cpu_server_runs_eagerly_unless_the_users_extra_args_decide_the_compilation(tmp_path):
    argv, env, why = server(tmp_path, **CPU, vllm={"dtype": "float32"})
    assert argv.count(vllm_start.CPU_EAGER) == 1
    assert env["TORCH_COMPILE_DISABLE"] == "1"  # vLLM's sampler ops compiled at their first call: off too
    assert any(w.startswith("vLLM runs the model eagerly (--enforce-eager): CPU build") for w in why), why
    for user in (["--enforce-eager"], ["-O3"], ["-O", "2"], ["--optimization-level=1"], ["-cc.mode=3"],
                 ["--compilation-config", '{"mode": 3}'], ["--compilation_config.mode=3"]):  # fmt: skip
        argv, env, why = server(tmp_path, **CPU, vllm={"dtype": "float32", "extra_args": user})
        assert "TORCH_COMPILE_DISABLE" not in env
        assert argv[-len(user) :] == user and argv.count("--enforce-eager") == user.count("--enforce-eager"), (user, argv)
        assert not any("eagerly" in w for w in why), (user, why)
    # other extra args leave it on; a GPU server keeps vLLM's torch.compile
    argv, _, _ = server(tmp_path, **CPU, vllm={"dtype": "float32", "extra_args": ["--max-num-seqs", "64"]})
    assert vllm_start.CPU_EAGER in argv
    argv, env, why = server(tmp_path)
    assert vllm_start.CPU_EAGER not in argv and not any("eagerly" in w for w in why) and "TORCH_COMPILE_DISABLE" not in env


def test_the_plugin_has_vllm_inspect_the_model_class_in_this_process(tmp_path, monkeypatch):
    from vllm.model_executor.models import registry

    from trainer.push import vllm_plugin

    monkeypatch.setattr(registry, "_run_in_subprocess", registry._run_in_subprocess)  # undone after the test
    vllm_plugin.inspect_in_process()
    vllm_plugin.inspect_in_process()  # idempotent
    assert registry._run_in_subprocess(os.getpid) == os.getpid(), "the function ran here, not in a child"
    # vLLM's own cold-cache path: no subprocess, and it still writes its cache (a restart reads it)
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    real_run = registry.subprocess.run

    def run(cmd, *a, **k):
        if cmd == registry._SUBPROCESS_COMMAND:
            pytest.fail("vLLM started its inspection process")
        return real_run(cmd, *a, **k)

    monkeypatch.setattr(registry.subprocess, "run", run)
    info = registry._LazyRegisteredModel("tests.unit.test_vllm_start", "TinyLm").inspect_model_cls()
    assert info.architecture == "TinyLm"
    assert list((tmp_path / "modelinfos").glob("*TinyLm.json"))


LOG_A_LINE = """
import argparse
from vllm.logger import configure_logging_from_args, init_logger
from vllm.utils.system_utils import decorate_logs
configure_logging_from_args(argparse.Namespace())  # as vLLM's API server entry configures it
decorate_logs("APIServer")
init_logger("vllm.config.model").info("Resolved architecture: Qwen2ForCausalLM")
"""
HOSTILE = {"VLLM_CONFIGURE_LOGGING": "0", "VLLM_LOGGING_LEVEL": "ERROR", "FORCE_COLOR": "1", "VLLM_LOGGING_PREFIX": "x "}
"""Logging settings a job may inherit: TRL's import sets VLLM_LOGGING_LEVEL=ERROR (trl/_compat.py), and the integration
tier's servers, started from the pytest process, once wrote not one vLLM line into the log."""


def test_the_servers_log_has_vllms_lines_the_status_reads_whatever_the_job_inherits(tmp_path):
    import subprocess
    import sys

    from launcher.vllm_log import RESOLVED

    _, env, _ = server(tmp_path)
    base = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_LOG")} | HOSTILE
    runs = {
        name: subprocess.Popen(
            [sys.executable, "-c", LOG_A_LINE], env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for name, e in (("inherited", base), ("server", base | env))
    }
    out = {name: p.communicate(timeout=120)[0] for name, p in runs.items()}
    assert RESOLVED.search(out["server"]), out["server"]  # the line launcher.vllm_log times the model inspection by
    assert not RESOLVED.search(out["inherited"]), out["inherited"]  # what the server's env overrides


try:
    import torch

    class TinyLm(torch.nn.Module):
        """A model class for the registry to inspect (importing a real vLLM model module takes seconds)."""

        def forward(self, x):
            return x
except ImportError:  # pragma: no cover
    pass


def gdn_model(tmp_path: Path) -> Path:
    """A Qwen3.5 config.json (Gated DeltaNet and full-attention layers), as make-tiny-model writes it."""
    from transformers import AutoConfig

    from trainer.tiny_families import config_fields

    fields = config_fields(
        "qwen3_5_text", vocab=300, hidden=128, layers=4, heads=2, kv_heads=1, head_dim=64, intermediate=256, tie=True,
        token_id=0, dtype="bfloat16",
    )  # fmt: skip
    model = tmp_path / "q35"
    model.mkdir()
    (model / "config.json").write_text(AutoConfig.for_model("qwen3_5_text", **fields).to_json_string())
    return model


def test_a_gated_deltanet_model_prefills_on_triton_on_cuda_unless_the_user_configures_vllm(tmp_path):
    # H100, 2026-12-06 (gpu/results/2026-12-06-moe/7-qwen3_5-failed): vLLM 0.32's auto took FlashInfer, not installed
    model = str(gdn_model(tmp_path))
    argv, _, why = server(tmp_path, vllm={"model": model})
    assert argv[-1] == vllm_start.GDN_PREFILL_TRITON and argv.count(vllm_start.GDN_PREFILL_TRITON) == 1
    assert any("Gated DeltaNet prefill on Triton" in w and "FlashInfer" in w for w in why), why
    # the user's own additional config wins (vLLM would merge the two); CPU and ROCm keep vLLM's choice
    user = ["--additional-config.gdn_prefill_backend=flashinfer"]
    argv, _, why = server(tmp_path, vllm={"model": model, "extra_args": user})
    assert vllm_start.GDN_PREFILL_TRITON not in argv and not any("Gated DeltaNet" in w for w in why)
    argv, _, _ = server(tmp_path, vllm={"model": model}, job={"platform": "rocm"})
    assert vllm_start.GDN_PREFILL_TRITON not in argv
    cpu = {"job": {"device": "cpu"}, "slurm": {"gpus_per_node": 3}, "trainer": {"dtype": "float32"}}
    argv, _, _ = server(tmp_path, **cpu, vllm={"model": model, "dtype": "float32"})
    assert vllm_start.GDN_PREFILL_TRITON not in argv
    # a model without GDN layers: nothing added
    argv, _, _ = server(tmp_path)
    assert vllm_start.GDN_PREFILL_TRITON not in argv


def test_an_adapter_push_captures_one_set_of_graphs_with_lora_and_nothing_else_does(tmp_path):
    """trainer.lora with the adapter pushed: every request names the adapter, so vLLM's second set of graphs (without
    LoRA) would never be replayed; the merged push, a CPU server and a user's own compilation config get no flag."""
    lora = {"lora": {"r": 16}}
    argv, env, why = server(tmp_path, trainer=lora)
    assert vllm_start.LORA_ONE_GRAPH_SET in argv and "--enable-lora" in argv and env[Env.LORA_ACTIVE_GRAPHS_ONLY] == "1"
    assert any("with LoRA only" in w for w in why)
    merged, env, why = server(tmp_path, trainer={"lora": {"r": 16, "push": "merged"}})
    assert "--enable-lora" not in merged and vllm_start.LORA_ONE_GRAPH_SET not in merged
    assert not any("with LoRA only" in w for w in why) and Env.LORA_ACTIVE_GRAPHS_ONLY not in env
    own, env, _ = server(tmp_path, trainer=lora, vllm={"extra_args": ["-cc.mode=3"]})
    assert vllm_start.LORA_ONE_GRAPH_SET not in own and "--enable-lora" in own and Env.LORA_ACTIVE_GRAPHS_ONLY not in env
    cpu = {"job": {"device": "cpu"}, "slurm": {"gpus_per_node": 3}, "trainer": {"dtype": "float32", **lora}}
    argv, env, _ = server(tmp_path, **cpu)
    assert vllm_start.LORA_ONE_GRAPH_SET not in argv and Env.LORA_ACTIVE_GRAPHS_ONLY not in env


DENSE = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 300,
}  # fmt: skip


def model_folder(tmp_path: Path, name: str, config: dict) -> str:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_a_cuda_server_of_a_dense_model_skips_vllms_jit_kernel_warm_up_unless_the_user_configures_it(tmp_path):
    """vLLM's JIT warm-up took 19-20 s of a 7 B adapter's first start (H100, gpu/results/2026-12-07-kv-work-jit-warmup/)
    for kernels the run compiles at first use anyway: a CUDA server of a dense GQA body skips it. The user's own kernel
    config (JSON or dotted: vLLM keeps one of the two), attention that sizes vLLM's workspace at first use (decode context
    parallelism, a KV cache dtype), an MoE model (its captured graphs hold views of that workspace), a model whose shape
    cannot be read, a CPU and a ROCm server keep vLLM's default."""
    dense = {"model": model_folder(tmp_path, "dense", DENSE)}
    argv, _, why = server(tmp_path, vllm=dense)
    assert argv.count(vllm_start.NO_JIT_WARMUP) == 1 and any("JIT kernel warm-up" in w for w in why), why
    argv, _, _ = server(tmp_path, vllm=dense, trainer={"lora": {"r": 16}})
    assert vllm_start.NO_JIT_WARMUP in argv and vllm_start.LORA_ONE_GRAPH_SET in argv
    own_config = (["--kernel-config.enable_jit_warmup=true"], ["--kernel-config", '{"moe_backend": "triton"}'])
    for own in (*own_config, ["-dcp", "2"], ["--kv-cache-dtype", "fp8"]):
        argv, _, why = server(tmp_path, vllm={**dense, "extra_args": own})
        assert vllm_start.NO_JIT_WARMUP not in argv and argv[-len(own) :] == own, own
        assert not any("JIT kernel warm-up" in w for w in why), why
    moe = {**DENSE, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 8}
    moe |= {"num_experts_per_tok": 2, "moe_intermediate_size": 32, "head_dim": 16}
    argv, _, _ = server(tmp_path, vllm={"model": model_folder(tmp_path, "moe", moe)})
    assert vllm_start.NO_JIT_WARMUP not in argv
    argv, _, _ = server(tmp_path)  # job()'s config.json holds no shape
    assert vllm_start.NO_JIT_WARMUP not in argv
    argv, _, why = server(tmp_path, vllm=dense, job={"platform": "rocm"})
    assert vllm_start.NO_JIT_WARMUP not in argv and not any("JIT kernel warm-up" in w for w in why)
    cpu = {"job": {"device": "cpu"}, "slurm": {"gpus_per_node": 3}, "trainer": {"dtype": "float32"}}
    argv, _, _ = server(tmp_path, **cpu, vllm={**dense, "dtype": "float32"})
    assert vllm_start.NO_JIT_WARMUP not in argv
    # the flag is vLLM's: its parser takes the dotted spelling into the kernel config the worker reads
    pytest.importorskip("vllm")
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--model", "m", vllm_start.NO_JIT_WARMUP])
    assert EngineArgs.from_cli_args(args).kernel_config.enable_jit_warmup is False


def test_the_plugin_has_model_runner_v2_capture_graphs_through_the_adapter_only(monkeypatch):
    """vLLM 0.32's Model Runner V2 captures graphs for batches without an adapter even with cudagraph_specialize_lora
    off; the plugin (Env.LORA_ACTIVE_GRAPHS_ONLY) keeps the set through the adapter, which every request of an
    adapter push replays; a batch without one finds no graph and runs eagerly (vLLM's own fallback)."""
    from vllm.config.compilation import CompilationConfig
    from vllm.config.lora import LoRAConfig
    from vllm.v1.worker.gpu import lora_utils

    from trainer.push import vllm_plugin

    monkeypatch.setattr(lora_utils, "get_lora_capture_cases", lora_utils.get_lora_capture_cases)  # undone after
    runner = sys.modules.get("vllm.v1.worker.gpu.model_runner")  # the plugin patches its reference too, where imported
    if runner is not None:
        monkeypatch.setattr(runner, "get_lora_capture_cases", runner.get_lora_capture_cases)
    one_lora = LoRAConfig(max_loras=1, max_lora_rank=16)
    off, on = CompilationConfig(cudagraph_specialize_lora=False), CompilationConfig(cudagraph_specialize_lora=True)
    assert lora_utils.get_lora_capture_cases(one_lora, off) == [0, 2], "vLLM as shipped: both sets"
    vllm_plugin.lora_graphs_active_only()
    vllm_plugin.lora_graphs_active_only()  # idempotent
    assert lora_utils.get_lora_capture_cases(one_lora, off) == [2]
    assert lora_utils.get_lora_capture_cases(one_lora, on)[0] == 0, "a user's own specialize_lora keeps vLLM's sets"
    assert lora_utils.get_lora_capture_cases(None, off) == [0], "no LoRA: the one set without"
