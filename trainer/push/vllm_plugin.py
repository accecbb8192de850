"""vLLM plugin (entry point group `vllm.general_plugins`, see pyproject.toml), loaded in every vLLM
process: registers the project's `gloo` (CPU), `mapped_ipc` (one shared GPU) and `nccl_adapter` (vLLM's nccl, able to
take a LoRA adapter) weight-transfer engines, on CPU servers keeps linear
weights as plain tensors and re-prepacks MoE experts after each update so that pushed weights take effect, with LoRA pushes serves a pushed adapter
(from tensors or read once from its folder) and has Model Runner V2 capture CUDA graphs through the adapter only,
makes the push's prefix-cache reset cost the blocks that hold a cached hash, not the whole KV cache
(trainer/push/prefix_reset.py says why that leaves the same state; on a vLLM whose code it was not checked against it keeps vLLM's own, with a warning),
keeps an orderly shutdown's expected EngineDeadError traceback out of the log (trainer/push/clean_shutdown.py), splits a
push's fused experts for models whose loader takes per-expert names only (DeepSeek-V2/V3, GLM-4.7-Flash) or would
write the fused ones where a push's reload does not look (gpt-oss, its attention sinks too; MiMo-V2-Flash's sinks),
computes Apertus's xIELU from its constants (a push's reload leaves its beta/eps buffers uninitialised), and with
vllm.inspect_in_process has vLLM inspect the model class in the API server's own process.

Why the second part: vLLM's CPU linear layers prepack weights into oneDNN handles and drop the weight
tensor (`dispatch_cpu_unquantized_gemm(layer, remove_weight=True)`); a weight reload then writes
into a tensor nothing reads, and the server keeps serving the old model. Plain
`torch.nn.functional.linear` on the kept weight costs speed only, irrelevant at test sizes.

Why the third (load_adapters_once, Env.LORA_LOAD_ONCE): vLLM 0.32 stores the LoRARequest of /v1/load_lora_adapter,
load_inplace=True included, and gives that object to every request naming the adapter; the worker's per-step
activation (LRUCacheWorkerLoRAManager._apply_adapters -> add_adapter) reloads an adapter whose request says
load_inplace, so every engine step of every request read the adapter from disk again, pinned it and copied it into
its slot: generation through the adapter took 8x the base's on the H200 (gpu/RESULTS.md; /tmp/sg/lora_slow's report).
Only the push, the explicit add_lora (worker add_lora -> add_adapter), needs the reload; the per-step path gets the
requests with the flag off. Same id, same slot: requests in flight go on under the newly pushed weights, as before.
The same patch serves an adapter pushed as tensors through the weight-transfer engine (trainer.push.adapter_receiver):
the per-step re-add after such a push takes the LoRAModel built from the tensors instead of reading a folder.
"""

from __future__ import annotations

import os

from launcher.core.jobdir import Env

PLAIN_LINEAR_ENV = Env.CPU_PLAIN_LINEAR

REGISTERED_MARK = "slurm-grpo vLLM plugin: registered gloo, mapped_ipc and nccl_adapter weight-transfer engines"
ADAPTER_READ_MARK = "slurm-grpo vLLM plugin: LoRA adapter read from disk"
"""Printed (with name, id and path) each time a worker reads an adapter, with Env.LORA_LOAD_ONCE: one per push."""


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if "gloo" not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine("gloo", "trainer.push.gloo_engine", "GlooWeightTransferEngine")
    if "mapped_ipc" not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine("mapped_ipc", "trainer.push.ipc_engine", "MappedIpcWeightTransferEngine")
    if "nccl_adapter" not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            "nccl_adapter", "trainer.push.nccl_adapter_engine", "NcclAdapterWeightTransferEngine"
        )
    if os.environ.get(PLAIN_LINEAR_ENV) == "1":
        import torch
        import vllm.model_executor.layers.utils as layer_utils

        def keep_weight(layer, remove_weight):  # noqa: ARG001 - signature of the function it replaces
            layer.cpu_linear = torch.nn.functional.linear

        layer_utils.dispatch_cpu_unquantized_gemm = keep_weight
        reprepack_cpu_moe_on_update()
    split_fused_experts_for_per_expert_loaders()
    xielu_from_its_constants()
    from trainer.push import clean_shutdown, prefix_reset

    fast_reset = prefix_reset.install()
    clean_shutdown.install()
    once = os.environ.get(Env.LORA_LOAD_ONCE) == "1"
    if once:
        load_adapters_once()
    if os.environ.get(Env.LORA_ACTIVE_GRAPHS_ONLY) == "1":
        lora_graphs_active_only()
    if os.environ.get(Env.INSPECT_IN_PROCESS) == "1":
        inspect_in_process()
    if os.environ.get(Env.PLUGIN_QUIET) != "1":
        print(
            f"{REGISTERED_MARK} (pid {os.getpid()}, plain CPU linear: {os.environ.get(PLAIN_LINEAR_ENV) == '1'}, "
            f"LoRA adapters read once: {once}, prefix reset over cached blocks only: {fast_reset})",
            flush=True,
        )


