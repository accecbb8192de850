"""The start-up benchmarks' reading of vLLM's log and of the CLI's output (bench.startup, bench.startup_cluster)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.startup import compile_cache_use, this_start
from bench.startup_cluster import job_id_of, table

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


def test_the_table_puts_first_start_and_restart_side_by_side_per_node() -> None:
    def run(host: str, server: float, aot: str) -> dict:
        node = {
            "host": host,
            "submit -> bootstrap start": 1.5,
            "phases_s": {"server start": server, "vLLM healthy -> step 1": 0.5},
            "cache": {"aot": aot, "in_job_folder": True},
            "cache_folder": {"files": 10 if aot == "compiled" else 12, "mb": 1.5},
        }
        return {"nodes": {0: node, 1: {**node, "phases_s": {"server start": server}}}}

    out = table(run("n1", 60.0, "compiled"), run("n2", 40.0, "loaded")).splitlines()
    assert "| 0 | host | n1 | n2 |" in out
    assert "| 0 | server start | 60.0 | 40.0 |" in out
    assert "| 0 | vLLM healthy -> step 1 | 0.5 | 0.5 |" in out
    assert "| 1 | vLLM healthy -> step 1 | - | - |" in out  # a phase one node lacks shows as -, not a made-up figure
    assert "| 0 | vLLM compiled graph | compiled | loaded |" in out
    assert "| 0 | cache folder after the job (files, MB) | 10, 1.5 | 12, 1.5 |" in out
