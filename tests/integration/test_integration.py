"""Integration tier: real vLLM CPU servers, real torch.distributed (gloo), the real bootstrap.
Servers take about a minute to start on 2 cores, so each test here is one whole local run."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from launcher.cli import cli_argv
from tests.conftest import PY, REPO, assert_tracked, cli, read, report
from tests.unit.test_export import tensors as hf_tensors

pytestmark = pytest.mark.integration

LR = 0.003
"""trainer.learning_rate of configs/smoke_cpu.yaml; TRL's default schedule decays it linearly to 0 at max_steps."""


def linear_lr(step: int, max_steps: int) -> float:
    """The LR step `step` (from 1) trains with, as the Trainer logs it: the schedule after step - 1 scheduler steps."""
    return LR * (max_steps - step + 1) / max_steps


@dataclass(frozen=True)
class Ports:
    vllm: int
    rendezvous: int
    transfer: int

    @property
    def sets(self) -> tuple[str, ...]:
        return (
            f"vllm.port={self.vllm}",
            f"trainer.rendezvous_port={self.rendezvous}",
            f"trainer.weight_transfer_port={self.transfer}",
        )


@pytest.fixture
def ports() -> Ports:
    """Free ports for this test's runs: the config's fixed ones (8000, 29500, 29600) collide with any other run on
    the machine (another suite, scripts/smoke.sh, a server someone keeps on 8000)."""
    socks = [socket.socket() for _ in range(3)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    numbers = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return Ports(*numbers)


def local_argv(job_dir: Path, model: str, ports: Ports, sets: tuple[str, ...], cache: str) -> list[str]:
    """`slurm-grpo local` of the smoke config; cache: the session's shared vllm.cache_dir (tests.conftest.vllm_cache),
    empty for the job folder's own cache/."""
    shared = (f"vllm.cache_dir={cache}",) if cache else ()
    return cli_argv(
        PY, "local", "configs/smoke_cpu.yaml", f"vllm.model={model}", f"job.job_dir={job_dir}", *ports.sets, *shared, *sets
    )


def local(
    job_dir: Path,
    model: str,
    ports: Ports,
    *sets: str,
    env: dict[str, str] | None = None,
    timeout: float = 900,
    cache: str = "",
) -> subprocess.CompletedProcess:
    return subprocess.run(
        local_argv(job_dir, model, ports, sets, cache),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )


def test_local_run_learns_pushes_land_and_resume_continues(tmp_path, tiny_model, ports):
    job = tmp_path / "run"
    # the job folder's own cache/ (no shared vllm.cache_dir): assert_both_starts checks the restart found vLLM's model-class
    # inspection cache there (a CPU server runs eagerly: no compile cache, launcher.core.vllm_start.CPU_EAGER)
    track = "trainer.report_to=[wandb, tensorboard]"  # W&B offline (the default), TensorBoard event files
    r = local(job, tiny_model, ports, "trainer.max_steps=16", "trainer.save_steps=8", track)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    s = json.loads((job / "summary.json").read_text())
    # real FSDP2: every trained parameter is a DTensor
    assert s["dtensor_params"]["dtensor"] == s["dtensor_params"]["total"] > 0
    hist = s["nodes"]["0"]["parity_history"]
    after = [h["max_diff"] for h in hist if h["kind"] == "after_push"]
    stale = [h["max_diff"] for h in hist if h["kind"] == "stale"]
    assert after and max(after) <= 1e-4, after  # the server holds the trainer's weights after every push
    assert min(stale) > 1e-3, stale  # ... and each push really changed what the server computes
    assert s["nodes"]["0"]["parity_final"] <= 1e-4
    assert (job / "metrics.png").stat().st_size > 1000
    assert "step 16/16" in r.stdout  # the progress lines
    # the final model in Hugging Face's format (JOB/model), and `slurm-grpo export` of the step-16 checkpoint the two
    # ranks wrote (on this host's CPU, in a child process): the same tensors
    final16 = hf_tensors(job / "model")
    export16 = tmp_path / "export16"
    x = cli("export", str(job), "--step", "16", "--out", str(export16))
    assert x.returncode == 0, x.stdout[-2000:] + x.stderr[-2000:]
    assert "model-00001-of-00001.safetensors (1/1)" in x.stdout, x.stdout
    exported = hf_tensors(export16)
    assert sorted(exported) == sorted(final16) and all(torch.equal(exported[n], final16[n]) for n in final16)
    # trainer.async_checkpoint (the default): step 8's periodic checkpoint was written in the background and completed
    # at a later step's end (rank 0's line); the rows of the checkpoint steps say how long it held them, no other row does
    held = {x["step"]: x.get("checkpoint_s") for x in read(job / "metrics.jsonl") if "reward" in x}
    assert all(held[k] is not None and held[k] >= 0 for k in (8, 16)) and all(
        held[k] is None for k in held if k not in (8, 16)
    ), held
    trainer_log = (job / "logs" / "node0-trainer.log").read_text()
    assert "checkpoint step-000008 complete (written in the background)" in trainer_log
    assert "checkpoint step 8: copied into host memory in" in trainer_log  # the step's share, apart from the write
    assert "checkpoint step-000016 complete (written in the background)" in trainer_log, "the last step's, at the end"

    # resume: run on to step 24 in the same job folder, its server serving the final model of step 16 (a copy of
    # JOB/model as vllm.model: the run writes JOB/model anew at its end), with a leftover of the first attempt (a
    # process of this job folder) still holding the server's port: the node stops it before it starts its own server
    from tests.unit.test_stale import listener

    model16 = shutil.copytree(job / "model", tmp_path / "model16")
    leftover = listener(ports.vllm, str(job))
    r = local(job, str(model16), ports, "trainer.max_steps=24", "trainer.save_steps=8", track)
    leftover.kill()
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    cleared = [e for e in read(job / "logs" / "node0-events.jsonl") if e["event"] == "leftovers"]
    assert cleared[-1]["stopped"] == [leftover.pid], cleared
    rows = read(job / "metrics.jsonl")
    resumed = [x for x in rows if x.get("event") == "resumed"]
    assert resumed and resumed[0]["from_step"] == 16 and resumed[0]["reason"] == "periodic", resumed
    steps = [x["step"] for x in rows if "reward" in x]
    assert steps == list(range(1, 25)), steps  # no step lost, none done twice
    # the LR schedule: linear to 0 at max_steps; the resumed run goes on from step 16 of its own 24-step schedule
    # (a schedule restarted at the resume would give step 17 the LR of step 1, the full 0.003)
    lrs = {x["step"]: x["lr"] for x in rows if "reward" in x}
    assert [lrs[k] for k in range(1, 17)] == pytest.approx([linear_lr(k, 16) for k in range(1, 17)]), lrs
    assert [lrs[k] for k in range(17, 25)] == pytest.approx([linear_lr(k, 24) for k in range(17, 25)]), lrs
    # retention: the newest two checkpoints (step 8 of the first run was pruned by step 24's)
    assert sorted(d.name for d in (job / "checkpoints").iterdir()) == ["step-000016", "step-000024"]
    # the vLLM CPU server serving the final model computes the trainer's logprobs: the probe before the resumed run's
    # first push compares the fresh server (JOB/model of step 16, loaded from its files) with the ranks (the checkpoint
    # of step 16, from DCP); the test below proves a push into a server started from the base model lands
    first_resumed = next(x for x in rows if x.get("step") == 17 and "reward" in x)
    assert first_resumed["parity_stale"]["0"] <= 1e-4, first_resumed
    assert first_resumed["parity"]["0"] <= 1e-4, first_resumed
    # optimizer state continued: Adam's step count in the last checkpoint is 24, not 8
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(job / "checkpoints" / "step-000024"), str(tmp_path / "ck.pt"))
    ck = torch.load(tmp_path / "ck.pt", weights_only=False)
    adam_steps = {float(v["step"]) for v in ck["optim"]["state"].values()}
    assert adam_steps == {24.0}, adam_steps
    # JOB/model now holds step 24: the final checkpoint's weights (fp32 here, trainer.dtype), the tied lm_head once
    final24 = hf_tensors(job / "model")
    assert sorted(final24) == sorted(n for n in ck["model"] if n != "lm_head.weight")
    assert all(torch.equal(final24[n], ck["model"][n]) for n in final24)
    rewards = [x["reward"] for x in rows if "reward" in x]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print(f"reward first 5 {first:.3f} -> last 5 {last:.3f}")
    assert last > first + 0.05, (first, last)
    assert_tracked(job, attempts=2, steps=24, evals=[0, 10, 16, 20, 24])
    assert_evaluated(job, [0, 10, 16, 20, 24])
    assert_both_starts(job)


