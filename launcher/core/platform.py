"""The GPU platform of a job (job.platform: cuda | rocm), and the two node-level settings big clusters need with it:
environment staging (slurm.stage_env) and CPU binding (slurm.gpu_cores). Torch-free: plan, commands, bootstrap,
submit and the trainer read it.

Why ROCm differs. On CUDA each node process gets its own CUDA_VISIBLE_DEVICES (vLLM its first GPUs, torchrun the
rest). On ROCm that layout is the one that breaks: a HIP IPC handle carries the exporter's device ordinal and RCCL
resolves its peer in the importer's numbering, so a trainer and a vLLM server that each see only their own GPUs fail
(`invalid device ordinal`, `hipIpcGetMemHandle failed`; vLLM PR 46895, ms-swift PR 9627, vime PR 418, rccl 2188,
rocm-systems 5756: ../shared/PEERS.md section 5). So on ROCm every process of a node sees all of the node's GPUs
(the allocation's mask, the same for all of them) and picks its own by index: vLLM takes GPUs 0..k-1 by its own
device selection (worker i on device i), a trainer rank calls set_device(its node-local GPU index). Where a mask is
needed at all (the allocation's, translated from a CUDA_VISIBLE_DEVICES), it is HIP_VISIBLE_DEVICES, never together
with ROCR_VISIBLE_DEVICES (the two compose and can hide every GPU).

The weight push on ROCm: `nccl` is an RCCL broadcast (vLLM's nccl engine loads librccl on ROCm; RCCL reads the
NCCL_* variables), for a server and a trainer leader on different GCDs; `ipc` is HIP IPC, only for vLLM and the
trainer on one shared GCD (slurm.gpus_per_node 1); `gloo` is for job.device cpu only.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from launcher.core.config import STAGE_IMAGE, STAGE_VENV, ConfigError, stage_kind  # noqa: F401 (the stage rules live with the config checks)

if TYPE_CHECKING:
    from launcher.core.config import JobConfig
    from launcher.core.plan import Plan


@dataclass(frozen=True)
class Platform:
    name: str
    collective: str
    """The collective library, as the user reads it: NCCL or RCCL (which reads the same NCCL_* variables)."""
    ipc: str
    """Same-GPU handle sharing: CUDA IPC or HIP IPC."""
    gpu: str
    """What one device is called: GPU, or GCD (an MI250X has two Graphics Compute Dies, each its own device)."""
    per_process_mask: bool
    """Each node process gets its own *_VISIBLE_DEVICES (cuda); rocm: all see the node's GPUs, pick by index."""


CUDA = Platform("cuda", "NCCL", "CUDA IPC", "GPU", per_process_mask=True)
ROCM = Platform("rocm", "RCCL", "HIP IPC", "GCD", per_process_mask=False)
MASKS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")


def of(cfg: JobConfig) -> Platform:
    return ROCM if cfg.job.platform == "rocm" else CUDA


def of_plan(p: Plan) -> Platform:
    return ROCM if p.platform == "rocm" else CUDA


def device_index(platform: str, local_rank: int, gpu: int) -> int:
    """The device a trainer rank passes to set_device: on cuda its index in torchrun's mask (the node's trainer GPUs),
    on rocm its node-local GPU index (the rank sees all of the node's GPUs)."""
    return gpu if platform == "rocm" else local_rank


# ----------------------------------------------------------------------------- CPU binding


def core_set(spec: str) -> set[int]:
    """'1-3,7' -> {1, 2, 3, 7}."""
    out: set[int] = set()
    for part in spec.replace(" ", "").split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def core_list(cores: set[int]) -> str:
    """{1, 2, 3, 7} -> '1-3,7' (taskset's form)."""
    out: list[list[int]] = []
    run: list[int] = []
    for c in sorted(cores):
        if run and c != run[-1] + 1:
            out.append(run)
            run = []
        run.append(c)
    if run:
        out.append(run)
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in out)


def cores_of(cfg: JobConfig, gpus: list[int]) -> set[int]:
    """The cores nearest these node-local GPUs (slurm.gpu_cores); empty = no binding."""
    if not cfg.slurm.gpu_cores:
        return set()
    return set().union(*(core_set(cfg.slurm.gpu_cores[g]) for g in gpus))


