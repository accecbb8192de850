"""trainer.tools, trainer.environment and trainer.rollout_func: found by dotted path 'pkg.module:name', checked for the
right kind of object, and handed to TRL's GRPOTrainer with a deadline on every tool call (trainer.agents.deadline).

    python -m trainer.agents.resolve --tool pkg.mod:fn --environment [name=]pkg.mod:factory --rollout-func pkg.mod:fn
        resolve each as the trainer does and print the problems, one line each, the last stdout line a JSON list
        (what `slurm-grpo local` runs before anything starts: the launcher itself never imports user code)
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trainer.agents.deadline import RESERVED, environment_with_deadlines, tool_methods, with_deadline
from trainer.rewards import import_module_of


def find(key: str, entry: str) -> Any:
    """The object at 'pkg.module:name'; ValueError naming the config key and the fix."""
    mod_name, _, attr = entry.partition(":")
    mod = import_module_of(f"{key} {entry!r}", mod_name)
    if not hasattr(mod, attr):
        raise ValueError(f"{key} {entry!r}: module {mod_name!r} has no {attr!r}")
    return getattr(mod, attr)


def _schema_problem(fn: Callable, what: str) -> str | None:
    """TRL renders each tool's JSON schema from its type hints and Google-style docstring (transformers'
    get_json_schema): a tool it cannot render would fail in the first step, so say it now."""
    from transformers.utils import get_json_schema

    try:
        get_json_schema(fn)
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        return f"{what} cannot be described to the model ({first}); give every argument a type hint and a Google-style docstring with an Args: section"
    return None


def check_tool(entry: str) -> Callable:
    fn = find("trainer.tools", entry)
    if inspect.isclass(fn) or not callable(fn):
        raise ValueError(
            f"trainer.tools {entry!r} is a {type(fn).__name__}, not a function; tools are functions (an environment's methods go in trainer.environment)"
        )
    problem = _schema_problem(fn, f"trainer.tools {entry!r}")
    if problem:
        raise ValueError(problem)
    return fn


def check_environment(key: str, entry: str) -> Callable:
    """A factory: a class, or a function returning an environment. A function is called once to see what it makes
    (TRL probes one instance at start too)."""
    factory = find(key, entry)
    if not callable(factory):
        raise ValueError(f"{key} {entry!r} is a {type(factory).__name__}, not a class or a function that returns an environment")
    if inspect.isclass(factory):
        cls = factory
    else:
        try:
            cls = type(factory())
        except Exception as e:
            raise ValueError(f"{key} {entry!r}: calling the factory raised {type(e).__name__}: {e}") from None
    if not callable(getattr(cls, "reset", None)):
        raise ValueError(f"{key} {entry!r}: {cls.__name__} has no reset(**row) method; TRL calls it at every episode's start")
    tools = tool_methods(cls)
    if not tools:
        raise ValueError(
            f"{key} {entry!r}: {cls.__name__} has no public method besides {' and '.join(RESERVED)}; its public methods are the model's tools"
        )
    for name in tools:
        problem = _schema_problem(getattr(cls, name), f"{key} {entry!r}: method {cls.__name__}.{name}")
        if problem:
            raise ValueError(problem)
    return factory


def check_rollout_func(entry: str) -> Callable:
    fn = find("trainer.rollout_func", entry)
    if inspect.isclass(fn) or not callable(fn):
        raise ValueError(
            f"trainer.rollout_func {entry!r} is a {type(fn).__name__}, not a function rollout_func(prompts, trainer)"
        )
    try:
        inspect.signature(fn).bind([], None)
    except TypeError:
        raise ValueError(f"trainer.rollout_func {entry!r} does not take (prompts, trainer), as TRL calls it") from None
    except ValueError:  # no signature to read (a builtin): TRL will find out
        pass
    return fn


def environments(environment: str | dict[str, str]) -> dict[str, str]:
    """trainer.environment as {config key: entry}."""
    if isinstance(environment, dict):
        return {f"trainer.environment.{name}": entry for name, entry in environment.items()}
    return {"trainer.environment": environment} if environment else {}


def problems(tools: list[str], environment: str | dict[str, str], rollout_func: str) -> list[str]:
    """Each entry that cannot be resolved, as one line naming the config key and the fix."""
    out = []
    checks: list[tuple[Callable[..., Any], tuple[str, ...]]] = [(check_tool, (e,)) for e in tools]
    checks += [(check_environment, (k, e)) for k, e in environments(environment).items()]
    if rollout_func:
        checks.append((check_rollout_func, (rollout_func,)))
    for check, args in checks:
        try:
            check(*args)
        except ValueError as e:
            out.append(str(e))
    return out


@dataclass
class Agents:
    """What GRPOTrainer takes (tools=, environment_factory=, rollout_func=), every tool call bounded."""

    tools: list[Callable] | None = None
    environment_factory: Callable | dict[str, Callable] | None = None
    rollout_func: Callable | None = None

    def trainer_kwargs(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if v}


def resolve(tools: list[str], environment: str | dict[str, str], rollout_func: str, tool_timeout_s: float) -> Agents:
    tool_fns = [with_deadline(check_tool(e), tool_timeout_s) for e in tools]
    factories = {
        k: environment_with_deadlines(check_environment(k, e), tool_timeout_s) for k, e in environments(environment).items()
    }
    factory: Callable | dict[str, Callable] | None = None
    if isinstance(environment, dict):
        factory = {k.removeprefix("trainer.environment."): f for k, f in factories.items()}
    elif factories:
        factory = next(iter(factories.values()))
    return Agents(
        tools=tool_fns or None,
        environment_factory=factory,
        rollout_func=check_rollout_func(rollout_func) if rollout_func else None,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer.agents.resolve")
    ap.add_argument("--tool", action="append", default=[])
    ap.add_argument("--environment", action="append", default=[], help="pkg.mod:factory, or name=pkg.mod:factory (repeat)")
    ap.add_argument("--rollout-func", default="")
    a = ap.parse_args(argv)
    named = [e.partition("=") for e in a.environment]
    env: str | dict[str, str] = (
        {n: e for n, _, e in named} if any(sep for _, sep, _ in named) else (a.environment[0] if a.environment else "")
    )
    found = problems(a.tool, env, a.rollout_func)
    # the last stdout line is the JSON list of problems (the modules' own imports may print before it)
    print(json.dumps(found), flush=True)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
