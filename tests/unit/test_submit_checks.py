"""Submit-time checks: a config's local paths are checked on the submit host before sbatch (one-line errors, a
--skip-path-checks way out), and every command printed for the user to paste is shell-quoted. SLURM is faked at
the process boundary (conftest's fake_slurm: commands on PATH that record their argv and answer as SLURM does), so
these tests need no SLURM on the machine and assert what it was asked."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.core import config as C
from tests.conftest import FakeSlurm, cli


@pytest.mark.parametrize(
    "override,needle",
    [
        ("vllm.model=/nonexistent/dir", "vllm.model '/nonexistent/dir': no such folder on this host"),
        (
            "trainer.dataset=/nonexistent/prompts.jsonl",
            "trainer.dataset '/nonexistent/prompts.jsonl' does not exist on this host",
        ),
        ("trainer.reward_funcs=[no_such_pkg.rewards:f]", "module 'no_such_pkg.rewards' is not importable here"),
        ("slurm.setup_vars={venv: /nonexistent/venv}", "slurm.setup_vars.venv '/nonexistent/venv': no bin/activate there"),
    ],
)
def test_a_bad_path_fails_at_submit_in_one_line_and_sbatch_is_never_called(
    fake_slurm: FakeSlurm, tiny_model, tmp_path, override, needle
):
    r = cli("submit", "configs/smoke_cpu.yaml", "--set", f"vllm.model={tiny_model}", "--set", override,
            "--set", f"job.job_dir={tmp_path / 'job'}")  # fmt: skip
    assert r.returncode == 2, r.stdout + r.stderr
    assert needle in r.stderr and "--skip-path-checks" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert fake_slurm.calls() == []  # no SLURM command ran: nothing was queued
    # a path that exists only on the compute nodes: the user says so, and the job goes to sbatch
    job = tmp_path / "job2"
    r = cli("submit", "configs/smoke_cpu.yaml", "--set", f"vllm.model={tiny_model}", "--set", override,
            "--set", f"job.job_dir={job}", "--skip-path-checks")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "submitted job 4242" in r.stdout and (job / "job_id").read_text() == "4242\n"
    assert_one_sbatch_of(fake_slurm, job)


def assert_one_sbatch_of(fake: FakeSlurm, job: Path) -> str:
    """One SLURM call, sbatch, given one script file in the job's submitit folder whose text is the job.sbatch kept in
    the job folder (what dry-run prints), running the job's bootstrap; the script's text is returned."""
    calls = fake.calls()
    assert [c["cmd"] for c in calls] == ["sbatch"], calls
    (path,) = calls[0]["argv"]
    assert Path(path).parent == job / "submitit", path
    assert calls[0]["script"] == (job / "job.sbatch").read_text()
    assert f"-m launcher.node.bootstrap {shlex.quote(str(job / 'plan.json'))}" in calls[0]["script"], calls[0]["script"]
    return calls[0]["script"]


def test_every_printed_command_is_shell_quoted(fake_slurm: FakeSlurm, tiny_model, weird_tmp_path):
    """A job folder named `it's $(touch x) one`: pasting the printed `watch it:` line must pass the folder as one
    argument and run nothing."""
    job = weird_tmp_path / "it's $(touch x) one"
    r = cli("submit", "configs/smoke_cpu.yaml", "--set", f"vllm.model={tiny_model}", "--set", f"job.job_dir={job}")
    assert r.returncode == 0, r.stderr
    assert_one_sbatch_of(fake_slurm, job)  # the folder reached sbatch whole
    lines = {ln.split(":", 1)[0]: ln.split(":", 1)[1].strip() for ln in r.stdout.splitlines() if ":" in ln}
    watch = lines["watch it"]
    assert watch.startswith("slurm-grpo status ")
    for pasted in (watch, "ls " + lines["job folder"], "ls " + lines["sbatch text"]):
        # what a shell makes of the pasted line, run in an empty folder: the arguments, and no file x created
        scratch = weird_tmp_path / "scratch"
        scratch.mkdir(exist_ok=True)
        out = subprocess.run(
            ["bash", "-c", "set -- " + pasted + '; printf "%s\\n" "$@"'], cwd=scratch, capture_output=True, text=True
        )
        args = out.stdout.splitlines()
        assert args[-1] in (str(job), str(job / "job.sbatch")), (pasted, args)
        assert not (scratch / "x").exists(), pasted


def hub_cache(home: Path, repo: str, model_dir: str) -> Path:
    """A Hugging Face cache as huggingface_hub lays it out (refs/main -> snapshots/<commit>/files), made here: no network."""
    import shutil

    commit = "0123456789abcdef0123456789abcdef01234567"
    root = home / "hub" / ("models--" + repo.replace("/", "--"))
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)
    snap = root / "snapshots" / commit
    shutil.copytree(model_dir, snap)
    return snap


def test_a_hub_name_runs_offline_on_its_cached_snapshot_and_a_missing_one_fails_before_sbatch(
    fake_slurm: FakeSlurm, tiny_model, tmp_path
):
    snap = hub_cache(tmp_path / "hf", "acme/tiny", tiny_model)
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    job = tmp_path / "job"
    r = cli("submit", "configs/smoke_cpu.yaml", "--set", "vllm.model=acme/tiny", "--set", f"job.job_dir={job}", env=env)
    assert r.returncode == 0, r.stderr
    assert f"vllm.model acme/tiny -> {snap}" in r.stdout
    assert_one_sbatch_of(fake_slurm, job)
    plan = json.loads((job / "plan.json").read_text())
    assert plan["config"]["vllm"]["model"] == str(snap)  # the job runs on the folder, not the name
    r = cli("dry-run", "configs/smoke_cpu.yaml", "--set", "vllm.model=acme/tiny", env=env)
    node_cmds = r.stdout.split("# per-node commands")[1]
    assert node_cmds.count("HF_HUB_OFFLINE=1") == 2 and f"--model {snap}" in node_cmds  # both processes, offline

    fake_slurm.calls_file.unlink()
    r = cli(
        "submit", "configs/smoke_cpu.yaml", "--set", "vllm.model=acme/missing", "--set", f"job.job_dir={tmp_path / 'j2'}", env=env
    )
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "is not in HF_HOME" in r.stderr and "hf download acme/missing" in r.stderr, r.stderr
    assert (Path(sys.executable).parent / "hf").is_file()  # the command the message names is the venv's own
    assert fake_slurm.calls() == []


def test_a_sweep_is_one_job_array_with_a_job_folder_per_point(fake_slurm: FakeSlurm, tiny_model, tmp_path, monkeypatch):
    sweep = tmp_path / "sweep"
    r = cli("sweep", "configs/smoke_cpu.yaml", "--set", f"vllm.model={tiny_model}", "--set", f"job.job_dir={sweep}",
            "--grid", "trainer.learning_rate=1e-6,3e-6", "--grid", "trainer.beta=0,0.04", "--parallel", "3")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "submitted job array 4242" in r.stdout and f"slurm-grpo status {sweep}" in r.stdout
    sbatch = (sweep / "job.sbatch").read_text()
    assert "#SBATCH --array=0-3%3" in sbatch and f"launcher.node.bootstrap --sweep {sweep}" in sbatch
    # every task logs into the one folder that exists before sbatch (SLURM makes no folders; a task fails without one)
    assert f"--output={sweep}/submitit/%A_%a_0_log.out" in sbatch and (sweep / "submitit").is_dir()
    # one sbatch for the whole grid, given the array's script (kept as job.sbatch)
    calls = fake_slurm.calls()
    assert [c["cmd"] for c in calls] == ["sbatch"] and Path(calls[0]["argv"][0]).parent == sweep / "submitit", calls
    assert calls[0]["script"] == sbatch
    record = json.loads((sweep / "sweep.json").read_text())
    want = [(1e-6, 0.0), (1e-6, 0.04), (3e-6, 0.0), (3e-6, 0.04)]
    for i, (lr, beta) in enumerate(want):
        d = sweep / f"point-{i:03d}"
        assert record["points"][i]["job_dir"] == str(d)
        cfg = C.load(d / "config.yaml")  # the resolved config of the point, flat
        assert (cfg.trainer.learning_rate, cfg.trainer.beta, cfg.job.job_dir) == (lr, beta, str(d))
        assert json.loads((d / "plan.json").read_text())["job_dir"] == str(d)
        assert (d / "job_id").read_text().strip() == f"4242_{i}"  # the array task: `status` of the point works
    # the array task finds its own point's plan
    from launcher.node.bootstrap import sweep_point_plan

    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "2")
    assert sweep_point_plan(str(sweep)) == str(sweep / "point-002" / "plan.json")
    # status: each point's state as sacct gives it for the array (pending tasks collapse into one 4242_[2-3%3] row)
    fake_slurm.calls_file.unlink()
    fake_slurm.set_sacct(
        {"JobID": "4242_0", "State": "COMPLETED", "NodeList": "n1"},
        {"JobID": "4242_0.batch", "State": "COMPLETED", "NodeList": "n1"},
        {"JobID": "4242_1", "State": "RUNNING", "NodeList": "n2"},
        {"JobID": "4242_[2-3%3]", "State": "PENDING", "NodeList": "None assigned"},
        {"JobID": "999", "State": "FAILED", "NodeList": "n3"},  # another job: not asked for
    )
    r = cli("status", str(sweep))
    assert r.returncode == 0 and r.stdout.count("point-00") == 4 and "trainer.beta=0.04" in r.stdout, r.stdout
    states = {ln.split()[0]: ln.split()[1] for ln in r.stdout.splitlines() if ln.strip().startswith("point-")}
    assert states == {"point-000": "COMPLETED", "point-001": "RUNNING", "point-002": "PENDING", "point-003": "PENDING"}
    assert [c["cmd"] for c in fake_slurm.calls()] == ["sacct"] and "4242" in fake_slurm.calls()[0]["argv"]


@pytest.mark.parametrize(
    "grid,needle",
    [
        ("slurm.nodes=1,2", "share its sbatch header"),
        ("trainer.beta", "must be section.key=v1,v2"),
        ("trainer.beta=0,0", "empty or repeated values"),
        ("beta=0,1", "must be section.key"),
        ("trainer.max_steps=3,x", "sweep point 1 (trainer.max_steps=x): trainer.max_steps must be an integer"),
    ],
)
def test_bad_grids_are_one_line_errors(fake_slurm: FakeSlurm, grid, needle):
    r = cli("sweep", "configs/smoke_cpu.yaml", "--grid", grid)
    assert r.returncode == 2 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert fake_slurm.calls() == []


def test_the_check_report_says_skipped_with_why_where_there_was_nothing_to_check(tmp_path):
    """REVIEW-newcomer item 10: `venv ok` with no venv set and `model ok` for a hub name not downloaded said ok for
    checks that looked at nothing. launcher.submit_checks (every dry-run's check section) says skipped and why."""
    from launcher.core.jobdir import make_plan
    from launcher.submit_checks import refusal, run_checks, section

    def report(cfg, skip=frozenset()):
        results = run_checks([make_plan(cfg)], skip)
        lines = [ln for ln in section(results).splitlines()[1:] if not ln.startswith("    ")]
        return lines, refusal(results, listed=True)

    hub = C.load("configs/math_example.yaml")  # a hub name, no venv, no agents
    lines, err = report(hub, skip=frozenset({"rewards"}))
    by_kind = {ln.split()[0]: ln.split(None, 2)[1:] for ln in lines}
    assert err is None and by_kind["data"][0] == "ok"
    assert by_kind["model"] == ["skipped", "hub name 'Qwen/Qwen2.5-0.5B-Instruct': checked after the download at submit"]
    assert by_kind["venv"][0] == "skipped" and by_kind["venv"][1].startswith("none set: the nodes run job.python (python)")
    assert by_kind["agents"] == ["skipped", "none set (trainer.tools, trainer.environment, trainer.rollout_func)"]
    assert by_kind["rewards"][0] == "skipped" and by_kind["rewards"][1].endswith("(--skip-checks)")
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "activate").write_text("")
    for venv, state in ((tmp_path / "venv", "ok"), (tmp_path / "nowhere", "PROBLEM")):
        lines, err = report(C.load("configs/math_example.yaml", [f"slurm.setup_vars={{venv: {venv}}}"]))
        (venv_line,) = [ln for ln in lines if ln.startswith("  venv")]
        assert venv_line.split()[1] == state and (err is not None) == (state == "PROBLEM"), lines