def reprepack_cpu_moe_on_update() -> None:
    """Patch vLLM's unquantized MoE (idempotent): on a weight update, run the CPU experts' own
    process_weights_after_loading (pad the expert width to a multiple of 32, prepack) as on the first load.

    Why: UnquantizedFusedMoEMethod._setup_kernel copies the pushed [E, 2I, H] weights into the kernel's storage but
    runs that hook only on the first load, so after a push the CPU kernel read plain weights as prepacked ones (parity
    0.064 on a tiny Qwen3-MoE), and an expert width that is not a multiple of 32 failed the copy (96 into 128)."""
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as ufm
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    method = ufm.UnquantizedFusedMoEMethod
    if getattr(method._setup_kernel, "_slurm_grpo", False):
        return
    setup = method._setup_kernel

    def _setup_kernel(self, layer, w13, w2):
        update = self.moe_kernel is not None
        setup(self, layer, w13, w2)
        if update and isinstance(self.moe_kernel.fused_experts, CPUUnquantizedExperts):
            self.moe_kernel.fused_experts.process_weights_after_loading(layer)

    _setup_kernel._slurm_grpo = True  # type: ignore[attr-defined]
    method._setup_kernel = _setup_kernel  # type: ignore[method-assign]


def xielu_from_its_constants() -> None:
    """Patch vLLM's XIELU (Apertus's activation; idempotent): its Python path computes with the beta and eps it was
    built with (the floats its CUDA path already uses), not with its beta/eps buffers.

    Why: no push carries buffers (the trainer sends parameters), and vLLM 0.32's layerwise reload
    (`_copy_and_restore_kernel_tensors`) copies a layer's persistent buffers that nothing loaded from the layer it
    materialised empty: after the first push beta and eps held uninitialised memory (0.0 / -1.9e26 on a tiny Apertus)
    and the served logprobs were 0.4 off transformers'. Both are constants in both libraries (0.5, -1e-6)."""
    import torch
    from torch import nn
    from vllm.model_executor.layers.activation import XIELU

    if getattr(XIELU._xielu_python, "_slurm_grpo", False):
        return

    def _xielu_python(self, x: torch.Tensor) -> torch.Tensor:
        beta, eps = self._beta_scalar, self._eps_scalar
        alpha_p = nn.functional.softplus(self.alpha_p)
        alpha_n = beta + nn.functional.softplus(self.alpha_n)
        return torch.where(x > 0, alpha_p * x * x + beta * x, (torch.expm1(torch.clamp(x, max=eps)) - x) * alpha_n + beta * x)

    _xielu_python._slurm_grpo = True  # type: ignore[attr-defined]
    XIELU._xielu_python = _xielu_python  # type: ignore[method-assign]


FUSED_EXPERT_SHARDS = {"gate_up_proj": ("w1", "w3"), "w13": ("w1", "w3"), "down_proj": ("w2",), "w2": ("w2",)}
"""The fused expert tensors a push sends (trainer.checkpoint_names.served_names: `experts.<leaf>` [E, rows, cols]) and
the per-expert shards of vLLM's expert mapping that each is made of, in row order (gate rows first)."""


