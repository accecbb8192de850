"""slurm-grpo: GRPO on SLURM with one vLLM server per node.

slurm-grpo dry-run CONFIG [--set a.b=c ...]   print the plan, the sbatch text and every node's commands
slurm-grpo submit CONFIG [--dry-run]          write the job folder and sbatch it (via submitit)
slurm-grpo local CONFIG                       run the same bootstrap here as a one-node job (no SLURM)
slurm-grpo resume JOB_DIR [--set ...]         resubmit into the same folder, continue from its checkpoint
slurm-grpo status|logs|cancel JOB_DIR|JOB_ID  look after a job
slurm-grpo sync JOB_DIR                       upload the job's offline W&B run from the login node
slurm-grpo sweep CONFIG --grid k=v1,v2 ...    a grid of configs as one job array, a job folder per point
slurm-grpo export JOB_DIR [--step N]           a checkpoint as a Hugging Face model (or LoRA adapter), on CPU
slurm-grpo make-tiny-model DIR                build a tiny Qwen2 + tokenizer locally (tests, CPU smoke run)
slurm-grpo dequantize SRC DST                 a bf16 copy of an mxfp4 (gpt-oss) or fp8 block-wise checkpoint
slurm-grpo simulate CONFIG --nodes 1,2,...    predicted step time, per-node design vs one global server
slurm-grpo config-reference [SECTION]         every config key, its default and meaning
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from launcher.core import config as config_mod
from launcher.core.config import ConfigError, JobConfig
from launcher.core.jobdir import JobDir
from launcher.core.plan import Plan
from launcher.core.records import eval_rows, format_eval, format_summary, read_rows, step_rows, summarize
from launcher.dryrun import node_table, render_dry_run
from launcher.memory import plan_report
from launcher.status import cancel, find_job_dir, log_files, q, status

if TYPE_CHECKING:
    from launcher.submit import SbatchFailed


def cli_argv(python: str, command: str, config: str, *sets: str) -> list[str]:
    """`python -m launcher COMMAND CONFIG --set a.b=c ...`: the command line tests and the benchmark run."""
    return [python, "-m", "launcher", command, config, *[x for s in sets for x in ("--set", s)]]


def _add_set_arg(p: argparse.ArgumentParser, what: str = "a config value") -> None:
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help=f"override {what} (YAML values; a text key takes its value as typed), e.g. --set slurm.nodes=4 trainer.max_steps=50; may be repeated",
    )


def expand_sets(argv: list[str]) -> list[str]:
    """`--set a=1 b=2` (the form simulate prints) -> `--set a=1 --set b=2`: the words after --set that hold '=' and are
    no option; a config path after them stays the positional argument it is."""
    out: list[str] = []
    taking = empty = False  # after a --set; and that --set has no value yet
    for word in argv:
        if taking and "=" in word and not word.startswith("-"):
            out += ["--set", word]
            empty = False
            continue
        if empty:
            out.append("--set")  # a --set with no pair: argparse takes the next word or says what it needs
        taking = empty = word == "--set"
        out += [] if taking else [word]
    return out + ["--set"] * empty


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML job config, e.g. configs/smoke_cpu.yaml")
    _add_set_arg(p)


def _load(a: argparse.Namespace, **force: object) -> JobConfig:
    """The config of a command, a hub model name resolved to its cached snapshot (the nodes run offline): downloaded
    first by submit and local, only looked up by dry-run."""
    from launcher.hub import resolve_hub_model

    overrides = list(a.overrides) + [f"{k}={json.dumps(v)}" for k, v in force.items()]
    check_config_path(a.config)
    cfg = config_mod.load(a.config, overrides)
    return resolve_hub_model(cfg, download=a.command in ("submit", "local", "sweep") and not getattr(a, "dry_run", False))


def check_config_path(path: str) -> None:
    """A folder given where the YAML config goes: say so, with the YAML files in it (the loader would say "not found")."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        return
    found = sorted(f.name for f in folder.iterdir() if f.suffix in (".yaml", ".yml") and f.is_file())
    if not found:
        raise ConfigError(f"{q(path)} is a directory with no .yaml file in it; give a YAML config, e.g. configs/smoke_cpu.yaml")
    listed = ", ".join(found[:8]) + (f" and {len(found) - 8} more" if len(found) > 8 else "")
    raise ConfigError(f"{q(path)} is a directory; give one of its YAML configs, e.g. {q(folder / found[0])} (it holds {listed})")


