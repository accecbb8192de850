"""pass@k and mean@k of an evaluation, from each prompt's k summed rewards (pure arithmetic, no torch).

pass@j is the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on Code", eq. 1): with
n completions of a prompt of which c pass, the chance that j of them drawn without replacement hold at least one pass,
1 - C(n-c, j) / C(n, j), averaged over the prompts. It is reported for j = 1, 2, 4, ... and n itself: pass@1 is the
mean pass rate, pass@n the fraction of prompts with any pass. `shard` is each rank's share of the prompts."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def pass_at(n: int, c: int, j: int) -> float:
    """1 - C(n-c, j) / C(n, j), as a product (no huge binomials): the chance that j of the n completions, c of which
    pass, hold at least one pass."""
    if not (0 <= c <= n and 1 <= j <= n):
        raise ValueError(f"pass@{j} needs 0 <= passes <= samples and 1 <= j <= samples; got {c} passes of {n}")
    if n - c < j:  # every draw of j holds a pass
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - j / i
    return 1.0 - miss


def reported_ks(n: int) -> list[int]:
    """The j pass@j is reported for: powers of two below n, and n."""
    out, j = [], 1
    while j < n:
        out.append(j)
        j *= 2
    return out + [n]


def summed(values: Sequence[float | None]) -> float | None:
    """One completion's rewards from each function, summed as TRL sums them (a None, "does not apply", adds nothing);
    None when no function applies (math_accuracy on an unparsable solution): no reward, so neither a pass nor a fail."""
    scored = [v for v in values if v is not None and not math.isnan(v)]
    return float(sum(scored)) if scored else None


def scored_prompts(per_prompt: dict[int, list[float | None]]) -> tuple[dict[int, list[float]], int]:
    """(the prompts every completion of which has a reward, how many prompts were left out). A prompt with an unscored
    completion is left out whole: pass@j's estimator needs the same k completions of every prompt, and counting a
    missing reward as 0 would make it a failure (TRL leaves None rewards out of its means too)."""
    kept = {i: [v for v in r if v is not None] for i, r in per_prompt.items() if all(v is not None for v in r)}
    return kept, len(per_prompt) - len(kept)


@dataclass(frozen=True)
class Scores:
    pass_at: dict[int, float]
    mean_at_k: float
    reward_std: float


def score(per_prompt: Sequence[Sequence[float]], threshold: float) -> Scores:
    """per_prompt: each prompt's summed rewards, one per completion (the same number k for every prompt)."""
    if not per_prompt:
        raise ValueError("no eval prompt was scored")
    n = len(per_prompt[0])
    if n == 0 or any(len(r) != n for r in per_prompt):
        raise ValueError(f"every eval prompt needs the same number of completions; got {sorted({len(r) for r in per_prompt})}")
    passes = [sum(r >= threshold for r in rewards) for rewards in per_prompt]
    flat = [r for rewards in per_prompt for r in rewards]
    mean = sum(flat) / len(flat)
    return Scores(
        pass_at={j: sum(pass_at(n, c, j) for c in passes) / len(passes) for j in reported_ks(n)},
        mean_at_k=sum(sum(r) / n for r in per_prompt) / len(per_prompt),
        reward_std=math.sqrt(sum((r - mean) ** 2 for r in flat) / len(flat)),
    )


def shard(count: int, world: int, rank: int) -> range:
    """This rank's share of `count` eval prompts: contiguous blocks in rank order, the first count % world ranks one
    longer (a node's ranks are consecutive, so each node's share is one block too; a set smaller than the world
    leaves the last ranks none)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a world of {world}")
    base, extra = divmod(count, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))
