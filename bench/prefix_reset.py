"""vLLM's prefix-cache reset against slurm-grpo's (trainer/push/prefix_reset.py), side by side on vLLM's real BlockPool
(CPU, no server, no model): the reset every push ends with.

    python -m bench.prefix_reset [--blocks 200000 2000000] [--cached 0 2048] [--repeats 5] [--out results.json]

For each pool size (--blocks: the KV cache's blocks; vLLM's log says "GPU KV cache size: N tokens", N / 16 blocks) and
each number of blocks the step left cached (--cached; 2048 = 32 completions x 1024 tokens at 16 tokens a block), caches
that many blocks of one request, frees them, and times one reset; the median of --repeats, for each reset on the same
pool. vLLM's walks every block of the pool, ours the cached ones only (tests/unit/test_prefix_reset.py shows the two
leave the same state). Timings, not a pass/fail: the figures depend on the CPU (the reset runs in vLLM's engine core,
one Python thread).
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.run import write_results

BLOCK = 16


def time_resets(num_blocks: int, cached: int, repeats: int) -> dict:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from trainer.push import prefix_reset

    init_none_hash(sha256)
    vllms = getattr(BlockPool.reset_prefix_cache, "__wrapped__", BlockPool.reset_prefix_cache)
    t0 = time.perf_counter()
    pool = BlockPool(num_blocks, enable_caching=True, hash_block_size=BLOCK)
    build_s = time.perf_counter() - t0
    hasher = get_request_block_hasher(BLOCK, sha256)
    request = Request("bench", list(range(cached * BLOCK)), SamplingParams(), None, block_hasher=hasher)
    seconds: dict[str, list[float]] = {"vllm": [], "ours": []}
    for _ in range(repeats):
        for name, reset in (("vllm", vllms), ("ours", prefix_reset.reset_prefix_cache)):
            blocks = pool.get_new_blocks(cached)  # the step's KV, cached, then freed when its requests finish
            pool.cache_full_blocks(request, blocks, 0, cached, BLOCK, 0)
            pool.free_blocks(reversed(blocks))
            assert len(pool.cached_block_hash_to_block) == cached
            t0 = time.perf_counter()
            assert reset(pool)
            seconds[name].append(time.perf_counter() - t0)
    vllm_s, ours_s = statistics.median(seconds["vllm"]), statistics.median(seconds["ours"])
    return {
        "blocks": num_blocks,
        "cached_blocks": cached,
        "vllm_reset_s": round(vllm_s, 6),
        "ours_reset_s": round(ours_s, 6),
        "speedup": round(vllm_s / ours_s, 1) if ours_s else None,
        "pool_build_s": round(build_s, 2),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, nargs="+", default=[200_000, 2_000_000], help="the pool sizes (KV cache blocks)")
    ap.add_argument("--cached", type=int, nargs="+", default=[0, 2048], help="blocks the step left cached")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args(argv)
    from trainer.push import prefix_reset

    if changed := prefix_reset.changed_internals():  # the plugin would refuse this vLLM: say so before timing
        raise SystemExit(f"trainer/push/prefix_reset.py was not checked against this vLLM: {'; '.join(changed)}")
    rows = []
    print(f"{'blocks':>10} {'cached':>7} {'vLLM reset s':>13} {'ours s':>10} {'speedup':>8}")
    for n in args.blocks:
        for cached in args.cached:
            row = time_resets(n, cached, args.repeats)
            rows.append(row)
            print(
                f"{row['blocks']:>10} {row['cached_blocks']:>7} {row['vllm_reset_s']:>13.4f} {row['ours_reset_s']:>10.6f} "
                f"{row['speedup'] if row['speedup'] is not None else '-':>7}x",
                flush=True,
            )
    write_results(args.out, {"rows": rows})


if __name__ == "__main__":
    main()
