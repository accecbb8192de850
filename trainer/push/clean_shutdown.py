"""An orderly vLLM shutdown leaves no EngineDeadError traceback in node<i>-vllm.log (issue 37), the log a user reads
after a failure; an engine core that dies on its own still prints its traceback.

Why vLLM 0.32 printed one at every end: AsyncLLM.shutdown (which the API server's SIGTERM handler calls) stops the
engine core processes first and cancels its output_handler task after; the handler, still waiting for the engine's
outputs, finds the engine gone and logs "AsyncLLM output_handler failed." with EngineDeadError, the very lines of an
engine that crashed. (And while the bootstrap signalled vLLM's whole process group, the engine core also ended by
itself before the API server's shutdown began; it now signals the API server alone: launcher.node.procs.Proc's
term_leader.)

install() (the vLLM plugin, in every vLLM process) notes when AsyncLLM.shutdown begins and from then on drops that one
record: that logger, that message, an EngineDeadError. Everything logged before a shutdown passes, so a real engine
death keeps its traceback (and the engine core's own traceback, printed by the engine core, is never filtered). If vLLM
renames the message, nothing is dropped: the traceback comes back, nothing is hidden.
"""

from __future__ import annotations

import logging
import threading

HANDLER_LOGGER = "vllm.v1.engine.async_llm"
HANDLER_FAILED = "AsyncLLM output_handler failed."
"""What vLLM 0.32's AsyncLLM output_handler logs (logger.exception) when the engine's outputs end with an error."""

STOPPING = threading.Event()
"""Set when this process's AsyncLLM.shutdown began (the API server's orderly end)."""


class ExpectedEngineEnd(logging.Filter):
    """Drops the output handler's EngineDeadError once this process's shutdown began."""

    def filter(self, record: logging.LogRecord) -> bool:
        from vllm.v1.engine.exceptions import EngineDeadError

        error = record.exc_info[1] if record.exc_info else None
        expected = STOPPING.is_set() and record.getMessage() == HANDLER_FAILED and isinstance(error, EngineDeadError)
        return not expected


def install() -> None:
    """Wrap AsyncLLM.shutdown to set STOPPING first, and filter the output handler's logger (idempotent)."""
    from vllm.v1.engine.async_llm import AsyncLLM

    if getattr(AsyncLLM.shutdown, "_slurm_grpo", False):
        return
    shutdown = AsyncLLM.shutdown

    def _shutdown(self, *args, **kwargs):
        STOPPING.set()
        return shutdown(self, *args, **kwargs)

    _shutdown._slurm_grpo = True  # type: ignore[attr-defined]
    _shutdown.__wrapped__ = shutdown  # type: ignore[attr-defined]
    AsyncLLM.shutdown = _shutdown  # type: ignore[method-assign]
    logging.getLogger(HANDLER_LOGGER).addFilter(ExpectedEngineEnd())