def assert_both_starts(job: Path) -> None:
    """`slurm-grpo status` shows the first start and the restart, the job's phases and vLLM's own (launcher.vllm_log);
    vLLM inspected the model class in its API server (vllm.inspect_in_process: a fresh Python process took 7-16 s
    here) and wrote its cache of it into the job folder, where the restart found it."""
    from launcher.status import status
    from launcher.vllm_log import node_starts

    st = status(job)
    log = (job / "logs" / "node0-vllm.log").read_text(errors="replace")
    inherited = {k: v for k, v in os.environ.items() if k.startswith("VLLM_LOG") or "COLOR" in k}
    for name in ("first start", "restart 1"):
        # vLLM's own lines are there whatever this process inherited (launcher.node.commands.VLLM_LOG_ENV)
        assert f"start-up, {name}: server start" in st and f"vLLM start, {name}: imports" in st, (
            st,
            inherited,
            log.count("(APIServer pid="),
        )
    first, again = node_starts(job / "logs" / "node0-vllm.log")
    assert float(first["model inspection"]) <= 3 and float(again["model inspection"]) <= 3, (first, again)
    assert list((job / "cache" / "node0" / "vllm" / "modelinfos").glob("*Qwen2ForCausalLM.json"))


def assert_evaluated(job: Path, steps: list[int]) -> None:
    """trainer.eval of configs/smoke_cpu.yaml (8 held-out prompts x 2 samples, every 10 steps and at the end, before
    training on a fresh start only): a row per evaluation with plausible figures, the eval curve rising as the training
    reward does (the eval generates with the current weights), `slurm-grpo status` naming the latest."""
    from launcher.status import status

    evals = [x for x in read(job / "metrics.jsonl") if x.get("kind") == "eval"]
    assert [x["step"] for x in evals] == steps, evals
    for x in evals:
        assert (x["prompts"], x["samples_per_prompt"], x["prompts_per_node"]) == (8, 2, {"0": 8}), x
        assert set(x["pass_at"]) == {"1", "2"} and 0 <= x["pass_at"]["1"] <= x["pass_at"]["2"] <= 1, x
        assert 0 <= x["mean_at_k"] <= 1 and x["reward_funcs"]["letter_a_fraction"] == pytest.approx(x["mean_at_k"], abs=1e-5)
        assert x["seconds"] > 0 and x["gen_s"]["0"] > 0 and x["completion_tokens_mean"] > 0, x
    print("eval mean@2 per evaluation:", [x["mean_at_k"] for x in evals], "pass@1:", [x["pass_at"]["1"] for x in evals])
    assert evals[-1]["mean_at_k"] > evals[0]["mean_at_k"] + 0.05, evals
    assert f"latest eval: step {steps[-1]}: pass@1 " in status(job)


