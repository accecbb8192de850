"""What submit, resume, local and dry-run say about the job folder they use, and what a failed sbatch leaves: a folder
that already holds a checkpoint is resumed and says so (one with nothing left to train is refused), an sbatch that
gave no job id is reported once with its cause and fix and leaves no folder `status` would read as a job. SLURM is
faked at the process boundary (conftest's fake_slurm: sbatch on PATH answering as the real one does), or absent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher import cli
from launcher.core import config as C
from launcher.core.jobdir import JobDir, make_plan, meta_file, write_job_dir
from launcher.status import q, status
from tests.conftest import FakeSlurm

REPO = Path(__file__).resolve().parents[2]
SMOKE = str(REPO / "configs" / "smoke_cpu.yaml")  # trainer.max_steps 30

NO_CONFIG_SOURCE = (  # sbatch 22.05 on a host without slurm.conf or a reachable controller (exit 1)
    "sbatch: error: resolve_ctls_from_dns_srv: res_nsearch error: Unknown host\n"
    "sbatch: error: fetch_config: DNS SRV lookup failed\n"
    "sbatch: error: _establish_config_source: failed to fetch config\n"
    "sbatch: fatal: Could not establish a configuration source\n"
)


def job_with_checkpoint(d: Path, step: int) -> Path:
    """A job folder of the smoke config that a run left with a complete checkpoint at `step`."""
    cfg = C.load(SMOKE, [f"job.job_dir={d}"])
    write_job_dir(cfg, make_plan(cfg))
    ck = JobDir(d).checkpoint(step)
    ck.mkdir(parents=True)
    meta_file(ck).write_text(json.dumps({"step": step, "world_size": 2}))
    return d


def submit(d: Path, *sets: str, command: str = "submit") -> int:
    sets_ = [x for s in (f"job.job_dir={d}", *sets) for x in ("--set", s)]
    return cli.main([command, SMOKE, *sets_, *([] if command == "local" else ["--skip-path-checks"])])


# --------------------------------------------------------------------------------------- a folder with a checkpoint


def test_a_reused_job_folder_says_the_run_resumes_from_its_checkpoint(tmp_path, capsys, fake_slurm: FakeSlurm):
    d = job_with_checkpoint(tmp_path / "job", 20)
    said = (
        f"job folder {q(d)} holds checkpoint step 20: this run resumes from it (trainer.resume); for a new run set "
        "job.job_dir to a new folder or --set trainer.resume=false"
    )
    assert submit(d, "trainer.learning_rate=0.1", command="dry-run") == 0
    assert capsys.readouterr().err.strip() == f"note: {said}"
    assert submit(d, "trainer.learning_rate=0.1") == 0
    out, err = capsys.readouterr()
    assert err.strip() == f"note: {said}" and "submitted job 4242" in out, out + err
    # a new run in the same folder, as the line says: nothing to say
    assert submit(d, "trainer.resume=false", command="dry-run") == 0
    assert "note:" not in capsys.readouterr().err


@pytest.mark.parametrize("sets", [[], ["trainer.max_steps=10"]], ids=["30-of-30", "past-max-steps"])
def test_a_folder_with_nothing_left_to_train_is_refused_and_a_dry_run_notes_it(sets, tmp_path, capsys, fake_slurm: FakeSlurm):
    d = job_with_checkpoint(tmp_path / "job", 30)
    total = 10 if sets else 30
    assert submit(d, *sets) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"slurm-grpo submit: error: job folder {q(d)} holds checkpoint step 30, at or past trainer.max_steps ({total}): "
        "resuming from it (trainer.resume) leaves nothing to train; raise trainer.max_steps to train on, or for a new "
        "run set job.job_dir to a new folder or --set trainer.resume=false"
    )
    assert submit(d, *sets, command="local") == 2  # refused before a server starts
    assert "leaves nothing to train" in capsys.readouterr().err
    assert submit(d, *sets, command="dry-run") == 0
    assert capsys.readouterr().err.startswith("note: submit would refuse this: job folder")

    resume = ["resume", str(d), *[x for s in sets for x in ("--set", s)], "--skip-path-checks"]
    left = f"{q(d)} is at step 30 of trainer.max_steps {total}: nothing left to train; to train on, raise it: "
    assert cli.main([*resume, "--dry-run"]) == 0
    assert capsys.readouterr().err.strip() == f"note: resume would refuse this: {left}--set trainer.max_steps=<more than 30>"
    assert cli.main(resume) == 2
    assert capsys.readouterr().err.strip() == f"slurm-grpo resume: error: {left}--set trainer.max_steps=<more than 30>"
    assert fake_slurm.calls() == []  # nothing was queued
    assert cli.main([*resume, "--set", "trainer.max_steps=40"]) == 0  # the way out it names
    assert "resumes from step 30" in capsys.readouterr().out


# ----------------------------------------------------------------------------------------------- a failed sbatch


def test_submit_without_slurm_on_path_says_so_in_one_line_and_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))  # no sbatch, no srun
    d = tmp_path / "job"
    assert submit(d) == 1
    err = capsys.readouterr().err.strip()
    assert err == (
        "slurm-grpo submit: sbatch and srun not found on PATH: this host has no SLURM; submit from the cluster's login "
        "node (`slurm-grpo local CONFIG` runs the job on this machine, `slurm-grpo dry-run CONFIG` prints the sbatch text)"
    )
    assert not d.exists()
    assert cli.main(["sweep", SMOKE, "--grid", "trainer.beta=0,0.04", "--set", f"job.job_dir={d}", "--skip-path-checks"]) == 1
    assert "sbatch and srun not found on PATH" in capsys.readouterr().err and not d.exists()


def test_an_unreachable_controller_is_said_once_and_leaves_no_job_folder(tmp_path, capsys, fake_slurm: FakeSlurm):
    fake_slurm.answer("sbatch", stderr=NO_CONFIG_SOURCE, rc=1)
    d = tmp_path / "job"
    assert submit(d) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "slurm-grpo submit: sbatch: fatal: Could not establish a configuration source",
        "no job folder kept (no job was queued); this host cannot reach SLURM's controller: submit from the cluster's "
        "login node (where `sinfo` answers)",
    ]
    assert [c["cmd"] for c in fake_slurm.calls()] == ["sbatch"] and not d.exists()
    sweep = tmp_path / "sweep"
    assert cli.main(["sweep", SMOKE, "--grid", "trainer.beta=0,0.04", "--set", f"job.job_dir={sweep}", "--skip-path-checks"]) == 1
    assert len(capsys.readouterr().err.strip().splitlines()) == 2 and not sweep.exists()


def test_a_kept_folder_of_a_failed_sbatch_reads_as_never_submitted_until_a_submit_goes_through(
    tmp_path, capsys, fake_slurm: FakeSlurm
):
    d = tmp_path / "job"
    d.mkdir()  # there before this submit (job.job_dir named an existing folder): kept
    fake_slurm.answer("sbatch", stderr="sbatch: error: Batch job submission failed: Invalid account or account/partition", rc=1)
    assert submit(d) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and err[1].endswith(f"job folder kept: {q(d)} (job.sbatch: what was sent)"), err
    text = status(d)
    assert "never submitted: sbatch failed (sbatch: error: Batch job submission failed: Invalid account" in text, text
    assert "vLLM" not in text and "local run" not in text
    (fake_slurm.state / "sbatch.answer.json").unlink()  # sbatch takes it now
    assert submit(d) == 0
    assert "never submitted" not in status(d) and "SLURM job 4242" in status(d)


def test_an_sbatch_that_timed_out_keeps_the_folder_and_status_says_the_job_may_be_queued(tmp_path, capsys, fake_slurm: FakeSlurm):
    """The controller's reply was lost: the job may exist, running from this folder, so the folder stays."""
    timed_out = "sbatch: error: Batch job submission failed: Socket timed out on send/recv operation"
    fake_slurm.answer("sbatch", stderr=timed_out, rc=1)
    d = tmp_path / "job"
    assert submit(d) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"slurm-grpo submit: {timed_out}",
        "sbatch gave no job id, yet the job may be queued: `squeue --me --name smoke-cpu` shows it; job folder kept: "
        f"{q(d)} (job.sbatch: what was sent)",
    ]
    assert (d / "job.sbatch").is_file()
    assert f"the newest submit failed: {timed_out}; sbatch gave no job id, yet the job may be queued" in status(d)