def split_fused_experts_for_per_expert_loaders() -> None:
    """Patch vLLM's model loading (idempotent): a model whose `load_weights` takes per-expert checkpoint names only gets
    each fused expert tensor of a push split into them, by the model's own expert mapping, as it is received.

    Why: vLLM 0.32's DeepSeek-V2/V3 (Kimi-K2) and GLM-4.7-Flash loaders are hand-written loops over
    `get_expert_mapping()` (`experts.{e}.gate_proj.` -> w1 ...), without the fused entries that the models loading
    through RoutedExperts take (`include_fused=True`): a fused `experts.gate_up_proj` fell through to a KeyError.
    Splitting here keeps the trainer's push one fused tensor per layer for every family; the split tensors are views."""
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    if getattr(BaseModelLoader.load_model, "_slurm_grpo", False):
        return
    load_model = BaseModelLoader.load_model

    def load_model_then_wrap(self, *args, **kwargs):
        model = load_model(self, *args, **kwargs)
        wrap_per_expert_loader(model) or wrap_gpt_oss_loader(model)
        wrap_mimo_sink_loader(model)
        name_partial_weight_loaders(model)
        return model

    load_model_then_wrap._slurm_grpo = True  # type: ignore[attr-defined]
    BaseModelLoader.load_model = load_model_then_wrap  # type: ignore[method-assign]


def wrap_per_expert_loader(model) -> bool:
    """Wrap model.load_weights if the model's expert mapping has per-expert names only; True if wrapped."""
    import re

    mapping_of = getattr(model, "get_expert_mapping", None)
    mapping = mapping_of() if callable(mapping_of) else []
    if not mapping or not all(re.search(r"experts\.\d+\.", w) for _, w, _, _ in mapping):
        return False
    names = {(e, shard): w for _, w, e, shard in mapping}  # (expert, w1/w2/w3) -> "experts.{e}.gate_proj."

    def split(name: str, t, _params: dict):
        head, sep, leaf = name.rpartition("experts.")
        shards = FUSED_EXPERT_SHARDS.get(leaf) if sep and t.dim() == 3 else None
        if shards is None:
            return [(name, t)]
        rows = t.shape[1] // len(shards)
        return [
            (f"{head}{names[(e, shard)]}weight", t[e, i * rows : (i + 1) * rows])
            for e in range(t.shape[0])
            for i, shard in enumerate(shards)
        ]

    route_load_weights(model, split)
    return True


def name_partial_weight_loaders(model) -> int:
    """Give every parameter's weight_loader that is a functools.partial the __name__ of its function; returns how many.

    Why: a push's layerwise reload (vllm/model_executor/model_loader/reload/layerwise.py) reads each loader's
    `__name__`, which a partial lacks: MiniMax-M2's q/k norms (MiniMaxText01RMSNormTP) bind their TP shard into one, and
    the first push raised AttributeError before any weight moved. A name changes nothing a load does."""
    import functools

    named = 0
    for p in model.parameters():
        loader = getattr(p, "weight_loader", None)
        if isinstance(loader, functools.partial) and not hasattr(loader, "__name__"):
            loader.__name__ = getattr(loader.func, "__name__", "weight_loader")  # type: ignore[attr-defined]
            named += 1
    return named


GPT_OSS_EXPERTS = {
    "gate_up_proj": "w13_weight",
    "gate_up_proj_bias": "w13_bias",
    "down_proj": "w2_weight",
    "down_proj_bias": "w2_bias",
}
"""gpt-oss's fused expert tensors as the trainer pushes them (transformers' names, [E, ...]) and the per-expert names
vLLM's gpt-oss loader streams through the experts' own weight_loader (`experts.{e}.w13_weight`, ...)."""


