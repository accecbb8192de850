"""LoRA (trainer.lora) end to end on the real vLLM CPU build: two short local runs (the second resumes the first)
carry every assertion, since a server takes a minute to start on 2 cores.

  - each push moves only the adapter (push_bytes = the adapter's bytes) and changes what vLLM returns (parity before
    the push stale, after it equal to the trainer's forward);
  - run 1 pushes it through the weight-transfer engine (trainer.lora.adapter_transport engine, the default): one
    /update_weights per push, the worker installs the adapter from the tensors (the plugin's line, once per push) and
    reads no folder after the zero adapter's; run 2 (the resume) through disk (adapter_transport disk): one folder
    written and one /v1/load_lora_adapter per push, no /update_weights;
  - the base in vLLM is unchanged: asked under the base model's name, mid-run, the server gives the base's logprobs;
  - resume continues the adapter (checkpoints hold only the adapter and its AdamW state, whose step count goes on;
    the resumed run's first push brings the fresh server from the zero adapter to the checkpoint's);
  - the final adapter loads with PeftModel.from_pretrained and equals the merged model (trainer.lora.save_merged);
  - the merged fallback (trainer.lora.push: merged, a third short run): vLLM starts without LoRA, every push sends the
    whole model under the base's names and changes what vLLM returns under the base's name, parity after it holds."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

from tests.conftest import read
from tests.integration.test_integration import local, ports, start_local, wait_for_step  # noqa: F401  (ports: the fixture)

pytestmark = pytest.mark.integration

R = 8
# parity_every 1: a stale probe before every push, the proof below that every push changed what the server returns
LORA = ("trainer.lora.r=8", "trainer.lora.save_merged=true", "trainer.parity_every=1")
PROBE = "the quick brown fox jumps over a lazy dog"


def adapter_bytes(model: str) -> int:
    """fp32 adapter bytes of the tiny model: r x (in + out) x 4 per adapted projection and layer."""
    from launcher.core.config import LORA_TARGETS
    from launcher.core.shape import ModelShape
    from launcher.memory import adapter_layer_params

    shape = ModelShape.read(model)
    assert shape is not None
    return 4 * shape.layers * adapter_layer_params(shape, R, LORA_TARGETS)


def route_counts(vllm_log: str) -> dict[str, int]:
    """POSTs per route, from the server's access log."""
    routes = ("/v1/load_lora_adapter", "/update_weights", "/init_weight_transfer_engine", "/v1/completions")
    return {route: vllm_log.count(f'"POST {route} ') for route in routes}


def hf_logprobs(model, ids: list[int]) -> list[float]:
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    lp = torch.log_softmax(logits, -1)
    return lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()


