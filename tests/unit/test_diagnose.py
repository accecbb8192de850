"""The root cause a node reports from its trainer log: the first exception a rank printed, or, when our own code
re-raised it `from` a lower-level error, the outer one (it names what was being done and the inner cause)."""

from __future__ import annotations

from pathlib import Path

from launcher.node.diagnose import root_cause

CHAINED = """===== 2026-12-04 15:00:00 node 0 trainer: python -m trainer.main plan.json
[rank0]: Traceback (most recent call last):
[rank0]:   File "trainer/rollout/server.py", line 90, in request
[rank0]: trainer.rollout.server.ServerError: node 0: vLLM server http://127.0.0.1:8000/update_weights failed at step 2: no answer within 15 s
[rank0]:
[rank0]: The above exception was the direct cause of the following exception:
[rank0]:
[rank0]: Traceback (most recent call last):
[rank0]:   File "trainer/rollout/node.py", line 228, in push
[rank0]: RuntimeError: weight push at step 2 (node 0) failed: node 0: vLLM server .../update_weights failed at step 2
[rank1]: RuntimeError: Connection closed by peer
"""

DURING = """===== 2026-12-04 15:00:00 node 0 trainer: python -m trainer.main plan.json
[rank0]: ValueError: reward 'pkg.mod:fn' raised ValueError at step 2 on node 0: bad
[rank0]:
[rank0]: During handling of the above exception, another exception occurred:
[rank0]:
[rank0]: RuntimeError: cleanup failed
"""


def test_an_error_our_code_re_raised_from_another_is_reported_as_the_outer_one(tmp_path: Path):
    log = tmp_path / "node0-trainer.log"
    log.write_text(CHAINED)
    assert root_cause(log).startswith("RuntimeError: weight push at step 2 (node 0) failed"), root_cause(log)


def test_an_error_during_the_handling_of_another_keeps_the_first(tmp_path: Path):
    """Implicit chaining is a second failure while handling the first: the first is the cause."""
    log = tmp_path / "node0-trainer.log"
    log.write_text(DURING)
    assert root_cause(log).startswith("ValueError: reward 'pkg.mod:fn' raised ValueError at step 2"), root_cause(log)


# gpu/results/2026-12-06-moe/5-deepseek-v3-failed: the engine core's lines (one cut), then the API server's traceback,
# whose last lines are all the failure message showed
ENGINE_FAILED = (
    """===== 2026-12-06 12:10:00 node 0 vllm: python3 -m vllm.entrypoints.openai.api_server --model /tmp/model-ds3
(EngineCore pid=4521) ERROR 12-06 12:10:18 [core.py:1510] EngineCore failed to start.
(EngineCore pid=4521) ERROR 12-06 12:10:18 [core.py:1510] Traceback (most recent call last):
(EngineCore pid=4521) ERROR 12-06 12:10:18 [core.py:1510]     raise ValueError(
(EngineCore pid=4521) ERROR 12-06 12:10:18 [core.py:1510] ValueError: No valid MLA prefill backend found with MLAPrefillSelectorConfig(dtype=torch.bfloat16, mla_dimensions=(qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64)).
(APIServer pid=4316) Traceback (most recent call last):
"""
    + '(APIServer pid=4316)   File "vllm/v1/engine/utils.py", line 1431, in wait_for_engine_startup\n' * 40
    + """\
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""
)


def test_a_server_that_died_starting_names_its_engine_cores_error_not_only_the_api_servers(tmp_path: Path):
    from launcher.node.bootstrap import _died_during_training, _exited_before_healthy
    from launcher.node.diagnose import engine_cause

    assert engine_cause(ENGINE_FAILED).startswith("ValueError: No valid MLA prefill backend found")
    assert engine_cause(ENGINE_FAILED.replace("ValueError: No valid", "No valid")) == ""  # no exception line: nothing
    # a restart in the same log (appended): its own error, not the first start's
    restart = ENGINE_FAILED.replace("ValueError: No valid MLA", "RuntimeError: CUDA out of memory; not MLA")
    assert engine_cause(ENGINE_FAILED + restart).startswith("RuntimeError: CUDA out of memory")

    class Server:  # the supervised process as the message reads it
        log_path = tmp_path / "node0-vllm.log"

        def describe(self) -> str:
            return "vllm (pid 4316)"

    Server.log_path.write_text(ENGINE_FAILED)
    msg = str(_exited_before_healthy(Server(), 1, "http://127.0.0.1:8000", "node 0 (gpu7)"))  # type: ignore[arg-type]
    assert "node 0 (gpu7): vLLM server vllm (pid 4316) exited with code 1" in msg
    assert "the engine core's error: ValueError: No valid MLA prefill backend" in msg, msg
    assert str(Server.log_path) in msg and "Engine core initialization failed" in msg
    # the same server dying after it was healthy (a worker's error mid-generation): the same line
    msg = str(_died_during_training(Server(), 0, "node 0 (gpu7)"))  # type: ignore[arg-type]
    assert "died with code 0 during training" in msg and "the engine core's error: ValueError: No valid MLA" in msg