def resume_note(cfg: JobConfig, p: Plan, resuming: bool = False) -> tuple[str, bool] | None:
    """What a run does in a job folder that already holds a checkpoint (trainer.resume on): the line that says so,
    and whether nothing is left to train (its newest step at or past trainer.max_steps: submit refuses that, a dry-run
    notes it). resuming: the `resume` command, whose preface already names the step."""
    done = JobDir(Path(p.job_dir)).complete_checkpoints() if cfg.trainer.resume else []
    if not done:
        return None
    step, total, d = done[-1][0], cfg.trainer.max_steps, q(p.job_dir)
    if step >= total and resuming:
        return (
            f"{d} is at step {step} of trainer.max_steps {total}: nothing left to train; to train on, raise it: "
            f"--set trainer.max_steps=<more than {step}>",
            True,
        )
    if step >= total:
        return (
            f"job folder {d} holds checkpoint step {step}, at or past trainer.max_steps ({total}): resuming from it "
            "(trainer.resume) leaves nothing to train; raise trainer.max_steps to train on, or for a new run set "
            "job.job_dir to a new folder or --set trainer.resume=false",
            True,
        )
    if resuming:
        return None
    return (
        f"job folder {d} holds checkpoint step {step}: this run resumes from it (trainer.resume); for a new run set "
        "job.job_dir to a new folder or --set trainer.resume=false",
        False,
    )


def _refuse_or_note(cfg: JobConfig, p: Plan, resuming: bool = False) -> None:
    """submit, resume and local: refuse a job with nothing left to train, else say that it resumes (stderr)."""
    note = resume_note(cfg, p, resuming)
    if note and note[1]:
        raise ConfigError(note[0])
    if note:
        print(f"note: {note[0]}", file=sys.stderr, flush=True)


def _skipped(a: argparse.Namespace) -> frozenset[str]:
    """The kinds of submit-host checks this command skips (--skip-checks, --skip-path-checks = all)."""
    from launcher.core.inputs import CHECK_KINDS, parse_skip

    if getattr(a, "skip_path_checks", False):
        return frozenset(CHECK_KINDS)
    return parse_skip(getattr(a, "skip_checks", "") or "")


def cmd_dry_run(a: argparse.Namespace) -> int:
    """The plan, the sbatch text and the commands, then the submit host's checks (those not skipped): a problem
    submit would refuse makes the dry-run fail too. `dry-run --grid` is `sweep --dry-run`."""
    from launcher.core.jobdir import make_plan

    if a.grid:  # a sweep's dry-run: the grid, the array's sbatch text and every point's checks
        a.dry_run, a.parallel = True, 0
        return cmd_sweep(a)
    cfg = _load(a)
    return _show_and_check(cfg, make_plan(cfg), "", _skipped(a))


def _show_and_check(cfg: JobConfig, p: Plan, preface: str, skip: frozenset[str], resuming: bool = False) -> int:
    """Every dry-run (dry-run, submit/resume --dry-run): what would be submitted, then the checks submit runs, failing
    where submit would refuse; last, a note on a job folder that already holds a checkpoint (one with nothing left to
    train is noted, not failed: the config is sound, the folder is done)."""
    from launcher.submit_checks import refusal, run_checks, section

    print(preface + render_dry_run(cfg, p))
    results = run_checks([p], skip)
    print("\n" + section(results))
    note = resume_note(cfg, p, resuming)
    if note:
        refused = f"note: {'resume' if resuming else 'submit'} would refuse this: "
        print((refused if note[1] else "note: ") + note[0], file=sys.stderr, flush=True)
    err = refusal(results, listed=True)
    if err:
        raise err
    return 0


