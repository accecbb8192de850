"""A prefix-cache reset whose cost follows the blocks that hold a cached hash, not the KV cache's size (issue 37).

Every push ends with POST /reset_prefix_cache (KV computed under the old weights must not serve a new request). vLLM
0.32's BlockPool.reset_prefix_cache empties its hash map and then calls reset_hash() on every block of the pool: a
small model at 35% of an H200 has millions of blocks, and that Python loop took 0.42-0.70 s of every push on the
agents runs, however few blocks the step had cached.

Why resetting only the blocks in the hash map leaves the same state: in vLLM 0.32 the one caller of
KVCacheBlock.set_block_hash is BlockPool._insert_block_hash, which puts the block into cached_block_hash_to_block
under that hash in the same call; the one place that takes a (hash, block) entry out of the map,
BlockPool._remove_cached_block_hashes, resets that block's hash in the same call. So a block with a hash is always in
the map, and every other block's reset_hash() is a no-op. The reset below does everything else vLLM's does, in the
same order (refuse while blocks are in use, new map, reuse watchers, metrics, log line, AllBlocksCleared event).
tests/unit/test_prefix_reset.py compares the two resets on vLLM's real classes after one history of allocations,
prefix hits, decoding, evictions, partial-block entries and moved hashes; bench/prefix_reset.py times them.

install() leaves vLLM's own reset in place, with one warning in the server's log naming what changed, when one of the
vLLM functions this reasoning reads is not the code it was checked against (a digest of each one's tokens, comments
and layout ignored): another vLLM keeps a correct reset (only its cost grows with the cache again) until someone
re-reads the reasoning against it; it never runs a shortcut that may leave stale hashes behind.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import io
import textwrap
import tokenize
from collections.abc import Callable
from typing import Any

PINNED = {
    "block_pool.BlockPool": "9c0bbfd67052a729",  # the whole class: no new method of it may take a hash out of the map
    "block_pool.BlockPool.reset_prefix_cache": "beb031cfefce6849",
    "block_pool.BlockPool._insert_block_hash": "45ff1d7e62599458",
    "block_pool.BlockPool._remove_cached_block_hashes": "31673e014fecf499",
    "block_pool.BlockHashToBlockMap": "684ab65733867c11",
    "kv_cache_utils.KVCacheBlock": "0e0c186b22362b78",
}
"""The vLLM code (under vllm.v1.core) the reasoning above reads, and the code_digest of the version it was checked
against (vLLM 0.32.0; the CPU and CUDA wheels ship the same files). tests/unit/test_prefix_reset.py also checks, over
the whole vLLM tree, that no other code sets a block's hash."""


def code_digest(obj: Callable[..., Any] | type) -> str:
    """A digest of an object's code tokens: the same for the same code whatever its comments, layout or string texts
    (docstrings, log messages), and the same on Python 3.11 and 3.12+ (which splits f-strings into several tokens)."""
    return source_digest(inspect.getsource(obj))


def source_digest(source: str) -> str:
    """code_digest of a piece of source text."""
    layout = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    f_start, f_end = getattr(tokenize, "FSTRING_START", -1), getattr(tokenize, "FSTRING_END", -1)
    words, in_fstring = [], 0
    for t in tokenize.generate_tokens(io.StringIO(textwrap.dedent(source)).readline):
        in_fstring += (t.type == f_start) - (t.type == f_end)
        if t.type == f_end and not in_fstring or t.type == tokenize.STRING and not in_fstring:
            words.append("<str>")
        elif not in_fstring and t.type not in layout:
            words.append(t.string)
    return hashlib.sha256(" ".join(words).encode()).hexdigest()[:16]


def changed_internals() -> list[str]:
    """What of the pinned vLLM code differs from what this module was checked against, one line each (empty: none)."""
    changed = []
    for name, digest in PINNED.items():
        module, *attrs = name.split(".")
        obj: Any = importlib.import_module(f"vllm.v1.core.{module}")
        try:
            for attr in attrs:
                obj = getattr(obj, attr)
        except AttributeError:
            changed.append(f"vllm.v1.core.{name} is gone")
            continue
        if (now := code_digest(obj)) != digest:
            changed.append(f"vllm.v1.core.{name} changed (digest {now}, checked {digest})")
    return changed


def hashed_blocks(pool: Any) -> list[Any]:
    """Every block in pool's prefix-cache map (a key maps to one block or to a {block_id: block} dict), once each."""
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    seen: dict[int, Any] = {}
    for entry in pool.cached_block_hash_to_block._cache.values():
        if isinstance(entry, KVCacheBlock):
            seen[entry.block_id] = entry
        else:
            seen.update(entry)
    return list(seen.values())


def reset_prefix_cache(self: Any) -> bool:
    """BlockPool.reset_prefix_cache of vLLM 0.32 with its walk over every block replaced by one over the blocks of
    the hash map (this module's docstring says why that is the same)."""
    from vllm.distributed.kv_events import AllBlocksCleared
    from vllm.v1.core import block_pool

    num_used_blocks = self.num_gpu_blocks - self.get_num_free_blocks()
    if num_used_blocks != 1:  # The null block is always marked as used
        block_pool.logger.warning("Failed to reset prefix cache because some blocks (%d) are not freed yet", num_used_blocks - 1)
        return False
    hashed = hashed_blocks(self)
    self.cached_block_hash_to_block = block_pool.BlockHashToBlockMap()
    self.cached_block_hashes_by_block.clear()
    if self._reuse_watchers:
        self._notify_reuse([self.blocks[block_id] for block_id in list(self._reuse_watchers)])
    for block in hashed:
        block.reset_hash()
    if self.metrics_collector:
        self.metrics_collector.reset()
    block_pool.logger.info("Successfully reset prefix cache")
    if self.enable_kv_cache_events:
        self.kv_event_queue.append(AllBlocksCleared())
    return True


def install() -> bool:
    """Replace vLLM's BlockPool.reset_prefix_cache (idempotent) and say True; if vLLM is not the code this was checked
    against, keep vLLM's own (correct, its cost the cache's size), warn naming what changed, and say False."""
    import vllm
    from vllm.v1.core import block_pool
    from vllm.v1.core.block_pool import BlockPool

    if getattr(BlockPool.reset_prefix_cache, "_slurm_grpo", False):
        return True
    if changed := changed_internals():
        block_pool.logger.warning(
            "slurm-grpo vLLM plugin: vLLM %s is not the code trainer/push/prefix_reset.py was checked against (%s): "
            "keeping vLLM's own prefix-cache reset, whose cost grows with the KV cache (re-read the reasoning, then "
            "update PINNED)",
            vllm.__version__,
            "; ".join(changed),
        )
        return False
    patched = reset_prefix_cache
    patched._slurm_grpo = True  # type: ignore[attr-defined]
    patched.__wrapped__ = BlockPool.reset_prefix_cache  # type: ignore[attr-defined]
    BlockPool.reset_prefix_cache = patched  # type: ignore[method-assign]
    return True
