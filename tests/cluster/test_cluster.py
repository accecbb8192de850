"""Cluster tier: `slurm-grpo submit` of a 2-node GRPO job on the real SLURM cluster that
scripts/start_cluster.sh starts (each node its own network namespace; fake GPUs as GRES).
Everything is asserted from the job's own outputs."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from launcher.cli import cli_argv
from launcher.core import config as C
from launcher.core.plan import Plan
from tests.conftest import PY, REPO, assert_tracked, read, report

pytestmark = pytest.mark.cluster
ENV_FILE = os.environ.get("SLURM_GRPO_CLUSTER_ENV", "/tmp/slurm-grpo-cluster/env.sh")


def cluster_env() -> dict:
    if not Path(ENV_FILE).is_file():
        pytest.fail(f"no test cluster: {ENV_FILE} missing; start it with scripts/start_cluster.sh 2 3 (scripts/test.sh does)")
    env = dict(os.environ)
    for line in Path(ENV_FILE).read_text().splitlines():
        m = re.match(r"export (\w+)=(.*)", line)
        if m:
            env[m.group(1)] = m.group(2).strip("'")
    # a stale env.sh of a cluster that is gone would otherwise fail every test with munge/sbatch noise
    r = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, env=env, timeout=30)
    if r.returncode != 0:
        pytest.fail(
            f"the test cluster of {ENV_FILE} does not answer (sinfo: {r.stderr.strip()[:200]}); "
            f"restart it: bash scripts/stop_cluster.sh --base /tmp/slurm-grpo-cluster; bash scripts/start_cluster.sh "
            f"2 3 --cpus 4 --mem 12000 --base /tmp/slurm-grpo-cluster (scripts/test.sh does both)"
        )
    return env


def sacct_state(job_id: str, env: dict) -> str:
    out = subprocess.run(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State"], capture_output=True, text=True, env=env)
    return out.stdout.strip().split("\n")[0] if out.stdout.strip() else ""


PLANTED = {"HF_TOKEN": "hf_PLANTED_fake_token_314159", "WANDB_API_KEY": "PLANTED_wandb_key_271828"}


def submit(job: Path, model: str, env: dict, *sets: str) -> str:
    r = subprocess.run(
        cli_argv(
            PY,
            "submit",
            "configs/cluster_cpu.yaml",
            f"vllm.model={model}",
            f"job.job_dir={job}",
            f"job.python={PY}",
            f"trainer.dataset={REPO}/data/letters.jsonl",
            *sets,
        ),
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    m = re.search(r"submitted job (\d+)", r.stdout)
    assert m, f"no job id in the submit output:\n{r.stdout}\n{r.stderr}"
    return m.group(1)


def events(job: Path, node: int) -> list[dict]:
    return read(job / "logs" / f"node{node}-events.jsonl")


def last_pid(job: Path, node: int, event: str) -> int:
    return [e["pid"] for e in events(job, node) if e["event"] == event][-1]


def steps_done(job: Path) -> int:
    return max((x["step"] for x in read(job / "metrics.jsonl") if "reward" in x), default=0)


def job_processes(job_id: str) -> list[str]:
    """Every process, on any node, that belongs to the job (nodes share this host's process table: each
    slurmd is only in its own network namespace), found by the SLURM_JOB_ID its environment carries."""
    mark = f"SLURM_JOB_ID={job_id}".encode()
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if mark in (d / "environ").read_bytes().split(b"\0"):
                    cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ")[:150].decode(errors="replace")
                    out.append(f"{d.name} {cmd}")
            except OSError:
                continue
    return out


def wait_until(cond, timeout: float, what: str, job_id: str, env: dict, job: Path):
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = cond()
        if got:
            return got
        state = sacct_state(job_id, env)
        if state and state not in ("PENDING", "RUNNING", "REQUEUED"):
            got = cond()  # the job may have ended between the two looks (a run here caught COMPLETED so)
            if got:
                return got
            logs = subprocess.run([PY, "-m", "launcher", "logs", str(job)], capture_output=True, text=True, cwd=REPO).stdout
            pytest.fail(f"job {job_id} ended {state} while waiting for {what}\n{logs[-4000:]}")
        time.sleep(0.5)
    pytest.fail(f"timed out after {timeout} s waiting for {what} (job {job_id})")


def connect_from_n2(port: int, host: str = "10.200.0.11") -> str:
    probe = (
        f"import socket\ntry:\n socket.create_connection(({host!r}, {port}), timeout=3); print('OPEN')\n"
        f"except OSError as e: print('CLOSED', e)"
    )
    return subprocess.run(["nsenter", "--net=/run/netns/slc-n2", PY, "-c", probe], capture_output=True, text=True).stdout


def test_two_node_job_preempted_requeued_resumes_and_completes(tmp_path, tiny_model):
    """The happy path and preemption in one job, generation one step off on each node: SIGUSR2 (what `--signal=USR2@60` sends before the time
    limit) at step >= 4 -> every rank checkpoints at the same step -> the job requeues itself -> the
    restart resumes with the same optimizer state; no step lost, none done twice. Along the way: the
    servers, the dev routes and the weight-transfer port are not reachable from the other node, and a
    token planted in the submitting environment appears nowhere in the job folder."""
    env = {**cluster_env(), **PLANTED}
    job = tmp_path / "cluster job"
    # with asynchronous generation on (one step off, per node): preemption and resume must not care
    # and W&B (offline on the nodes): the requeued attempt must continue the same run
    job_id = submit(job, tiny_model, env, "trainer.max_staleness=1", "trainer.report_to=[wandb, tensorboard]")
    p = Plan.load(job / "plan.json")

    wait_until(lambda: steps_done(job) >= 1, 600, "step 1", job_id, env, job)
    # security, while everything is up: n1's loopback-only ports are closed to n2; the rendezvous port must be open
    assert "CLOSED" in connect_from_n2(p.vllm_port), "n1's vLLM server (dev-mode routes) is reachable from n2"
    assert "CLOSED" in connect_from_n2(p.nodes[0].weight_transfer_port), "n1's weight-transfer store is reachable from n2"
    assert "OPEN" in connect_from_n2(p.rendezvous_port), "the rendezvous store must be reachable from the other nodes"

    wait_until(lambda: steps_done(job) >= 4, 600, "step 4", job_id, env, job)
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True, env=env)
    t_sig = time.time()
    req = wait_until(
        lambda: [e for n in (0, 1) for e in events(job, n) if e["event"] == "requeue"],
        180,
        "the job to requeue itself",
        job_id,
        env,
        job,
    )
    report("preemption signal (USR2) -> checkpoint written and job requeued, 2-node cluster", req[0]["t"] - t_sig, "REQUEUED")
    # a requeued job waits for its begin time; the test plays the scheduler and lets it start now
    time.sleep(2)
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], env=env, capture_output=True)
    wait_until(lambda: sacct_state(job_id, env) == "COMPLETED", 900, "the restarted job to complete", job_id, env, job)

    s = json.loads((job / "summary.json").read_text())
    hosts = {n: {e["host"] for e in events(job, n) if e["event"] == "bootstrap_start"} for n in (0, 1)}
    assert hosts == {0: {"n1"}, 1: {"n2"}}  # one bootstrap on each node, in both attempts
    assert {e["restart"] for e in events(job, 0) if e["event"] == "bootstrap_start"} == {0, 1}
    assert s["allreduce_check"] == {"got": 10.0, "expected": 10.0}  # 4 ranks across 2 nodes: 1+2+3+4
    assert s["dtensor_params"]["dtensor"] == s["dtensor_params"]["total"]
    rows = read(job / "metrics.jsonl")
    resumed = [x for x in rows if x.get("event") == "resumed"]
    assert len(resumed) == 1 and resumed[0]["from_step"] >= 4, resumed
    k = resumed[0]["from_step"]
    meta = (
        json.loads((Path(resumed[0]["checkpoint"]) / "meta.json").read_text())
        if Path(resumed[0]["checkpoint"]).exists()
        else None
    )
    steps = s["final_step"]
    assert steps == 16
    staleness = [x["staleness"] for x in rows if "reward" in x]
    assert all(set(x) == {"0", "1"} and set(x.values()) <= {0, 1} for x in staleness), staleness
    assert sum(x["0"] == 1 and x["1"] == 1 for x in staleness) >= steps - 4, staleness  # both nodes generated ahead
    assert [x["step"] for x in rows if "reward" in x] == list(range(1, steps + 1))  # none lost, none twice
    for n in ("0", "1"):
        node = s["nodes"][n]
        assert node["pushes"] == steps - k + 1  # this attempt: a push before each generation plus the final one
        assert node["parity_final"] <= 1e-4  # the server holds the final weights
        vllm_log = (job / "logs" / f"node{n}-vllm.log").read_text()
        # each node's ranks sent their requests only to their own (loopback, own namespace) server
        assert len(re.findall(r'"POST /v1/completions HTTP/1.1" 200', vllm_log)) >= steps, n
        assert len(re.findall(r'"POST /update_weights HTTP/1.1" 200', vllm_log)) == steps + 1  # both attempts
    # the optimizer continued: Adam's step count in the final checkpoint is 16, not 16 - k
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(s["final_checkpoint"], str(tmp_path / "ck.pt"))
    osd = torch.load(tmp_path / "ck.pt", weights_only=False)["optim"]["state"]
    assert {float(v["step"]) for v in osd.values()} == {16.0}
    assert_tracked(job, attempts=2, steps=16)  # one W&B run id across the requeue, figures in both parts
    assert meta is None or meta["reason"] == "preempt"  # (kept only if it is among the last two)
    assert s["reward_last"] > s["reward_first"], (s["reward_first"], s["reward_last"])
    assert (job / "metrics.png").exists()
    assert oct(job.stat().st_mode & 0o777) == "0o700"  # the job folder is the owner's only
    assert not job_processes(job_id)
    # no planted secret in anything the job wrote: job folder, sbatch script, SLURM and submitit logs
    for f in [x for x in job.rglob("*") if x.is_file()]:
        data = f.read_bytes()
        for name, value in PLANTED.items():
            assert value.encode() not in data, f"{name} leaked into {f}"


def run_fault_job(tmp_path, tiny_model, name: str, inject, *sets: str) -> tuple[Path, str, float, str]:
    """Submit a long job, wait for step 2, inject the fault, and time until SLURM and the process table say
    the whole job is gone (on both nodes)."""
    env = cluster_env()
    job = tmp_path / name
    job_id = submit(job, tiny_model, env, "trainer.max_steps=200", "trainer.save_steps=0", *sets)
    wait_until(lambda: steps_done(job) >= 2, 600, "step 2", job_id, env, job)
    t0 = inject(job)
    deadline = time.time() + 300
    while time.time() < deadline and (sacct_state(job_id, env) in ("RUNNING", "PENDING", "") or job_processes(job_id)):
        time.sleep(0.25)
    took = time.time() - t0
    state = sacct_state(job_id, env)
    assert not job_processes(job_id), f"left behind: {job_processes(job_id)}"  # no orphan on any node
    assert state == "FAILED", state
    failed = {n: [e for e in events(job, n) if e["event"] == "failed"] for n in (0, 1)}
    # the node that failed says why; the other one says it stopped because of it
    assert failed[1] and not failed[1][0]["remote"], failed
    assert failed[0] and failed[0][0]["remote"] and "node 1 (n2) failed" in failed[0][0]["error"], failed
    return job, failed[1][0]["error"], took, state


def test_paused_server_on_one_node_times_out_and_stops_both_nodes(tmp_path, tiny_model):
    def inject(job: Path) -> float:
        # SIGSTOP n2's server while its generation request is in flight or about to be sent. Each step's
        # requests are: parity probe, push, reset_prefix_cache, parity probe, generation. Stop right after the
        # second probe's access line; if the (fast) generation had already answered by then, the next request
        # would be a push: resume at once (a pause of well under the timeout) and try at the next step.
        log = job / "logs" / "node1-vllm.log"
        server = last_pid(job, 1, "vllm_start")
        offset = log.stat().st_size
        deadline = time.time() + 300
        while time.time() < deadline:
            new = log.read_bytes()[offset:]
            i = new.rfind(b"POST /reset_prefix_cache")
            if i < 0 or b"POST /v1/completions" not in new[i:]:
                time.sleep(0.005)
                continue
            # the access line is logged as the answer starts: let its body reach the trainer first, or the
            # probe, not the generation, would be the request left hanging
            time.sleep(0.05)
            os.killpg(server, signal.SIGSTOP)
            t = time.time()
            time.sleep(0.2)  # let a line already being written land
            if log.read_bytes()[offset + i :].count(b"POST /v1/completions") == 1:
                return t  # the generation has not answered: the server is stopped under it
            os.killpg(server, signal.SIGCONT)
            offset = log.stat().st_size
        raise AssertionError("never caught node 1's server before its generation answered")

    job, error, took, state = run_fault_job(
        tmp_path, tiny_model, "paused", inject, "trainer.request_timeout_s=20", "trainer.push_timeout_s=20"
    )
    report("vLLM server on node 1 paused (SIGSTOP) during generation -> whole 2-node job gone", took, state)
    assert "generation" in error and "no answer within 20 s" in error, error
    assert took < 20 + 60, took


def test_dead_trainer_rank_on_one_node_stops_both_nodes(tmp_path, tiny_model):
    def inject(job: Path) -> float:
        torchrun = last_pid(job, 1, "trainer_start")
        for pid in subprocess.run(["pgrep", "-P", str(torchrun)], capture_output=True, text=True).stdout.split():
            if b"RANK=3" in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                os.kill(int(pid), signal.SIGKILL)  # node 1's second rank
                return time.time()
        raise AssertionError("no rank 3 under node 1's torchrun")

    job, error, took, state = run_fault_job(tmp_path, tiny_model, "rank death", inject)
    report("trainer rank 3 (node 1) killed -> whole 2-node job gone", took, state)
    assert "trainer" in error and "node1-trainer.log" in error, error
    # the real cause (from torchrun's summary), not its surviving local rank's "reset by peer"
    assert "rank 3" in error and "SIGKILL" in error, error
    assert took < 60, took


def kill_node(env: dict, node: str) -> list[str]:
    """Power loss of one emulated node: SIGKILL every process in its UTS namespace (its slurmd, the job's
    slurmstepd, bootstrap, vLLM and ranks), all at once. Nodes share this host's process table."""
    uts = (Path(env["SLC_BASE"]) / "nodes" / node / "utsns").read_text().strip()
    victims = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if os.readlink(d / "ns" / "uts") == uts:
                    victims.append((int(d.name), (d / "cmdline").read_bytes().replace(b"\0", b" ")[:80].decode(errors="replace")))
            except OSError:
                continue
    for pid, _ in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return [cmd for _, cmd in victims]