def _show_or_submit(
    cfg: JobConfig, p: Plan, dry_run: bool, preface: str = "", skip: frozenset[str] = frozenset(), resuming: bool = False
):
    """--dry-run: print what would be submitted, run the checks and return None; else the same checks (refused
    before anything is written), the job folder, sbatch. A new folder of a job sbatch did not queue is removed again."""
    from launcher.core.jobdir import write_job_dir
    from launcher.simulate import timeout_warning
    from launcher.submit import SbatchFailed, check_submittable, submit
    from launcher.submit_checks import refusal, run_checks

    if dry_run:
        _show_and_check(cfg, p, preface, skip, resuming)
        return None
    _refuse_or_note(cfg, p, resuming)
    check_submittable(cfg)  # before the job folder is written
    err = refusal(run_checks([p], skip), listed=False)
    if err:  # before sbatch: a typo must not wait in the queue
        raise err
    for line in [*plan_report(p), timeout_warning(cfg) or ""]:  # a job that will not fit should not wait unwarned
        if line.startswith("WARNING"):
            print(line, file=sys.stderr)
    fresh = not Path(p.job_dir).exists()
    write_job_dir(cfg, p)
    try:
        return submit(cfg, p)
    except SbatchFailed as e:
        raise RuntimeError(sbatch_failed(e, Path(p.job_dir), fresh)) from None


def sbatch_failed(e: SbatchFailed, folder: Path, fresh: bool) -> str:
    """The two lines of a submit sbatch did not take: its reason, then what became of the folder and the fix. A folder
    this submit made for a job that does not exist is removed (no orphan that `status` would read as a job); one that
    was there before (a resume's checkpoints) or whose job may exist (a timeout) is kept, its submit_failed.json
    telling `status`, its job.sbatch what was sent."""
    import shutil

    if fresh and not e.maybe_queued:
        shutil.rmtree(folder, ignore_errors=True)
        return f"{e.reason}\nno job folder kept (no job was queued); {e.fix}"
    return f"{e.reason}\n{e.fix}; job folder kept: {q(folder)} (job.sbatch: what was sent)"


def cmd_submit(a: argparse.Namespace) -> int:
    from launcher.core.jobdir import make_plan

    cfg = _load(a)
    s = _show_or_submit(cfg, make_plan(cfg), a.dry_run, skip=_skipped(a))
    if s is None:
        return 0
    print(
        f"submitted job {s.job_id}\njob folder: {q(s.job_dir)}\nsbatch text: {q(s.sbatch_path)}\n"
        f"watch it: slurm-grpo status {q(s.job_dir)}"
    )
    return 0


def cmd_resume(a: argparse.Namespace) -> int:
    """Resubmit a job folder's own resolved config (plus --set overrides, e.g. fewer nodes) into the same folder;
    the trainer continues from its newest complete checkpoint, resharded to the new number of ranks."""
    from launcher.core.jobdir import make_plan

    d = find_job_dir(a.job).absolute()
    done = JobDir(d).complete_checkpoints()
    if not done:
        raise ConfigError(
            f"{d} has no complete checkpoint (checkpoints/step-N with meta.json) to resume from; submit the config again instead"
        )
    pinned = [f"job.job_dir={json.dumps(str(d))}", "trainer.resume=true"]
    cfg = config_mod.load(JobDir(d).config, list(a.overrides) + pinned)
    p = make_plan(cfg)
    step, path = done[-1]
    preface = f"# would resume {d} from step {step} ({path.name}) on {p.num_nodes} nodes x {p.ranks_per_node} ranks\n\n"
    s = _show_or_submit(cfg, p, a.dry_run, preface, skip=_skipped(a), resuming=True)
    if s is None:
        return 0
    print(
        f"resubmitted job folder {q(d)} as job {s.job_id}: resumes from step {step} on {p.num_nodes} nodes "
        f"({p.world_size} ranks)\nwatch it: slurm-grpo status {q(d)}"
    )
    return 0


class Progress(threading.Thread):
    """Follows metrics.jsonl and prints one progress line per step: step, reward, push, ETA."""

    def __init__(self, job_dir: Path, total: int):
        super().__init__(daemon=True)
        self.path, self.total, self.done = JobDir(job_dir).metrics, total, threading.Event()

    def run(self) -> None:
        seen, t0 = 0, None
        while not self.done.wait(1.0):
            rows = step_rows(read_rows(self.path))
            for r in rows[seen:]:
                t0 = t0 or time.time() - (r.step_s or 0)
                per = (time.time() - t0) / max(1, len(rows))
                eta = per * (self.total - r.step)
                bar = "#" * int(20 * r.step / self.total)
                push = max(r.push_s.values(), default=0)
                print(
                    f"[{bar:<20}] step {r.step}/{self.total} reward {r.reward:.3f} "
                    f"push {push:.2f}s parity {r.parity_max} ETA {eta:.0f}s",
                    flush=True,
                )
            seen = len(rows)