def start_local(
    job_dir: Path, model: str, ports: Ports, *sets: str, env: dict[str, str] | None = None, cache: str = ""
) -> subprocess.Popen:
    return subprocess.Popen(
        local_argv(job_dir, model, ports, sets, cache),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )


def poll_until(cond, p: subprocess.Popen, what: str, timeout: float = 600, every: float = 0.5) -> None:
    """Wait for cond() while the run is alive, with a deadline (a fault test must never hang either)."""
    deadline = time.time() + timeout
    while not cond():
        assert p.poll() is None, p.communicate()
        assert time.time() < deadline, f"no {what} within {timeout} s"
        time.sleep(every)


def wait_for_step(p: subprocess.Popen, job_dir: Path, step: int, timeout: float = 600) -> None:
    poll_until(lambda: [x for x in read(job_dir / "metrics.jsonl") if x.get("step", 0) >= step], p, f"step {step}", timeout)


def pids(job_dir: Path) -> tuple[int, int]:
    """(vLLM server pid, torchrun pid) of the latest start, from the bootstrap's events."""
    ev = read(job_dir / "logs" / "node0-events.jsonl")
    return ([e["pid"] for e in ev if e["event"] == "vllm_start"][-1], [e["pid"] for e in ev if e["event"] == "trainer_start"][-1])