def bind_prefix(cfg: JobConfig, gpus: list[int]) -> list[str]:
    """argv prefix that starts a process (and its children) on the cores of its GPUs: vLLM on its GPUs' cores,
    torchrun on all its ranks' (each rank then narrows itself to its own GPU's cores)."""
    cores = cores_of(cfg, gpus)
    return ["taskset", "-c", core_list(cores)] if cores else []


# ----------------------------------------------------------------------------- visibility (bootstrap, commands)


def node_visibility(platform: str, environ: Mapping[str, str], gpus_needed: int) -> dict[str, str | None]:
    """The changes to the bootstrap's environment (None = unset) so that every process it starts sees the node's
    allocation the same way. cuda: none (commands map the plan's indices through CUDA_VISIBLE_DEVICES). rocm: a
    CUDA_VISIBLE_DEVICES becomes HIP_VISIBLE_DEVICES (ROCm 7 dropped the CUDA name) unless a HIP_ or ROCR_ mask is
    already there; both HIP_ and ROCR_ masks are refused; the mask must hold the plan's GPUs."""
    if platform != "rocm":
        return {}
    hip, rocr, cuda = (environ.get(k, "").strip() for k in MASKS[1:] + MASKS[:1])
    if hip and rocr:
        raise ConfigError(
            f"HIP_VISIBLE_DEVICES={hip!r} and ROCR_VISIBLE_DEVICES={rocr!r} are both set here: the masks compose and "
            "can hide every GPU; unset HIP_VISIBLE_DEVICES (SLURM sets ROCR's)"
        )
    changes: dict[str, str | None] = {}
    if cuda:
        changes["CUDA_VISIBLE_DEVICES"] = None
        if not hip and not rocr:
            changes["HIP_VISIBLE_DEVICES"] = hip = cuda
    mask = hip or rocr
    ids = [x for x in mask.split(",") if x.strip()]
    if mask and len(ids) < gpus_needed:
        name = "HIP_VISIBLE_DEVICES" if hip else "ROCR_VISIBLE_DEVICES"
        raise ConfigError(
            f"the plan uses {gpus_needed} GCDs of the node, but {name}={mask!r} shows {len(ids)}; ask SLURM for "
            "slurm.gpus_per_node GPUs (--gpus-per-node) or lower it"
        )
    return changes


def process_env(p: Plan, role: str) -> dict[str, str]:
    """Environment a node process gets besides its mask (none on cuda)."""
    if p.platform != "rocm":
        return {}
    env = {"SLURM_GRPO_PLATFORM": "rocm"}
    if role == "vllm":
        # should vLLM start its workers through Ray, Ray must not narrow their visibility either (miles PR 1615)
        env |= {"RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES": "1", "RAY_EXPERIMENTAL_NOSET_ROCR_VISIBLE_DEVICES": "1"}
    return env


def derivation_lines(p: Plan) -> list[str]:
    """The plan's lines about the platform (dry-run prints them under the plan); none on cuda."""
    pf = of_plan(p)
    if pf.per_process_mask:
        return []
    n0 = p.nodes[0]
    push = (
        f"an {pf.collective} broadcast from the trainer leader to vLLM's workers (vLLM's nccl engine on ROCm)"
        if p.weight_transfer_backend == "nccl"
        else f"{pf.ipc} on the shared {pf.gpu}"
    )
    return [
        f"platform = {pf.name}: every node process sees all of the node's {pf.gpu}s (no per-process mask; ROCm renumbers "
        f"masked devices per process, which breaks {pf.collective} and {pf.ipc} between them): vLLM on {pf.gpu}s "
        f"{n0.vllm_gpus} by its own device selection, trainer rank i calls set_device({n0.trainer_gpus[0]} + i)",
        f"weight push on {pf.name} = {push}",
    ]


def apptainer_gpu_flag(cfg: JobConfig) -> str:
    """apptainer exec's flag that binds the GPU driver stack into the image."""
    return "--rocm" if cfg.job.platform == "rocm" else "--nv"