def vllm_start_note(cfg: JobConfig) -> str:
    """What the wait for the first server takes on this run's device (measured: 45-100 s on 2 CPU cores, 100-150 s on
    an H200, see README and gpu/RESULTS.md)."""
    if cfg.job.device == "cpu":
        return "vLLM start takes about a minute on CPU"
    if "--enforce-eager" in cfg.vllm.extra_args:
        return "vLLM start on a GPU: imports and loading the weights (--enforce-eager: no torch.compile, no CUDA graphs)"
    return "vLLM start takes a few minutes on a GPU: imports, loading the weights, torch.compile and CUDA graph capture"


def cmd_local(a: argparse.Namespace) -> int:
    from launcher.core.inputs import local_problems
    from launcher.core.jobdir import make_plan, write_job_dir
    from launcher.node.bootstrap import run_node

    cfg = _load(a)
    if cfg.slurm.nodes != 1:
        print(f"local: running as one node (the config asks for {cfg.slurm.nodes}; slurm.nodes is ignored here)")
        cfg = _load(a, **{"slurm.nodes": 1})
    p = make_plan(cfg)
    _refuse_or_note(cfg, p)  # before the server starts: a folder with nothing left to train is refused
    problems = local_problems(p.config)  # the plan's config: what the ranks will run (LoRA targets resolved)
    if problems:  # before the job folder and the server: a typo must not cost a vLLM start; one line each
        raise ConfigError("\n".join(problems))
    for line in plan_report(p):
        if line.startswith("WARNING"):
            print(line, file=sys.stderr)
    d = write_job_dir(cfg, p)
    jd = JobDir(d)
    print(f"job folder: {q(d)}\n" + node_table(p) + f"\nlogs: {q(jd.logs)}/ ({vllm_start_note(cfg)})", flush=True)
    prog = Progress(d, cfg.trainer.max_steps)
    prog.start()
    t0 = time.time()
    rc = run_node(p, 0)
    prog.done.set()
    prog.join(2)
    print(f"local run finished with code {rc} after {time.time() - t0:.0f} s")
    rows = read_rows(jd.metrics)
    print("summary: " + format_summary(summarize(rows)))
    evals = eval_rows(rows)
    if evals:  # the held-out set before training and at the end (trainer.eval)
        print("eval: " + format_eval(evals[0]) + "\n   -> " + format_eval(evals[-1]))
    for f in (jd.summary, jd.plot, jd.metrics):
        if f.exists():
            print(f"  {q(f)}")
    return rc


def cmd_status(a: argparse.Namespace) -> int:
    from launcher.sweep import is_sweep, sweep_status

    if is_sweep(Path(a.job)):
        print(sweep_status(Path(a.job)))
        return 0
    print(status(find_job_dir(a.job)))
    return 0


def cmd_logs(a: argparse.Namespace) -> int:
    from launcher.node.diagnose import tail

    d = find_job_dir(a.job)
    files = log_files(d, a.node)
    if not files:
        print(f"no logs yet in {q(d / 'logs')}")
    for f in files:
        print(f"==> {f} <==\n{tail(f, a.lines)}")
    return 0


