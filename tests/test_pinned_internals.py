"""The TRL / transformers / vLLM / submitit internals slurm-grpo relies on. If an upgrade moves one,
this fails with a message naming it, instead of the trainer failing somewhere deep in a job."""

from __future__ import annotations

import inspect

import pytest


def test_trl_generation_injection_point():
    import trl.trainer.grpo_trainer as gt

    assert hasattr(gt, "VLLMGeneration"), "trl.trainer.grpo_trainer.VLLMGeneration is gone (trainer/grpo.py swaps it)"
    src = inspect.getsource(gt.GRPOTrainer)
    for needle in ("VLLMGeneration(", "self.vllm_generation.sync_weights()", "self.vllm_generation.generate(",
                   "vllm_client.get_server_info()"):
        assert needle in src, f"GRPOTrainer no longer contains {needle!r}; trainer/generation.py must follow TRL"
    params = list(inspect.signature(gt.VLLMGeneration.generate).parameters)
    assert params[:5] == ["self", "prompts", "images", "num_generations", "profiler"], params


def test_transformers_leaves_self_sharded_models_alone():
    import transformers.trainer as tt

    assert "is_distributed_loading_by_transformers" in inspect.getsource(tt.Trainer.__init__), \
        "transformers' Trainer no longer reads is_distributed_loading_by_transformers (trainer/parallel.py sets it)"


def test_vllm_weight_transfer_hooks():
    vllm = pytest.importorskip("vllm")
    import vllm.model_executor.layers.utils as lu
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    assert hasattr(WeightTransferEngineFactory, "register_engine") and hasattr(WeightTransferEngineFactory, "_registry")
    for m in ("init_transfer_engine", "receive_weights", "update_weights", "parse_update_info"):
        assert hasattr(NCCLWeightTransferEngine, m), f"NCCLWeightTransferEngine.{m} is gone (trainer/gloo_engine.py)"
    assert hasattr(lu, "dispatch_cpu_unquantized_gemm"), "vLLM's CPU gemm dispatch moved (trainer/vllm_plugin.py patches it)"
    assert vllm.__version__.startswith("0.32"), vllm.__version__


def test_submitit_internals():
    from submitit.slurm.slurm import SlurmExecutor

    assert hasattr(SlurmExecutor, "_submit_command") and hasattr(SlurmExecutor, "_make_submission_file_text")


WORKER = """
import os, signal, sys, time
rank = int(os.environ["RANK"])
if rank == 1:
    time.sleep(0.5)
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)  # what the OOM killer does
    raise ValueError("boom in rank 1")
# rank 0 reports what a survivor reports when its peer vanished, then waits for torchrun's SIGTERM: before
# the kill (the worst case: its line comes first in the log), after the exception (as survivors do)
time.sleep(0.2 if sys.argv[1] == "kill" else 1.5)
print("RuntimeError: [pair.cc:537] Read error: Connection reset by peer. remote worker", file=sys.stderr, flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("how, needles", [("kill", ("rank 1", "local rank 1", "SIGKILL")),
                                          ("raise", ("ValueError: boom in rank 1",))])
def test_torchrun_failure_summary_names_the_killed_rank(tmp_path, how, needles):
    """launcher.bootstrap.root_cause reads torchrun's failure summary (its format is torch's): a rank killed
    by a signal is the node's own cause, not the survivor's "reset by peer" (which would make the node wait
    for another node's abort, and name the wrong cause); an exception in a rank is named as it was raised."""
    import subprocess
    import sys

    from launcher.bootstrap import PEER_LOST, root_cause

    (tmp_path / "w.py").write_text(WORKER)
    log = tmp_path / "trainer.log"
    with open(log, "w") as f:
        f.write("===== test start\n")
        f.flush()
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "0",
                        "--master-port", "29561", str(tmp_path / "w.py"), how], stdout=f, stderr=subprocess.STDOUT,
                       timeout=120, cwd=tmp_path)
    cause = root_cause(log)
    for n in needles:
        assert n in cause, (cause, log.read_text()[-3000:])
    assert not any(m in cause for m in PEER_LOST), cause
