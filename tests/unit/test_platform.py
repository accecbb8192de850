"""job.platform (cuda | rocm), slurm.stage_env and slurm.gpu_cores (launcher/core/platform.py): the plan, the node
commands and their environment on both platforms, what ROCm refuses and why, the bootstrap's view of the node's
device masks, the pre-flight reach check (run for real: this machine has no GPU, so it fails as it must, naming
the node, the check and its log), the staging lines of the batch script (their per-node script run by bash here),
the CPU binding, and the AMD GPUs of the memory estimate and simulate."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tarfile

import pytest

from launcher.core import config as C
from launcher.core import platform as P
from launcher.core.plan import Plan, plan
from launcher.dryrun import render_dry_run
from launcher.memory import gpu_memory_gb, gpu_name
from launcher.node.commands import trainer_command, vllm_command
from launcher.node.peers import NodeFailure
from launcher.node.reach import check_reach, node_allocation, reach_command
from launcher.simulate import GPU_FIGURES, gpu_of
from launcher.startup import STARTUP_DEFAULTS, predict_startup
from launcher.submit import job_command, sbatch_text
from tests.conftest import REPO


def make(platform: str = "cuda", gpus: int = 8, tp: int = 1, nodes: int = 2, **slurm) -> Plan:
    cfg = C.from_dict(
        {
            "vllm": {"model": "/m", "tensor_parallel_size": tp},
            "slurm": {"nodes": nodes, "gpus_per_node": gpus, **slurm},
            "job": {"platform": platform},
        }
    )
    return plan(cfg, "/jobs/x")


def masks(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k in P.MASKS}


# --- plan and commands, both platforms ---------------------------------------------------------------------------


@pytest.mark.parametrize("tp", [1, 2])
def test_rocm_ranks_pick_their_gpu_by_node_index_and_cuda_ranks_by_their_place_in_the_mask(tp):
    cuda, rocm = make("cuda", tp=tp), make("rocm", tp=tp)
    assert [n.trainer_gpus for n in rocm.nodes] == [n.trainer_gpus for n in cuda.nodes]  # the same layout
    for nc, nr in zip(cuda.nodes, rocm.nodes):
        assert [r.cuda_index for r in nc.ranks] == list(range(8 - tp))
        assert [r.cuda_index for r in nr.ranks] == [r.gpu for r in nr.ranks] == list(range(tp, 8))
    assert (cuda.platform, rocm.platform) == ("cuda", "rocm")
    assert Plan.from_dict(__import__("json").loads(rocm.to_json())) == rocm  # plan.json round trip keeps it


def test_cuda_processes_get_their_own_mask_rocm_processes_none():
    cuda, rocm = make("cuda", tp=2), make("rocm", tp=2)
    assert masks(vllm_command(cuda, 1).env) == {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert masks(trainer_command(cuda, 1, "h").env) == {"CUDA_VISIBLE_DEVICES": "2,3,4,5,6,7"}
    # an allocation's mask still maps the cuda indices, as before
    assert masks(vllm_command(cuda, 0, allocated="4,5,6,7,8,9,10,11").env) == {"CUDA_VISIBLE_DEVICES": "4,5"}
    v, t = vllm_command(rocm, 1), trainer_command(rocm, 1, "h")
    assert masks(v.env) == {} and masks(t.env) == {}
    assert v.env["RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES"] == "1" == v.env["RAY_EXPERIMENTAL_NOSET_ROCR_VISIBLE_DEVICES"]
    assert "--tensor-parallel-size" in v.argv and v.argv[v.argv.index("--tensor-parallel-size") + 1] == "2"
    assert json_backend(v.argv) == "nccl"  # the RCCL broadcast runs through vLLM's nccl engine
    # the rest of the environment is the same on both platforms
    same = {k for k in trainer_command(cuda, 1, "h").env if k not in P.MASKS}
    assert same <= set(t.env) and set(t.env) - same == {"SLURM_GRPO_PLATFORM"}


def json_backend(argv: list[str]) -> str:
    return __import__("json").loads(argv[argv.index("--weight-transfer-config") + 1])["backend"]


def test_the_dry_run_names_rccl_on_rocm_and_nccl_on_cuda():
    rocm = make("rocm")
    out = render_dry_run(rocm.config, rocm)
    assert "platform = rocm: every node process sees all of the node's GCDs" in out
    assert "trainer rank i calls set_device(1 + i)" in out
    assert "weight push on rocm = an RCCL broadcast" in out
    assert "CUDA_VISIBLE_DEVICES" not in out.split("# per-node commands")[1]
    cuda = make("cuda")
    out = render_dry_run(cuda.config, cuda)
    assert "platform = rocm" not in out and "RCCL" not in out and "CUDA_VISIBLE_DEVICES=0 " in out


def test_one_shared_gcd_uses_hip_ipc_and_gets_no_reach_check():
    p = make("rocm", gpus=1, nodes=1, tp=1)
    assert p.weight_transfer_backend == "ipc" and p.nodes[0].shared_gpu
    assert "weight push on rocm = HIP IPC on the shared GCD" in p.derivation
    assert reach_command(p, 0, "python") is None
    assert reach_command(make("cuda"), 0, "python") is None  # cuda: a mask per process, nothing to check here


ROCM_REFUSALS = [
    ({"vllm": {"weight_transfer_backend": "gloo"}}, "vllm.weight_transfer_backend gloo is for job.device cpu; on ROCm use nccl"),
    ({"vllm": {"weight_transfer_backend": "ipc"}}, "ipc (HIP IPC) works on ROCm only for vLLM and the trainer on one shared GCD"),
    ({"vllm": {"weight_transfer_backend": "nccl"}, "slurm": {"gpus_per_node": 1}}, "nccl (RCCL) needs the trainer on another GCD"),
    ({"vllm": {"data_parallel_size": 2}}, "vllm.data_parallel_size 2 on ROCm: vLLM gives each DP engine its own device mask"),
    ({"job": {"device": "cpu"}, "trainer": {"dtype": "float32"}}, "job.platform rocm needs job.device cuda"),
    ({"slurm": {"layout": "shared"}}, "slurm.layout shared on ROCm would put a vLLM data-parallel engine on every GCD"),
]  # fmt: skip


@pytest.mark.parametrize("extra,message", ROCM_REFUSALS, ids=[m[:30] for _, m in ROCM_REFUSALS])
def test_rocm_refuses_what_it_does_not_support_with_the_fix(extra, message):
    raw = {"vllm": {"model": "/m"}, "job": {"platform": "rocm"}}
    for k, v in extra.items():
        raw[k] = {**raw.get(k, {}), **v}
    with pytest.raises(C.ConfigError, match=re.escape(message)):
        C.from_dict(raw)
    raw["job"]["platform"] = "cuda"  # the same config is not refused for these reasons on cuda
    try:
        C.from_dict(raw)
    except C.ConfigError as e:
        assert "ROCm" not in str(e) and "rocm" not in str(e)


# --- the bootstrap's view of the node's masks ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "environ,changes",
    [
        ({}, {}),
        ({"ROCR_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}, {}),  # SLURM's allocation mask: every process inherits it alike
        ({"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}, {"CUDA_VISIBLE_DEVICES": None, "HIP_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}),
        ({"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7", "ROCR_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}, {"CUDA_VISIBLE_DEVICES": None}),
    ],
)
def test_on_rocm_the_node_keeps_one_mask_for_all_its_processes(environ, changes):
    assert P.node_visibility("rocm", environ, 8) == changes
    assert P.node_visibility("cuda", environ, 8) == {}


def test_both_hip_and_rocr_masks_or_too_few_gpus_are_refused():
    with pytest.raises(C.ConfigError, match="HIP_VISIBLE_DEVICES='0' and ROCR_VISIBLE_DEVICES='0,1' are both set.*unset HIP_"):
        P.node_visibility("rocm", {"HIP_VISIBLE_DEVICES": "0", "ROCR_VISIBLE_DEVICES": "0,1"}, 2)
    with pytest.raises(C.ConfigError, match="the plan uses 8 GCDs of the node, but ROCR_VISIBLE_DEVICES='0,1' shows 2"):
        P.node_visibility("rocm", {"ROCR_VISIBLE_DEVICES": "0,1"}, 8)


def test_the_bootstrap_environment_is_rewritten_on_rocm_only(monkeypatch):
    for k in P.MASKS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    assert node_allocation(make("cuda")) == "0,1,2,3,4,5,6,7"  # cuda: the commands map through it
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
    assert node_allocation(make("rocm")) is None
    assert "CUDA_VISIBLE_DEVICES" not in os.environ and os.environ["HIP_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"


# --- the pre-flight reach check ----------------------------------------------------------------------------------


def test_the_reach_check_fails_on_a_machine_without_the_gpus_naming_node_check_and_log(tmp_path):
    cfg = C.from_dict(
        {"vllm": {"model": "/m", "tensor_parallel_size": 2}, "slurm": {"gpus_per_node": 8}, "job": {"platform": "rocm"}}
    )
    p = plan(cfg, str(tmp_path))
    (tmp_path / "logs").mkdir()
    cmd = reach_command(p, 0, sys.executable)
    assert cmd is not None and cmd.argv[1:] == ["-m", "trainer.reach", "--leader", "2", "--server", "0", "1"]
    with pytest.raises(NodeFailure) as e:  # the real check, in torch: this machine shows no GPU
        check_reach(p, 0, sys.executable, "node 0 (h1)")
    msg = str(e.value)
    assert msg.startswith("node 0 (h1): pre-flight reach check (trainer leader GPU 2 <-> vLLM GPUs 0,1) failed with code 3")
    assert f"last lines of {tmp_path}/logs/node0-reach.log" in msg
    assert "this process sees 0 GPU(s)" in msg and "the plan needs index 2" in msg


# --- staging ------------------------------------------------------------------------------------------------------

STAGE_REFUSALS = [
    ({"stage_env": "envs/x.tar"}, "slurm.stage_env 'envs/x.tar' must be an absolute path"),
    ({"stage_env": "/s/x.zip"}, "slurm.stage_env '/s/x.zip' must be an absolute path on the shared file system to a packed venv"),
    ({"stage_env": "/s/x.sif"}, "slurm.stage_env /s/x.sif is an image: set slurm.container.image to the same file"),
    ({"stage_env": "/s/x.tar", "container": {"image": "/s/y.sif", "runtime": "apptainer"}}, "stage the image instead"),
    ({"stage_dir": "/tmp/$HOME/x"}, "slurm.stage_dir '/tmp/$HOME/x' must be an absolute node-local folder"),
    ({"stage_dir": "tmp/x"}, "slurm.stage_dir 'tmp/x' must be an absolute node-local folder"),
    ({"gpu_cores": ["1-7"]}, "slurm.gpu_cores has 1 entries for 8 GPUs per node"),
    ({"gpu_cores": ["1-7"] * 7 + ["a"]}, "slurm.gpu_cores[7] 'a' is not a core list"),
]  # fmt: skip


@pytest.mark.parametrize("slurm,message", STAGE_REFUSALS, ids=[m[:32] for _, m in STAGE_REFUSALS])
def test_staging_and_binding_mistakes_are_refused_with_the_fix(slurm, message):
    with pytest.raises(C.ConfigError, match=re.escape(message)):
        C.from_dict({"vllm": {"model": "/m"}, "slurm": slurm})


def test_a_staged_venv_needs_python_from_path():
    with pytest.raises(C.ConfigError, match=r"job.python '/opt/py/bin/python' is a path, so the staged venv"):
        C.from_dict({"vllm": {"model": "/m"}, "slurm": {"stage_env": "/s/e.tgz"}, "job": {"python": "/opt/py/bin/python"}})


def test_the_stage_dir_expands_only_user_and_job_id():
    assert P.stage_dir_shell("/mnt/bb/$USER/g-$SLURM_JOB_ID") == '/mnt/bb/"$USER"/g-"$SLURM_JOB_ID"'
    out = subprocess.run(
        ["bash", "-c", "echo " + P.stage_dir_shell("/tmp/a b-$USER-$SLURM_JOB_ID")],
        env={"USER": "al", "SLURM_JOB_ID": "42"},
        capture_output=True,
        text=True,
    )
    assert out.stdout.strip() == "/tmp/a b-al-42"


def per_node_script(cfg: C.JobConfig) -> str:
    """The script the batch file's staging srun step runs on every node."""
    line = next(ln for ln in P.stage_setup(cfg) if " sh -c " in ln)
    return shlex.split(line.split(" sh -c ", 1)[1])[0]