def cmd_sweep(a: argparse.Namespace) -> int:
    """Plan every grid point, check them, write the sweep folder, submit one job array."""
    from launcher import sweep
    from launcher.submit import ArraySpec, SbatchFailed, check_submittable, sbatch_text, submit
    from launcher.submit_checks import refusal, run_checks, section

    grid = sweep.parse_grid(a.grid)
    if a.parallel < 0:
        raise ConfigError(f"--parallel {a.parallel}: give the number of points to run at once (0 = all)")
    base = _load(a)  # a hub model name resolved once, for every point
    d = sweep.sweep_dir_for(base)
    if sweep.is_sweep(d) and not a.dry_run:
        raise ConfigError(f"{q(d)} already holds a sweep; pick another job.job_dir (or leave it empty for a new folder)")
    points = sweep.plan_sweep(a.config, [*a.overrides, f"vllm.model={json.dumps(base.vllm.model)}"], grid, d)
    array = ArraySpec(str(d), len(points), a.parallel or len(points))
    first = points[0]
    print(f"sweep of {len(points)} points ({' x '.join(str(len(v)) for _, v in grid)}), at most {array.parallel} at once:")
    print("\n".join(sweep.grid_table(points)))
    results = run_checks([p.plan for p in points], _skipped(a))  # every point's, a shared problem once
    if a.dry_run:
        print("\n# sbatch text (one job array; task i runs point-i)\n" + sbatch_text(first.config, first.plan, array))
        print("\n" + section(results))
    err = refusal(results, listed=a.dry_run)
    if err:
        raise err
    if a.dry_run:
        return 0
    check_submittable(first.config)  # SLURM's commands here, before the sweep folder is written
    fresh = not d.exists()
    sweep.write_sweep(d, grid, points)
    try:
        s = submit(first.config, first.plan, array)
    except SbatchFailed as e:
        raise RuntimeError(sbatch_failed(e, d, fresh)) from None
    for p in points:  # each point's folder answers `slurm-grpo status` on its own too
        JobDir(Path(p.plan.job_dir)).job_id.write_text(f"{s.job_id}_{p.index}\n")
    print(f"submitted job array {s.job_id}\nsweep folder: {q(d)}\nwatch it: slurm-grpo status {q(d)}")
    return 0


def positive_int(text: str) -> int:
    """argparse type: a count of at least 1 (`--lines 0` would otherwise print whole files)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} is below 1; give how many lines to print, e.g. --lines 50")
    return n


def cmd_sync(a: argparse.Namespace) -> int:
    """Upload a job's offline W&B run (every attempt's part) from a host that reaches the Internet."""
    import shutil
    import subprocess

    d = find_job_dir(a.job)
    jd = JobDir(d)
    if jd.is_sweep():
        raise ConfigError(f"{q(d)} is a sweep folder: sync one of its points, e.g. slurm-grpo sync {q(jd.point(0).root)}")
    parts = sorted(jd.wandb.glob("offline-run-*"))
    if not parts:
        raise ConfigError(
            f"no offline W&B run under {q(jd.wandb)}: the job ran without trainer.report_to: [wandb] or with wandb_mode online"
        )
    exe = shutil.which("wandb")
    if exe is None:
        raise ConfigError(
            "the wandb command is not installed here: pip install wandb (or slurm-grpo[track]), then run sync again"
        )
    run_id = jd.wandb_id.read_text().strip()
    print(f"syncing W&B run {run_id}: {len(parts)} part(s) (one per attempt) from {q(jd.wandb)}", flush=True)
    return subprocess.run([exe, "sync", *map(str, parts)]).returncode


def cmd_cancel(a: argparse.Namespace) -> int:
    print(cancel(find_job_dir(a.job)))
    return 0


def cmd_export(a: argparse.Namespace) -> int:
    """Checked here (no torch), converted in a child `python -m trainer.export`, whose progress lines go straight to
    this terminal; a child that fails, is killed or outlives its deadline (ExportRequest.deadline_s, scaled to what it
    reads) gets one line saying so and what to rerun."""
    import subprocess

    from launcher.core.export import resolve

    req = resolve(find_job_dir(a.job), a.step, a.out, a.merged, a.dtype)
    deadline = req.deadline_s()
    print(f"exporting {req.what} of step {req.step} ({q(req.checkpoint)}) to {q(req.out)}", flush=True)
    try:
        rc: int | None = subprocess.run(req.child_argv(), stdin=subprocess.DEVNULL, timeout=deadline).returncode
    except subprocess.TimeoutExpired:  # run() has killed the child
        rc = None
    if rc == 0:
        return 0
    print(req.failure(rc, deadline), file=sys.stderr, flush=True)
    return 124 if rc is None else (rc if rc > 0 else 128 - rc)


def cmd_make_tiny_model(a: argparse.Namespace) -> int:
    import subprocess

    return subprocess.run([sys.executable, "-m", "trainer.tiny_model", *a.args]).returncode


def cmd_dequantize(a: argparse.Namespace) -> int:
    import subprocess

    return subprocess.run([sys.executable, "-m", "trainer.dequantize", *a.args]).returncode


def cmd_config_reference(a: argparse.Namespace) -> int:
    """Every config key with its default and meaning (the README's reference), or one section's / group's."""
    text = config_mod.reference_markdown()
    if a.section:
        tables = {t.split("`**", 1)[0]: "**`" + t for t in text.split("**`")[1:]}
        section, _, group = a.section.partition(".")
        if section not in tables:
            raise ConfigError(
                f"config-reference {a.section!r}: no such section{config_mod.did_you_mean(section, tables)}; "
                f"sections: {', '.join(tables)}"
            )
        text = tables[section].strip()
        if group:  # a key, a nested group (slurm.container) or the start of keys (trainer.max)
            keys = [ln.split("`")[1] for ln in text.splitlines() if ln.startswith("| `")]
            if not any(k.startswith(group) for k in keys):
                known = config_mod.KNOWN_AS.get(group)
                hint = config_mod.did_you_mean(group, keys) or (f"; did you mean {known!r}?" if known in keys else "")
                raise ConfigError(
                    f"config-reference {a.section!r}: {section} has no key {group!r}{hint} "
                    f"(`slurm-grpo config-reference {section}` lists its keys)"
                )
            text = "\n".join(ln for ln in text.splitlines() if ln.startswith(f"| `{group}") or not ln.startswith("| `"))
    print(text)
    return 0


def cmd_simulate(a: argparse.Namespace) -> int:
    from launcher.simulate import main as simulate_main

    return simulate_main(a)


def _add_grid_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="SECTION.KEY=V1,V2",
        help="a sweep: values of one key (repeat for more keys; the points are every combination), e.g. trainer.beta=0,0.04",
    )


