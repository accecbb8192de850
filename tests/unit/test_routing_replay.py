"""Routing replay (trainer.routing_replay) on tiny random MoE bodies of the project's families (trainer.tiny_families),
on CPU: the router override replays given expert ids exactly, keeps the router's gradient, holds under activation
checkpointing's recompute, and finds each training row's routes from the server's format (built as vLLM 0.32 builds
it, sent by a local HTTP server: the process boundary). vLLM's side (Model Runner V2, Triton) is GPU only:
bench/routing_replay_gpu.py measures it there."""

from __future__ import annotations

import base64
import importlib.util
import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from launcher.core.config import ROUTING_REPLAY_FAMILIES
from tests.unit.test_rollout import load, par  # noqa: F401 (a fixture: a world-1 gloo group)
from tests.unit.test_server_client import client_of, fake_vllm  # noqa: F401 (a fixture)
from trainer.push.pusher import PushSettings
from trainer.rollout.node import GenerationSettings, NodeRollout, TrlAdapter
from trainer.rollout.server import RoutedExperts, decode_routed_experts
from trainer.routing_replay import RouteTable, RoutingReplay
from trainer.tiny_families import MOE, config_fields

FAMILIES = ["qwen3_moe", "mixtral", "qwen2_moe", "olmoe", "gpt_oss"]
assert set(FAMILIES) == set(ROUTING_REPLAY_FAMILIES) and set(FAMILIES) <= set(MOE)  # every family replay serves


def tiny(family: str, layers: int = 2, seed: int = 0) -> Any:
    """A random tiny body of `family` from its config (trainer.tiny_families' shapes), float32, dropout-free."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = config_fields(
        family, vocab=96, hidden=64, layers=layers, heads=2, kv_heads=1, head_dim=32, intermediate=64, tie=True,
        token_id=0, dtype="float32",
    )  # fmt: skip
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **fields), attn_implementation="eager")


def own_routes(model: torch.nn.Module, replay: RoutingReplay, ids: torch.Tensor) -> torch.Tensor:
    """(rows, layers, top_k): the experts the model's own routers pick for `ids`."""
    got: dict[int, torch.Tensor] = {}
    hooks = [
        m.register_forward_hook(lambda _m, _i, out, layer=layer: got.__setitem__(layer, out[2]))
        for layer, m in enumerate(m for m in model.modules() if type(m).__name__.endswith("TopKRouter"))
    ]
    replay.set(None)
    with torch.no_grad():
        model(input_ids=ids)
    for h in hooks:
        h.remove()
    return torch.stack([got[i] for i in range(replay.layers)], dim=1)


def others(routes: torch.Tensor, experts: int) -> torch.Tensor:
    """Other experts for every row (each id moved by one): top_k ids stay distinct."""
    return (routes + 1) % experts


def experts_of(model) -> int:
    c = model.config
    return getattr(c, "num_experts", None) or c.num_local_experts


@pytest.mark.parametrize("family", FAMILIES)
def test_replaying_the_models_own_routes_is_exact_and_other_routes_change_the_logits_and_train_the_router(family):
    model = tiny(family)
    replay = RoutingReplay(model)
    assert replay.routers == 2
    ids = torch.randint(1, 96, (2, 7))
    own = own_routes(model, replay, ids)
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        replay.set(own)
        same = model(input_ids=ids).logits
    assert torch.equal(plain, same), "replaying the model's own routes must not change a bit"

    replay.set(others(own, experts_of(model)))
    out = model(input_ids=ids).logits
    assert (out - plain).abs().max() > 1e-3, "other experts must change the logits"
    torch.log_softmax(out, -1)[..., 5].sum().backward()
    routers = [n for n, p in model.named_parameters() if n.endswith(("mlp.gate.weight", "mlp.router.weight"))]
    assert len(routers) == 2, routers
    for name, p in model.named_parameters():
        if name in routers:  # the routers: the weights are their softmax at the replayed ids
            assert p.grad is not None and p.grad.abs().max() > 0, name


def test_only_the_masked_rows_replay():
    model = tiny("qwen3_moe")
    replay = RoutingReplay(model)
    ids = torch.randint(1, 96, (1, 6))
    own = own_routes(model, replay, ids)
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        mask = torch.tensor([False, False, False, True, True, True])
        replay.set(others(own, 3), mask)
        out = model(input_ids=ids).logits
    # causal: rows before the replayed ones see nothing of them (up to the last bits: an expert's matmul now has
    # other rows beside them)
    torch.testing.assert_close(out[0, :3], plain[0, :3], rtol=1e-6, atol=1e-6)
    assert (out[0, 3:] - plain[0, 3:]).abs().max() > 1e-3


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_activation_checkpointings_recompute_routes_as_the_replayed_forward(family):
    """Gradients with checkpointing equal those without (same replayed routes), and differ when the routes are
    dropped before the backward: the recompute reads the replay, so it must stay set."""

    def run(checkpointing: bool, drop_before_backward: bool = False) -> dict[str, torch.Tensor]:
        model = tiny(family)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        replay = RoutingReplay(model)
        ids = torch.randint(1, 96, (2, 6), generator=torch.Generator().manual_seed(1))
        replay.set(others(own_routes(model, replay, ids), experts_of(model)))
        loss = torch.log_softmax(model(input_ids=ids).logits, -1)[..., 3].mean()
        if drop_before_backward:
            replay.set(None)
        loss.backward()
        return grads(model)

    plain, checkpointed = run(False), run(True)
    assert plain.keys() == checkpointed.keys() and len(plain) > 5
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-5, atol=1e-7, msg=name)
    # the bug this guards against: a recompute that routes by itself saves other tensors (torch refuses) or computes
    # other gradients; either way the comparison above would have seen it
    try:
        dropped = run(True, drop_before_backward=True)
    except torch.utils.checkpoint.CheckpointError:
        return
    assert any(not torch.allclose(dropped[n], plain[n], rtol=1e-4, atol=1e-6) for n in plain)