def load_rank_heads(param, full) -> None:
    """Load a per-head tensor (attention sinks: [heads]) through its parameter's weight loader, narrowed to this TP
    rank's heads as vLLM's loaders do (a layerwise reload buffers what goes through the loader, not a copy_)."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    per_rank = full.shape[0] // get_tensor_model_parallel_world_size()
    loader = getattr(param, "weight_loader", default_weight_loader)
    loader(param, full.narrow(0, get_tensor_model_parallel_rank() * per_rank, per_rank))


def wrap_gpt_oss_loader(model) -> bool:
    """Wrap a GptOssForCausalLM's load_weights so that a push lands; True if wrapped.

    Why: vLLM 0.32's unquantized gpt-oss loader writes the fused experts, their biases and the attention sinks with
    `param.copy_`, not through the parameters' weight loaders; a push's layerwise reload puts every parameter on the
    meta device and loads only through those loaders, so the copies went nowhere and the server kept its experts and
    sinks. The same loader also takes one expert at a time (`experts.{e}.w13_weight`, through the experts'
    weight_loader, TP and EP slicing included): each fused tensor is split into those, as views; the sinks go through
    their parameter's weight_loader, narrowed to this TP rank's heads as the loader does."""
    if type(model).__name__ != "GptOssForCausalLM":
        return False

    def route(name: str, t, params: dict):
        head, sep, leaf = name.rpartition(".experts.")
        if sep and leaf in GPT_OSS_EXPERTS:
            return [(f"{head}.experts.{e}.{GPT_OSS_EXPERTS[leaf]}", t[e]) for e in range(t.shape[0])]
        if name.endswith(".sinks"):
            served = name.replace(".self_attn.", ".attn.")
            load_rank_heads(params[served], t)
            return served
        return [(name, t)]

    route_load_weights(model, route)
    return True


def wrap_mimo_sink_loader(model) -> bool:
    """Wrap a MiMoV2FlashForCausalLM's load_weights so that a push reaches its attention sinks; True if wrapped.

    Why: as gpt-oss's, vLLM 0.32's MiMo-V2-Flash loader writes each sliding-window layer's `attention_sink_bias` with
    `param.data.copy_`, past the parameter's weight loader, which a push's layerwise reload loads through: the server
    kept its first sinks (the family sweep: "a push left vLLM's parameters [...attention_sink_bias] as they were").
    Here they go through their parameter's weight loader, narrowed to this TP rank's heads as the loader does."""
    if type(model).__name__ not in ("MiMoV2FlashForCausalLM", "MiMoV2ForCausalLM"):  # vLLM registers both
        return False

    def route(name: str, t, params: dict):
        if name.endswith(".attention_sink_bias") and name in params:
            load_rank_heads(params[name], t)
            return name
        return [(name, t)]

    route_load_weights(model, route)
    return True


def route_load_weights(model, route) -> None:
    """Replace model.load_weights by one that hands each (name, tensor) to route(name, tensor, parameters): it returns
    the pairs for vLLM's own loader (the pair itself, or its split) or, having loaded the tensor through its parameter's
    weight loader, the served name it loaded, which joins the loader's set of loaded names."""
    load_weights = model.load_weights

    def routed(weights, loaded: set):
        params = dict(model.named_parameters())  # during a reload: the parameters with the reload's loaders
        for name, t in weights:
            out = route(name, t, params)
            if isinstance(out, str):
                loaded.add(out)
            else:
                yield from out

    def load_weights_routed(weights, *args, **kwargs):
        loaded: set = set()
        return load_weights(routed(weights, loaded), *args, **kwargs) | loaded

    model.load_weights = load_weights_routed


