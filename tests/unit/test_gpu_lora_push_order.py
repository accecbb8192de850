"""The LoRA merged push (trainer.lora.push: merged) through vLLM 0.32's real nccl packed producer, on one GPU, without
NCCL: review note 4a of issue 27. The merged weights (W + alpha/r B A) are computed on the caller's stream and handed
over to whichever producer side stream pulls them (trainer.push.adapter.merged_params), as the full-weight walk does
(tests/unit/test_gpu_push_order.py, N1/N3/N6 of ../shared/GPU-AUDIT.md, whose harness this reuses).

A world-1 FSDP2 Qwen2 with peft adapters (r=16 on all projections, base frozen in bf16, fp32 adapters) as
trainer.lora builds it; its adapters are updated in place behind `torch.cuda._sleep` on the caller's stream with no
sync before the push, as the optimizer leaves them (N3). vLLM's real consumer cuts the captured chunks; every tensor
must equal the merge computed from the model's own full tensors, byte for byte. The walk without stream ordering
(order_streams=False) is the negative control: the same delay must corrupt it. The producer streams' reserved memory
after a merged push (N6: the merge's fp32 temporaries no longer land in their pools) is printed as PUSH-ORDER lines.
Needs a CUDA device (gpu/push_order.sh runs it on the H200); not yet run there (issue 27's helper had no device time).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist

from tests.unit.test_gpu_push_order import (
    BUCKET,
    OPTIMIZER_DELAY_CYCLES,
    KeepChunks,
    produce_on_a_thread,
    received,
    report,
    world_of_one_and_a_body,
)

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; run gpu/push_order.sh on a GPU machine"),
    pytest.mark.filterwarnings("ignore:Tensor .* exceeds buffer_size_bytes"),
]

R = 16


@pytest.fixture(scope="module")
def lora_sharded():
    """(model, meta, scale): a random untied Qwen2 body made a peft LoRA model by trainer.lora.apply, sharded by the
    project's shard_model on a world-1 mesh, adapters non-zero."""
    from launcher.core.config import LoraConfig
    from trainer import lora as trainer_lora
    from trainer.parallel import shard_model
    from trainer.push.adapter import MergedPusher
    from trainer.push.pusher import PushSettings

    par, body = world_of_one_and_a_body()
    device = par.device
    lora = LoraConfig(r=R, alpha=2 * R)
    model = trainer_lora.apply(body, lora, torch.bfloat16)
    with torch.no_grad():
        for _, p in trainer_lora.adapter_params(model):
            p.normal_(0, 0.02)
    shard_model(model, par, torch.bfloat16)
    settings = PushSettings("nccl", 0, 1, 60.0, torch.bfloat16, BUCKET)
    meta = MergedPusher(model, None, settings, device, lora).meta
    torch.cuda.synchronize()
    yield model, meta, trainer_lora.scaling(lora)
    dist.destroy_process_group()


def merged_push(model, meta, scale: float, group, order_streams: bool) -> None:
    """The leader's merged push as MergedPusher + NcclSender run it: the stream is made here (the caller's thread and
    stream), vLLM's producer pulls it on another thread with the device set."""
    from trainer.push.adapter import merged_params
    from trainer.push.gather import iter_unsharded_params
    from trainer.push.senders import checked

    walk = iter_unsharded_params(model, torch.bfloat16, order_streams=order_streams)
    params = checked(merged_params(walk, scale, torch.bfloat16) if order_streams else unordered(walk, scale), meta)
    produce_on_a_thread(group, params)


def unordered(walk, scale: float):
    """The negative control: the merge pulled and computed lazily on whichever stream the producer pulls under, on a
    walk that does not order streams either (what a merge on the producer's streams without hand-over would read)."""
    from trainer.push import adapter

    return adapter._merged(walk, scale, torch.bfloat16, None)


def expected(model, scale: float) -> dict[str, torch.Tensor]:
    """The merged model in bf16 from the model's own full tensors (after a device sync), by the push's formula
    (tests/unit/test_lora_push.py shows it equals peft's merge_and_unload)."""
    from trainer import lora as trainer_lora

    torch.cuda.synchronize()
    full = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
    out = {}
    for n, t in full.items():
        base = trainer_lora.base_name(n)
        if base is None:
            continue
        owner, sep, rest = n.partition(".base_layer.")
        if sep and rest == "weight":
            a, b = full[f"{owner}.lora_A.default.weight"], full[f"{owner}.lora_B.default.weight"]
            t = t.to(torch.bfloat16).float() + scale * (b.to(torch.bfloat16).float() @ a.to(torch.bfloat16).float())
        out[base] = t.to(torch.bfloat16).contiguous()
    return out


@pytest.mark.parametrize("order_streams", [True, False], ids=["ordered", "unordered-negative-control"])
def test_the_merged_push_reads_the_adapters_the_callers_stream_wrote_before_it(lora_sharded, order_streams):
    from trainer import lora as trainer_lora

    model, meta, scale = lora_sharded
    with torch.no_grad():
        torch.cuda._sleep(OPTIMIZER_DELAY_CYCLES)  # the optimizer's update lands late, on the caller's stream
        for _, p in trainer_lora.adapter_params(model):
            p.to_local().add_(0.01)
    group = KeepChunks()
    merged_push(model, meta, scale, group, order_streams)
    got = received(group.chunks, meta)
    want = expected(model, scale)
    bad = [n for n, t in want.items() if not torch.equal(got[n].view(torch.int16), t.view(torch.int16))]
    report("LoRA-merged-N3", order_streams=order_streams, chunks=len(group.chunks), params=len(meta), mismatched=bad)
    if order_streams:
        assert bad == [], f"{len(bad)} of {len(meta)} merged tensors were read before the caller's update: {bad}"
    else:
        assert bad, "the unordered merge saw the update under the delay: the harness cannot see the race"


def test_merged_push_memory_on_the_producer_streams(lora_sharded):
    """N6 figures (printed): the leader's reserved memory per stream after a merged push; asserted only that the
    ordered merged push delivers the merge without any delay."""
    from vllm.distributed.weight_transfer.packed_tensor import _get_streams

    model, meta, scale = lora_sharded
    side = {s.cuda_stream for s in _get_streams(0, 2)}
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    group = KeepChunks()
    merged_push(model, meta, scale, group, True)
    torch.cuda.synchronize()
    by_stream: Counter = Counter()
    for segment in torch.cuda.memory_snapshot():
        by_stream[segment["stream"]] += segment["total_size"]
    got, want = received(group.chunks, meta), expected(model, scale)
    bad = [n for n, t in want.items() if not torch.equal(got[n].view(torch.int16), t.view(torch.int16))]
    report(
        "LoRA-merged-N6",
        merged_bf16_gb=round(sum(m.nbytes for m in meta) / 1e9, 3),
        reserved_on_producer_streams_gb=round(sum(by_stream[s] for s in side) / 1e9, 3),
        reserved_elsewhere_gb=round(sum(v for s, v in by_stream.items() if s not in side) / 1e9, 3),
    )
    assert bad == [], bad
