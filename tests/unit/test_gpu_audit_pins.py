"""The cheap CPU pins of ../shared/GPU-AUDIT.md turn 4 (issue 33 item 4): facts the GPU path relies on that a CPU run
never exercises, read from the installed vLLM's source or our own functions, so an upgrade or an edit that breaks
them fails here first; and G8's length bound, with a fake server that refuses prompts as vLLM does."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from trainer.agents.ahead_rollout import episode_len_limit
from trainer.agents.episodes import EpisodeLoop, LoopSettings


def vllm_source(rel: str) -> str:
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None
    return (Path(spec.origin).parent / rel).read_text()


def test_g4_the_cuda_model_runner_v2_reaches_the_patched_lora_manager():
    """CUDA runs vLLM's Model Runner V2 (every CPU run takes V1: no Triton CPU backend). The plugin's load-once fix
    (trainer.push.vllm_plugin.load_adapters_once) patches LRUCacheWorkerLoRAManager._apply_adapters, which V2 reaches
    only through the LoRA mixin's _set_active_loras -> set_active_adapters."""
    v2 = vllm_source("v1/worker/gpu/model_runner.py")
    assert re.search(r"^class GPUModelRunner\(LoRAModelRunnerMixin\b", v2, re.M), "V2's runner no longer is the LoRA mixin"
    assert "self._set_active_loras(" in v2, "V2 no longer activates adapters through the mixin"
    mixin = vllm_source("v1/worker/lora_model_runner_mixin.py")
    assert "LRUCacheWorkerLoRAManager" in mixin and "set_active_adapters(" in mixin
    manager = vllm_source("lora/worker_manager.py")
    assert re.search(r"def set_active_adapters\(.*?\n(?:.*\n){0,4}?.*self\._apply_adapters\(", manager), (
        "set_active_adapters no longer goes through _apply_adapters (the method the plugin patches)"
    )


def test_g7_the_push_generators_stay_plain_functions():
    """iter_unsharded_params and merged_params capture the optimizer's stream when called, on the main thread, because
    they are plain functions returning generators: a `yield` in either would capture the producer's slot stream
    instead, where vLLM's packed producer first pulls it (the N3 guarantee of the audit)."""
    from trainer.push.adapter import merged_params
    from trainer.push.gather import iter_unsharded_params

    assert not inspect.isgeneratorfunction(iter_unsharded_params)
    assert not inspect.isgeneratorfunction(merged_params)


def refusing_server(limit: int, sent: list[int]):
    """vLLM's check (v1/engine/input_processor.py): a prompt of >= --max-model-len tokens is an error (HTTP 400)."""

    def generate(prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
        for ids in prompts:
            if len(ids) >= limit:
                raise RuntimeError(f"HTTP 400: the prompt ({len(ids)} tokens) is longer than max_model_len {limit}")
            sent.append(len(ids))
        return [([9], [-0.1]) for _ in prompts]

    return generate


def loop(max_model_len: int) -> EpisodeLoop:
    """The real episode loop: a 10-token prompt, a model that calls a tool every turn, 10 tokens per tool turn."""
    call = {"type": "function", "function": {"name": "echo", "arguments": {}}}

    def echo() -> str:
        """Says r."""
        return "r"

    return EpisodeLoop(
        {},
        [echo],
        lambda prompt, tools: [1] * 10,
        lambda messages: [2] * 10,
        lambda ids, prefix, tools: {"role": "assistant", "content": "", "tool_calls": [call]},
        LoopSettings(max_completion_length=10_000, max_model_len=max_model_len, max_iterations=100),
    )


def test_g8_episodes_end_below_the_servers_max_model_len_not_the_models():
    """A model of 2048 positions served with vllm.max_model_len 64: an episode's turns stop before a prompt of 64
    tokens is sent; bounded by the model's own 2048 (before the fix) the server refuses the step."""
    server_limit, model_positions = 64, 2048
    sent: list[int] = []
    eps = loop(episode_len_limit(server_limit, model_positions)).run([{"prompt": [{"role": "user", "content": "go"}]}],
                                                                     refusing_server(server_limit, sent))  # fmt: skip
    assert sent and max(sent) < server_limit and len(sent) >= 4, sent  # turns ran, up to the limit
    assert len(eps[0].prompt_ids) + len(eps[0].completion_ids) < server_limit + 1
    with pytest.raises(RuntimeError, match="longer than max_model_len 64"):
        loop(model_positions).run([{"prompt": [{"role": "user", "content": "go"}]}], refusing_server(server_limit, []))
    assert episode_len_limit(0, model_positions) == model_positions, "vllm.max_model_len 0: the model's own"


@pytest.mark.parametrize(
    "env, fits",
    [
        ({}, True),
        ({"TRL": "1"}, True),
        ({"TRL": "1", "RESTART_STEPS": "5"}, False),
        ({"RUN_TIMEOUT": "330", "TRL": "1", "TRL_TIMEOUT": "300"}, False),  # the limits before G9: 630 s
        ({"RUN_TIMEOUT": "230", "RESTART_STEPS": "8", "RESTART_TIMEOUT": "170"}, True),
        ({"TRL": "1", "TRL_TIMEOUT": "300", "RUN_TIMEOUT": "300"}, False),
        # LOCAL=0: TRL's run alone, the local run was the call before
        ({"LOCAL": "0", "TRL": "1", "TRL_TIMEOUT": "300", "RUN_TIMEOUT": "300"}, True),
    ],
)
def test_g9_gpu_device_sh_refuses_run_limits_that_do_not_fit_one_call(env, fits):
    """A device call runs at most 600 s; gpu/device.sh's runs must leave the install and the model build inside 550 s."""
    import os
    import subprocess

    repo = Path(__file__).resolve().parents[2]
    r = subprocess.run(
        ["bash", str(repo / "gpu/device.sh")],
        env={"PATH": os.environ["PATH"], "CHECK_ONLY": "1", **env},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert (r.returncode == 0) == fits, r.stdout + r.stderr
    if not fits:
        assert r.returncode == 2 and "lower them so the call fits 550 s" in r.stderr, r.stderr
