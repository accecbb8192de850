"""`slurm-grpo resume`: a job folder's own config resubmitted into the same folder (its dry-run: the plan on the
new node count; its sbatch), and `status` pointing at it after a lost job. SLURM is faked at the process boundary
(conftest's fake_slurm: sbatch and sacct on PATH, answering as SLURM does), so `sacct -P` parsing is tested."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from launcher import cli
from launcher import status as jobs
from launcher.core import config as C
from launcher.core.jobdir import write_job_dir
from launcher.core.plan import plan
from launcher.status import q
from tests.conftest import FakeSlurm


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


def test_resume_on_fewer_nodes_keeps_the_folder_and_its_config(job_dir, fake_slurm: FakeSlurm, capsys):
    checkpoint(job_dir, 8)
    (job_dir / "checkpoints" / "step-000012.tmp").mkdir()  # an interrupted write never counts
    # its model /m exists only on the nodes: a dry-run runs submit's checks, so it is told so
    assert cli.main(["resume", str(job_dir), "--set", "slurm.nodes=2", "--dry-run", "--skip-path-checks"]) == 0
    out = capsys.readouterr().out
    assert f"# would resume {job_dir} from step 8 (step-000008) on 2 nodes x 2 ranks" in out, out
    assert "max_steps: 40" in out and "resume: true" in out  # the folder's own config, resume forced on
    assert f"job_dir: {job_dir}" in out
    assert fake_slurm.calls() == []  # a dry-run asks SLURM nothing


def test_resume_without_a_checkpoint_says_what_to_do(job_dir, fake_slurm: FakeSlurm, capsys):
    assert cli.main(["resume", str(job_dir)]) == 2
    assert "has no complete checkpoint" in capsys.readouterr().err
    assert fake_slurm.calls() == []


def test_resume_submits_the_folder_again_on_the_nodes_asked_for(job_dir, fake_slurm: FakeSlurm, capsys):
    checkpoint(job_dir, 8)
    (job_dir / "job_id").write_text("77\n")
    assert cli.main(["resume", str(job_dir), "--set", "slurm.nodes=2", "--skip-path-checks"]) == 0
    out = capsys.readouterr().out
    assert f"resubmitted job folder {q(job_dir)} as job 4242: resumes from step 8 on 2 nodes (4 ranks)" in out, out
    (call,) = fake_slurm.calls()
    assert call["cmd"] == "sbatch" and call["script"] == (job_dir / "job.sbatch").read_text()
    assert "#SBATCH --nodes=2" in call["script"] and f"bootstrap {q(job_dir / 'plan.json')}" in call["script"], call["script"]
    assert (job_dir / "job_id").read_text() == "4242\n"  # status and logs follow the new submission
    cfg = C.load(job_dir / "config.yaml")
    assert (cfg.slurm.nodes, cfg.trainer.resume, cfg.trainer.max_steps, cfg.job.job_dir) == (2, True, 40, str(job_dir))


def lost_job(job_dir: Path, fake: FakeSlurm, state: str) -> None:
    """Job 77 as sacct reports it after it ended in `state`: the job's row, then its steps' (the batch step
    is cancelled with the job; the srun step has its own state and exit code)."""
    (job_dir / "job_id").write_text("77\n")
    fake.set_sacct(
        {"JobID": "77", "State": state, "NodeList": "n[1-3]", "Elapsed": "00:10:00", "ExitCode": "0:0"},
        {"JobID": "77.batch", "State": "CANCELLED", "NodeList": "n1", "Elapsed": "00:10:00", "ExitCode": "0:15"},
        {"JobID": "77.0", "State": "FAILED", "NodeList": "n[1-3]", "Elapsed": "00:09:58", "ExitCode": "1:0"},
        {"JobID": "78", "State": "RUNNING", "NodeList": "n4", "Elapsed": "00:01:00", "ExitCode": "0:0"},  # not this job
    )


def pasted(hint: str) -> list[str]:
    """The arguments a shell makes of the command on a `next:` line (up to its explanation)."""
    cmd = hint.removeprefix("next: ").split("   (")[0].split(": ", 1)[-1].split(" starts it")[0]
    out = subprocess.run(["bash", "-c", "set -- " + cmd + '; printf "%s\\n" "$@"'], capture_output=True, text=True)
    return out.stdout.splitlines()


@pytest.mark.parametrize(
    "state, why",
    [
        ("NODE_FAIL", "a node failed; add --set slurm.nodes=N to go on with the nodes left"),
        ("TIMEOUT", "it reached its time limit, slurm.time=01:00:00; add --set slurm.time=HH:MM:SS for more"),
        ("FAILED", "shows the first error"),
        ("PREEMPTED", "the scheduler preempted it"),
        ("OUT_OF_MEMORY", "host memory limit (slurm.mem=unset: the partition default); add --set slurm.mem=<more>"),
        ("CANCELLED by 0", "it was cancelled (scancel)"),  # sacct names who cancelled it
        ("RUNNING", None),
        ("PENDING", None),
        ("COMPLETED", None),
    ],
)
def test_status_of_an_ended_job_prints_the_resume_command_quoted(job_dir, fake_slurm: FakeSlurm, state, why):
    checkpoint(job_dir, 8)
    lost_job(job_dir, fake_slurm, state)
    text = jobs.status(job_dir)
    # sacct asked for this job's rows, parsable, no header; every row of the job shown, the other job's not
    assert fake_slurm.calls() == [
        {"cmd": "sacct", "argv": ["-j", "77", "-n", "-P", "-o", "JobID,State,NodeList,Elapsed,ExitCode"]}
    ]
    assert f"  77  {state}  n[1-3]  00:10:00  0:0" in text and "  77.0  FAILED  n[1-3]  00:09:58  1:0" in text, text
    assert "  78  " not in text
    hints = [ln for ln in text.splitlines() if ln.startswith("next:")]
    if why is None:
        assert hints == [], text
        return
    (hint,) = hints
    assert hint.startswith("next: slurm-grpo resume " + q(job_dir) + "   (continues from step 8; ") and why in hint, hint
    assert pasted(hint) == ["slurm-grpo", "resume", str(job_dir)]


def test_an_ended_job_without_a_checkpoint_is_submitted_again_not_resumed(job_dir, fake_slurm: FakeSlurm, tmp_path):
    (job_dir / "checkpoints" / "step-000012.tmp").mkdir(parents=True)  # an interrupted write: nothing to resume from
    lost_job(job_dir, fake_slurm, "NODE_FAIL")
    (hint,) = [ln for ln in jobs.status(job_dir).splitlines() if ln.startswith("next:")]
    assert "nothing to resume (a node failed" in hint and "no complete checkpoint was written" in hint, hint
    assert cli.main(["resume", str(job_dir), "--dry-run"]) == 2  # what resume would have said
    # the printed command, pasted: the folder's config, planned into a new folder under the current one
    argv = pasted(hint)
    assert argv[:3] == ["slurm-grpo", "submit", str(job_dir / "config.yaml")], argv
    dry = [*argv[1:], "--dry-run", "--skip-path-checks"]  # its model /m exists only on the nodes
    r = subprocess.run([sys.executable, "-m", "launcher", *dry], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"-m launcher.node.bootstrap {tmp_path}/runs/grpo-" in r.stdout, r.stdout


def test_status_says_when_sacct_cannot_answer(job_dir, fake_slurm: FakeSlurm):
    lost_job(job_dir, fake_slurm, "NODE_FAIL")
    fake_slurm.answer("sacct", stderr="sacct: error: Slurm accounting storage is disabled\n", rc=1)
    text = jobs.status(job_dir)
    assert "(sacct failed: sacct: error: Slurm accounting storage is disabled)" in text and "next:" not in text, text
    fake_slurm.answer("sacct")  # it answers, with no row for the job
    text = jobs.status(job_dir)
    assert "SLURM job 77:\n  (sacct has no record of job 77; is this the cluster it was submitted to?)" in text, text


def test_resume_sets_aside_the_lost_attempts_later_steps(tmp_path):
    """A node died after step 5, the last checkpoint is step 4: step 5 runs again, so its first row moves to
    metrics.lost.jsonl (kept, not deleted) and metrics.jsonl holds every step once."""
    from launcher.core.jobdir import JobDir
    from launcher.core.records import ResumedRow, StepRow, read_rows
    from trainer.metrics import MetricsWriter

    m = MetricsWriter(tmp_path)
    with open(m.path, "a") as f:
        f.write(json.dumps({"time": 1.0, "step": 1, "reward": 0.1}) + "\n")  # a row written before rows had a kind
    m.write(ResumedRow(from_step=0, checkpoint="x"))  # not a step row: stays
    for s in range(2, 6):
        m.write(StepRow(step=s, reward=s / 10))
    with open(m.path, "a") as f:
        f.write('{"step": 6, "rew')  # a line cut by the crash
    assert m.set_aside_after(4) == 1
    kept = read_rows(m.path)
    assert [(type(r).__name__, getattr(r, "step", None)) for r in kept] == [
        ("StepRow", 1),
        ("ResumedRow", None),
        ("StepRow", 2),
        ("StepRow", 3),
        ("StepRow", 4),
    ]
    lost = read_rows(JobDir(tmp_path).metrics_lost)
    assert [r.step for r in lost if isinstance(r, StepRow)] == [5] and len(lost) == 1
    assert m.set_aside_after(4) == 0
