"""Rewards: built-ins (the synthetic task a tiny random model learns in tens of CPU steps here; the verifiable math
and format rewards in trainer/verifiable_rewards.py), and user rewards by dotted path 'pkg.module:function' (TRL's
signature: f(prompts, completions, **kwargs) -> list[float], the dataset's other columns as keyword arguments).

`resolve` wraps every reward so that one which raises names itself in the error the run stops with:
"reward 'pkg.mod:fn' raised ValueError at step 2 on node 0: ...", the function's own frames below it.

    python -m trainer.rewards pkg.mod:fn ...   resolve each as the trainer does; print the problems (slurm-grpo local)
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

from launcher.core import reward_check
from launcher.core.jobdir import Env

NODE_ENV = Env.NODE
"""Set for the trainer ranks by launcher.node.commands: the node they run on."""


def completion_text(c) -> str:
    """A completion's text: TRL passes strings for plain prompts and [{"role": ..., "content": ...}] for conversational
    ones (content None for a message that only calls tools)."""
    return c if isinstance(c, str) else "".join(m.get("content") or "" for m in c)


def letter_a_fraction(completions, **kwargs) -> list[float]:
    """Fraction of the completion's characters that are the letter 'a' (0..1): learnable from scratch."""
    out = []
    for c in completions:
        t = completion_text(c)
        out.append(t.count("a") / max(1, len(t)))
    return out


def short_completion(completions, **kwargs) -> list[float]:
    """1 / (1 + characters / 32): prefers short answers; a second, competing signal for tests."""
    return [1.0 / (1.0 + len(completion_text(c)) / 32) for c in completions]


BUILTIN = reward_check.BUILTIN
"""Built-in name -> 'pkg.module:function' (launcher.core.reward_check owns the list: the submit checks read it too)."""


def import_module_of(label: str, mod_name: str) -> Any:
    """The module of a 'pkg.module:name' config entry (a reward, a tool, an environment, a rollout_func); ValueError
    starting with `label` (what the entry is) and saying the fix when it cannot be imported."""
    try:
        return importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"{label}: cannot import module {mod_name!r} ({e}); is it on PYTHONPATH on every node?") from None
    except Exception as e:  # the module itself is broken: a syntax error, an import-time failure
        first = str(e).splitlines()[0] if str(e) else ""
        raise ValueError(f"{label}: importing module {mod_name!r} raised {type(e).__name__}: {first}; fix the module") from None


class RewardError(RuntimeError):
    """A reward function raised. The first line names the reward, the exception, the step and the node (the node's
    bootstrap shows it as the trainer's root cause); the lines after it are the reward's own traceback."""

    def __init__(self, message: str, original: BaseException):
        super().__init__(message)
        self.original = original


def _find(name: str) -> Callable:
    if ":" not in name and name not in BUILTIN:
        raise ValueError(f"reward {name!r} is not built in ({', '.join(BUILTIN)}) and not a 'pkg.module:function' path")
    mod_name, _, fn_name = BUILTIN.get(name, name).partition(":")
    mod = import_module_of(f"reward {name!r}", mod_name)
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise ValueError(f"reward {name!r}: module {mod_name!r} has no function {fn_name!r}")
    return fn


def _failure(name: str, node: str | None, e: Exception, kwargs: dict[str, Any]) -> RewardError:
    # TRL passes its TrainerState; global_step counts the finished steps, so the step being scored is the next one
    # (metrics.jsonl's numbering, whose first step is 1)
    done = getattr(kwargs.get("trainer_state"), "global_step", None)
    where = (f" at step {done + 1}" if isinstance(done, int) else "") + (f" on node {node}" if node is not None else "")
    text = str(e).splitlines()[0] if str(e) else "(no message)"
    frames = traceback.format_tb(e.__traceback__.tb_next if e.__traceback__ else None)  # from the reward's own frame down
    tb = "".join(frames).rstrip()
    return RewardError(
        f"reward {name!r} raised {type(e).__name__}{where}: {text}" + (f"\n  the reward's traceback:\n{tb}" if tb else ""), e
    )


def resolve(name: str, node: int | str | None = None) -> Callable:
    """The reward function for a config entry (a built-in name or 'pkg.module:function'), wrapped so that an
    exception it raises becomes a RewardError naming it, the step and the node. ValueError if it cannot be found.
    node: the node named in that error; default $SLURM_GRPO_NODE (the trainer ranks'), else none."""
    fn = _find(name)
    where = str(node) if node is not None else os.environ.get(NODE_ENV)
    # raise ... from None: the traceback's first exception line is then the named one, which the bootstrap's
    # root_cause reports; the reward's own frames are in the message
    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__):

        async def named_async(*args, **kwargs):
            try:
                return await fn(*args, **kwargs)
            except Exception as e:
                raise _failure(name, where, e, kwargs) from None

        wrapper: Callable = named_async
    else:

        def named(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except Exception as e:
                raise _failure(name, where, e, kwargs) from None

        wrapper = named
    functools.update_wrapper(wrapper, fn)  # TRL names its reward metrics by __name__ (rewards/<name>/mean)
    if not hasattr(fn, "__name__"):  # a callable instance: TRL would name it by its class
        wrapper.__name__ = type(fn).__name__
    return wrapper


def params_of(fn: Callable) -> list[reward_check.Param] | None:
    """The parameters TRL's call binds to (a callable instance: its __call__'s); None if Python cannot tell."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    kinds = {
        inspect.Parameter.POSITIONAL_ONLY: "positional-only",
        inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional",
        inspect.Parameter.KEYWORD_ONLY: "keyword-only",
        inspect.Parameter.VAR_POSITIONAL: "*args",
        inspect.Parameter.VAR_KEYWORD: "**kwargs",
    }
    return [
        reward_check.Param(
            p.name, kinds[p.kind], p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        )
        for p in sig.parameters.values()
    ]


def problems(names: list[str]) -> list[str]:
    """Each reward that `resolve` cannot find, or whose signature TRL's call would not fit, as one line naming the
    config key and the fix."""
    out = []
    for name in names:
        try:
            fn = _find(name)
        except ValueError as e:
            out.append(f"trainer.reward_funcs: {e}")
            continue
        params = params_of(fn)
        if params is not None:
            out += reward_check.signature_problems(name, params)[0]
    return out


if __name__ == "__main__":
    # the last stdout line is the JSON list of problems (the module's own imports may print before it)
    found = problems(sys.argv[1:])
    print(json.dumps(found), flush=True)
    sys.exit(1 if found else 0)
