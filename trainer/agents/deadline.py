"""Every tool call with a deadline (trainer.tool_timeout_s): a tool that raises or passes its deadline becomes an
exception TRL's tool loop records as a failure (the model sees {"error": ...} and `tools/failure_frequency` counts it),
never a stuck rank. Tools run on the calling rank's CPU; a call past its deadline is left running in a daemon thread
(Python cannot stop a thread) and the episode goes on without it.

The wrappers keep the tool's name, signature, type hints and docstring: TRL renders the tool's JSON schema from them.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import threading
import time
from collections.abc import Callable
from typing import Any

RESERVED = ("reset", "get_reward")
"""Environment methods TRL never offers as tools."""


class ToolTimeout(TimeoutError):
    pass


class ToolClock:
    """Seconds spent in tool calls and calls made, failed and timed out on this rank since the last `take`."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seconds = 0.0
        self.calls = 0
        self.failures = 0
        self.timeouts = 0

    def add(self, seconds: float, failed: bool, timed_out: bool) -> None:
        with self.lock:
            self.seconds += seconds
            self.calls += 1
            self.failures += failed
            self.timeouts += timed_out

    def take(self) -> dict[str, float]:
        with self.lock:
            out = {"seconds": self.seconds, "calls": self.calls, "failures": self.failures, "timeouts": self.timeouts}
            self.seconds, self.calls, self.failures, self.timeouts = 0.0, 0, 0, 0
        return out


CLOCK = ToolClock()
"""This process's tool figures (one rank per process)."""


def _late(name: str, timeout_s: float) -> ToolTimeout:
    return ToolTimeout(
        f"tool {name!r} gave no result within {timeout_s:g} s (trainer.tool_timeout_s); it was abandoned and the episode goes on"
    )


def call_with_deadline(fn: Callable[..., Any], name: str, timeout_s: float, *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **kwargs) on a daemon thread; its result, its exception, or ToolTimeout after timeout_s."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn(*args, **kwargs)
        except BaseException as e:  # handed to the caller below
            box["error"] = e

    t0 = time.monotonic()
    worker = threading.Thread(target=run, name=f"tool-{name}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        CLOCK.add(time.monotonic() - t0, failed=True, timed_out=True)
        raise _late(name, timeout_s)
    CLOCK.add(time.monotonic() - t0, failed="error" in box, timed_out=False)
    if "error" in box:
        raise box["error"]
    return box["result"]


def with_deadline(fn: Callable[..., Any], timeout_s: float, name: str | None = None) -> Callable[..., Any]:
    """fn (a function, bound method or coroutine function) whose every call ends within timeout_s."""
    label: str = name or str(getattr(fn, "__name__", type(fn).__name__))
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def timed_async(*args: Any, **kwargs: Any) -> Any:
            t0 = time.monotonic()
            try:
                out = await asyncio.wait_for(fn(*args, **kwargs), timeout_s)
            except asyncio.TimeoutError:
                CLOCK.add(time.monotonic() - t0, failed=True, timed_out=True)
                raise _late(label, timeout_s) from None
            except Exception:
                CLOCK.add(time.monotonic() - t0, failed=True, timed_out=False)
                raise
            CLOCK.add(time.monotonic() - t0, failed=False, timed_out=False)
            return out

        return timed_async

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        return call_with_deadline(fn, label, timeout_s, *args, **kwargs)

    return timed


def tool_methods(cls: type) -> list[str]:
    """The methods of an environment class TRL offers as tools: public functions other than reset and get_reward."""
    return [
        name
        for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
        if name not in RESERVED and not name.startswith("_")
    ]


def environment_with_deadlines(factory: Callable[[], Any], timeout_s: float) -> Callable[[], Any]:
    """A factory whose instances' tool methods end within timeout_s: each instance becomes an instance of a subclass
    of its own class (made once per class) whose tool methods are wrapped; reset and get_reward are left as they are."""
    subclasses: dict[type, type] = {}

    def make() -> Any:
        env = factory()
        cls = type(env)
        if cls not in subclasses:
            wrapped = {}
            for name in tool_methods(cls):
                method = getattr(cls, name)
                wrapped[name] = with_deadline(method, timeout_s, f"{cls.__name__}.{name}")
            subclasses[cls] = type(cls.__name__, (cls,), {**wrapped, "__module__": cls.__module__, "__doc__": cls.__doc__})
        env.__class__ = subclasses[cls]
        return env

    functools.update_wrapper(make, factory)
    return make
