"""The job folder and the contract around it: `JobDir` (every path of a job or a sweep folder), `Env` (the names of
the environment variables the processes of a job hand each other), the exit code of a preempted run, and the writers
of the folder (created owner-only) and of a node's events file."""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from launcher.core.config import JobConfig, to_yaml
from launcher.core.plan import Plan, plan
from launcher.core.records import CheckpointMeta, Event, event_line


class Env:
    """Names of the environment variables the processes of a job hand each other (the batch script sets some for the
    bootstrap, the bootstrap others for vLLM and torchrun). Written here once, read through these names everywhere."""

    NODE = "SLURM_GRPO_NODE"
    """The node's index in the plan (set by the bootstrap for its torchrun ranks)."""
    ATTEMPT = "SLURM_GRPO_ATTEMPT"
    """This attempt of the job, so abort files and checkpoints of an earlier attempt are told apart (set by the
    bootstrap for the trainer; recorded in each checkpoint's meta.json)."""
    JOB_DIR = "SLURM_GRPO_JOB_DIR"
    """Carried by every process of a job: the stale-process check knows its own job's leftovers by it."""
    FIRST_NODE = "SLURM_GRPO_FIRST_NODE"
    """The first node's host name, resolved by the batch script on the host (images seldom have scontrol)."""
    CPU_PLAIN_LINEAR = "SLURM_GRPO_CPU_PLAIN_LINEAR"
    """CPU only: the vLLM plugin replaces vLLM's CPU linear kernel with F.linear so weight reloads take effect."""
    PLUGIN_QUIET = "SLURM_GRPO_PLUGIN_QUIET"
    """"1": the vLLM plugin does not announce itself (tests that load it in-process)."""
    LORA_LOAD_ONCE = "SLURM_GRPO_LORA_LOAD_ONCE"
    """"1" (trainer.lora, adapter push): the vLLM plugin reads a pushed adapter from disk once, at its load, not again
    at every engine step of every request naming it (trainer.push.vllm_plugin.load_adapters_once)."""
    LORA_ACTIVE_GRAPHS_ONLY = "SLURM_GRPO_LORA_ACTIVE_GRAPHS_ONLY"
    """"1" (adapter push, launcher.core.vllm_start.lora_graphs): the vLLM plugin has Model Runner V2 capture CUDA graphs
    for batches through the adapter only, not also for batches without one (trainer.push.vllm_plugin.lora_graphs_active_only)."""
    KV_CACHE_FIXED = "SLURM_GRPO_KV_CACHE_FIXED"
    """"1": the node's vLLM was started with a KV cache size (the work's, or the one an earlier start measured:
    launcher.node.kv_reuse), so it does not size it while the trainer loads: a resumed trainer loads its checkpoint
    without waiting for the server."""
    INSPECT_IN_PROCESS = "SLURM_GRPO_INSPECT_IN_PROCESS"
    """"1" (vllm.inspect_in_process): the vLLM plugin has vLLM inspect the model class in the API server's own process
    instead of a fresh Python one (trainer.push.vllm_plugin.inspect_in_process)."""


PLUGIN_ENV = Env.CPU_PLAIN_LINEAR
"""The switch the node's vLLM server gets on CPU (trainer.push.vllm_plugin reads it)."""

COMPILER_SAFE_PATH = re.compile(r"[A-Za-z0-9._/+=@,:~-]+")
"""Characters a compile-cache path may hold: compilers get it on a command line without quotes (JobDir.compile_cache)."""

META_FILE = "meta.json"
"""A checkpoint folder's meta file (records.CheckpointMeta), written last: its presence marks the folder complete."""

WANDB_ID_FILE = "wandb_run_id"
"""Kept while trainer/ and the tests move to JobDir.wandb_id (the same file)."""

PREEMPTED_EXIT = 3
"""Exit code of a trainer (and of a node's bootstrap) that checkpointed on a preemption signal: requeue, not failure."""