def processes() -> dict[int, tuple[str, int, int]]:
    """pid -> (state, parent pid, process group) of every process in /proc (no procps needed)."""
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            state, ppid, pgid = stat[stat.rindex(")") + 2 :].split()[:3]
            out[int(d.name)] = (state, int(ppid), int(pgid))
    return out


def children(pid: int) -> list[int]:
    return [p for p, (_, ppid, _) in processes().items() if ppid == pid]


def assert_all_gone(*pids_: int) -> None:
    """No live process (zombies are dead) is one of these pids or in one of their process groups."""
    left = []
    for pid, (state, _ppid, pgid) in processes().items():
        if state not in "ZX" and (pid in pids_ or pgid in pids_):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()[:120]
            except OSError:
                continue
            left.append(f"{pid} ({state}) {cmd!r}")
    assert not left, f"still alive after the run stopped: {left}"


def stopped_after(p: subprocess.Popen, t0: float, what: str, timeout: float = 300) -> tuple[str, float]:
    """Wait for the run to end after a fault injected at t0; record the time; it must have failed.
    Returns (stderr, seconds from injection to the end)."""
    _, err = p.communicate(timeout=timeout)
    took = time.time() - t0
    report(what, took, p.returncode)
    assert p.returncode != 0, err[-3000:]
    return err, took


def test_async_generation_one_step_off_learns_and_survives_a_resume(tmp_path, tiny_model, ports, vllm_cache):
    """trainer.max_staleness 1: from step 2 on, every step trains on completions its node's server generated during
    the previous step's training (one optimizer step stale, recorded per step), no lookahead misses, every push
    lands (parity), TRL's importance-sampling figures recorded; a resume in the same folder continues with it on,
    from the first run's final checkpoint. The evaluations (trainer.eval) run in between."""
    job = tmp_path / "async"
    sets = ("trainer.max_staleness=1", "trainer.save_steps=4")
    r = local(job, tiny_model, ports, "trainer.max_steps=6", *sets, cache=vllm_cache)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    r = local(job, tiny_model, ports, "trainer.max_steps=12", *sets, cache=vllm_cache)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = read(job / "metrics.jsonl")
    resumed = [x for x in rows if x.get("event") == "resumed"]
    assert [(x["from_step"], x["reason"]) for x in resumed] == [(6, "final")], resumed
    steps = [x for x in rows if "reward" in x]
    assert [x["step"] for x in steps] == list(range(1, 13))
    # the first step of each attempt has nothing generated ahead (synchronous); every later one is one step off
    assert [x["staleness"]["0"] for x in steps] == [0, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1], [x["staleness"] for x in steps]
    assert all(x["ahead_misses"]["0"] == 0 for x in steps), [x["ahead_misses"] for x in steps]
    assert all(x["parity"]["0"] <= 1e-4 for x in steps), [x["parity"] for x in steps]
    # stale completions differ from the current policy: the mismatch TRL's correction works on is there and recorded
    stale = [x for x in steps if x["staleness"]["0"] == 1]
    assert all(x["logp_mismatch_mean"] is not None and x["is_ratio_mean"] is not None for x in stale)
    assert max(x["logp_mismatch_mean"] for x in stale) > 1e-3, [x["logp_mismatch_mean"] for x in stale]
    assert len({x["prompts_digest"]["0"] for x in steps}) == 12  # each step its own prompts, none repeated
    # the smoke config's evaluations ran between the pushes without disturbing the lookahead (no misses above): before
    # training, at each attempt's last step and every 10 steps, each with the weights the step left (pushed first)
    evals = [x for x in rows if x.get("kind") == "eval"]
    assert [x["step"] for x in evals] == [0, 6, 10, 12] and all(x["prompts"] == 8 for x in evals), evals