def test_lora_pushes_only_the_adapter_keeps_the_base_resumes_and_writes_a_peft_adapter(tmp_path, tiny_model, ports, vllm_cache):  # noqa: F811
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from launcher.core.jobdir import JobDir
    from launcher.core.lora import ADAPTER_NAME
    from trainer.push.adapter_receiver import TENSORS_MARK
    from trainer.push.vllm_plugin import ADAPTER_READ_MARK
    from trainer.rollout.server import VllmServer

    job = tmp_path / "run"
    tok = AutoTokenizer.from_pretrained(tiny_model)
    ids = tok(PROBE)["input_ids"][:24]
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    base_lp = hf_logprobs(base, ids)

    # run 1: 8 steps; mid-run, ask the live server for the probe under the base's name and under the adapter's
    p = start_local(job, tiny_model, ports, "trainer.max_steps=8", "trainer.save_steps=4", *LORA, cache=vllm_cache)
    metrics = job / "metrics.jsonl"
    wait_for_step(p, job, 2)
    server = VllmServer(f"http://127.0.0.1:{ports.vllm}", tiny_model, 0, 60)
    # the first base request mid-run has come back 0.139 off (twice, the same value), the next one equal: PROBE is a
    # prefix of the parity probe, whose KV the adapter requests cached; it looks like a prefix-cache hit across
    # adapter and base (not investigated; the trainer never asks the base). Ask again until one matches: weights that
    # changed would never match
    tries = []
    for _ in range(10):
        served_base = server.prompt_logprobs(ids)
        tries.append(max(abs(a - b) for a, b in zip(served_base, base_lp, strict=True)))
        if tries[-1] <= 1e-4 or p.poll() is not None:
            break
        time.sleep(0.2)
    print(f"base requests mid-run, |served - base| per try: {tries}")
    server.model = ADAPTER_NAME
    served_adapter = server.prompt_logprobs(ids)
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, out[-3000:] + err[-3000:]
    assert tries[-1] <= 1e-4, tries  # the base in vLLM is unchanged
    assert max(abs(a - b) for a, b in zip(served_adapter, base_lp, strict=True)) > 1e-4  # the adapter changes it

    s = json.loads((job / "summary.json").read_text())
    hist = s["nodes"]["0"]["parity_history"]
    after = [h["max_diff"] for h in hist if h["kind"] == "after_push"]
    stale = [h["max_diff"] for h in hist if h["kind"] == "stale"]
    assert len(after) == 9 and max(after) <= 1e-4, after  # parity through the adapter after every push (8 + final)
    assert min(stale) > 1e-5, stale  # every push changed what the server returns
    rows = [r for r in read(metrics) if "reward" in r]
    assert len(rows) == 8 and all(math.isfinite(r["reward"]) and math.isfinite(r["loss"]) for r in rows), rows[-1]
    expected = adapter_bytes(tiny_model)
    assert {r["push_bytes"]["0"] for r in rows} == {expected}, rows[0]["push_bytes"]  # only the adapter's bytes move
    model_bytes = 4 * sum(p.numel() for p in base.parameters())
    print(f"adapter push {expected} bytes vs full push {model_bytes} bytes ({model_bytes / expected:.0f}x)")
    vllm_log = (job / "logs" / "node0-vllm.log").read_text()
    # requests counted in uvicorn's access log (which test_integration's pause/resume counts rely on too), not by
    # vLLM's own INFO lines: one CI run found no "Loaded new LoRA adapter" line in this log although parity through
    # the adapter held after every push. 9 pushes (8 steps + final), each through the engine: one /update_weights
    seen = route_counts(vllm_log)
    assert seen["/v1/completions"] > 0 and seen["/v1/load_lora_adapter"] == 1, seen  # the zero adapter's, from a folder
    assert seen["/init_weight_transfer_engine"] == 1 and seen["/update_weights"] == 9, seen
    # the worker read a folder once (the zero adapter: the name's first load), then built the adapter from the pushed
    # tensors once per push (the plugin's lines), never at every engine step of every request naming it (vLLM 0.32's
    # per-step reload of a load_inplace adapter: 8x slower generation on the H200)
    assert vllm_log.count(ADAPTER_READ_MARK) == 1 and vllm_log.count(TENSORS_MARK) == 9, (
        vllm_log.count(ADAPTER_READ_MARK),
        vllm_log.count(TENSORS_MARK),
    )
    pushed = JobDir(job).adapter_pushes(0)
    assert f"{pushed}/initial" in vllm_log and f"{pushed}/step-" not in vllm_log, vllm_log[-2000:]  # no folder per push
    assert not pushed.exists()  # ... and the folder is gone at the end
    trainer_log = (job / "logs" / "node0-trainer.log").read_text()
    assert trainer_log.count("adapter (engine)") == 9, trainer_log[-2000:]  # the pusher's line per push

    # the final adapter: peft's format, loadable, equal to the merged model, not the base
    peft_model = PeftModel.from_pretrained(base, str(job / "adapter"))
    merged = AutoModelForCausalLM.from_pretrained(str(job / "merged"), dtype=torch.float32)
    lp_peft, lp_merged = hf_logprobs(peft_model, ids), hf_logprobs(merged, ids)
    assert max(abs(a - b) for a, b in zip(lp_peft, lp_merged, strict=True)) <= 1e-4
    assert max(abs(a - b) for a, b in zip(lp_peft, base_lp, strict=True)) > 1e-4
    assert json.loads((job / "adapter" / "adapter_config.json").read_text())["r"] == R

    # run 2: resume to step 11; the checkpoint holds the adapter and its optimizer state only
    ck = job / "checkpoints" / "step-000008"
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(ck), str(tmp_path / "ck8.pt"))
    state = torch.load(tmp_path / "ck8.pt", weights_only=False)
    assert state["model"] and all(".lora_" in k for k in state["model"]), sorted(state["model"])[:3]
    # ... through disk this time: the fallback's own counts, on the same server start
    r = local(
        job,
        tiny_model,
        ports,
        "trainer.max_steps=11",
        "trainer.save_steps=4",
        *LORA,
        "trainer.lora.adapter_transport=disk",
        cache=vllm_cache,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    log2 = (job / "logs" / "node0-vllm.log").read_text()[len(vllm_log) :]  # the log is appended to
    seen = route_counts(log2)  # 4 pushes (steps 9-11 + final) + the zero adapter, each a folder read by the worker
    assert seen["/v1/load_lora_adapter"] == 5 and seen["/update_weights"] == 0, seen
    assert log2.count(ADAPTER_READ_MARK) == 5 and log2.count(TENSORS_MARK) == 0, log2[-2000:]
    assert f"{pushed}/step-" in log2, log2[-2000:]
    rows = read(metrics)
    resumed = [x for x in rows if x.get("event") == "resumed"]
    assert resumed and resumed[-1]["from_step"] == 8, resumed
    steps = [x["step"] for x in rows if "reward" in x]
    assert steps == list(range(1, 12)), steps
    first_resumed = next(x for x in rows if x.get("step") == 9 and "reward" in x)
    assert first_resumed["parity_stale"]["0"] > 1e-5, first_resumed  # the fresh server held the zero adapter
    assert first_resumed["parity"]["0"] <= 1e-4, first_resumed  # ... and holds the checkpoint's adapter now
    dcp_to_torch_save(str(job / "checkpoints" / "step-000011"), str(tmp_path / "ck11.pt"))
    osd = torch.load(tmp_path / "ck11.pt", weights_only=False)["optim"]["state"]
    assert {float(v["step"]) for v in osd.values()} == {11.0}  # AdamW went on from step 8
    assert not math.isnan(json.loads((job / "summary.json").read_text())["nodes"]["0"]["parity_final"])
    size = Path(job / "adapter" / "adapter_model.safetensors").stat().st_size
    assert expected <= size < expected + 16384, (size, expected)  # the fp32 adapter and safetensors' header, no base


def test_a_merged_lora_push_sends_the_whole_model_to_a_server_without_lora(tmp_path, tiny_model, ports, capsys, vllm_cache):  # noqa: F811
    import torch
    from transformers import AutoModelForCausalLM

    from launcher.cli import main as cli_main
    from launcher.core.plan import Plan
    from launcher.node.commands import vllm_command
    from trainer.push.vllm_plugin import REGISTERED_MARK

    sets = ["trainer.lora.r=8", "trainer.lora.push=merged", "trainer.parity_every=1"]
    # what dry-run states for this choice
    assert (
        cli_main(["dry-run", "configs/smoke_cpu.yaml", *(x for s in [f"vllm.model={tiny_model}", *sets] for x in ("--set", s))])
        == 0
    )
    out = capsys.readouterr().out
    assert "LoRA push = merged: trainer.lora.push: merged" in out and "--enable-lora" not in out, out

    job = tmp_path / "merged"
    r = local(job, tiny_model, ports, "trainer.max_steps=3", *sets, cache=vllm_cache)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    p = Plan.load(str(job / "plan.json"))
    assert p.lora_push == "merged" and "--enable-lora" not in vllm_command(p, 0).argv  # what the bootstrap started
    vllm_log = (job / "logs" / "node0-vllm.log").read_text()
    assert f"{REGISTERED_MARK} " in vllm_log and "LoRA adapters read once: False" in vllm_log  # no LoRA env either
    assert "'enable_lora': True" not in vllm_log  # vLLM's non-default args, where it logged them
    posts = ("/v1/load_lora_adapter", "/update_weights", "/v1/completions")
    seen = {route: vllm_log.count(f'"POST {route} ') for route in posts}
    assert seen["/v1/load_lora_adapter"] == 0 and seen["/update_weights"] == 4 and seen["/v1/completions"] > 0, seen

    s = json.loads((job / "summary.json").read_text())
    hist = s["nodes"]["0"]["parity_history"]
    after = [h["max_diff"] for h in hist if h["kind"] == "after_push"]
    stale = [h["max_diff"] for h in hist if h["kind"] == "stale"]
    # parity is asked under the base's name (GenerationSettings.model): the server holds the merged weights
    assert len(after) == 4 and max(after) <= 1e-4, after
    assert min(stale) > 1e-5, stale  # every push changed what the server returns under the base's name
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    model_bytes = 4 * sum(p.numel() for p in base.parameters())  # fp32 serving, tied embeddings counted once
    rows = [x for x in read(job / "metrics.jsonl") if "reward" in x]
    assert len(rows) == 3 and {x["push_bytes"]["0"] for x in rows} == {model_bytes}, rows[0]["push_bytes"]
    assert json.loads((job / "adapter" / "adapter_config.json").read_text())["r"] == R  # the adapter is the output still