@dataclass(frozen=True)
class JobDir:
    """Every path of a job folder (or of a sweep folder), in one place: no other module spells a file name of it.
    submitit's JobPaths is the model. The folder is made owner-only by `write_job_dir`."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    # inputs, written at submit
    @property
    def plan(self) -> Path:
        return self.root / "plan.json"

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def job_id(self) -> Path:
        """The SLURM job id of the newest submission (a resume writes its new id; a sweep: the array's)."""
        return self.root / "job_id"

    def read_job_id(self) -> str | None:
        """The newest submission's SLURM job id; None for a local run (no job_id file)."""
        return self.job_id.read_text().strip() if self.job_id.is_file() else None

    @property
    def wandb_id(self) -> Path:
        """The job's one W&B run id, written once with the folder: every attempt (requeue, resume) continues that run."""
        return self.root / WANDB_ID_FILE

    @property
    def submitit(self) -> Path:
        """submitit's folder: the sbatch file it submitted and SLURM's output of each task."""
        return self.root / "submitit"

    @property
    def sbatch(self) -> Path:
        return self.root / "job.sbatch"

    @property
    def submit_failed(self) -> Path:
        """Why the newest sbatch of a folder that was kept gave no job id (launcher.submit writes it, a later successful
        submit removes it): `status` says "never submitted" (or "may be queued") instead of reading the folder as a job."""
        return self.root / "submit_failed.json"

    # per node, written by the node's bootstrap and its trainer leader
    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def log(self, node: int, proc: str) -> Path:
        """logs/node{i}-{proc}.log, proc one of vllm, trainer."""
        return self.logs / f"node{node}-{proc}.log"

    def node_logs(self, node: int | None = None) -> list[Path]:
        """Every node's process logs (or one node's), sorted."""
        files = sorted(self.logs.glob("node*-*.log"))
        return files if node is None else [f for f in files if f.name.startswith(f"node{node}-")]

    def events(self, node: int) -> Path:
        return self.logs / f"node{node}-events.jsonl"

    def abort(self, attempt: str) -> Path:
        """Written by the first node that fails in an attempt; every node's supervisor watches for it."""
        return self.logs / f"abort-{attempt}.json"

    def heartbeats(self, attempt: str) -> Path:
        """A folder of one file per node, touched while the node's supervisor is alive."""
        return self.logs / f"heartbeat-{attempt}"

    def heartbeat(self, attempt: str, node: int) -> Path:
        return self.heartbeats(attempt) / f"node{node}.json"

    # the ranks' outputs
    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def metrics_lost(self) -> Path:
        """Step rows of an attempt that died after its last checkpoint: set aside, their steps run again."""
        return self.root / "metrics.lost.jsonl"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    @property
    def plot(self) -> Path:
        return self.root / "metrics.png"

    def profile(self, node: int, rank: int) -> Path:
        """trainer.profile_steps: torch.profiler's tables of a node leader's profiled steps (trainer.profiling)."""
        return self.root / "profile" / f"node{node}-rank{rank}.txt"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def checkpoint(self, step: int) -> Path:
        """checkpoints/step-N (complete once its meta.json exists)."""
        return self.checkpoints / f"step-{step:06d}"

    def complete_checkpoints(self) -> list[tuple[int, Path]]:
        return complete_checkpoints(self.checkpoints)

    @property
    def model(self) -> Path:
        """model/: the final model of a full fine-tune in Hugging Face format (sharded safetensors in trainer.dtype,
        index, config, tokenizer, generation config): from_pretrained and `vllm serve` load it (trainer.save_model)."""
        return self.root / "model"

    def export(self, step: int, kind: str = "model") -> Path:
        """exports/step-N-KIND: where `slurm-grpo export` writes a checkpoint's model (kind model, adapter, merged)
        unless told --out."""
        return self.root / "exports" / f"step-{step:06d}-{kind}"

    @property
    def hf_output(self) -> Path:
        """TRL's output_dir (its own files only; the project's checkpoints are under checkpoints/)."""
        return self.root / "hf"

    @property
    def wandb(self) -> Path:
        return self.root / "wandb"

    # LoRA (trainer.lora)
    @property
    def adapter(self) -> Path:
        """adapter/: the final LoRA adapter in peft's format (PeftModel.from_pretrained(base, JOB/adapter))."""
        return self.root / "adapter"

    @property
    def merged(self) -> Path:
        """merged/: the base with the final adapter merged in (trainer.lora.save_merged), from_pretrained-loadable."""
        return self.root / "merged"

    def adapter_pushes(self, node: int) -> Path:
        """Node-local, not in the (shared) job folder: where node i's leader writes each pushed adapter for its own
        server to load (TMPDIR, else /tmp; one folder per job folder and node, owner-only)."""
        digest = hashlib.sha1(str(self.root.absolute()).encode()).hexdigest()[:12]
        return Path(os.environ.get("TMPDIR") or "/tmp") / f"slurm-grpo-adapters-{digest}" / f"node{node}"

    def adapter_push(self, node: int, step: int) -> Path:
        """The adapter of one push (a new folder each time: vLLM keeps prefix-cache blocks of a path it reloads)."""
        return self.adapter_pushes(node) / f"step-{step:06d}"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    def kv_cache_record(self, node: int) -> Path:
        """The KV cache size node `node`'s server measured at its last profiled start (launcher.node.kv_reuse)."""
        return self.root / "cache" / f"node{node}-kv-cache.json"

    def compile_cache(self, node: int, shared: str = "") -> Path:
        """Node `node`'s compile caches (vLLM's torch.compile artifacts, Inductor's and Triton's kernels): under the
        config's vllm.cache_dir when it names one, else in the job folder, so a requeue or a resume of the job finds
        them and skips the compile. One folder per node: nodes never write the same files at once."""
        base = Path(shared) if shared else self.root / "cache"
        if not COMPILER_SAFE_PATH.fullmatch(str(base)):
            # Inductor hands the cache path to g++ unquoted: a space (or a shell character) in it fails every compile.
            # Such a folder's caches go to a stable folder of the node's temp dir instead (a restart on the same node
            # still finds them).
            digest = hashlib.sha1(str(base).encode()).hexdigest()[:16]
            base = Path(tempfile.gettempdir()) / f"slurm-grpo-cache-{digest}"
        return base / f"node{node}"

    # a sweep folder
    @property
    def sweep(self) -> Path:
        """sweep.json: the grid and its points (only a sweep folder has it)."""
        return self.root / "sweep.json"

    def is_sweep(self) -> bool:
        return self.sweep.is_file()

    def point(self, i: int) -> JobDir:
        """The job folder of the sweep's point i."""
        return JobDir(self.root / f"point-{i:03d}")

    def array_task_logs(self, array_job: str, task: str) -> list[Path]:
        """A sweep folder: SLURM's output of one task of a point's array task (submitit's <array>_<point>_<task>)."""
        return sorted(self.submitit.glob(f"{array_job}_{task}_log.out"))

    def task_logs(self, task: str) -> list[Path]:
        """A job folder: SLURM's output of its tasks (submitit's <job>/<job>_<task>_log.out, a task per node)."""
        return sorted(self.submitit.glob(f"*/*_{task}_log.out"))


def point_dir(sweep_dir: Path, index: int) -> Path:
    """The job folder of a sweep's point (launcher.sweep writes it, the array task's bootstrap runs its plan)."""
    return JobDir(sweep_dir).point(index).root


def resolve_job_dir(cfg: JobConfig, now: float | None = None) -> Path:
    if cfg.job.job_dir:
        return Path(cfg.job.job_dir).expanduser().absolute()
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return (Path("runs") / f"{cfg.job.name}-{stamp}").absolute()


def make_plan(cfg: JobConfig, now: float | None = None) -> Plan:
    return plan(cfg, str(resolve_job_dir(cfg, now)))


def write_job_dir(cfg: JobConfig, p: Plan) -> Path:
    """Create the job folder (mode 0700: logs and checkpoints are the owner's only) and write the inputs."""
    jd = JobDir(Path(p.job_dir))
    old = os.umask(0o077)
    try:
        for sub in (jd.root, jd.logs, jd.checkpoints, jd.submitit):
            sub.mkdir(parents=True, exist_ok=True)
        os.chmod(jd.root, 0o700)
        jd.config.write_text(to_yaml(cfg))
        jd.plan.write_text(p.to_json())
        jd.submit_failed.unlink(missing_ok=True)  # a new run in the folder (local, or a submit about to sbatch)
        if not jd.wandb_id.is_file():  # W&B's own id format: 8 of [a-z0-9]
            alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
            jd.wandb_id.write_text("".join(secrets.choice(alphabet) for _ in range(8)) + "\n")
    finally:
        os.umask(old)
    return jd.root


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint under root, oldest first. A folder counts only once
    its meta.json exists (written last); step-N.tmp folders of an interrupted write never count."""
    out = []
    for d in Path(root).glob("step-*"):
        if d.is_dir() and not d.name.endswith(".tmp") and meta_file(d).is_file():
            try:
                out.append((int(d.name.split("-")[1]), d))
            except ValueError:
                continue
    return sorted(out)


def free_space(path: Path) -> tuple[Path, int]:
    """The nearest existing folder of `path` (a job folder or its checkpoints/ before they exist) and the free bytes of
    its file system: what the dry-run shows and what a checkpoint must fit in (trainer.checkpoint.room_for)."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path, shutil.disk_usage(path).free


def meta_file(folder: Path) -> Path:
    """checkpoints/step-N/meta.json."""
    return Path(folder) / META_FILE


def checkpoint_meta(folder: Path) -> CheckpointMeta:
    """A complete checkpoint's meta.json, typed (the one reader: trainer.checkpoint uses it too)."""
    return CheckpointMeta.read(meta_file(folder))


class Events:
    """logs/node{i}-events.jsonl: phase timestamps (server start, healthy, trainer start, exits). The node's
    bootstrap and its trainer leader both append to it; `slurm-grpo status` reads it (records.read_events)."""

    def __init__(self, job_dir: Path, node: int):
        self.path = JobDir(job_dir).events(node)
        self.node = node

    def __call__(self, event: Event, **kw: object) -> None:
        with open(self.path, "a") as f:
            f.write(event_line(self.node, event, **kw))


def remove_pushed_adapters(job_dir: str, node: int) -> None:
    """The node-local folder of node `node`'s pushed adapters (JobDir.adapter_pushes), and the job's folder above it
    once no node on this machine has one left: the bootstrap removes them when its processes have stopped, after a
    finished, failed or preempted attempt alike (a requeued attempt starts from the zero adapter and a checkpoint)."""
    folder = JobDir(Path(job_dir)).adapter_pushes(node)
    shutil.rmtree(folder, ignore_errors=True)
    try:
        folder.parent.rmdir()
    except OSError:  # absent, or another node of this machine (the test cluster) still has its own
        pass