def test_two_steps_off_on_a_data_parallel_server_pauses_pushes_and_every_engine_gets_the_weights(
    tmp_path, tiny_model, ports, vllm_cache
):
    """vllm.data_parallel_size 2 (two vLLM engines behind the node's one server; the CPU build runs them) with
    trainer.max_staleness 2: every push reaches both engines (parity probed on each by the X-data-parallel-rank
    header, stale before and equal after), completions are at most 2 steps old (0, 1, then 2), every push with a later
    step's request outstanding pauses it (/pause?mode=keep ... /resume) and that request finishes after the push with
    every token it asked for and a logprob per token (nothing lost or doubled), and no lookahead misses."""
    job = tmp_path / "dp"
    # long completions (max_model_len 256, prompts under 20 tokens): a batch usually takes the engines longer than a
    # step's training, so the paused request of step s+2 is usually still generating (4 of 6 pushes in a quiet run)
    long = 224
    r = local(
        job,
        tiny_model,
        ports,
        "vllm.data_parallel_size=2",  # slots 0-1 serve, slot 2 trains
        "trainer.max_staleness=2",
        "trainer.max_steps=8",
        "trainer.parity_every=1",  # the stale probe before every push: each engine's weights really changed
        f"trainer.max_completion_length={long}",
        "trainer.grpo={generation_kwargs: {ignore_eos: true}}",
        "trainer.eval.max_prompts=2",  # the smoke config's evaluations, kept short: their completions are `long` too
        cache=vllm_cache,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    plan = json.loads((job / "plan.json").read_text())
    assert plan["nodes"][0]["vllm_gpus"] == [0, 1] and plan["nodes"][0]["trainer_gpus"] == [2]
    vllm_log = (job / "logs" / "node0-vllm.log").read_text()
    assert "--data-parallel-size 2" in vllm_log.splitlines()[1]  # the command the node ran (the log's header)
    # (two engines really served: the per-engine parity below asks engine 1 by name; one engine would answer 400)
    steps = [x for x in read(job / "metrics.jsonl") if "reward" in x]
    assert [x["staleness"]["0"] for x in steps] == [0, 1, 2, 2, 2, 2, 2, 2], [x["staleness"] for x in steps]
    assert all(x["ahead_misses"]["0"] == 0 for x in steps)
    for x in steps[1:]:  # the push before each later step reached both engines
        assert len(x["parity_engines"]["0"]) == 2 and max(x["parity_engines"]["0"]) <= 1e-4, x["parity_engines"]
    hist = json.loads((job / "summary.json").read_text())["nodes"]["0"]["parity_history"]
    stale = [h["per_engine"] for h in hist if h["kind"] == "stale"]
    assert stale and all(len(e) == 2 and min(e) > 1e-3 for e in stale), stale  # each engine's weights really changed
    # every push with later steps' requests outstanding paused them (steps 1-6 of 8: step 7's push has none left)
    assert [x["pushes_paused"]["0"] for x in steps] == [0, 1, 2, 3, 4, 5, 6, 6], [x["pushes_paused"] for x in steps]
    assert vllm_log.count("POST /pause?mode=keep") == vllm_log.count("POST /resume") == 6
    print("pushes that paused a request still generating:", steps[-1]["pushes_paused_running"]["0"], "of 6")
    # 8 completions of exactly `long` tokens per step, paused or not (a length mismatch of ids and logprobs fails the run)
    assert all(x["gen_tokens"]["0"] == 8 * long for x in steps), [x["gen_tokens"] for x in steps]


def test_kl_to_a_reference_model_temperature_parquet_and_datasets_data_and_parity_warn_then_fail(
    tmp_path, tiny_model, ports, vllm_cache
):
    """trainer.beta > 0 (TRL's reference model beside the FSDP2 policy) with temperature 0.7 on Parquet data, and a push
    that does not land (the gloo engine's test-only fault point receives the third push and loads none of it) under
    parity_action warn: the run goes on, warns naming the step, and the next push lands. Then, in the same folder, a
    run that starts over (trainer.resume false) on the same rows saved as a `datasets` folder, with parity_action
    fail and a tolerance of its own: its second push does not land, and it stops with the parity error."""
    from datasets import Dataset

    from trainer.push.gloo_engine import PUSH_FAULT_ENV

    rows = [json.loads(x) for x in (REPO / "data" / "letters.jsonl").read_text().splitlines() if x.strip()]

    Dataset.from_list(rows).to_parquet(str(tmp_path / "letters.parquet"))
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "letters-ds"))
    job = tmp_path / "kl"
    r = local(
        job,
        tiny_model,
        ports,
        "trainer.max_steps=5",
        "trainer.save_steps=2",
        "trainer.beta=0.04",
        "trainer.temperature=0.7",
        f"trainer.dataset={tmp_path / 'letters.parquet'}",
        "trainer.parity_action=warn",
        env={PUSH_FAULT_ENV: "skip@3"},
        cache=vllm_cache,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    steps = {x["step"]: x for x in read(job / "metrics.jsonl") if "reward" in x}
    assert sorted(steps) == [1, 2, 3, 4, 5]
    s = json.loads((job / "summary.json").read_text())
    assert s["dtensor_params"]["dtensor"] == s["dtensor_params"]["total"] > 0  # the policy is still FSDP2 beside the reference
    # the KL term: none at step 1 (the policy is the reference), then logged and growing as the policy moves away
    kl = [steps[k]["kl"] for k in range(1, 6)]
    print("kl per step:", kl)
    assert kl[0] is not None and abs(kl[0]) < 1e-6 and all(k is not None and k > 0 for k in kl[1:]), kl
    # the third push (at step 2, before step 3's generation) did not land: parity says so at step 3 and the run warned
    # with the float32 default tolerance; the next push landed
    parity = {k: x["parity"]["0"] for k, x in steps.items()}
    assert parity[3] > 1e-3 and all(parity[k] <= 1e-4 for k in (1, 2, 4, 5)), parity
    trainer_log = (job / "logs" / "node0-trainer.log").read_text()
    assert "WARNING: node 0: parity check failed at step 2" in trainer_log and "tolerance 0.001 + rounding" in trainer_log
    # temperature 0.7: vLLM's processed logprobs of the sampled tokens equal the trainer's at the same temperature,
    # except at step 3, sampled by the server's stale weights (which shows the figure can tell)
    mismatch = {k: x["logp_mismatch_mean"] for k, x in steps.items()}
    print("vLLM vs trainer logprob difference per step:", mismatch)
    assert mismatch[3] > 1e-3 and all(mismatch[k] < 1e-4 for k in (1, 2, 4, 5)), mismatch
    assert sorted(d.name for d in (job / "checkpoints").iterdir()) == ["step-000004", "step-000005"]  # step 5: the final one

    r = local(
        job,
        tiny_model,
        ports,
        "trainer.max_steps=5",
        "trainer.resume=false",
        f"trainer.dataset={tmp_path / 'letters-ds'}",
        "trainer.parity_action=fail",
        "trainer.parity_tolerance=0.0005",
        env={PUSH_FAULT_ENV: "skip@2"},
        cache=vllm_cache,
    )
    assert r.returncode != 0, r.stdout[-3000:]
    assert "parity check failed at step 1" in r.stderr and "tolerance 0.0005 + rounding" in r.stderr, r.stderr[-3000:]
    # it started over: no resume, step 1 again, on the same prompts (the same rows in the same order, from the folder)
    rows_b = read(job / "metrics.jsonl")
    assert not [x for x in rows_b if x.get("event") == "resumed"]
    again = [x for x in rows_b if "reward" in x][5:]
    assert [x["step"] for x in again] == [1] and again[0]["prompts_digest"] == steps[1]["prompts_digest"], again
    # the first run's checkpoints were set aside, not resumed from, pruned or mixed with this run's
    aside = [d for d in (job / "checkpoints").iterdir() if d.name.startswith("set-aside-")]
    assert len(aside) == 1 and sorted(d.name for d in aside[0].iterdir()) == ["step-000004", "step-000005"], aside
    assert not list((job / "checkpoints").glob("step-*"))
