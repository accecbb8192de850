"""vLLM plugin (entry point group `vllm.general_plugins`, see pyproject.toml), loaded in every vLLM
process: registers the project's `gloo` (CPU) and `mapped_ipc` (one shared GPU) weight-transfer engines, and on CPU servers keeps linear
weights as plain tensors so that pushed weights take effect.

Why the second part: vLLM's CPU linear layers prepack weights into oneDNN handles and drop the weight
tensor (`dispatch_cpu_unquantized_gemm(layer, remove_weight=True)`); a weight reload then writes
into a tensor nothing reads, and the server keeps serving the old model. Plain
`torch.nn.functional.linear` on the kept weight costs speed only, irrelevant at test sizes.
"""

from __future__ import annotations

import os

from launcher.core.jobdir import Env

PLAIN_LINEAR_ENV = Env.CPU_PLAIN_LINEAR

REGISTERED_MARK = "slurm-grpo vLLM plugin: registered gloo and mapped_ipc weight-transfer engines"


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if "gloo" not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine("gloo", "trainer.push.gloo_engine", "GlooWeightTransferEngine")
    if "mapped_ipc" not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine("mapped_ipc", "trainer.push.ipc_engine", "MappedIpcWeightTransferEngine")
    if os.environ.get(PLAIN_LINEAR_ENV) == "1":
        import torch
        import vllm.model_executor.layers.utils as layer_utils

        def keep_weight(layer, remove_weight):  # noqa: ARG001 - signature of the function it replaces
            layer.cpu_linear = torch.nn.functional.linear

        layer_utils.dispatch_cpu_unquantized_gemm = keep_weight
    if os.environ.get(Env.PLUGIN_QUIET) != "1":
        print(f"{REGISTERED_MARK} (pid {os.getpid()}, plain CPU linear: {os.environ.get(PLAIN_LINEAR_ENV) == '1'})", flush=True)