def test_the_per_node_stage_script_unpacks_a_venv_once_and_names_the_node_when_the_copy_is_missing(tmp_path):
    cfg = C.from_dict({"vllm": {"model": "/m"}, "slurm": {"stage_env": "/shared/e.tar.gz"}})
    script = per_node_script(cfg)
    stage = tmp_path / "stage"
    stage.mkdir()
    env = {**os.environ, "SLURM_GRPO_STAGE": str(stage)}
    bad = subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True)
    assert bad.returncode == 1
    assert re.search(r"slurm.stage_env on \S+: env.tar.gz is missing or empty after sbcast", bad.stderr)
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("#!/bin/sh\necho staged\n")
    with tarfile.open(stage / "env.tar.gz", "w:gz") as t:  # what `sbcast` leaves on the node
        t.add(venv, arcname=".")
    for _ in range(2):  # a second task on a node that shares the folder finds it unpacked
        ok = subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True)
        assert ok.returncode == 0, ok.stderr
    assert (stage / "env/bin/python").read_text().endswith("echo staged\n") and (stage / "env/.staged").exists()
    lines = P.stage_setup(cfg)
    assert lines[-1] == 'export PATH="$SLURM_GRPO_STAGE/env/bin:$PATH" VIRTUAL_ENV="$SLURM_GRPO_STAGE/env"'
    sbcast = next(ln for ln in lines if ln.startswith("sbcast "))
    assert sbcast.startswith('sbcast --force /shared/e.tar.gz "$SLURM_GRPO_STAGE"/env.tar.gz || {')
    # before any Python: nothing in the staging lines starts one
    assert not any(re.search(r"\bpython", ln) for ln in lines)


