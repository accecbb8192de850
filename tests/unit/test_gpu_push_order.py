"""The leader's half of the nccl weight push on one GPU, without NCCL: N1 and N3 of ../shared/GPU-AUDIT.md.

A world-1 FSDP2 Qwen2 (fp32 shards, bf16 gathers, every layer bigger than the bucket) is walked by the project's
`iter_unsharded_params` + `checked` and packed by vLLM 0.32's real producer (`packed_nccl_broadcast_producer`,
through `trainer.push.senders.nccl_broadcast_packed`, on a thread as in the push), with its two side streams. The
group is a stand-in for PyNccl whose broadcast keeps a clone of each chunk on the current stream; vLLM's real
consumer then cuts the captured chunks by the metadata and the test compares every tensor byte for byte with
the model's own `full_tensor()` in bf16. A delay is injected where a race would show:

  N1: `torch.cuda._sleep` before each unit's unshard finishes (FSDP's `wait_for_unshard`, patched: the library
      boundary), so a unit gathered under one producer stream and copied under the other is read before it
      is written;
  N3: an in-place update of every parameter enqueued behind `torch.cuda._sleep` on the caller's stream, with no
      sync before the push, as the optimizer leaves them.

Each scenario also runs with `order_streams=False` (the walk before the fix), where the same delay must corrupt
the push: the harness sees the race it guards against. The leader's reserved memory per stream after a push
(N6) is printed as `PUSH-ORDER {json}` lines (pytest -s). Needs a CUDA device: gpu/push_order.sh runs it on the
H200 with the pinned stack.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections import Counter
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

pytestmark = [
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA device (vLLM's packed producer runs on CUDA side streams); run gpu/push_order.sh on a GPU machine",
    ),
    pytest.mark.filterwarnings("ignore:Tensor .* exceeds buffer_size_bytes"),  # vLLM's: a tensor bigger than the bucket
]

BUCKET = 16 * 2**20  # bytes; a layer holds ~115 MiB in bf16, its MLP weights 32 MiB each: every layer spans 4 chunks
UNSHARD_DELAY_CYCLES = 10**8  # ~50 ms at the H200's clock, per unit
OPTIMIZER_DELAY_CYCLES = 4 * 10**8  # ~200 ms: longer than the whole push


def report(what: str, **figures) -> None:
    print("PUSH-ORDER " + json.dumps({"what": what, **figures}), flush=True)


def world_of_one_and_a_body():
    """(par, model): torch.distributed over NCCL on GPU 0 with one rank (a HashStore: no rendezvous), the trainer's
    Parallel on a world-1 shard mesh, and a random untied Qwen2 body (4 layers of a 2048-wide model, seed 0) on the GPU,
    not yet sharded (the LoRA test wraps it first)."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trainer.parallel import Parallel

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("shard",))
    cfg = Qwen2Config(  # type: ignore[call-arg]
        vocab_size=8192,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=4,
        num_attention_heads=32,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with device:
        model = Qwen2ForCausalLM(cfg)
    return Parallel(0, 0, 1, 0, dist.group.WORLD, [0], 0, mesh, device, {}), model  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def sharded():
    """(model, meta): a random untied Qwen2 body, FSDP2-sharded by the project's shard_model on a world-1 mesh."""
    from trainer.parallel import shard_model
    from trainer.push.gather import param_metadata

    par, model = world_of_one_and_a_body()
    shard_model(model, par, torch.bfloat16)
    meta = param_metadata(model, torch.bfloat16)
    push(model, meta, Discard(), order_streams=True)  # FSDP's lazy init and the producer's streams, once
    torch.cuda.synchronize()
    yield model, meta
    dist.destroy_process_group()


class KeepChunks:
    """PyNccl's stand-in on the sending side: broadcast(t, src) keeps a clone of the chunk, on the current stream
    (where PyNccl would enqueue the broadcast)."""

    def __init__(self) -> None:
        self.chunks: list[torch.Tensor] = []

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        assert src == 0
        self.chunks.append(tensor.clone())


class Discard:
    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        assert src == 0


def push(model, meta, group, order_streams: bool) -> None:
    """The leader's push as NcclSender runs it: the walk is made here (the caller's thread and stream), the
    producer runs on another thread with the device set."""
    from trainer.push.gather import iter_unsharded_params
    from trainer.push.senders import checked

    params = checked(iter_unsharded_params(model, torch.bfloat16, order_streams=order_streams), meta)
    produce_on_a_thread(group, params)


def produce_on_a_thread(group, params) -> None:
    """vLLM's packed producer over `params` on another thread with the device set, as NcclSender runs it; re-raises
    its error; 300 s deadline."""
    from trainer.push.senders import nccl_broadcast_packed

    errors: list[BaseException] = []

    def work() -> None:
        try:
            torch.cuda.set_device(0)
            nccl_broadcast_packed(group, params, BUCKET)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    t = threading.Thread(target=work, name="work /update_weights")
    t.start()
    t.join(timeout=300)
    assert not t.is_alive(), "the push did not finish within 300 s"
    if errors:
        raise errors[0]


def received(chunks: list[torch.Tensor], meta) -> dict[str, torch.Tensor]:
    """What vLLM's worker would load: its real packed consumer, cutting chunks by the metadata, fed the captured
    chunks by a group whose broadcast(buf) copies the next one into buf (their sizes must agree)."""
    from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_consumer

    from trainer.push.wire import chunk_metas

    feed = iter(chunks)

    class Replay:
        def broadcast(self, buf: torch.Tensor, src: int) -> None:
            sent = next(feed)
            assert sent.numel() == buf.numel(), f"chunk of {sent.numel()} B sent, the receiver cut {buf.numel()} B"
            buf.copy_(sent)

    got: dict[str, torch.Tensor] = {}
    wanted: Iterator = ((m.name, (m.shape, getattr(torch, m.dtype))) for m in meta)
    packed_nccl_broadcast_consumer(
        iterator=wanted,
        group=Replay(),
        src=0,
        post_unpack_func=lambda weights: got.update({n: t.clone() for n, t in weights}),
        buffer_size_bytes=BUCKET,
        num_buffers=2,
        device="cuda",
    )
    torch.cuda.synchronize()
    assert next(feed, None) is None, "the producer sent more chunks than the consumer cut"
    assert len(chunks) == len(list(chunk_metas(meta, BUCKET))) > 4 * 4
    return got


def mismatches(model, got: dict[str, torch.Tensor]) -> list[str]:
    """Parameters whose bytes differ from the model's own full_tensor() in bf16 (read after a device sync)."""
    torch.cuda.synchronize()
    bad = []
    for name, p in model.named_parameters():
        want = p.detach().full_tensor().to(torch.bfloat16).contiguous()
        have = got[name]
        if have.shape != want.shape or not torch.equal(have.view(torch.int16), want.view(torch.int16)):
            bad.append(name)
    return bad


def fresh_values(model, seed: int) -> None:
    """New random values in every shard (synced): bytes a stale read could return are no longer right."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_(0, 0.02)
    torch.cuda.synchronize()


@pytest.fixture
def slow_unshard(monkeypatch):
    """Each unit's gathered values land UNSHARD_DELAY_CYCLES late, on the stream the unshard runs on."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    wait = FSDPParamGroup.wait_for_unshard

    def late(self):
        torch.cuda._sleep(UNSHARD_DELAY_CYCLES)
        return wait(self)

    monkeypatch.setattr(FSDPParamGroup, "wait_for_unshard", late)


@pytest.mark.parametrize("order_streams", [True, False], ids=["ordered", "unordered-negative-control"])
def test_a_unit_gathered_on_one_producer_stream_is_read_complete_on_the_other(sharded, slow_unshard, order_streams):
    """N1: with vLLM's two producer streams and a unit's gather landing late, every tensor vLLM would load equals
    the model's, byte for byte; the walk without stream ordering loads stale bytes under the same delay."""
    model, meta = sharded
    fresh_values(model, seed=1 if order_streams else 2)
    group = KeepChunks()
    push(model, meta, group, order_streams)
    bad = mismatches(model, received(group.chunks, meta))
    report("N1", order_streams=order_streams, chunks=len(group.chunks), params=len(meta), mismatched=bad)
    if order_streams:
        assert bad == [], f"{len(bad)} of {len(meta)} tensors would load stale bytes into vLLM: {bad}"
    else:
        assert bad, "the unordered walk loaded the right bytes under the delay: the harness cannot see the race"


@pytest.mark.parametrize("order_streams", [True, False], ids=["ordered", "unordered-negative-control"])
def test_the_push_reads_what_the_callers_stream_wrote_before_it(sharded, order_streams):
    """N3: parameters updated in place on the caller's stream behind a delay, with no sync before the push (as an
    optimizer step leaves them): vLLM receives the updated values; unordered, it receives the old ones."""
    model, meta = sharded
    fresh_values(model, seed=3 if order_streams else 4)
    with torch.no_grad():
        torch.cuda._sleep(OPTIMIZER_DELAY_CYCLES)
        for p in model.parameters():
            p.to_local().add_(1.0)
    group = KeepChunks()
    push(model, meta, group, order_streams)
    bad = mismatches(model, received(group.chunks, meta))
    report("N3", order_streams=order_streams, chunks=len(group.chunks), params=len(meta), mismatched=bad)
    if order_streams:
        assert bad == [], f"{len(bad)} of {len(meta)} tensors were read before the caller's update: {bad}"
    else:
        assert bad, "the unordered walk saw the update under the delay: the harness cannot see the race"


def reserved_by_stream() -> Counter:
    out: Counter = Counter()
    for segment in torch.cuda.memory_snapshot():
        out[segment["stream"]] += segment["total_size"]
    return out


def test_push_memory_and_time_per_stream(sharded):
    """N6 figures (printed) for the walk with and without stream ordering: the leader's reserved memory after a push,
    split into vLLM's producer streams (which training on the caller's stream cannot reuse) and the rest, and the
    push's wall time (5 pushes, no delay). Asserted: with ordering, the push delivers the model."""
    from vllm.distributed.weight_transfer.packed_tensor import _get_streams

    model, meta = sharded
    side = {s.cuda_stream for s in _get_streams(0, 2)}
    gb = 1e-9
    for order_streams in (False, True):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_reserved()
        push(model, meta, Discard(), order_streams)
        torch.cuda.synchronize()
        by_stream = reserved_by_stream()
        after = torch.cuda.memory_reserved()
        peak = torch.cuda.max_memory_allocated()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            push(model, meta, Discard(), order_streams)
            times.append(time.perf_counter() - t0)
        fresh_values(model, seed=5 + order_streams)
        group = KeepChunks()
        push(model, meta, group, order_streams)
        bad = mismatches(model, received(group.chunks, meta))
        report(
            "N6",
            order_streams=order_streams,
            model_bf16_gb=round(sum(m.nbytes for m in meta) * gb, 3),
            bucket_mib=BUCKET // 2**20,
            reserved_before_gb=round(before * gb, 3),
            reserved_after_gb=round(after * gb, 3),
            reserved_on_producer_streams_gb=round(sum(by_stream[s] for s in side) * gb, 3),
            reserved_elsewhere_gb=round(sum(v for s, v in by_stream.items() if s not in side) * gb, 3),
            peak_allocated_gb=round(peak * gb, 3),
            push_s_median=round(statistics.median(times), 4),
            push_s=[round(t, 4) for t in times],
            mismatched_without_delay=bad,
        )
        del group  # its clones sit in the producer streams' pools: not part of the next walk's figures
    assert bad == [], f"ordered, without any delay, {len(bad)} tensors differ: {bad}"
