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