def vllm_payload(rows: np.ndarray) -> str:
    """A choice's routed_experts exactly as vLLM 0.32 sends it: numpy2base64 (vllm/utils/serial_utils.py:67-71)."""
    with io.BytesIO() as buffer:
        np.save(buffer, rows, allow_pickle=False)
        return base64.b64encode(buffer.getbuffer()).decode("ascii")


def vllm_source(rel: str) -> str:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM not installed")
    return (Path(next(iter(spec.submodule_search_locations))) / rel).read_text()


def test_the_payload_is_built_as_vllm_builds_it():
    """The two lines of vLLM 0.32 vllm_payload and the dtypes below copy (read, not imported: importing vLLM costs seconds)."""
    assert "np.save(buffer, array, allow_pickle=False)" in vllm_source("utils/serial_utils.py")
    capturer = vllm_source("model_executor/layers/fused_moe/routed_experts_capturer.py")
    assert '"uint8" if num_experts <= 256 else "uint16"' in capturer


@pytest.mark.parametrize("dtype,experts", [(np.uint8, 128), (np.uint16, 300)])
def test_routed_experts_decode_in_vllms_dtypes(dtype, experts):
    rows = np.random.default_rng(0).integers(0, experts, (9, 3, 2)).astype(dtype)
    got = decode_routed_experts(vllm_payload(rows), prompt_start=2)
    assert got.rows.dtype == dtype and np.array_equal(got.rows, rows) and got.prompt_start == 2


def test_a_recorded_completion_reaches_the_client_with_its_routes(fake_vllm):  # noqa: F811
    prompt, ids = [5, 6, 7, 8], [9, 10, 11]
    rows = np.arange(6 * 2 * 2, dtype=np.uint8).reshape(6, 2, 2) % 3  # prompt + generated - 1 = 6 rows
    answer = {
        "choices": [
            {
                "index": 0,
                "token_ids": ids,
                "logprobs": {"token_logprobs": [-0.5, -1.0, -0.25]},
                "routed_experts": vllm_payload(rows),
            }
        ]
    }
    srv: Any = fake_vllm
    srv.answer = lambda path: (200, answer)
    client = client_of(srv)
    sampling: dict[str, Any] = {"max_tokens": 3, "temperature": 1.0}
    [(got_ids, lps)] = client.complete([prompt], **sampling)  # the default: pairs, as before
    [routed] = client.complete([prompt], routed_experts=True, **sampling)
    assert (got_ids, lps) == (ids, [-0.5, -1.0, -0.25]) and routed.ids == ids
    assert routed.routes is not None and np.array_equal(routed.routes.rows, rows)
    table = RouteTable()
    table.replace([(prompt, routed.ids, routed.routes)])
    assert table.lookup(tuple(prompt + ids)) is routed.routes
    # routes that do not cover their tokens (a request recomputed after a push): the row keeps the trainer's routing
    table.replace([(prompt, ids + [12], routed.routes), (prompt, routed.ids, None)])
    assert table.lookup(tuple(prompt + ids + [12])) is None and (table.misfit, table.without_routes) == (1, 1)


def test_rows_find_their_routes_at_their_positions_whatever_the_padding():
    """TRL's rows: left-padded prompt, right-padded completion. vLLM row t = real position prompt_start + t, up to
    N-2; the last position and the padding keep their own routing."""
    model = tiny("olmoe")
    replay = RoutingReplay(model)
    a, b = [7, 8, 9, 10, 11], [20, 21, 22]  # N = 5 (prompt 3 + 2), N = 3 (prompt 1 + 2)
    rows_a = np.full((5 - 1 - 1, 2, 2), 1, dtype=np.uint8)  # prompt_start 1: positions 1..3
    rows_b = np.full((3 - 1, 2, 2), 2, dtype=np.uint8)
    replay.table.replace([(a[:3], a[3:], RoutedExperts(rows_a, 1)), (b[:1], b[1:], RoutedExperts(rows_b, 0))])
    pad = 0  # row a: no padding; row b: 2 prompt pads on the left, 0 after; plus one completion pad on the right of both
    ids = torch.tensor([a + [pad], [pad, pad] + b + [pad]])
    att = torch.tensor([[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 0]])
    got = replay.replay_for(ids, att)
    assert got is not None
    mask = got.mask.reshape(2, 6)
    assert mask.tolist() == [[False, True, True, True, False, False], [False, False, True, True, False, False]]
    idx = got.indices.reshape(2, 6, 2, 2)
    assert (idx[0, 1:4] == 1).all() and (idx[1, 2:4] == 2).all()
    assert replay.take_hit_rate() == 1.0
    assert replay.replay_for(torch.tensor([[1, 2, 3]]), None) is None and replay.take_hit_rate() == 0.0


