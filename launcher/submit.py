"""Plan -> submitit SlurmExecutor -> sbatch text (dry-run) or a submitted job (submit).

submitit stays the one writer of the sbatch script: dry-run asks the same executor for the text it
would submit, so the two cannot drift. The job runs a readable command,
`python -u -m launcher.node.bootstrap <job_dir>/plan.json`, one srun task per node; submitit's pickled
function path is not used (nothing opaque runs on the nodes).
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import jinja2
import jinja2.meta

from launcher.core import platform
from launcher.core.config import ConfigError, JobConfig, control_character, did_you_mean
from launcher.core.jobdir import Env, JobDir
from launcher.core.plan import Plan
from launcher.node.commands import bootstrap_argv

TEMPLATES = Path(__file__).resolve().parent.parent / "slurm_templates"


@functools.cache
def profile_variables() -> frozenset[str]:
    """Every variable some setup profile (slurm_templates/*.sh.j2) uses."""
    env = jinja2.Environment()
    env.filters["q"] = shlex.quote
    return frozenset().union(
        *(jinja2.meta.find_undeclared_variables(env.parse(t.read_text())) for t in TEMPLATES.glob("*.sh.j2"))
    )


def render_setup(cfg: JobConfig) -> list[str]:
    """The cluster profile's setup lines, rendered with StrictUndefined (a missing variable is an error)."""
    path = TEMPLATES / f"{cfg.slurm.setup_profile}.sh.j2"
    if not path.is_file():
        have = sorted(p.name.removesuffix(".sh.j2") for p in TEMPLATES.glob("*.sh.j2"))
        raise ConfigError(f"slurm.setup_profile {cfg.slurm.setup_profile!r} has no template {path}; profiles: {', '.join(have)}")
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True, autoescape=False)
    env.filters["q"] = lambda v: shlex.quote(str(v))
    known = {
        "venv": "",
        "conda_env": "",
        "pythonpath": "",
        "modules": "",
        "nccl_ifname": "",
        "ib_hca": "",
        "apptainer_module": "",
        "hf_home": "",
        "apptainer_ld_library_path": "",
    }
    # a misspelt key would be dropped without a word; one another profile uses may come from a site base config
    used = set(known) | profile_variables()
    for key in sorted(set(cfg.slurm.setup_vars) - used):
        hint = did_you_mean(key, used) or f"; known: {', '.join(sorted(used))}"
        raise ConfigError(f"slurm.setup_vars.{key} is used by no setup profile{hint}")
    try:
        text = env.from_string(path.read_text()).render({**known, **cfg.slurm.setup_vars})
    except jinja2.UndefinedError as e:
        raise ConfigError(f"setup profile {path.name}: {e}; set it under slurm.setup_vars") from None
    return [line for line in text.splitlines() if line.strip()]


def executor_parameters(cfg: JobConfig, p: Plan, array: ArraySpec | None = None) -> dict:
    s = cfg.slurm
    extra: dict[str, object] = {"time": s.time}
    # off means off: without --no-requeue SLURM's own JobRequeue default (1) could still requeue it after a node failure
    extra["requeue" if s.requeue else "no_requeue"] = True
    for k, v in sorted(s.extra_sbatch.items()):
        extra[k] = v if v != "" else True  # '' = a flag without a value: #SBATCH --overcommit
    params: dict[str, object] = dict(
        job_name=cfg.job.name,
        nodes=s.nodes,
        ntasks_per_node=1,
        gpus_per_node=s.gpus_per_node,
        signal_delay_s=s.signal_seconds,
        setup=render_setup(cfg) + container_setup(cfg) + platform.stage_setup(cfg),
        additional_parameters=extra,
        stderr_to_stdout=True,
        # one task per node must see all of the node's GPUs and CPUs; the bootstrap splits them. No --cpus-per-task
        # here although Slurm 22.05+ srun no longer inherits sbatch's: on srun it implies --exact (the step would get
        # only those CPUs, not the whole node the job may own); a step without it gets every CPU of the job on the
        # node, and --cpu-bind=none keeps the task from being bound to its one default CPU
        srun_args=["--kill-on-bad-exit=1", "--cpu-bind=none", *pyxis_args(cfg, p, array)],
    )
    for key, value in (
        ("partition", s.partition),
        ("account", s.account),
        ("qos", s.qos),
        ("constraint", s.constraint),
        ("mem", s.mem),
    ):
        if value:
            params[key] = value
    if s.cpus_per_task:
        params["cpus_per_task"] = s.cpus_per_task
    if s.exclusive:
        params["exclusive"] = True
    return params


@dataclass(frozen=True)
class ArraySpec:
    """A sweep as one SLURM job array: task i runs the plan in `sweep_dir`/point-i (launcher.sweep)."""

    sweep_dir: str
    count: int
    parallel: int
    """At most this many points run at once (sbatch --array=0-N%parallel)."""


def root_dir(p: Plan, array: ArraySpec | None) -> str:
    """The folder that holds the submission (job.sbatch, job_id, submitit/): the job folder, or the sweep folder."""
    return array.sweep_dir if array else p.job_dir


def make_executor(cfg: JobConfig, p: Plan, render_only: bool = False, array: ArraySpec | None = None):
    import submitit  # imported here: `slurm-grpo --help` must not pay for it

    root = root_dir(p, array)
    bad = control_character(root)
    if bad:  # a folder made from the current directory: job.job_dir itself was checked with the config
        raise ConfigError(f"job folder {root!r} contains {bad}, which would end the sbatch header there; set job.job_dir")
    cls: type = submitit.SlurmExecutor
    if render_only:
        # submitit refuses to build an executor where there is no `srun` (a laptop doing a dry-run);
        # rendering does not need it, so the dry-run uses the same class with that check answered.
        cls = type("RenderOnlySlurmExecutor", (submitit.SlurmExecutor,), {"affinity": classmethod(lambda c: 2)})
    # a job's logs go to submitit/<id>/ (submitit makes it after sbatch); an array's tasks all write into submitit/
    # itself (<array>_<task>_...): SLURM does not create folders, and a task may start before anyone could make one
    folder = JobDir(Path(root)).submitit
    ex = cls(folder=folder if array else folder / "%j", max_num_timeout=0)
    ex.update_parameters(**executor_parameters(cfg, p, array))
    if array is not None:  # submitit renders --array=0-(count-1)%parallel and per-task log names (%A_%a)
        ex.update_parameters(array_parallelism=array.parallel)
        ex.parameters["map_count"] = array.count  # as submitit's own array submission sets it (not an update key)
    return ex


def container_setup(cfg: JobConfig) -> list[str]:
    """With a container: the first node's name, found on the host, where `scontrol` is (images seldom have it)."""
    if not cfg.slurm.container.image:
        return []
    return [
        "# the rendezvous host, resolved here: the image may have no scontrol",
        f'export {Env.FIRST_NODE}=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
    ]


def container_mounts(cfg: JobConfig, p: Plan, array: ArraySpec | None = None) -> list[str]:
    """The config's mounts plus the job (or sweep) folder at its own path (plan.json, logs and checkpoints are there)."""
    root = root_dir(p, array)
    if any(ch in root for ch in ",:"):
        raise ConfigError(f"job folder {root!r} has a comma or colon, which a container mount list cannot hold; set job.job_dir")
    own = f"{root}:{root}"
    return [*cfg.slurm.container.mounts, *([] if own in cfg.slurm.container.mounts else [own])]


def pyxis_args(cfg: JobConfig, p: Plan, array: ArraySpec | None = None) -> list[str]:
    """srun flags of NVIDIA's pyxis plugin: each node's one task (the bootstrap, and so vLLM and torchrun) runs in
    the image. `sbatch --container-image` would put the batch script itself in it, which then cannot call srun."""
    c = cfg.slurm.container
    if not c.image or c.runtime != "pyxis":
        return []
    args = [f"--container-image={c.image}", f"--container-mounts={','.join(container_mounts(cfg, p, array))}"]
    return args + ([f"--container-workdir={c.workdir}"] if c.workdir else [])


def job_command(cfg: JobConfig, p: Plan, array: ArraySpec | None = None) -> str:
    """What srun runs on each node: the bootstrap (of the array task's point, for a sweep); inside `apptainer exec
    --nv` for an Apptainer image."""
    if array is None:
        argv = bootstrap_argv(str(JobDir(Path(p.job_dir)).plan), cfg.job.python)
    else:
        argv = bootstrap_argv("--sweep", cfg.job.python) + [array.sweep_dir]
    c = cfg.slurm.container
    if c.image and c.runtime == "apptainer":
        wrap = ["apptainer", "exec", platform.apptainer_gpu_flag(cfg), "--bind", ",".join(container_mounts(cfg, p, array))]
        wrap += ["--pwd", c.workdir] if c.workdir else []
        staged = platform.staged_image(cfg)  # slurm.stage_env: the node-local copy (a shell word, not quoted again)
        if staged:
            return f"{shlex.join(wrap)} {staged} {shlex.join(argv)}"
        argv = [*wrap, c.image, *argv]
    return shlex.join(argv)


def sbatch_text(cfg: JobConfig, p: Plan, array: ArraySpec | None = None) -> str:
    """Exactly what submit hands to sbatch (submitit's own renderer, same executor, same parameters)."""
    return make_executor(cfg, p, True, array)._make_submission_file_text(job_command(cfg, p, array), "dry-run")


@dataclass(frozen=True)
class Submitted:
    job_id: str
    job_dir: str
    sbatch_path: str


def check_submittable(cfg: JobConfig) -> None:
    """What only the nodes' layout forbids: an emulated plan's nodes share one host and one GPU, so on SLURM node 1's
    ranks would never meet node 0's (they wait out the rendezvous timeout after the queue). Then what this host lacks:
    SLURM's commands (checked before the job folder is written)."""
    if cfg.job.emulate_gpus:
        raise ConfigError(
            "job.emulate_gpus lays a cluster out on this machine's one GPU, for tests; SLURM cannot run it: remove it to "
            "submit (dry-run still shows the emulated plan)"
        )
    missing = [c for c in SLURM_COMMANDS if shutil.which(c) is None]
    if missing:
        raise SlurmMissing(
            f"{' and '.join(missing)} not found on PATH: this host has no SLURM; submit from the cluster's login node "
            "(`slurm-grpo local CONFIG` runs the job on this machine, `slurm-grpo dry-run CONFIG` prints the sbatch text)"
        )


SLURM_COMMANDS = ("sbatch", "srun")
"""What submit needs on this host: sbatch, and srun (submitit's executor looks for it before anything else)."""


class SlurmMissing(RuntimeError):
    """SLURM's commands are not on this host's PATH: nothing was written, nothing submitted."""


UNREACHABLE = ("configuration source", "contact slurm controller", "connect failure", "Connection refused", "slurm.conf")
"""Words of sbatch failing to reach the controller (or to find its configuration): no job exists."""

TIMED_OUT = "timed out"
"""sbatch's words when the controller's reply was lost: it may have queued the job all the same."""


class SbatchFailed(RuntimeError):
    """sbatch gave no job id. maybe_queued: the job may exist all the same (the reply timed out, or sbatch printed no
    job id it could be told from); else sbatch exited with an error and no job exists."""

    def __init__(self, reason: str, fix: str, maybe_queued: bool) -> None:
        super().__init__(f"{reason}\n{fix}")
        self.reason, self.fix, self.maybe_queued = reason, fix, maybe_queued

    @classmethod
    def of(cls, err: BaseException, job_name: str) -> SbatchFailed:
        """From what submitit raised: a nonzero exit (its cause holds sbatch's stderr), output with no job id (exit 0),
        or sbatch not runnable at all."""
        if isinstance(err, OSError) and Path(str(err.filename or "")).name == "sbatch":  # Popen's: sbatch not runnable
            return cls(f"sbatch could not run: {err}", "submit from the cluster's login node, where sbatch works", False)
        if isinstance(err, OSError):  # submitit's own files after sbatch gave the id (a full disk): the job may exist
            return cls(
                f"after sbatch: {err}",
                f"sbatch may have queued the job: `squeue --me --name {shlex.quote(job_name)}` shows it",
                True,
            )
        cause = err.__cause__
        rc = cause.returncode if isinstance(cause, subprocess.CalledProcessError) else None
        text = str(cause.stderr or "") if isinstance(cause, subprocess.CalledProcessError) else str(err)
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        # the fatal line, else the first error line (the lines before it are often warnings, the last a summary)
        reason = next((ln for ln in lines if "fatal:" in ln), None) or next((ln for ln in lines if "error:" in ln), None)
        reason = reason or (lines[0] if lines else f"sbatch exited with code {rc} and no message")
        if rc is None or TIMED_OUT in text:
            squeue = f"squeue --me --name {shlex.quote(job_name)}"
            return cls(reason, f"sbatch gave no job id, yet the job may be queued: `{squeue}` shows it", True)
        if any(w in text for w in UNREACHABLE):
            fix = "this host cannot reach SLURM's controller: submit from the cluster's login node (where `sinfo` answers)"
        else:
            fix = "fix what sbatch names (the config's slurm section; `slurm-grpo dry-run CONFIG` prints the sbatch text)"
        return cls(reason, fix, False)

    def record(self) -> str:
        """The job folder's submit_failed.json, which `status` reads."""
        return json.dumps({"reason": self.reason, "fix": self.fix, "maybe_queued": self.maybe_queued}) + "\n"


def submit(cfg: JobConfig, p: Plan, array: ArraySpec | None = None) -> Submitted:
    """sbatch the job (or the sweep's array, from its first point's config and plan); job.sbatch and job_id go into
    the job (or sweep) folder. A failure is SbatchFailed, recorded in the folder for `status` (the caller removes a
    folder it made for a job that does not exist)."""
    check_submittable(cfg)
    root = JobDir(Path(root_dir(p, array)))
    ex = make_executor(cfg, p, array=array)
    command = job_command(cfg, p, array)
    text = ex._make_submission_file_text(command, "submitted")
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # submitit prints sbatch's stderr before raising it: said once
            job = ex._submit_command(command)
    except Exception as e:  # submitit's FailedJobError (from a CalledProcessError), FailedSubmissionError, OSError
        failed = SbatchFailed.of(e, cfg.job.name)
        root.submit_failed.write_text(failed.record())
        raise failed from None
    finally:
        root.sbatch.write_text(text)
    root.submit_failed.unlink(missing_ok=True)
    root.job_id.write_text(str(job.job_id) + "\n")
    return Submitted(job_id=str(job.job_id), job_dir=str(root.root), sbatch_path=str(root.sbatch))
