"""Rewards: built-ins for the synthetic task a tiny random model learns in tens of CPU steps, and user
rewards by dotted path 'pkg.module:function' (TRL's signature: f(completions, **kwargs) -> list[float])."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def _text(c) -> str:
    # TRL passes strings for plain prompts and [{"role": ..., "content": ...}] for conversational ones
    return c if isinstance(c, str) else "".join(m.get("content", "") for m in c)


def letter_a_fraction(completions, **kwargs) -> list[float]:
    """Fraction of the completion's characters that are the letter 'a' (0..1): learnable from scratch."""
    out = []
    for c in completions:
        t = _text(c)
        out.append(t.count("a") / max(1, len(t)))
    return out


def short_completion(completions, **kwargs) -> list[float]:
    """1 / (1 + characters / 32): prefers short answers; a second, competing signal for tests."""
    return [1.0 / (1.0 + len(_text(c)) / 32) for c in completions]


BUILTIN: dict[str, Callable] = {"letter_a_fraction": letter_a_fraction, "short_completion": short_completion}


def resolve(name: str) -> Callable:
    if name in BUILTIN:
        return BUILTIN[name]
    if ":" not in name:
        raise ValueError(f"reward {name!r} is not built in ({', '.join(BUILTIN)}) and not a 'pkg.module:function' path")
    mod_name, _, fn_name = name.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(
            f"reward {name!r}: cannot import module {mod_name!r} ({e}); is it on PYTHONPATH on every node?"
        ) from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise ValueError(f"reward {name!r}: module {mod_name!r} has no function {fn_name!r}")
    return fn