def test_a_staged_image_runs_from_the_node_local_copy_with_rocm_devices():
    cfg = C.load(REPO / "configs/frontier_7b_4nodes.yaml", ["job.job_dir=/j"])
    p = plan(cfg, "/j")
    cmd = job_command(cfg, p)
    assert cmd.startswith("apptainer exec --rocm --bind ")
    assert ' "$SLURM_GRPO_STAGE"/slurm-grpo-vllm-rocm.sif python -u -m launcher.node.bootstrap /j/plan.json' in cmd
    text = sbatch_text(cfg, p)
    assert text.index("sbcast --force") < text.index("# command")  # copied before the job's srun starts any Python
    for line in ("export FI_MR_CACHE_MONITOR=kdreg2", "export NCCL_SOCKET_IFNAME=hsn0", "#SBATCH --network=disable_rdzv_get"):
        assert line in text.splitlines()
    assert "memhooks" not in text.replace("never memhooks", "").replace("memhooks deadlocks", "")
    # NCCL_NET=OFI only across nodes
    assert 'if [ "${SLURM_JOB_NUM_NODES:-1}" -gt 1 ]; then export NCCL_NET=OFI; else export NCCL_NET=Socket; fi' in text
    # the cuda apptainer job keeps --nv
    cuda = C.load(REPO / "configs/gpu_7b_4nodes.yaml", ["slurm.container={runtime: apptainer, image: /s/i.sif}"])
    assert job_command(cuda, plan(cuda, "/j")).startswith("apptainer exec --nv ")


