"""An orderly vLLM end leaves no EngineDeadError traceback, a real engine death keeps it (trainer/push/clean_shutdown.py,
on vLLM's own logger and AsyncLLM class, no server); and the bootstrap's stop of vLLM signals the API server alone, the
rest of its group only by the final SIGKILL (launcher.node.procs.Proc term_leader). The integration tier checks a real
server's log after a clean end (tests/integration/test_agents_integration.py)."""

from __future__ import annotations

import inspect
import logging
import sys
import time
from pathlib import Path

import pytest

from launcher.node.commands import NodeCommand
from launcher.node.procs import Proc, alive

vllm = pytest.importorskip("vllm")

from vllm.v1.engine.async_llm import AsyncLLM  # noqa: E402
from vllm.v1.engine.exceptions import EngineDeadError  # noqa: E402

from trainer.push import clean_shutdown  # noqa: E402


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append(record)


def log_handler_failure(logger: logging.Logger, error: Exception) -> None:
    """What vLLM's output_handler does when the engine's outputs end with an error."""
    try:
        raise error
    except Exception:
        logger.exception(clean_shutdown.HANDLER_FAILED)


@pytest.fixture
def handler_log(monkeypatch):
    logger = logging.getLogger(clean_shutdown.HANDLER_LOGGER)
    monkeypatch.setattr(AsyncLLM, "shutdown", getattr(AsyncLLM.shutdown, "__wrapped__", AsyncLLM.shutdown))
    monkeypatch.setattr(logger, "filters", [])
    records = Records()
    logger.addHandler(records)
    clean_shutdown.STOPPING.clear()
    yield logger, records
    logger.removeHandler(records)
    clean_shutdown.STOPPING.clear()


def test_the_engines_death_keeps_its_traceback_until_the_shutdown_began(handler_log):
    logger, records = handler_log
    clean_shutdown.install()
    clean_shutdown.install()
    assert len(logger.filters) == 1
    log_handler_failure(logger, EngineDeadError())  # the engine core died by itself: printed
    assert len(records.seen) == 1 and records.seen[0].exc_info

    AsyncLLM.shutdown(object.__new__(AsyncLLM))  # an AsyncLLM with nothing started: its shutdown has nothing to stop
    assert clean_shutdown.STOPPING.is_set()
    log_handler_failure(logger, EngineDeadError())  # the shutdown stopped the engine: the expected end, dropped
    log_handler_failure(logger, ValueError("not the engine's end"))  # any other error still prints
    logger.error("another message")
    assert [r.getMessage() for r in records.seen] == [clean_shutdown.HANDLER_FAILED] * 2 + ["another message"]
    assert isinstance(records.seen[1].exc_info[1], ValueError)  # type: ignore[index]


def test_vllm_still_stops_the_engine_before_its_output_handler():
    """The reason for the filter, in vLLM's code: if this fails, vLLM changed the order (or the message), and
    clean_shutdown may no longer be needed (or no longer match)."""
    from vllm.v1.engine import async_llm

    src = inspect.getsource(getattr(AsyncLLM.shutdown, "__wrapped__", AsyncLLM.shutdown))
    assert src.index("engine_core.shutdown(") < src.index("cancel_task_threadsafe(handler)")
    assert f'logger.exception("{clean_shutdown.HANDLER_FAILED}")' in inspect.getsource(async_llm)


LEADER = """
import signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", '''
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *a: (open(sys.argv[1], "a").write("child TERM\\\\n"), sys.exit(0)))
open(sys.argv[1], "a").write("child up\\\\n")
time.sleep(60)
''', sys.argv[1]])
def term(*a):
    open(sys.argv[1], "a").write("leader TERM\\n")
    time.sleep(0.3)  # as vLLM's API server: its own shutdown, then it exits (its engine is the last SIGKILL's here)
    sys.exit(0)
signal.signal(signal.SIGTERM, term)
open(sys.argv[1], "a").write(f"child {child.pid}\\n")
time.sleep(60)
"""


@pytest.mark.parametrize("term_leader", [True, False])
def test_stop_signals_the_leader_alone_with_term_leader(tmp_path: Path, term_leader: bool):
    marks = tmp_path / "marks"
    proc = Proc(
        NodeCommand("vllm", [sys.executable, "-c", LEADER, str(marks)], {}, "vllm.log"),
        tmp_path,
        0,
        grace_s=10,
        term_leader=term_leader,
    )
    deadline = time.time() + 30
    while "child up" not in (marks.read_text() if marks.exists() else ""):
        assert time.time() < deadline and proc.poll() is None, (tmp_path / "vllm.log").read_text()
        time.sleep(0.05)
    child = int(next(line for line in marks.read_text().splitlines() if line.startswith("child ") and line[6:].isdigit())[6:])
    proc.stop()
    lines = marks.read_text().splitlines()
    assert "leader TERM" in lines and ("child TERM" in lines) is not term_leader, lines
    assert not alive(child) and proc.poll() is not None