OURS = ("launcher.node.bootstrap", "vllm.entrypoints", "torch.distributed.run", "trainer.main")


def test_a_lost_node_is_named_and_the_run_resumes_on_the_node_left(tmp_path, tiny_model):
    """Last in this file: it kills node n2 (slurmd included) for good. Node 0 must stop its own server and ranks
    within job.node_timeout_s plus a few seconds, naming node 1; `slurm-grpo resume` then finishes the run on
    n1 alone (4 ranks' checkpoint resharded to 2), every step once, the server proven to hold the checkpoint."""
    env = cluster_env()
    job = tmp_path / "lost"
    job_id = submit(job, tiny_model, env, "trainer.max_steps=12", "trainer.save_steps=2", "job.node_timeout_s=20")
    wait_until(lambda: steps_done(job) >= 3, 600, "step 3", job_id, env, job)
    killed = kill_node(env, "n2")
    t0 = time.time()
    assert any("slurmd" in c for c in killed), killed

    def node0_stopped() -> bool:
        failed = [e for e in events(job, 0) if e["event"] == "failed"]
        return bool(failed) and not any(m in p for p in job_processes(job_id) for m in OURS)

    deadline = time.time() + 120
    while time.time() < deadline and not node0_stopped():
        time.sleep(0.25)
    took = time.time() - t0
    report("whole node 1 lost (every process of its namespace, slurmd too) -> node 0 stopped, naming it", took, "stopped")
    error = next(e["error"] for e in events(job, 0) if e["event"] == "failed")
    assert "node 1 (n2) stopped answering: no heartbeat for" in error, error
    assert took < 20 + 15, took  # node_timeout_s, plus a bounded stop
    # SLURM's own verdict follows (it declares the node down after SlurmdTimeout); a requeued copy of the job
    # would wait for two nodes forever: cancel it, the user's next step is `slurm-grpo resume`
    deadline = time.time() + 300
    while time.time() < deadline and job_processes(job_id):
        time.sleep(0.5)
    assert not job_processes(job_id), f"left behind: {job_processes(job_id)}"  # no process of the job on any node
    subprocess.run(["scancel", job_id], env=env, capture_output=True, timeout=30)
    deadline = time.time() + 120
    while time.time() < deadline and sacct_state(job_id, env) in ("RUNNING", "PENDING", "REQUEUED", ""):
        time.sleep(0.5)
    status = subprocess.run([PY, "-m", "launcher", "status", str(job)], capture_output=True, text=True, env=env, cwd=REPO)
    assert "next: slurm-grpo resume" in status.stdout, status.stdout
    saved = [int(d.name.split("-")[1]) for d in (job / "checkpoints").glob("step-*") if (d / "meta.json").is_file()]
    assert saved and max(saved) >= 2, saved  # the last complete checkpoint is intact

    r = subprocess.run(
        cli_argv(PY, "resume", str(job), "slurm.nodes=1"), capture_output=True, text=True, env=env, cwd=REPO, timeout=60
    )
    assert r.returncode == 0, r.stdout + r.stderr
    m = re.search(r"as job (\d+)", r.stdout)
    assert m, r.stdout
    resumed_id = m.group(1)
    wait_until(lambda: sacct_state(resumed_id, env) == "COMPLETED", 900, "the resumed job to complete", resumed_id, env, job)
    rows = read(job / "metrics.jsonl")
    steps = [x["step"] for x in rows if "reward" in x]
    assert steps == list(range(1, 13)), steps  # every step once across both attempts (redone ones set aside)
    resumed = [x for x in rows if x.get("event") == "resumed"]
    assert resumed and resumed[-1]["from_step"] == max(saved), resumed
    first = next(x for x in rows if x.get("step") == max(saved) + 1 and "reward" in x and x["time"] > resumed[-1]["time"])
    assert first["parity_stale"]["0"] > 1e-3 and first["parity"]["0"] <= 1e-3, first  # base model -> checkpoint
    assert "resharding checkpoint" in (job / "logs" / "node0-trainer.log").read_text()  # 4 ranks -> 2
    # the data cursor: the 2-node attempt consumed 32 sampler indices per step (4 ranks x 8 completions), which the
    # checkpoint recorded; the 1-node attempt (16 per step) skips exactly that, not its own rate x steps
    assert resumed[-1]["data_indices_skipped"] == max(saved) * 4 * 8, resumed[-1]
    # the reward is printed, not asserted: 12 tiny-model steps, the last ones on half the batch, are too few
    # for a rise that always shows (a run here: 0.055 -> 0.063); tests/integration/test_integration.py asserts learning
    rewards = [x["reward"] for x in rows if "reward" in x]
    print(f"reward first 3 {sum(rewards[:3]) / 3:.3f} -> last 3 {sum(rewards[-3:]) / 3:.3f}")