def _add_skip_path_checks(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--skip-path-checks",
        action="store_true",
        help="skip every check on this host (model folder, dataset, reward/agent modules, setup venv): for paths that "
        "exist only on the compute nodes; the nodes still check them before starting",
    )
    _add_skip_checks(p)


def _add_skip_checks(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--skip-checks",
        default="",
        metavar="KIND,...",
        help="skip these kinds of submit-host checks: model, data, rewards, agents, venv (or all of those), memory (only "
        "by name: vLLM's weights estimate)",
    )


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="slurm-grpo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("dry-run", help="print the plan, sbatch text and per-node commands, run the submit checks; submit nothing")
    _add_config_args(p)
    _add_grid_arg(p)
    _add_skip_path_checks(p)
    p.set_defaults(fn=cmd_dry_run)
    p = sub.add_parser("submit", help="write the job folder and submit it with sbatch (through submitit)")
    _add_config_args(p)
    p.add_argument("--dry-run", action="store_true", help="print what would be submitted and stop")
    _add_skip_path_checks(p)
    p.set_defaults(fn=cmd_submit)
    p = sub.add_parser(
        "resume",
        help="resubmit a job folder's config into the same folder, continuing from its "
        "newest checkpoint (e.g. on the nodes left: --set slurm.nodes=2)",
    )
    p.add_argument("job", help="job folder (runs/NAME-STAMP) or SLURM job id")
    _add_set_arg(p, "a value of the folder's config.yaml")
    p.add_argument("--dry-run", action="store_true", help="print what would be resubmitted and stop")
    _add_skip_path_checks(p)
    p.set_defaults(fn=cmd_resume)
    p = sub.add_parser(
        "sweep",
        help="submit a grid of configs as one SLURM job array, a job folder per point (slurm-grpo status shows them all)",
    )
    _add_config_args(p)
    _add_grid_arg(p)
    p.add_argument("--parallel", type=int, default=0, help="run at most N points at once (sbatch --array %%N; default all)")
    p.add_argument("--dry-run", action="store_true", help="print the grid and the array's sbatch text; submit nothing")
    _add_skip_path_checks(p)
    p.set_defaults(fn=cmd_sweep)
    p = sub.add_parser("local", help="run the job on this machine as one node (vLLM + trainer ranks), no SLURM")
    _add_config_args(p)
    p.set_defaults(fn=cmd_local)
    for name, fn, text in (
        ("status", cmd_status, "SLURM state per node, server health, last metrics, summary"),
        ("logs", cmd_logs, "last lines of every node's logs"),
        ("cancel", cmd_cancel, "scancel the job"),
        ("sync", cmd_sync, "upload the job's offline W&B run (all its attempts) from this host"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument("job", help="job folder (runs/NAME-STAMP) or SLURM job id")
        if name == "logs":
            p.add_argument("--node", type=int, default=None, help="only this node's logs")
            p.add_argument("-n", "--lines", type=positive_int, default=30, help="lines per log (default 30)")
        p.set_defaults(fn=fn)
    p = sub.add_parser(
        "export",
        help="write a checkpoint of the job as a Hugging Face model (full runs) or a peft adapter (LoRA), on this "
        "host's CPU (JOB/model already holds the final model of a full run)",
    )
    p.add_argument("job", help="job folder (runs/NAME-STAMP) or SLURM job id")
    p.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the newest)")
    p.add_argument("--out", default=None, help="output folder (default: JOB/exports/step-N-model, -adapter or -merged)")
    p.add_argument("--merged", action="store_true", help="LoRA runs: the base with the adapter merged in, not the adapter")
    p.add_argument("--dtype", default="", help="bfloat16, float16 or float32 (default: the run's trainer.dtype)")
    p.set_defaults(fn=cmd_export)
    # the builder needs torch, which launcher/ never imports: it runs as `python -m trainer.tiny_model`,
    # which owns the options (and the --help) passed through here
    p = sub.add_parser(
        "make-tiny-model",
        add_help=False,
        help="build a random Qwen2 (head_dim 64) and a locally trained tokenizer (see make-tiny-model --help)",
    )
    p.add_argument("args", nargs=argparse.REMAINDER)
    p.set_defaults(fn=cmd_make_tiny_model)
    p = sub.add_parser(
        "dequantize",
        add_help=False,  # trainer.dequantize owns its options and --help, as trainer.tiny_model does make-tiny-model's
        help="write a bf16 copy of a quantized checkpoint (mxfp4, fp8 block-wise) for vllm.model (see dequantize --help)",
    )
    p.add_argument("args", nargs=argparse.REMAINDER)
    p.set_defaults(fn=cmd_dequantize)
    p = sub.add_parser("config-reference", help="every config key with its default and meaning (or one section's)")
    p.add_argument("section", nargs="?", default="", help="only this section or group, e.g. trainer or slurm.container")
    p.set_defaults(fn=cmd_config_reference)
    p = sub.add_parser(
        "simulate",
        help="predict step time vs node count (per-node servers vs one global server), the best split of a node's GPUs "
        "between vLLM and training (sync and async, vs TRL colocate and separate inference nodes), and which models fit",
    )
    p.add_argument("config", help="YAML job config (model size from vllm.model's config.json, or --params-b)")
    p.add_argument("--nodes", default="1,2,4,8,16,32,64,128,256", help="comma-separated node counts")
    p.add_argument("--params-b", type=float, default=0.0, help="model parameters in billions (default: from the config)")
    p.add_argument("--calibration", default="", help="JSON from `bench` to take this machine's measured figures from")
    p.add_argument("--plot", default="", help="write a PNG plot here")
    p.add_argument("--json", default="", help="write the predicted rows as JSON here")
    _add_set_arg(p)
    p.set_defaults(fn=cmd_simulate)
    return ap


def parse(ap: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """argparse, but an unknown word is reported by its command's parser (its usage, not the top level's), and a
    `--set KEY VALUE` says how --set is written."""
    a, extra = ap.parse_known_args(argv)
    commands = next(x for x in ap._actions if isinstance(x, argparse._SubParsersAction))
    sub = commands.choices[a.command]
    if extra:
        bare = [x for x in getattr(a, "overrides", []) if "=" not in x]  # `--set slurm.nodes 16`: 16 is the extra word
        if bare and not extra[0].startswith("-"):
            sub.error(f"--set {bare[0]} {extra[0]}: --set takes KEY=VALUE, e.g. --set {bare[0]}={extra[0]}")
        sub.error(f"unrecognized arguments: {' '.join(extra)}")
    return a


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["make-tiny-model"]:  # its options (--help too) are trainer.tiny_model's: argparse must not read them
        return cmd_make_tiny_model(argparse.Namespace(args=args[1:]))
    if args[:1] == ["dequantize"]:  # likewise trainer.dequantize's
        return cmd_dequantize(argparse.Namespace(args=args[1:]))
    a = parse(build_parser(), expand_sets(args))
    try:
        return a.fn(a)
    except ConfigError as e:
        print(f"slurm-grpo {a.command}: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"slurm-grpo {a.command}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
