"""vLLM's model classes built in this process on CPU, without a server (vLLM's own `get_model`, ~1 s per tiny body):
the unit tier checks what a push sends against what vLLM's own `load_weights` does with it. Run it in a spawned
process (tests.support.ranks.run_ranks): it sets vLLM's global distributed state."""

from __future__ import annotations

import os
from typing import Any

from launcher.core.jobdir import Env


def vllm_env() -> None:
    """As the project's CPU servers run: the plugin keeps linear weights plain and re-prepacks MoE experts after an
    update (trainer.push.vllm_plugin), quietly."""
    os.environ[Env.CPU_PLAIN_LINEAR] = "1"
    os.environ[Env.PLUGIN_QUIET] = "1"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


class InProcessVllm:
    def __init__(self) -> None:
        vllm_env()
        import torch
        from vllm.plugins import load_general_plugins

        load_general_plugins()
        # vLLM's loader empties the accelerator cache after a load; there is no accelerator on a CPU test machine
        torch.accelerator.empty_cache = lambda: None  # type: ignore[assignment]
        self.ready = False

    def build(self, model_dir: str) -> tuple[Any, Any]:
        """(vLLM's model loaded from model_dir, its VllmConfig)."""
        import json
        from pathlib import Path

        from vllm.config import set_current_vllm_config
        from vllm.distributed import init_distributed_environment, initialize_model_parallel
        from vllm.engine.arg_utils import EngineArgs
        from vllm.model_executor.model_loader import get_model
        from vllm.model_executor.models.registry import ModelRegistry
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        # MLA (DeepSeek, GLM-4.7-Flash): vLLM picks AMX_MLA on a CPU with AMX, whose prepack takes bf16/fp16 weights only;
        # CPU_MLA takes fp32 and derives its absorbed matrices as the GPU backends do (MLACommonImpl)
        mla = "kv_lora_rank" in json.loads((Path(model_dir) / "config.json").read_text())
        args = EngineArgs(
            model=model_dir,
            dtype="float32",
            enforce_eager=True,
            max_model_len=256,
            skip_tokenizer_init=True,
            attention_backend=AttentionBackendEnum.CPU_MLA if mla else None,
        )
        for arch in json.loads((Path(model_dir) / "config.json").read_text())["architectures"]:
            # inspected in this process (the class is imported anyway) instead of one subprocess per architecture
            lazy = ModelRegistry.models.get(arch)
            if lazy is not None and hasattr(lazy, "load_model_cls") and hasattr(lazy, "module_name"):
                ModelRegistry.register_model(arch, lazy.load_model_cls())
        cfg = args.create_engine_config()
        with set_current_vllm_config(cfg):
            if not self.ready:
                import torch.distributed as dist

                rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
                init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo")
                initialize_model_parallel(1, 1)
                self.ready = True
            return get_model(vllm_config=cfg), cfg

    @staticmethod
    def push(model: Any, cfg: Any, weights: list[tuple[str, Any]]) -> None:
        """One weight update as the project's engines run it (trainer.push.gloo_engine / vLLM's nccl engine): layerwise
        reload, load_weights, finalize."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        with set_current_vllm_config(cfg):
            initialize_layerwise_reload(model)
            model.load_weights(weights)
            finalize_layerwise_reload(model, cfg.model_config)

    @staticmethod
    def prompt_logprobs(model: Any, cfg: Any, ids: list[int]) -> list[float]:
        """log p(ids[i+1] | ids[:i+1]) by vLLM's own forward (its CPU attention kernel, one prefill into a fresh KV
        cache), as the server answers the parity probe's prompt_logprobs."""
        import torch
        from vllm.config import set_current_vllm_config
        from vllm.forward_context import set_forward_context
        from vllm.model_executor.layers.attention import Attention
        from vllm.v1.attention.backend import CommonAttentionMetadata
        from vllm.v1.kv_cache_interface import AttentionSpec

        layers = [m for m in model.modules() if isinstance(m, Attention)]
        n = len(ids)
        common = CommonAttentionMetadata(
            query_start_loc=torch.tensor([0, n], dtype=torch.int32),
            query_start_loc_cpu=torch.tensor([0, n], dtype=torch.int32),
            seq_lens=torch.tensor([n], dtype=torch.int32),
            num_reqs=1,
            num_actual_tokens=n,
            max_query_len=n,
            max_seq_len=n,
            block_table_tensor=torch.zeros((1, 1), dtype=torch.int32),
            # padded with -1 (no slot) past the sequence, as the runner's persistent buffer: a model whose attention
            # sees more key rows than tokens (the tiny GPT-NeoX had 1 kv head for 2) reads those, not past the tensor
            slot_mapping=torch.cat([torch.arange(n), torch.full((8 * n,), -1)])[:n],
        )
        metadata, slots = {}, {}
        with set_current_vllm_config(cfg):
            for layer in layers:
                spec = layer.get_kv_cache_spec(cfg)
                assert isinstance(spec, AttentionSpec), spec
                assert n <= spec.block_size, (n, spec.block_size)
                layer.kv_cache = torch.zeros(1, spec.num_kv_heads, spec.block_size, 2 * spec.head_size, dtype=spec.dtype)
                builder = layer.get_attn_backend().get_builder_cls()(spec, [layer.layer_name], cfg, torch.device("cpu"))
                metadata[layer.layer_name] = builder.build(0, common)
                slots[layer.layer_name] = common.slot_mapping
            with torch.no_grad(), set_forward_context(metadata, cfg, num_tokens=n, slot_mapping=slots):
                hidden = model(input_ids=torch.tensor(ids), positions=torch.arange(n))
                logits = model.compute_logits(hidden)
        logprobs = torch.log_softmax(logits.float(), -1)
        return [logprobs[i, ids[i + 1]].item() for i in range(n - 1)]
