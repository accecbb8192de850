"""trainer.routing_replay in the launcher: what it renders (vLLM's flag, Model Runner V2, prefix caching left on) and
each refusal, one line naming the key and the fix."""

from __future__ import annotations

import json

import pytest

from launcher.core import config as C
from launcher.core.plan import plan
from launcher.dryrun import render_dry_run
from launcher.node.commands import vllm_command
from tests.unit.test_moe_config import MOE  # a tiny Qwen3-MoE config.json

DENSE = {k: v for k, v in MOE.items() if k not in ("num_experts", "num_experts_per_tok", "moe_intermediate_size")}


def cfg(tmp_path, model: dict, **sections: dict) -> C.JobConfig:
    (tmp_path / "config.json").write_text(json.dumps(model))
    d: dict = {"vllm": {"model": str(tmp_path)}, "slurm": {"gpus_per_node": 2}}
    for name, values in sections.items():
        d[name] = {**d.get(name, {}), **values}
    return C.from_dict(d)


def refusal(make) -> str:
    with pytest.raises(C.ConfigError) as e:
        make()
    msg = str(e.value)
    assert "\n" not in msg and len(msg) <= 200, msg
    return msg


def test_the_server_returns_routes_from_model_runner_v2_and_dry_run_shows_it(tmp_path):
    on = cfg(tmp_path, MOE, trainer={"routing_replay": True})
    p = plan(on, str(tmp_path / "j"))
    cmd = vllm_command(p, 0)
    assert "--enable-return-routed-experts" in cmd.argv and cmd.env["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    assert not any("prefix-caching" in a for a in cmd.argv)  # vLLM's default (on), which routed experts need
    assert "VLLM_USE_V2_MODEL_RUNNER=1" in render_dry_run(on, p) and "--enable-return-routed-experts" in render_dry_run(on, p)
    off = vllm_command(plan(cfg(tmp_path, MOE), str(tmp_path / "j")), 0)
    assert "--enable-return-routed-experts" not in off.argv and "VLLM_USE_V2_MODEL_RUNNER" not in off.env
    for family, arch in C.ROUTING_REPLAY_FAMILIES.items():  # every family the trainer overrides plans
        plan(cfg(tmp_path, MOE | {"architectures": [arch], "model_type": family}, trainer={"routing_replay": True}), "/j")


def test_refusals_name_the_key_and_the_fix(tmp_path):
    replay = {"routing_replay": True}
    msg = refusal(lambda: plan(cfg(tmp_path, DENSE | {"architectures": ["Qwen3ForCausalLM"]}, trainer=replay), "/j"))
    assert "trainer.routing_replay: Qwen3ForCausalLM" in msg and "remove trainer.routing_replay" in msg
    msg = refusal(lambda: plan(cfg(tmp_path, MOE | {"architectures": ["DeepseekV3ForCausalLM"]}, trainer=replay), "/j"))
    assert "not an MoE family it replays (qwen3_moe, qwen2_moe, olmoe, mixtral, gpt_oss)" in msg
    msg = refusal(lambda: cfg(tmp_path, MOE, trainer=replay, job={"device": "cpu"}))
    assert "trainer.routing_replay needs vLLM's Model Runner V2, GPU only" in msg
    msg = refusal(lambda: cfg(tmp_path, MOE, trainer=replay, vllm={"extra_args": ["--no-enable-prefix-caching"]}))
    assert "remove --no-enable-prefix-caching from vllm.extra_args" in msg
    msg = refusal(lambda: cfg(tmp_path, MOE, trainer={**replay, "tools": ["tests.support.agent_envs:add"]}))
    assert "trainer.routing_replay replays single-turn completions only" in msg
    msg = refusal(lambda: cfg(tmp_path, MOE, vllm={"extra_args": ["--enable-return-routed-experts"]}))
    assert "set by slurm-grpo from trainer.routing_replay" in msg
