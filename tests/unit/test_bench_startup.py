"""The start-up benchmarks' reading of vLLM's log and of the CLI's output (bench.startup, bench.startup_cluster)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.startup import compile_cache_use, this_start
from bench.startup_cluster import after_last_healthy, engine_init, job_id_of, table
from launcher.core.jobdir import JobDir

FIRST = """\
(EngineCore pid=11) INFO 12-04 [backends.py:1105] Using cache directory: {job}/cache/node0/vllm/torch_compile_cache/ab12/rank_0_0/backbone for vLLM's torch.compile
(EngineCore pid=11) INFO 12-04 [decorators.py:744] saved AOT compiled function to {job}/cache/node0/vllm/torch_compile_cache/torch_aot_compile/cd34/rank_0_0/model
"""
RESTART_FAILED = """\
(EngineCore pid=12) WARNING 12-04 [decorators.py:334] Compiling model again due to a load failure from {job}/cache/node0/vllm/torch_compile_cache/torch_aot_compile/cd34/rank_0_0/model, reason: 'function' object has no attribute 'finalize_loading'
(EngineCore pid=12) INFO 12-04 [backends.py:1105] Using cache directory: {job}/cache/node0/vllm/torch_compile_cache/ab12/rank_0_0/backbone for vLLM's torch.compile
"""
RESTART_LOADED = """\
(EngineCore pid=13) INFO 12-04 [decorators.py:320] Directly load AOT compilation from path {job}/cache/node0/vllm/torch_compile_cache/torch_aot_compile/cd34/rank_0_0/model
"""


def test_a_first_start_compiles_into_the_job_folder(tmp_path: Path) -> None:
    use = compile_cache_use(FIRST.format(job=tmp_path), tmp_path)
    assert use["aot"] == "compiled"
    assert use["in_job_folder"] is True
    assert use["paths"] == sorted(
        [
            f"{tmp_path}/cache/node0/vllm/torch_compile_cache/ab12/rank_0_0/backbone",
            f"{tmp_path}/cache/node0/vllm/torch_compile_cache/torch_aot_compile/cd34/rank_0_0/model",
        ]
    )


def test_a_restart_that_could_not_load_its_graph_says_why_and_the_path_has_no_trailing_comma(tmp_path: Path) -> None:
    use = compile_cache_use(RESTART_FAILED.format(job=tmp_path), tmp_path)
    assert use["aot"] == "load failed: 'function' object has no attribute 'finalize_loading'"
    assert f"{tmp_path}/cache/node0/vllm/torch_compile_cache/torch_aot_compile/cd34/rank_0_0/model" in use["paths"]
    assert not any(p.endswith(",") for p in use["paths"])
    assert use["in_job_folder"] is True


def test_a_restart_that_loaded_its_graph(tmp_path: Path) -> None:
    assert compile_cache_use(RESTART_LOADED.format(job=tmp_path), tmp_path)["aot"] == "loaded"


def test_a_cache_outside_the_job_folder_or_none_named_is_not_in_it(tmp_path: Path) -> None:
    elsewhere = FIRST.format(job="/root/.cache") + RESTART_LOADED.format(job=tmp_path)
    assert compile_cache_use(elsewhere, tmp_path)["in_job_folder"] is False
    # a sibling folder whose name starts with the job folder's is not inside it
    assert compile_cache_use(FIRST.format(job=f"{tmp_path}-other"), tmp_path)["in_job_folder"] is False
    assert compile_cache_use("no compile lines at all", tmp_path) == {"paths": [], "in_job_folder": False, "aot": "compiled"}


def test_this_start_is_the_part_of_the_log_after_the_last_start_line(tmp_path: Path) -> None:
    log = tmp_path / "node0-vllm.log"
    log.write_text("\n===== 2026-12-04 node 0 vllm: first\nsaved AOT\n===== 2026-12-04 node 0 vllm: second\nDirectly load\n")
    assert this_start(log) == "\n===== 2026-12-04 node 0 vllm: second\nDirectly load\n"
    assert this_start(tmp_path / "missing.log") == ""


def test_the_job_id_of_submit_and_of_resume() -> None:
    assert job_id_of("submitted job 42\njob folder: /tmp/x\n") == "42"
    assert job_id_of("resubmitted job folder /tmp/x as job 43: resumes from step 3 on 2 nodes (4 ranks)\n") == "43"
    with pytest.raises(RuntimeError, match="no job id"):
        job_id_of("sbatch: error: Batch job submission failed")


def test_the_table_puts_the_runs_side_by_side_per_node() -> None:
    def run(host: str, server: float, aot: str) -> dict:
        node = {
            "host": host,
            "submit -> bootstrap start": 1.5,
            "phases_s": {"server start": server, "vLLM healthy -> step 1": 0.5},
            "last vLLM healthy -> step 1": 0.5,
            "compile": [f"init engine (profile, create kv cache, warmup model) took {server / 10} s"],
            "cache": {"aot": aot, "in_job_folder": True},
            "cache_folder": {"files": 10 if aot == "compiled" else 12, "mb": 1.5},
        }
        return {"nodes": {0: node, 1: {**node, "phases_s": {"server start": server}}}}

    out = table([("first start", run("n1", 60.0, "compiled")), ("restart", run("n2", 40.0, "loaded"))]).splitlines()
    assert out[0] == "| node | phase | first start (s) | restart (s) |"
    assert "| 0 | host | n1 | n2 |" in out
    assert "| 0 | server start | 60.0 | 40.0 |" in out
    assert "| 0 | vLLM healthy -> step 1 | 0.5 | 0.5 |" in out
    assert "| 1 | vLLM healthy -> step 1 | - | - |" in out  # a phase one node lacks shows as -, not a made-up figure
    assert "| 1 | last vLLM healthy -> step 1 | 0.5 | 0.5 |" in out
    assert "| 0 | vLLM engine init (from its log) | 6.0 | 4.0 |" in out
    assert "| 0 | vLLM compiled graph | compiled | loaded |" in out
    assert "| 0 | cache folder after the job (files, MB) | 10, 1.5 | 12, 1.5 |" in out
    three = table([("a", run("n1", 60.0, "compiled")), ("b", run("n1", 40.0, "loaded")), ("c", run("n2", 50.0, "compiled"))])
    assert "| 0 | server start | 60.0 | 40.0 | 50.0 |" in three.splitlines()


def test_engine_init_is_read_from_vllms_line_or_is_none() -> None:
    assert engine_init(["saved AOT", "init engine (profile, create kv cache, warmup model) took 13.64 s"]) == 13.64
    assert engine_init(["saved AOT"]) is None


def write_events(job: Path, node: int, rows: list[tuple[str, float]]) -> None:
    path = JobDir(job).events(node)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f'{{"t": {t}, "node": {node}, "event": "{e}"}}\n' for e, t in rows))


def test_after_last_healthy_counts_from_the_slowest_nodes_server_per_attempt(tmp_path: Path) -> None:
    # attempt 1: node 0's server healthy at 100, node 1's at 105, both step 1 at 107; attempt 2: 300/302, step at 303
    write_events(tmp_path, 0, [("bootstrap_start", 0), ("vllm_healthy", 100), ("first_step", 107), ("bootstrap_start", 200), ("vllm_healthy", 300), ("first_step", 303)])  # fmt: skip
    write_events(tmp_path, 1, [("bootstrap_start", 0), ("vllm_healthy", 105), ("first_step", 107), ("bootstrap_start", 200), ("vllm_healthy", 302), ("first_step", 303.5)])  # fmt: skip
    assert after_last_healthy(tmp_path, 2, attempt=0) == {0: 2.0, 1: 2.0}
    assert after_last_healthy(tmp_path, 2) == after_last_healthy(tmp_path, 2, attempt=1) == {0: 1.0, 1: 1.5}
    assert after_last_healthy(tmp_path, 2, attempt=2) == {}  # no such attempt


def test_after_last_healthy_is_empty_while_a_node_has_no_step_1(tmp_path: Path) -> None:
    write_events(tmp_path, 0, [("bootstrap_start", 0), ("vllm_healthy", 100), ("first_step", 107)])
    write_events(tmp_path, 1, [("bootstrap_start", 0), ("vllm_healthy", 105)])
    assert after_last_healthy(tmp_path, 2) == {}