def test_a_two_point_sweep_runs_as_one_job_array_each_point_with_its_own_config(tmp_path, tiny_model):
    """`slurm-grpo sweep` on the real cluster: one sbatch, an array of 2 one-node tasks (one per grid point; SLURM
    places them on either node, side by side or one after the other), both COMPLETED, each trained with its own
    learning rate (its folder's resolved config and its metrics), and `slurm-grpo status` of the sweep folder lists
    both with their state and last reward."""
    env = cluster_env()
    sweep = tmp_path / "sweep"
    argv = cli_argv(
        PY, "sweep", "configs/cluster_cpu.yaml", f"vllm.model={tiny_model}", f"job.job_dir={sweep}", f"job.python={PY}",
        f"trainer.dataset={REPO}/data/letters.jsonl", "slurm.nodes=1", "trainer.max_steps=3", "trainer.save_steps=0",
    ) + ["--grid", "trainer.learning_rate=0.003,1e-9"]  # fmt: skip
    r = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr
    array_id = re.search(r"submitted job array (\d+)", r.stdout).group(1)  # type: ignore[union-attr]
    for i in (0, 1):
        wait_until(
            lambda i=i: sacct_state(f"{array_id}_{i}", env) == "COMPLETED", 900, f"point {i}", f"{array_id}_{i}", env, sweep / f"point-00{i}"
        )  # fmt: skip
    for i, lr in ((0, 0.003), (1, 1e-9)):
        d = sweep / f"point-00{i}"
        assert C.load(d / "config.yaml").trainer.learning_rate == lr
        rows = [x for x in read(d / "metrics.jsonl") if "reward" in x]
        assert [x["step"] for x in rows] == [1, 2, 3]
        s = json.loads((d / "summary.json").read_text())
        assert s["final_step"] == 3
        hosts = {e["host"] for e in events(d, 0) if e["event"] == "bootstrap_start"}
        assert len(hosts) == 1 and hosts <= {"n1", "n2"}, hosts  # the point ran as a one-node job of the cluster
        # learning rate 1e-9 leaves the weights where they were: parity before each push finds nothing to catch up
        stale = [h["max_diff"] for h in s["nodes"]["0"]["parity_history"] if h["kind"] == "stale"]
        assert (max(stale) < 1e-4) == (lr == 1e-9), (lr, stale)
    st = subprocess.run([PY, "-m", "launcher", "status", str(sweep)], capture_output=True, text=True, env=env, cwd=REPO)
    assert st.stdout.count("COMPLETED") == 2 and "trainer.learning_rate=1e-9" in st.stdout, st.stdout