def test_an_oserror_after_sbatch_gave_its_id_keeps_the_folder_and_a_new_run_clears_the_record(tmp_path):
    """Popen's error naming sbatch means it never ran (no job); any other OSError comes from submitit's own files
    after sbatch answered (a full disk, a file system without symlinks): the job may be queued, its folder stays. A
    new run in a kept folder (local, or the next submit) starts without the old record, so `status` reads it."""
    from launcher.submit import SbatchFailed

    never = SbatchFailed.of(FileNotFoundError(2, "No such file or directory", "sbatch"), "smoke-cpu")
    after = SbatchFailed.of(OSError(122, "Disk quota exceeded", str(tmp_path / "submitit" / "4242")), "smoke-cpu")
    assert not never.maybe_queued and never.reason.startswith("sbatch could not run")
    assert after.maybe_queued and "squeue --me --name smoke-cpu" in after.fix, after
    d = job_with_checkpoint(tmp_path / "job", 5)
    JobDir(d).submit_failed.write_text(after.record())
    assert "the newest submit failed: after sbatch" in status(d)
    cfg = C.load(SMOKE, [f"job.job_dir={d}"])
    write_job_dir(cfg, make_plan(cfg))
    assert not JobDir(d).submit_failed.exists() and "submit failed" not in status(d)
