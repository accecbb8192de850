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