def test_an_armed_forward_replays_the_tables_routes_as_a_forward_given_them():
    """The whole trainer path (table -> pre-forward hook -> routers) against replaying the same ids directly."""
    model = tiny("qwen2_moe")
    replay = RoutingReplay(model)
    prompt, completion = [3, 4, 5], [6, 7, 8, 9]
    seq = torch.tensor([prompt + completion])
    vllm_rows = others(own_routes(model, replay, seq), 3)[:-1].numpy().astype(np.uint8)  # no row for the last token
    payload = decode_routed_experts(vllm_payload(vllm_rows))
    replay.table.replace([(prompt, completion, payload)])
    batch = torch.tensor([prompt + completion + [0, 0], [1, 2, 3, 4, 5, 6, 7, 8, 9]])  # right padding; a stranger
    att = torch.tensor([[1] * 7 + [0, 0], [1] * 9])
    with torch.no_grad(), replay.armed():
        armed = model(input_ids=batch, attention_mask=att).logits
    mask = torch.tensor([True] * 6 + [False])
    with torch.no_grad():
        replay.set(torch.from_numpy(np.concatenate([vllm_rows, vllm_rows[-1:]])), mask)
        direct = model(input_ids=seq).logits
        replay.set(None)
        stranger = model(input_ids=batch[1:], attention_mask=att[1:]).logits
    torch.testing.assert_close(armed[0, :7], direct[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(armed[1], stranger[0], rtol=1e-5, atol=1e-6)  # not in the table: its own routing
    assert replay.take_hit_rate() == 0.5
    with torch.no_grad():  # a forward outside the logprobs (a parity check) routes by itself, table or not
        own = model(input_ids=seq).logits
        replay.set(torch.from_numpy(own_routes(model, replay, seq).numpy()))
        assert torch.equal(model(input_ids=seq).logits, own) and not torch.equal(direct, own)


def test_a_family_without_a_router_override_is_refused():
    with pytest.raises(ValueError, match="no router override for model_type 'qwen2'"):
        RoutingReplay(tiny("qwen2"))


def test_the_gpu_bench_skips_without_cuda(tmp_path, capsys, monkeypatch):
    from bench import routing_replay_gpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert routing_replay_gpu.main(["--out", str(tmp_path)]) == 0
    assert "skipped, no CUDA" in capsys.readouterr().out and not list(tmp_path.iterdir())


def test_each_completions_routes_travel_with_it_to_its_rank_and_into_the_table(tiny_model, par, fake_vllm):  # noqa: F811
    """NodeRollout and TrlAdapter as TRL drives them, against a recorded server answer: the request asks for nothing
    new (the server returns routes when it runs with --enable-return-routed-experts), each completion's routes arrive
    through the node's gather/scatter and land in the rank's table under its prompt + completion."""
    prompts = [[100, 5, 6], [100, 7]]
    rows = [np.full((len(p) + 3 - 1, 2, 2), i, dtype=np.uint8) for i, p in enumerate(prompts)]
    choices = [
        {"index": i, "token_ids": [1, 2, 3], "logprobs": {"token_logprobs": [-1.0] * 3}, "routed_experts": vllm_payload(r)}
        for i, r in enumerate(rows)
    ]
    srv: Any = fake_vllm
    srv.answer = lambda path: (200, {"choices": choices})
    push = PushSettings(backend="gloo", transfer_port=0, server_world=1, timeout_s=10, dtype=torch.float32, bucket_bytes=1 << 16)
    settings = GenerationSettings(
        server_url=client_of(srv).base_url, model="m", node=0, request_timeout_s=10, push=push, parity_tolerance=0.0,
        parity_action="fail", routing_replay=True,
    )  # fmt: skip
    rollout = NodeRollout(load(Path(tiny_model)), AutoTokenizer.from_pretrained(tiny_model), par, settings)
    adapter = TrlAdapter(rollout, max_completion_length=3, temperature=1.0)
    _, ids, logprobs, _ = adapter.generate(prompts, None, num_generations=2)
    assert ids == [[1, 2, 3]] * 2 and logprobs == [[[-1.0]] * 3] * 2
    assert [p for p, _, _ in srv.seen] == ["/v1/completions"]
    assert rollout.routes is not None
    for p, r in zip(prompts, rows, strict=True):
        got = rollout.routes.lookup(tuple(p + [1, 2, 3]))
        assert got is not None and got.rows.dtype == np.uint8 and np.array_equal(got.rows, r)