def load_adapters_once() -> None:
    """Patch vLLM's LoRA worker manager (idempotent): the per-step path (_apply_adapters) sees every request with
    load_inplace off, so only an explicit add_lora (a push) reads the adapter again; each read prints
    ADAPTER_READ_MARK (the integration test counts them against the pushes). The per-step re-add of an adapter pushed
    as tensors takes them (trainer.push.adapter_receiver.load_adapter) instead of a folder."""
    import msgspec
    from vllm.lora import worker_manager as wm

    from trainer.push.adapter_receiver import load_adapter

    lru = wm.LRUCacheWorkerLoRAManager
    if getattr(lru._apply_adapters, "_slurm_grpo", False):
        return
    apply, read = lru._apply_adapters, wm.WorkerLoRAManager._load_adapter

    def _apply_adapters(self, lora_requests):
        plain = {msgspec.structs.replace(r, load_inplace=False) if r is not None and r.load_inplace else r for r in lora_requests}
        return apply(self, plain)

    def read_folder(self, lora_request):
        out = read(self, lora_request)
        print(
            f"{ADAPTER_READ_MARK}: {lora_request.lora_name} id {lora_request.lora_int_id} {lora_request.lora_path} "
            f"(pid {os.getpid()})",
            flush=True,
        )
        return out

    def _load_adapter(self, lora_request):
        return load_adapter(self, lora_request, read_folder)

    _apply_adapters._slurm_grpo = True  # type: ignore[attr-defined]
    lru._apply_adapters = _apply_adapters  # type: ignore[method-assign]
    wm.WorkerLoRAManager._load_adapter = _load_adapter  # type: ignore[method-assign]


def lora_graphs_active_only() -> None:
    """Model Runner V2 (vLLM 0.32's GPU runner) with cudagraph_specialize_lora off still captures every graph size
    twice: for batches without an adapter and for batches through one (`get_lora_capture_cases` returns
    [0, max_loras + 1]); the V1 runner's dispatcher captures the second alone. With the adapter pushed every request
    names it, so the first set is never replayed; this keeps the second only (7 B, r 16, H100: 38 graph sizes, captured
    twice over, 15 s of a 90 s start, gpu/results/2026-12-07-resume-agents-7b). A batch without an adapter (a request
    from outside the trainer) finds no graph and runs eagerly: vLLM's dispatcher falls back to no graph for a batch it
    has none for (with DP > 1 every DP rank then runs that step eagerly: they agree on the lowest mode). Not for
    speculative decoding, whose adaptive verification profiles the graphs without an adapter: the launcher sets the
    switch only where vllm.extra_args decide nothing about graphs (launcher.core.vllm_start.lora_graphs). Idempotent; a
    vLLM without the V2 LoRA helpers is left as it is."""
    import sys

    try:
        from vllm.v1.worker.gpu import lora_utils
    except ImportError:
        return
    cases = lora_utils.get_lora_capture_cases
    if getattr(cases, "_slurm_grpo", False):
        return

    def get_lora_capture_cases(lora_config, compilation_config):
        captured = cases(lora_config, compilation_config)
        if lora_config is None or compilation_config.cudagraph_specialize_lora:
            return captured
        return [c for c in captured if c > 0] or captured

    get_lora_capture_cases._slurm_grpo = True  # type: ignore[attr-defined]
    lora_utils.get_lora_capture_cases = get_lora_capture_cases
    runner = sys.modules.get("vllm.v1.worker.gpu.model_runner")  # imported already: it holds its own reference
    if runner is not None:
        runner.get_lora_capture_cases = get_lora_capture_cases  # type: ignore[attr-defined]


def inspect_in_process() -> None:
    """Patch vLLM's model registry (idempotent): the model-class inspection it runs in a fresh Python process when its
    cache (VLLM_CACHE_ROOT/modelinfos) has no entry runs in this process instead; vLLM still writes the cache.

    Why: that process imports vLLM and the model module again, 20-30 s on the H200 (gpu/results/2026-12-04-round2-0.36b:
    "non-default args" to "Resolved architecture"), 8 s on 2 CPU cores, on every job folder's first start (the caches
    live in the job folder). vLLM isolates it so that an import initialising CUDA cannot force its engine core to be
    spawned rather than forked; the launcher forks it on CUDA (vllm.engine_start), and vLLM itself still falls back to
    spawn, with a warning, if CUDA was initialised. The engine core imports the same module anyway: forked, it inherits it."""
    from vllm.model_executor.models import registry

    if getattr(registry._run_in_subprocess, "_slurm_grpo", False):
        return

    def run_here(fn):
        return fn()

    run_here._slurm_grpo = True  # type: ignore[attr-defined]
    registry._run_in_subprocess = run_here
