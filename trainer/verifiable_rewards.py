"""Verifiable rewards ready to name in trainer.reward_funcs (TRL's signature: f(prompts, completions, **kwargs), the
dataset's other columns as keyword arguments, one float per completion):

- math_accuracy: 1.0 if the completion's final answer equals the row's `solution` column (math_verify: numbers,
  fractions, LaTeX, \\boxed{}), else 0.0; None for a row whose solution does not parse (TRL then leaves the row out
  of the reward). Needs `pip install 'slurm-grpo[math]'`.
- think_answer_format: 1.0 for `<think>...</think><answer>...</answer>` and nothing after (the opening <think> may
  come from the prompt's template), else 0.0.
- boxed_format: 1.0 if the completion holds one non-empty \\boxed{...} with balanced braces, else 0.0.

Garbage completions score 0.0, never raise: a parse error or timeout on one completion is that completion's 0.
"""

from __future__ import annotations

import logging
import re
import threading

from trainer.rewards import completion_text

ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
THINK_ANSWER = re.compile(
    r"^\s*(?:<think>)?(?:(?!<think>|</think>).)*</think>\s*<answer>((?:(?!<answer>|</answer>).)+)</answer>\s*$", re.DOTALL
)
MAX_ANSWER_CHARS = 2000
"""The tail of a completion math_verify reads when it has no <answer> tag: a final answer is at the end, and parsing
cost grows with the text (a runaway completion must not stall the step)."""
PARSE_TIMEOUT_S, VERIFY_TIMEOUT_S = 5, 5
"""math_verify's own timeouts (signal.alarm, so only in the main thread: TRL's accuracy_reward does the same)."""


def final_answer(text: str) -> str:
    """The last <answer>...</answer> block's content, else the completion's tail."""
    tags = ANSWER_TAG.findall(text)
    return tags[-1] if tags else text[-MAX_ANSWER_CHARS:]


def math_accuracy(prompts, completions, solution, **kwargs) -> list[float | None]:
    """1.0 where the completion's final answer is mathematically equal to `solution` (math_verify), else 0.0."""
    try:
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
    except ImportError:
        raise ImportError("reward math_accuracy needs math_verify: pip install 'slurm-grpo[math]'") from None
    main = threading.current_thread() is threading.main_thread()
    parse_s, verify_s = (PARSE_TIMEOUT_S, VERIFY_TIMEOUT_S) if main else (None, None)
    if not main:  # math_verify warns at every call that its timeouts are off; that is known here
        logging.getLogger("math_verify").setLevel(logging.ERROR)
    # boxed first, then LaTeX, then a plain expression ("The answer is 42."): small models rarely write LaTeX
    config = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    out: list[float | None] = []
    for completion, gold_text in zip(completions, solution, strict=True):
        try:
            gold = parse(str(gold_text), extraction_config=config, parsing_timeout=parse_s)
        except Exception:
            gold = []
        if not gold:
            out.append(None)  # the data's fault, not the completion's: TRL leaves the row out
            continue
        try:
            answer = parse(final_answer(completion_text(completion)), extraction_config=config, parsing_timeout=parse_s)
            out.append(float(bool(answer) and verify(gold, answer, timeout_seconds=verify_s)))
        except Exception:  # math_verify on adversarial text: a timeout, a sympy error; the completion scores 0
            out.append(0.0)
    return out


def think_answer_format(prompts, completions, **kwargs) -> list[float]:
    """1.0 for '<think>reasoning</think><answer>answer</answer>' (whitespace between and around; a non-blank answer),
    else 0.0."""
    found = [THINK_ANSWER.match(completion_text(c)) for c in completions]
    return [float(m is not None and bool(m.group(1).strip())) for m in found]


def boxed_format(prompts, completions, **kwargs) -> list[float]:
    """1.0 if the completion holds exactly one non-empty \\boxed{...} whose braces balance, else 0.0."""
    return [float(_boxed_count(completion_text(c)) == 1) for c in completions]


def _boxed_count(text: str) -> int:
    count, start = 0, 0
    while (i := text.find("\\boxed{", start)) >= 0:
        depth, j = 1, i + len("\\boxed{")
        while j < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            j += 1
        if depth or not text[i + len("\\boxed{") : j - 1].strip():
            return 0  # unbalanced or empty: not an answer
        count, start = count + 1, j
    return count