# ----------------------------------------------------------------------------- staging (the batch script)

STAGE_VAR = "SLURM_GRPO_STAGE"


def stage_dir_shell(stage_dir: str) -> str:
    """slurm.stage_dir for the batch script: literal parts quoted, $USER and $SLURM_JOB_ID expanded on the node."""
    parts = re.split(r"(\$USER|\$SLURM_JOB_ID)", stage_dir)
    return "".join(f'"{p}"' if p.startswith("$") else shlex.quote(p) for p in parts if p)


def staged_name(cfg: JobConfig) -> str:
    """The staged file's name in the stage folder: env.tar[.gz] for a venv, the image's own name for an image."""
    src = cfg.slurm.stage_env
    if stage_kind(src) == "venv":
        return "env" + next(s for s in (".tar.gz", ".tgz", ".tar") if src.endswith(s))
    return src.rsplit("/", 1)[-1]


def stage_setup(cfg: JobConfig) -> list[str]:
    """Batch-script lines (they run before srun starts any Python on the nodes): make the node-local folder on every
    node, sbcast the packed env or image into it, check it arrived on each node (naming the node otherwise), unpack a
    venv (once per folder, under a lock: nodes that share /tmp, as the test cluster's, unpack it once), put it first
    on PATH; the folder is removed when the batch script ends."""
    src = cfg.slurm.stage_env
    if not src:
        return []
    name = staged_name(cfg)
    q = shlex.quote
    fail = 'echo "slurm.stage_env on $(hostname): {what}" >&2; exit 1'
    per_node = [
        f'cd "${STAGE_VAR}" || {{ {fail.format(what=f"no folder ${STAGE_VAR}")}; }}',
        f"[ -s {q(name)} ] || {{ {fail.format(what=f'{name} is missing or empty after sbcast (see its errors above)')}; }}",
    ]
    if stage_kind(src) == "venv":
        unpack = f"tar -xf {q(name)} -C env && {{ [ ! -x env/bin/conda-unpack ] || env/bin/conda-unpack; }} && touch env/.staged"
        per_node += [
            "exec 9>.lock && flock 9",
            f"[ -e env/.staged ] || {{ rm -rf env && mkdir env && {unpack}; }} || "
            f"{{ {fail.format(what=f'unpacking {name} failed (a tar of a venv? room in slurm.stage_dir?)')}; }}",
        ]
    script = "; ".join(per_node)
    step = 'srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 --kill-on-bad-exit=1'
    lines = [
        "# slurm.stage_env: the environment is copied to node-local storage with sbcast before any Python starts (imports",
        "# from the shared file system by every process of every node take minutes at scale); removed when this script ends",
        f"export {STAGE_VAR}={stage_dir_shell(cfg.slurm.stage_dir)}",
        f'{step} mkdir -p "${STAGE_VAR}" || {{ echo "slurm.stage_env: cannot create ${STAGE_VAR} on a node (see above)" >&2; exit 1; }}',
        f"trap '{step} rm -rf \"${STAGE_VAR}\" || true' EXIT",
        f'sbcast --force {q(src)} "${STAGE_VAR}"/{q(name)} || {{ echo "slurm.stage_env: sbcast of {src} to '
        f'${STAGE_VAR} failed (sbcast names the node above); check the file and room in slurm.stage_dir" >&2; exit 1; }}',
        f"{step} sh -c {q(script)}",
    ]
    lines.append(
        f'echo "slurm.stage_env: {name} staged in ${STAGE_VAR} on $SLURM_JOB_NUM_NODES node(s), ${{SECONDS}} s into the job"'
    )
    if stage_kind(src) == "venv":
        lines.append(f'export PATH="${STAGE_VAR}/env/bin:$PATH" VIRTUAL_ENV="${STAGE_VAR}/env"')
    return lines


def staged_image(cfg: JobConfig) -> str | None:
    """The image path `apptainer exec` runs, as shell text: the staged copy when slurm.stage_env is the image."""
    if cfg.slurm.stage_env and stage_kind(cfg.slurm.stage_env) == "image":
        return f'"${STAGE_VAR}"/{shlex.quote(staged_name(cfg))}'
    return None