# --- CPU binding --------------------------------------------------------------------------------------------------


def test_each_process_is_bound_to_the_cores_of_its_gpus():
    assert P.core_list(P.core_set("9-15,1-7,17")) == "1-7,9-15,17"
    cfg = C.load(REPO / "configs/frontier_7b_4nodes.yaml")
    p = plan(cfg, "/j")
    v, t = vllm_command(p, 0), trainer_command(p, 0, "h")
    assert v.argv[:3] == ["taskset", "-c", "49-55"] and v.argv[3:6] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
    assert t.argv[:3] == ["taskset", "-c", "1-7,9-15,17-23,25-31,33-39,41-47,57-63"]
    assert P.cores_of(cfg, [4]) == set(range(1, 8))  # what trainer rank on GCD 4 binds itself to (trainer.parallel)
    assert vllm_command(make("rocm"), 0).argv[0] == "python"  # no gpu_cores: no binding


# --- AMD GPUs in the memory estimate and simulate -----------------------------------------------------------------


def test_the_gpu_lookup_knows_mi250x_and_mi300x():
    assert gpu_memory_gb(0, "", "gpu-mi250x") == 64 and gpu_memory_gb(0, "MI300X", "") == 192
    assert gpu_name("amd_mi250x") == "mi250x" and gpu_name("batch") == ""
    cfg = C.load(REPO / "configs/frontier_7b_4nodes.yaml")
    assert gpu_of(cfg) == "mi250x"  # ROCm, 64 GB per device
    mi300 = C.load(REPO / "configs/gpu_7b_4nodes.yaml", ["slurm.constraint=mi300x"])
    assert gpu_of(mi300) == "mi300x" and GPU_FIGURES["mi300x"]["intra_bw_gbs"] == 64


def test_the_startup_model_grows_with_nodes_on_the_shared_fs_and_not_when_staged():
    rows = predict_startup([64, 128, 256], 12, False, STARTUP_DEFAULTS)
    assert [r.shared_worst_s for r in rows] == sorted(r.shared_worst_s for r in rows)
    assert rows[-1].shared_worst_s == pytest.approx(256 * 12 * 44_000 / 200_000)
    assert rows[-1].shared_best_s == pytest.approx(256 * 44_000 / 200_000)
    assert max(r.staged_s for r in rows) - min(r.staged_s for r in rows) < 2  # one more tree level at most
    venv = predict_startup([256], 12, True, STARTUP_DEFAULTS)[0]
    assert venv.staged_s - rows[-1].staged_s == pytest.approx(STARTUP_DEFAULTS["env_gb"] / STARTUP_DEFAULTS["unpack_gbs"])
