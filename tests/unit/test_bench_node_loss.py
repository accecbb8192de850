"""The lost-node benchmark's census of a job's processes (bench.node_loss_cluster): found by the job id in their
environment, sorted into ours (the bootstrap and everything under it) and SLURM's, on real processes of this machine."""

from __future__ import annotations

import os
import subprocess
import time

from bench.node_loss_cluster import job_processes, kind_of

JOB = "987654321"


def test_a_job_s_processes_are_found_by_its_id_and_sorted_by_who_started_them() -> None:
    env = {**os.environ, "SLURM_JOB_ID": JOB}
    # a stand-in bootstrap (its command line names the module) with a child that is neither vLLM nor a rank, a process
    # of the job outside it (as srun or the batch script are), and one of another job
    boot = subprocess.Popen(["sh", "-c", "sleep 30; true", "launcher.node.bootstrap"], env=env)
    outside = subprocess.Popen(["sleep", "30"], env=env)
    other = subprocess.Popen(["sleep", "30"], env={**os.environ, "SLURM_JOB_ID": JOB + "1"})
    found: dict = {}
    try:
        deadline = time.time() + 5
        while time.time() < deadline:
            found = {p.pid: p for p in job_processes(JOB, {})}
            if len(found) == 3:
                break
            time.sleep(0.05)
        assert boot.pid in found and outside.pid in found and other.pid not in found, found
        assert found[boot.pid].kind == "bootstrap"
        assert found[outside.pid].kind == "other"
        child = [p for p in found.values() if p.pid not in (boot.pid, outside.pid)]
        assert [(p.kind, p.cmd) for p in child] == [("under the bootstrap", "sleep 30")]
        assert {p.host for p in found.values()} == {"host"}  # no node namespace given: this machine's own
    finally:
        for pid in set(found) - {boot.pid, outside.pid}:  # the stand-in's sleep, by its pid
            os.kill(pid, 9)
        for p in (boot, outside, other):
            p.kill()
            p.wait()


def test_the_job_s_own_processes_are_told_apart_by_their_command_lines() -> None:
    assert kind_of("python -m vllm.entrypoints.openai.api_server --model m", True) == "vllm"
    assert kind_of("VLLM::EngineCore", True) == "vllm"
    assert kind_of("python -m torch.distributed.run --nnodes 3 -m trainer.main plan.json", True) == "torchrun"
    assert kind_of("python -u -m trainer.main plan.json", True) == "rank"
    assert kind_of("slurmstepd: [123.0]", False) == "slurmstepd"
    # srun's command line holds the bootstrap's: it is SLURM's, not ours (a first run here counted it as the bootstrap)
    assert kind_of("srun --unbuffered --kill-on-bad-exit=1 python -u -m launcher.node.bootstrap plan.json", False) == "srun"
    assert kind_of("python -u -m launcher.node.bootstrap plan.json", False) == "bootstrap"
    assert kind_of("/bin/bash /tmp/spool/job123/slurm_script", False) == "batch script"
