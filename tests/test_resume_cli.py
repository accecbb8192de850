"""`slurm-grpo resume`: a job folder's own config resubmitted into the same folder (its dry-run: the plan on the
new node count; the submission itself is `submit`'s, tested in the cluster tier), and `status` pointing at it
after a lost job. sacct is faked at the process boundary (launcher.jobs.slurm_state)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher import cli, jobs
from launcher import config as C
from launcher.jobdir import write_job_dir
from launcher.topology import plan


@pytest.fixture
def job_dir(tmp_path: Path) -> Path:
    d = tmp_path / "it's a job"  # a folder name that needs quoting in every hint
    cfg = C.from_dict(
        {
            "job": {"device": "cpu", "job_dir": str(d)},
            "vllm": {"model": "/m"},
            "slurm": {"nodes": 3, "gpus_per_node": 3},
            "trainer": {"dtype": "float32", "max_steps": 40},
        }
    )
    write_job_dir(cfg, plan(cfg, str(d)))
    return d


def checkpoint(d: Path, step: int) -> None:
    ck = d / "checkpoints" / f"step-{step:06d}"
    ck.mkdir(parents=True)
    (ck / "meta.json").write_text(json.dumps({"step": step, "world_size": 6}))


def test_resume_on_fewer_nodes_keeps_the_folder_and_its_config(job_dir, capsys):
    checkpoint(job_dir, 8)
    (job_dir / "checkpoints" / "step-000012.tmp").mkdir()  # an interrupted write never counts
    assert cli.main(["resume", str(job_dir), "--set", "slurm.nodes=2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"# would resume {job_dir} from step 8 (step-000008) on 2 nodes x 2 ranks" in out, out
    assert "max_steps: 40" in out and "resume: true" in out  # the folder's own config, resume forced on
    assert f"job_dir: {job_dir}" in out


def test_resume_without_a_checkpoint_says_what_to_do(job_dir, capsys):
    assert cli.main(["resume", str(job_dir), "--dry-run"]) == 2
    assert "has no complete checkpoint" in capsys.readouterr().err


@pytest.mark.parametrize(
    "state, hint", [("NODE_FAIL", True), ("TIMEOUT", True), ("FAILED", True), ("RUNNING", False), ("COMPLETED", False)]
)
def test_status_of_a_lost_job_prints_the_resume_command_quoted(job_dir, monkeypatch, state, hint):
    (job_dir / "job_id").write_text("77\n")
    monkeypatch.setattr(
        jobs, "slurm_state", lambda jid: [f"{jid}|{state}|n[1-3]|00:10:00|0:0", f"{jid}.0|{state}|n1|00:10:00|1:0"]
    )
    text = jobs.status(job_dir)
    assert ("next: slurm-grpo resume '" + str(job_dir).replace("'", "'\"'\"'") + "'" in text) == hint, text


def test_resume_sets_aside_the_lost_attempts_later_steps(tmp_path):
    """A node died after step 5, the last checkpoint is step 4: step 5 runs again, so its first row moves to
    metrics.lost.jsonl (kept, not deleted) and metrics.jsonl holds every step once."""
    from trainer.metrics import MetricsWriter

    m = MetricsWriter(tmp_path)
    for s in range(1, 6):
        m.write({"step": s, "reward": s / 10})
    with open(m.path, "a") as f:
        f.write('{"step": 6, "rew')  # a line cut by the crash
    assert m.set_aside_after(4) == 1
    assert [json.loads(x)["step"] for x in m.path.read_text().splitlines()] == [1, 2, 3, 4]
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.lost.jsonl").read_text().splitlines()] == [5]
    assert m.set_aside_after(4) == 0
