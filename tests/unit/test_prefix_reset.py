"""trainer/push/prefix_reset.py against vLLM's real classes (CPU, no server): after the same history, its reset leaves
every block, the free queue, the hash maps, the reuse watchers and the KV events exactly as vLLM's own reset does,
and the next allocations after it go the same way; a vLLM whose code it was not checked against is refused."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from trainer.push import prefix_reset  # noqa: E402

VLLMS_RESET = getattr(BlockPool.reset_prefix_cache, "__wrapped__", BlockPool.reset_prefix_cache)
BLOCK = 4


@pytest.fixture(autouse=True)
def _none_hash():
    init_none_hash(sha256)  # a fixed seed: both pools' hashes (and their events) are the same bytes


def state(pool: BlockPool) -> dict[str, Any]:
    """Everything a reset may touch, comparable between two pools."""
    cache = {k: sorted(v) if isinstance(v, dict) else [v.block_id] for k, v in pool.cached_block_hash_to_block._cache.items()}
    return {
        "blocks": [(b.block_id, b.ref_cnt, b.block_hash, b.block_hash_num_tokens, b.is_null) for b in pool.blocks],
        "free_queue": [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],  # in eviction order
        "num_free": pool.get_num_free_blocks(),
        "cache": cache,
        "by_block": {k: sorted(v) for k, v in pool.cached_block_hashes_by_block.items()},
        "watchers": sorted(pool._reuse_watchers),
        "events": [repr(e) for e in pool.take_events()],
    }


def manager(num_blocks: int) -> KVCacheManager:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float32)
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    return KVCacheManager(
        config, max_model_len=256, scheduler_block_size=BLOCK, hash_block_size=BLOCK, enable_kv_cache_events=True
    )


def grpo_steps(m: KVCacheManager, seed: int, steps: int = 2, leave_running: bool = False) -> list[Request]:
    """GRPO-like traffic: prompts sharing a system prefix, 4 completions each (prefix hits), decoded token by token;
    a request that finds no free block is dropped (the pool is small, so cached blocks get evicted and reused)."""
    rng, hasher, running = random.Random(seed), get_request_block_hasher(BLOCK, sha256), []
    for step in range(steps):
        for p in range(3):
            prompt = [7, 8, 9, 10, 11, 12] + [rng.randrange(100) for _ in range(rng.randrange(3, 14))]
            for g in range(4):
                r = Request(f"s{seed}-{step}-{p}-{g}", prompt, SamplingParams(max_tokens=32), None, block_hasher=hasher)
                hit, n_hit, _ = m.get_computed_blocks(r)
                if m.allocate_slots(r, r.num_tokens - n_hit, n_hit, hit) is None:
                    continue
                r.num_computed_tokens = r.num_tokens
                running.append(r)
                for _ in range(rng.randrange(0, 12)):
                    r.append_output_token_ids(rng.randrange(100))
                    if m.allocate_slots(r, 1) is None:
                        break
                    r.num_computed_tokens += 1
        for r in running[: len(running) - (2 if leave_running and step == steps - 1 else 0)]:
            m.free(r)
        running = running[len(running) - 2 :] if leave_running and step == steps - 1 else []
    return running


def test_same_state_as_vllms_reset_after_generation_traffic():
    ours, theirs = manager(40), manager(40)
    for m in (ours, theirs):
        running = grpo_steps(m, seed=1, leave_running=True)
    pools = ours.block_pool, theirs.block_pool
    assert state(pools[0]) == state(pools[1])  # the same history
    assert sum(b.block_hash is not None for b in pools[0].blocks) > 10 and len(pools[0].cached_block_hash_to_block) > 10

    # blocks still in use: both refuse and change nothing
    assert running and prefix_reset.reset_prefix_cache(pools[0]) is False and VLLMS_RESET(pools[1]) is False
    assert state(pools[0]) == state(pools[1])
    for m in (ours, theirs):
        for r in running:
            m.free(r)

    assert prefix_reset.reset_prefix_cache(pools[0]) is True and VLLMS_RESET(pools[1]) is True
    after = state(pools[0])
    assert after == state(pools[1])
    assert all(b[2] is None for b in after["blocks"]) and not after["cache"] and "AllBlocksCleared()" in after["events"]
    # and after the reset both pools hand out the same blocks and cache the same way
    for m in (ours, theirs):
        grpo_steps(m, seed=2)
    assert state(pools[0]) == state(pools[1])


def test_same_state_with_duplicate_partial_and_moved_entries():
    """The hash map's rarer shapes: one hash held by two blocks (a dict entry), a block with a second (partial-block)
    hash in cached_block_hashes_by_block, hashes moved to a copy, and an unpinned block with a reuse watcher."""
    hasher, pools, notified = get_request_block_hasher(BLOCK, sha256), [], []
    for tag in ("ours", "theirs"):
        pool = BlockPool(24, enable_caching=True, hash_block_size=BLOCK, enable_kv_cache_events=True)
        twins = [Request(f"{tag}{i}", list(range(1, 21)), SamplingParams(), None, block_hasher=hasher) for i in range(2)]
        held = []
        for r in twins:  # the same 20 tokens in two sets of blocks of 8 tokens: each full block's hash twice
            blocks = pool.get_new_blocks(3)
            pool.cache_full_blocks(r, blocks, 0, 2, block_size=2 * BLOCK, kv_cache_group_id=0)
            held.append(blocks)
        pool.cache_partial_block(twins[0], held[0][2], 20, 0, 2 * BLOCK)  # a partial entry as a block's first hash
        pool.cache_partial_block(twins[0], held[0][1], 12, 0, 2 * BLOCK)  # ... and as a full block's second one
        copy = pool.get_new_blocks(1)[0]
        pool.move_block_hashes(held[1][0], copy)
        pool.unpin_blocks([copy], on_reuse=lambda b, tag=tag: notified.append((tag, b.block_id)))
        for blocks in held:
            pool.free_blocks(reversed(blocks))
        pools.append(pool)
    assert state(pools[0]) == state(pools[1])
    assert any(isinstance(v, dict) for v in pools[0].cached_block_hash_to_block._cache.values())
    assert pools[0].cached_block_hashes_by_block and pools[0]._reuse_watchers

    assert prefix_reset.reset_prefix_cache(pools[0]) is True and VLLMS_RESET(pools[1]) is True
    assert state(pools[0]) == state(pools[1])
    assert sorted(b for t, b in notified if t == "ours") == sorted(b for t, b in notified if t == "theirs") != []
    assert all(b.block_hash is None for b in pools[0].blocks)


def test_install_patches_once_and_keeps_vllms_reset_for_changed_vllm_code(monkeypatch, caplog):
    monkeypatch.setattr(BlockPool, "reset_prefix_cache", VLLMS_RESET)
    assert prefix_reset.changed_internals() == []
    assert prefix_reset.install() is True
    assert prefix_reset.install() is True
    assert BlockPool.reset_prefix_cache is prefix_reset.reset_prefix_cache
    assert BlockPool.reset_prefix_cache.__wrapped__ is VLLMS_RESET  # type: ignore[attr-defined]

    monkeypatch.setattr(BlockPool, "reset_prefix_cache", VLLMS_RESET)
    monkeypatch.setitem(prefix_reset.PINNED, "block_pool.BlockPool._insert_block_hash", "0" * 16)
    from vllm.v1.core import block_pool

    warned: list[str] = []
    monkeypatch.setattr(block_pool.logger, "warning", lambda msg, *a: warned.append(msg % a))
    assert prefix_reset.install() is False
    assert BlockPool.reset_prefix_cache is VLLMS_RESET  # the correct reset stays
    assert len(warned) == 1 and "vllm.v1.core.block_pool.BlockPool._insert_block_hash changed" in warned[0], warned


def test_the_digest_ignores_layout_comments_and_strings_but_not_code():
    code = "def f(x):\n    return g(x, 1)\n"
    same = '    def f( x ):  # why\n\n        """doc"""\n        return g(x,\n                 1)\n'
    assert prefix_reset.source_digest(code) == prefix_reset.source_digest(same.replace('"""doc"""\n        ', ""))
    assert prefix_reset.source_digest('def f():\n    log(f"a {x}")\n') == prefix_reset.source_digest('def f():\n    log("b")\n')
    assert prefix_reset.source_digest(code) != prefix_reset.source_digest(code.replace("1", "2"))


def test_no_other_vllm_code_sets_a_block_hash():
    """The reasoning's premise over the whole vLLM tree: set_block_hash is called in BlockPool._insert_block_hash
    only, and nothing but KVCacheBlock itself assigns its hash fields."""
    root = Path(vllm.__file__).parent
    calls, writes = [], []
    for path in root.rglob("*.py"):
        text = path.read_text(errors="replace")
        rel = str(path.relative_to(root))
        calls += [rel] * text.count(".set_block_hash(")
        if rel != "v1/core/kv_cache_utils.py" and ("._block_hash =" in text or "._block_hash_num_tokens =" in text):
            writes.append(rel)
    assert calls == ["v1/core/block_pool.py"] and not writes, (calls, writes)
