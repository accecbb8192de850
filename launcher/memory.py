"""Memory of one trainer rank and of the node's vLLM server, estimated from the model's config.json and the plan,
before anything is submitted: what `dry-run` prints and warns about, and what `simulate` tabulates for the
common model shapes. An estimate with stated terms, not a measurement (gpu/RESULTS.md has the measured peaks):

  per trainer rank, S = ranks sharing the shards (the node's ranks under hsdp, the whole world under fsdp)
    state        fp32 parameters 4P/S + fp32 gradients 4P/S + AdamW moments 8P/S    (host memory with cpu_offload)
    gathered     the root unit (embeddings, lm_head) in the compute dtype + two decoder layers (one computing,
                 one prefetched) + one layer's fp32 gradient before its reduce-scatter; with S = 1 (nothing to
                 gather) and no offload every unit stays in the compute dtype from forward to backward: bP
    activations  per decoder layer T x (16 H + 8 I) bytes in bf16 (inputs, q/k/v, attention out, MLP gate/up/act),
                 T = completions per rank x (prompt + completion tokens); with activation checkpointing only the
                 layer inputs (2 T H per layer) plus one layer recomputed; attention run eagerly
                 (trainer.attn_implementation eager, or unset on a family without SDPA: gpt-oss) adds its scores,
                 C x heads x L^2 per layer (C completions per rank of L tokens): bf16 probabilities kept for the
                 backward (2 bytes) in every layer without checkpointing, and in the layer computing also the bf16
                 scores and their fp32 softmax (6 bytes)
    logits       T x V x 6 bytes (bf16 logits and their fp32 log-softmax)
    overhead     2 GB (CUDA context, allocator slack, NCCL buffers)
  at load        sharded: the fp32 parameter shards 4P/S, and in host memory one tensor's rows (largest/S, bf16);
                 full: the whole fp32 model 4P on every rank, in host memory and then on the GPU
  on disk        a checkpoint: fp32 parameters 4P + AdamW's two fp32 moments 8P (gradients are not saved), times
                 trainer.keep_checkpoints; the final model (JOB/model) bP; with LoRA the adapters' 12A and 4A only
  MoE            P counts every expert (FSDP shards them, AdamW holds them, a push sends them, vLLM serves them);
                 a gathered unit is a whole MoE layer (all its experts); activations take the experts_per_token
                 experts a token runs through; the largest tensor read at load is a layer's fused gate_up_proj
  SSM, hybrids   families whose layers are not all attention + MLP (Mamba, Mamba-2, Gated DeltaNet, LFM2's short
                 convolutions, fused-qkv GELU bodies, Gemma-3n: launcher.core.layer_kinds) are counted per layer kind:
                 P, the largest gathered layer and each kind's activations per token (an SSM layer keeps transformers'
                 PyTorch scan's fp32 tensors: Mamba 16 d N bytes, Mamba-2 B and C per head plus the chunk's scores);
                 eager attention's scores count in the attention layers only
  vLLM           bf16 weights per GPU (vllm_weights_gb): 2P / tensor_parallel_size; with vllm.enable_expert_parallel
                 the routed experts split over TP x DP (2 (P - E) / TP + 2 E / (TP x DP), E = the routed experts'
                 parameters); they fit when they leave VLLM_HEADROOM_GB of the memory vLLM gets of a GPU
                 (gpu_memory_utilization x the GPU) for the rest (vllm_weights_fit)
  with LoRA      (trainer.lora.r = r > 0; A = adapter parameters, r x (in + out) per adapted projection)
                 state: the frozen base in the compute dtype bP/S (no gradients, no AdamW) + the adapters 16A/S;
                 gathered: the base units in the compute dtype, the adapters too, and one layer's adapter gradient;
                 activations: as without (the base's input gradients still flow) plus the rank-r intermediates,
                 2 T r bytes per adapted projection and layer; at load the base shards are bP/S;
                 push: the adapter push stages no weights, but the adapter itself (through the ipc engine,
                 trainer.lora.adapter_transport engine: a buffer of bA); the merged push (trainer.lora.push: merged, or
                 where vLLM cannot serve the adapter) sends the whole model, so the ipc push keeps its staging buffer as
                 without LoRA; the merge's fp32 temporaries (about 12 bytes x the largest projection) live only during the
                 push, when the step's activations and logits are freed, so they add nothing to the peak
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from launcher.core.inputs import PromptLength, prompt_length
from launcher.core.jobdir import free_space
from launcher.core.lora import ADAPTER, ENGINE, MERGED
from launcher.core.plan import Plan
from launcher.core.shape import NO_CONFIG, ModelShape
from launcher.core.vllm_start import VLLM_HEADROOM_GB

GB = 1e9
PROMPT_TOKENS = 256
"""Prompt length the activation estimate assumes where the dataset's own cannot be measured here (not JSONL, not on
this machine); else the longest prompt's (launcher.core.inputs.prompt_length)."""
OVERHEAD_GB = 2.0

KNOWN_GPUS_GB = {"b200": 180, "h200": 141, "gh200": 96, "h100": 80, "h800": 80, "a100": 80, "l40s": 48, "a6000": 48, "a10": 24}
"""Memory of a GPU by the name a cluster puts in its partition or constraint (an '-40gb'-style suffix wins)."""
KNOWN_GPUS_GB |= {"mi300x": 192, "mi250x": 64, "mi250": 64}
"""AMD: an MI300X is one device of 192 GB; an MI250X (Frontier) is two GCDs of 64 GB, each its own device: the figure
is one GCD's, as the plan's GPUs are GCDs there."""


COMMON_SHAPES = {
    # name: (hidden, layers, intermediate, vocab, heads, kv_heads, tied) - the published config.json values
    "Qwen2.5-0.5B": (896, 24, 4864, 151936, 14, 2, True),
    "Qwen2.5-7B": (3584, 28, 18944, 152064, 28, 4, False),
    "Llama-3.1-8B": (4096, 32, 14336, 128256, 32, 8, False),
    "Qwen2.5-14B": (5120, 48, 13824, 152064, 40, 8, False),
    "Qwen2.5-32B": (5120, 64, 27648, 152064, 40, 8, False),
    "Llama-3.1-70B": (8192, 80, 28672, 128256, 64, 8, False),
}

COMMON_MOE_SHAPES = {
    # name: (hidden, layers, dense intermediate, vocab, heads, kv_heads, head_dim, tied, experts, per token, expert
    # intermediate) - the published config.json values; every layer an MoE layer
    "Qwen3-30B-A3B": (2048, 48, 6144, 151936, 32, 4, 128, False, 128, 8, 768),
    "Mixtral-8x7B": (4096, 32, 14336, 32000, 32, 8, 128, False, 8, 2, 14336),
    "gpt-oss-20b": (2880, 24, 2880, 201088, 64, 8, 64, False, 32, 4, 2880),
    "gpt-oss-120b": (2880, 36, 2880, 201088, 64, 8, 64, False, 128, 4, 2880),
}
GPT_OSS = frozenset({"gpt-oss-20b", "gpt-oss-120b"})
"""COMMON_MOE_SHAPES with gpt-oss's biases and attention sinks (ModelShape.biases), attention run eagerly."""

COMMON_HYBRID_CONFIGS: dict[str, dict] = {
    # the released config.json values the count reads (transformers' configuration classes default to these models:
    # their defaults count the same)
    "Qwen3-Next-80B": {
        "model_type": "qwen3_next", "hidden_size": 2048, "num_hidden_layers": 48, "intermediate_size": 5120,
        "vocab_size": 151936, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
        "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
        "full_attention_interval": 4, "tie_word_embeddings": False,
    },
    "Jamba-v0.1": {
        "model_type": "jamba", "hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 14336,
        "vocab_size": 65536, "num_attention_heads": 32, "num_key_value_heads": 8, "num_experts": 16,
        "num_experts_per_tok": 2, "attn_layer_period": 8, "attn_layer_offset": 4, "expert_layer_period": 2,
        "expert_layer_offset": 1, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_dt_rank": 256,
        "tie_word_embeddings": False,
    },
    "MambaCodestral": {
        "model_type": "mamba2", "hidden_size": 4096, "num_hidden_layers": 64, "num_heads": 128, "head_dim": 64,
        "n_groups": 8, "state_size": 128, "expand": 2, "conv_kernel": 4, "chunk_size": 256, "vocab_size": 32768,
        "tie_word_embeddings": False,
    },
}  # fmt: skip
"""Hybrid and SSM models for simulate's table, counted per layer kind (launcher.core.layer_kinds): Qwen3-Next-80B-A3B
(79.7 B, 3.9 B active: Gated DeltaNet + MoE), Jamba-v0.1 (51.6 B, 12.1 B active: Mamba + attention + MoE),
Mamba-Codestral-7B (7.29 B: Mamba-2 only)."""


SCANNED = ("mamba", "gated_deltanet")
"""Layer kinds whose activations are those of transformers' PyTorch scan (launcher.core.layer_kinds)."""
SCAN_NOTE = (
    "SSM layers: activations as transformers' PyTorch scan keeps them (fp32 state-sized tensors per token); the "
    "mamba-ssm, causal-conv1d and flash-linear-attention kernels (not installed by scripts/install.sh) keep far less"
)


def common_shape(name: str) -> ModelShape:
    if name in COMMON_HYBRID_CONFIGS:
        shape = ModelShape.from_config(COMMON_HYBRID_CONFIGS[name])
        assert isinstance(shape, ModelShape), shape
        return shape
    if name in COMMON_MOE_SHAPES:
        h, n, i, v, heads, kv, hd, tied, e, k, ei = COMMON_MOE_SHAPES[name]
        return ModelShape(
            h, n, i, v, heads, kv, hd, tied, experts=e, experts_per_token=k, expert_intermediate=ei, moe_layers=n,
            biases=name in GPT_OSS, eager_attention=name in GPT_OSS,
        )  # fmt: skip
    h, n, i, v, heads, kv, tied = COMMON_SHAPES[name]
    return ModelShape(h, n, i, v, heads, kv, h // heads, tied)


@dataclass(frozen=True)
class Layout:
    """What the estimate needs of a plan: who shares the shards and whether vLLM shares the trainer's GPU."""

    nodes: int
    ranks_per_node: int
    tensor_parallel_size: int
    shard_ranks: int
    shared_gpu: bool
    gpu_gb: float
    vllm_fraction: float
    compute_bytes: int
    completions_per_rank: int
    completion_tokens: int
    prompt_tokens: int = PROMPT_TOKENS
    """The longest prompt a batch is padded to (the dataset's, measured, where it can be; else assumed)."""
    prompt_how: str = "assumed"
    """Where prompt_tokens comes from, for the estimate's line."""
    push_buffer_bytes: int = 0
    """ipc push (shared GPU): the staging buffer the node leader keeps on its GPU (trainer.ipc_buffer_mb); 0 otherwise."""
    vllm_data_parallel: int = 1
    """vllm.data_parallel_size: engines per node (they split the routed experts with expert_parallel)."""
    expert_parallel: bool = False
    """vllm.enable_expert_parallel: vLLM splits an MoE's routed experts over TP x DP."""


@dataclass(frozen=True)
class Options:
    activation_checkpointing: bool = False
    cpu_offload: bool = False
    sharded_loading: bool = True
    reference_model: bool = False
    """trainer.beta > 0: TRL builds a reference model on every rank, a whole unsharded copy in the policy's dtype
    (fp32 here: the FSDP2 master weights); not an option to turn on for memory, so settings() leaves it out."""
    lora_r: int = 0
    """trainer.lora.r: adapters of this rank on a frozen base (0 = full fine-tuning)."""
    lora_targets: tuple[str, ...] = ()
    """trainer.lora.target_modules (projection names)."""
    lora_merged: bool = False
    """LoRA pushed merged (the plan's lora_push): the push sends the whole model, so an ipc push keeps its staging
    buffer as without LoRA (the adapter push stages nothing)."""
    lora_adapter_staged: bool = False
    """The adapter pushed through the weight-transfer engine (trainer.lora.adapter_transport engine): an ipc push keeps
    a staging buffer of the adapter's size (through disk it stages nothing)."""
    fsdp_all: bool = False
    """trainer.fsdp=fsdp proposed by cheapest_fit: the shards spread over every rank of the job, not the node's."""
    attention: str = ""
    """trainer.attn_implementation: eager materializes the scores ('' = transformers' choice: eager only for a
    family without SDPA, ModelShape.eager_attention)."""

    def eager(self, shape: ModelShape) -> bool:
        return self.attention == "eager" or (not self.attention and shape.eager_attention)

    def settings(self) -> list[str]:
        """The trainer.* settings that make these options."""
        out = [f"trainer.lora.r={self.lora_r}"] if self.lora_r else []
        out += ["trainer.fsdp=fsdp"] if self.fsdp_all else []
        out += [f"trainer.{n}=true" for n in ("activation_checkpointing", "cpu_offload") if getattr(self, n)]
        return out + ([] if self.sharded_loading else ["trainer.model_loading=full"])

    def describe(self) -> str:
        return ", ".join(self.settings()) or "none"


@dataclass(frozen=True)
class Estimate:
    params_b: float
    """Total parameters (every expert of an MoE): what the state, the push and vLLM's weights scale with."""
    state_gb: float
    gathered_gb: float
    activations_gb: float
    logits_gb: float
    reference_gb: float
    """TRL's reference model (trainer.beta > 0), whole on every rank."""
    push_buffer_gb: float
    """The ipc push's staging buffer: the serving-dtype model or trainer.ipc_buffer_mb, the smaller (node leader)."""
    gpu_gb: float
    """Peak per trainer rank on its GPU while training."""
    host_gb_per_node: float
    """Pinned host memory of the offloaded state, all ranks of a node (0 without cpu_offload)."""
    load_gpu_gb: float
    load_host_gb_per_node: float
    vllm_weights_gb: float
    budget_gb: float | None
    """What a trainer rank may use of its GPU (the GPU minus vLLM's share on a shared GPU); None = GPU unknown."""
    vllm_budget_gb: float | None
    adapter_params_m: float = 0.0
    """LoRA: the adapters' parameters in millions (0 without LoRA)."""
    active_params_b: float = 0.0
    """Parameters one token runs through (an MoE's routed experts only); = params_b for a dense model."""

    @property
    def fits(self) -> bool | None:
        if self.budget_gb is None or self.vllm_budget_gb is None:
            return None
        return bool(self.trainer_fits) and self.vllm_weights_gb + VLLM_HEADROOM_GB <= self.vllm_budget_gb

    @property
    def trainer_fits(self) -> bool | None:
        """A trainer rank's peak (training or load) within its budget, whatever vLLM's side."""
        return None if self.budget_gb is None else max(self.gpu_gb, self.load_gpu_gb) <= self.budget_gb


def projections(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """(in, out) features of each linear projection of a decoder layer (Llama/Qwen2/Mistral names). A family counted per
    layer kind (an SSM or hybrid, GPT-2's fused c_attn) is sized as if every layer had these: LoRA's adapters are a
    small term, and an approximate one there."""
    h, q, kv, i = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.intermediate
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def adapter_layer_params(shape: ModelShape, r: int, targets: tuple[str, ...]) -> int:
    """LoRA parameters of one decoder layer: r x (in + out) per adapted projection (A is r x in, B is out x r)."""
    return sum(r * (i + o) for name, (i, o) in projections(shape).items() if name in targets)


def estimate(shape: ModelShape, lay: Layout, opt: Options) -> Estimate:
    p, s, b = shape.params, lay.shard_ranks, lay.compute_bytes
    if opt.fsdp_all:
        s = max(s, lay.ranks_per_node * lay.nodes)
    a_layer = adapter_layer_params(shape, opt.lora_r, opt.lora_targets) if opt.lora_r else 0
    a = a_layer * shape.layers
    t = lay.completions_per_rank * (lay.prompt_tokens + lay.completion_tokens)
    if opt.lora_r:  # the base frozen in the compute dtype; fp32 params, grads and AdamW for the adapters only
        state = (b * p + 16 * a) / s
        gathered = b * shape.root_params + 2 * b * (shape.layer_params + a_layer) + 4 * a_layer
    else:
        state = 16 * p / s
        gathered = b * shape.root_params + 2 * b * shape.layer_params + 4 * shape.layer_params
    if s == 1 and not opt.cpu_offload:  # one rank per shard group keeps every unit gathered (trainer.parallel.shard_model)
        gathered = b * (p + a) + 4 * (a_layer if opt.lora_r else shape.layer_params)
    adapted = sum(1 for name in projections(shape) if name in opt.lora_targets) if opt.lora_r else 0
    every, largest = shape.activation_bytes(mlp_width(shape))  # per token: all layers, the largest one
    lora = 2 * opt.lora_r * adapted
    if opt.activation_checkpointing:
        acts = t * (2 * shape.hidden * shape.layers + largest + lora)
    else:
        acts = t * (every + lora * shape.layers)
    if opt.eager(shape):  # an SSM or short-conv layer has no scores
        scores = lay.completions_per_rank * shape.heads * (lay.prompt_tokens + lay.completion_tokens) ** 2
        acts += scores * (8 if opt.activation_checkpointing else 2 * shape.attention_layers + 6)
    # TRL scores the completion tokens only (its labels are -100 over the prompt): the prompt adds no logits
    logits = 6 * lay.completions_per_rank * lay.completion_tokens * shape.vocab
    reference = 4 * p if opt.reference_model else 0
    staged = not opt.lora_r or opt.lora_merged  # an adapter push stages no full weights; a merged one does
    push_buffer = min(2 * p, lay.push_buffer_bytes) if staged else 0
    if not staged and opt.lora_adapter_staged:
        push_buffer = min(b * a, lay.push_buffer_bytes)
    on_gpu_state = 0 if opt.cpu_offload else state
    gpu = (on_gpu_state + gathered + acts + logits + reference + push_buffer) / GB + OVERHEAD_GB
    master = (b * p + 4 * a) if opt.lora_r else 4 * p  # the parameters as loaded: the base in the compute dtype with LoRA
    if opt.sharded_loading:  # a rank's read buffer: its rows of one tensor, stored in bf16
        load_gpu = (0 if opt.cpu_offload else master / s) / GB + OVERHEAD_GB
        load_host = lay.ranks_per_node * ((master / s if opt.cpu_offload else 0) + 2 * shape.largest_tensor / s) / GB
    else:
        load_gpu = (0 if opt.cpu_offload else 4 * p) / GB + OVERHEAD_GB
        load_host = lay.ranks_per_node * 4 * p / GB
    vllm_share = lay.gpu_gb * lay.vllm_fraction if lay.gpu_gb else None
    budget = None
    if lay.gpu_gb:
        budget = lay.gpu_gb - vllm_share if lay.shared_gpu else lay.gpu_gb  # type: ignore[operator]
    return Estimate(
        params_b=p / 1e9,
        state_gb=state / GB,
        gathered_gb=gathered / GB,
        activations_gb=acts / GB,
        logits_gb=logits / GB,
        reference_gb=reference / GB,
        push_buffer_gb=push_buffer / GB,
        gpu_gb=gpu,
        host_gb_per_node=lay.ranks_per_node * state / GB if opt.cpu_offload else 0.0,
        load_gpu_gb=load_gpu,
        load_host_gb_per_node=load_host,
        vllm_weights_gb=vllm_weights_gb(shape, lay.tensor_parallel_size, lay.vllm_data_parallel, lay.expert_parallel),
        budget_gb=budget,
        vllm_budget_gb=vllm_share,
        adapter_params_m=a / 1e6,
        active_params_b=shape.active_params / 1e9,
    )


def mlp_width(shape: ModelShape) -> int:
    """The MLP width a token's activations take in the widest layer: an MoE token runs experts_per_token experts
    (and the shared one)."""
    if not shape.experts:
        return shape.intermediate
    moe = shape.experts_per_token * shape.expert_intermediate + shape.shared_intermediate
    return max(moe, shape.intermediate if shape.moe_layers < shape.layers else 0)


def gpu_memory_gb(explicit: float, *names: str) -> float:
    """slurm.gpu_memory_gb if set, else a known GPU name found in the partition/constraint strings, else 0."""
    if explicit:
        return explicit
    for text in names:
        low = text.lower()
        size = re.search(r"(\d+)\s*g(?:b)?\b", low)
        for name, gb in KNOWN_GPUS_GB.items():
            if re.search(rf"(^|[^a-z0-9]){name}([^a-z0-9]|$)", low) or low.startswith(name):
                return float(size.group(1)) if size else float(gb)
    return 0.0


def gpu_name(*names: str) -> str:
    """The known GPU named in the partition/constraint strings ('' if none): the same match as gpu_memory_gb."""
    for text in names:
        low = text.lower()
        for name in KNOWN_GPUS_GB:
            if re.search(rf"(^|[^a-z0-9]){name}([^a-z0-9]|$)", low) or low.startswith(name):
                return name
    return ""


def cheapest_fit(
    shape: ModelShape, lay: Layout, reference_model: bool = False, base: Options | None = None, try_fsdp: bool = True
) -> Options | None:
    """The first option set that fits, from the fastest: none, activation checkpointing, then (try_fsdp, where the
    shards do not yet span every rank) the same two with trainer.fsdp=fsdp at this node count, then checkpointing with
    cpu_offload (and with fsdp): a reference model, trainer.beta > 0, LoRA and the attention, from `base`, stay in every
    one."""
    ref = reference_model
    kept = {"lora_r": base.lora_r, "lora_targets": base.lora_targets, "lora_merged": base.lora_merged} if base is not None else {}
    kept |= {"attention": base.attention} if base is not None else {}
    wider = try_fsdp and lay.ranks_per_node * lay.nodes > lay.shard_ranks
    sets = [{}, {"activation_checkpointing": True}]
    sets += [{"fsdp_all": True}, {"activation_checkpointing": True, "fsdp_all": True}] if wider else []
    sets += [{"activation_checkpointing": True, "cpu_offload": True}]
    sets += [{"activation_checkpointing": True, "cpu_offload": True, "fsdp_all": True}] if wider else []
    for kw in sets:
        opt = Options(reference_model=ref, **kw, **kept)  # type: ignore[arg-type]
        if estimate(shape, lay, opt).trainer_fits:  # the trainer's options do not change vLLM's side
            return opt
    return None


def vllm_tp_choices(heads: int, gpus: int, data_parallel: int, shared: bool) -> list[int]:
    """The vllm.tensor_parallel_size values a node of `gpus` GPUs can run: powers of two dividing the heads, TP x DP
    GPUs leaving a trainer GPU in the split layout (shared: dividing the GPUs)."""
    tps = [t for t in (1, 2, 4, 8, 16) if heads % t == 0 and t <= gpus]
    return [t for t in tps if (gpus % t == 0 if shared else t * data_parallel < gpus)]


SPLIT_VLLM_FRACTION = 0.9
"""vllm.gpu_memory_utilization's default: what vLLM may take of GPUs it has to itself (the split layout), where the fix
for weights that do not fit may raise a lower setting (one made to share a GPU with the trainer) to."""


def routed_expert_params(shape: ModelShape) -> int:
    """The routed experts' parameters (0 for a dense model): what expert parallelism splits; the router and a shared
    expert stay with the dense part."""
    return shape.routed_expert_params


def vllm_weights_gb(shape: ModelShape, tp: int, dp: int = 1, expert_parallel: bool = False) -> float:
    """vLLM's bf16 weights on each of its GPUs (ModelShape.vllm_weight_bytes)."""
    return shape.vllm_weight_bytes(tp, dp, expert_parallel) / GB


def vllm_weights_fit(shape: ModelShape, tp: int, vllm_gb: float, dp: int = 1, expert_parallel: bool = False) -> bool:
    """vLLM's weights per GPU leave VLLM_HEADROOM_GB of the vllm_gb it gets of a GPU (the one fit threshold)."""
    return vllm_weights_gb(shape, tp, dp, expert_parallel) + VLLM_HEADROOM_GB <= vllm_gb


def smallest_vllm_tp(shape: ModelShape, vllm_gb: float, tps: list[int], dp: int = 1, expert_parallel: bool = False) -> int | None:
    return next((t for t in sorted(tps) if vllm_weights_fit(shape, t, vllm_gb, dp, expert_parallel)), None)


def node_gpus(lay: Layout) -> int:
    """The GPUs of one node of the layout: its trainer ranks, plus vLLM's TP x DP GPUs in the split layout."""
    return lay.ranks_per_node + (0 if lay.shared_gpu else lay.tensor_parallel_size * lay.vllm_data_parallel)


def vllm_weights_fix(shape: ModelShape, lay: Layout) -> str:
    """What holds vLLM's weights where they do not fit (vllm_weights_fit): the smallest larger TP this node runs; else a
    node where vLLM has GPUs of its own (the split layout: TP x DP + 1 GPUs, vLLM up to SPLIT_VLLM_FRACTION of each),
    GPUs with more memory or a smaller model. The one fix that dry-run's estimate and its memory check both name."""
    dp, ep, tp0, g = lay.vllm_data_parallel, lay.expert_parallel, lay.tensor_parallel_size, node_gpus(lay)
    tps = vllm_tp_choices(shape.heads, g, dp, lay.shared_gpu)
    tp = smallest_vllm_tp(shape, lay.gpu_gb * lay.vllm_fraction, [t for t in tps if t > tp0], dp, ep)
    if tp:
        return f"set vllm.tensor_parallel_size={tp} ({vllm_weights_gb(shape, tp, dp, ep):.0f} GB per GPU)"
    fixes = []
    frac = max(lay.vllm_fraction, SPLIT_VLLM_FRACTION)
    own = smallest_vllm_tp(shape, lay.gpu_gb * frac, [t for t in (1, 2, 4, 8) if shape.heads % t == 0], dp, ep)
    if own is not None:
        sets = ["slurm.layout=split"] if lay.shared_gpu else []  # an explicit shared layout would refuse the GPUs below
        sets += [f"slurm.gpus_per_node={own * dp + 1}"] if own * dp + 1 > g else []
        sets += [f"vllm.tensor_parallel_size={own}"] if own != tp0 else []
        sets += [f"vllm.gpu_memory_utilization={frac:g}"] if frac > lay.vllm_fraction else []
        mine = "the split layout: vLLM on GPUs of its own, " if lay.shared_gpu else ""
        fixes.append(f"--set {' '.join(sets)} ({mine}{vllm_weights_gb(shape, own, dp, ep):.0f} GB per GPU)")
    return (
        f"no vllm.tensor_parallel_size of a {g}-GPU node holds them at gpu_memory_utilization {lay.vllm_fraction:g}: "
        + ", ".join([*fixes, "GPUs with more memory, or a smaller model"])
    )


def split_fits(shape: ModelShape, lay: Layout, gpus: int, vllm_gpus: int, tp: int, completions: int, base: Options) -> bool:
    """Whether a split of a node's `gpus` GPUs (vllm_gpus serving at TP tp, the rest training, `completions` per node
    per step) runs in memory: vLLM's weights fit its GPUs and some trainer option set (cheapest_fit) fits a rank."""
    ranks = gpus - vllm_gpus
    if ranks < 1 or not vllm_weights_fit(shape, tp, lay.gpu_gb * lay.vllm_fraction, vllm_gpus // tp, lay.expert_parallel):
        return False
    sub = Layout(
        **{
            **lay.__dict__,
            "ranks_per_node": ranks,
            "tensor_parallel_size": tp,
            "shard_ranks": ranks * lay.nodes if lay.shard_ranks > lay.ranks_per_node else ranks,
            "shared_gpu": False,
            "completions_per_rank": math.ceil(completions / ranks),
        }
    )
    return cheapest_fit(shape, sub, base.reference_model, base) is not None


def report(shape: ModelShape, lay: Layout, opt: Options) -> list[str]:
    """The dry-run section: the terms, the total against the GPU, and a warning with the fix when it does not fit."""
    e = estimate(shape, lay, opt)
    where = "host (cpu_offload)" if opt.cpu_offload else "GPU"
    lines = [
        f"model {e.params_b:.2f}B parameters"
        + (
            f" ({e.active_params_b:.2f}B active per token: {shape.experts_per_token} of {shape.experts} experts)"
            if shape.experts
            else ""
        )
        + (f" (layers: {', '.join(f'{k.count} {k.name}' for k in shape.kinds)})" if shape.kinds else "")
        + f"; shards over {lay.shard_ranks} ranks; options: {opt.describe()}; "
        f"T = {lay.completions_per_rank} completions x ({lay.prompt_tokens} prompt + {lay.completion_tokens}) tokens "
        f"per rank (prompt: {lay.prompt_how})",
        f"per trainer rank: state {e.state_gb:.1f} GB on the {where} "
        + (
            f"(frozen base in {'bf16' if lay.compute_bytes == 2 else 'fp32'} + LoRA r={opt.lora_r} adapters "
            f"{e.adapter_params_m:.1f}M: fp32 params + grads + AdamW)"
            if opt.lora_r
            else "(fp32 params + grads + AdamW)"
        )
        + ", gathered units "
        f"{e.gathered_gb:.1f}, activations {e.activations_gb:.1f}, logits {e.logits_gb:.1f}, overhead {OVERHEAD_GB:.0f}"
        + (f", reference model {e.reference_gb:.1f} (trainer.beta > 0: TRL's unsharded fp32 copy)" if e.reference_gb else "")
        + (f", ipc push buffer {e.push_buffer_gb:.1f} (trainer.ipc_buffer_mb)" if e.push_buffer_gb else "")
        + f" -> GPU peak ~{e.gpu_gb:.1f} GB",
        f"at load ({'sharded' if opt.sharded_loading else 'full from_pretrained'}): GPU ~{e.load_gpu_gb:.1f} GB per rank, "
        f"host ~{e.load_host_gb_per_node:.1f} GB per node"
        + (f"; offloaded state ~{e.host_gb_per_node:.0f} GB pinned host memory per node" if opt.cpu_offload else ""),
        f"vLLM: bf16 weights {e.vllm_weights_gb:.1f} GB per GPU (tensor_parallel_size {lay.tensor_parallel_size})",
    ]
    if any(k.name.startswith(SCANNED) for k in shape.kinds):
        lines.insert(1, SCAN_NOTE)
    if shape.approximate:  # counted as the Llama/MoE layout: say so rather than pass a low figure off as exact
        lines.insert(1, f"approximate: {shape.approximate}, so every figure here is low (launcher/core/shape.py)")
    largest = lay.compute_bytes * shape.largest_tensor
    if lay.push_buffer_bytes and largest > lay.push_buffer_bytes:  # the ipc push never splits a tensor across windows
        lines.append(
            f"WARNING: the largest tensor ({largest / 2**20:.0f} MB; an MoE's is one layer's fused experts) "
            f"does not fit the ipc push buffer; set trainer.ipc_buffer_mb >= {math.ceil(largest / 2**20)}"
        )
    if e.budget_gb is None:
        lines.append("GPU memory unknown: set slurm.gpu_memory_gb (or name the GPU in slurm.constraint) to check the fit")
        return lines
    lines.append(
        f"budget: {e.budget_gb:.0f} GB per trainer rank"
        + (f" (GPU {lay.gpu_gb:g} GB minus vLLM's {lay.vllm_fraction:g})" if lay.shared_gpu else f" (GPU {lay.gpu_gb:g} GB)")
    )
    if e.vllm_weights_gb + VLLM_HEADROOM_GB > (e.vllm_budget_gb or 0):
        lines.append(
            f"PROBLEM: vLLM's weights ({e.vllm_weights_gb:.0f} GB per GPU) leave under {VLLM_HEADROOM_GB:g} GB for its "
            f"KV cache in {e.vllm_budget_gb:.0f} GB: {vllm_weights_fix(shape, lay)}"
        )
    if max(e.gpu_gb, e.load_gpu_gb) > e.budget_gb:
        fix = cheapest_fit(shape, lay, opt.reference_model, opt)
        lines.append(
            f"WARNING: a trainer rank needs ~{max(e.gpu_gb, e.load_gpu_gb):.0f} GB, over the {e.budget_gb:.0f} GB it has; "
            + (
                f"it fits with {fix.describe().replace('none', 'trainer.model_loading=sharded')}"
                if fix
                else f"no option fits on {lay.nodes} node(s), trainer.fsdp=fsdp (shards over every rank) included: more "
                "nodes, or fewer completions per rank"
            )
        )
    return lines


def layout(p: Plan, prompt: PromptLength | None = None) -> Layout:
    """The estimate's view of a plan. prompt: the dataset's longest prompt (prompt_length(p.config), read where the
    trainer's estimate is shown: dry-run, simulate); None assumes PROMPT_TOKENS (vLLM's weights need no prompt)."""
    s, v, t = p.config.slurm, p.config.vllm, p.config.trainer
    return Layout(
        nodes=p.num_nodes,
        ranks_per_node=p.ranks_per_node,
        tensor_parallel_size=p.tensor_parallel_size,
        shard_ranks=p.ranks_per_node if t.fsdp == "hsdp" and p.num_nodes > 1 else p.world_size,
        shared_gpu=p.nodes[0].shared_gpu,
        gpu_gb=gpu_memory_gb(s.gpu_memory_gb, s.constraint, s.partition) if p.device == "cuda" else 0.0,
        vllm_fraction=v.gpu_memory_utilization,
        compute_bytes=2 if t.dtype == "bfloat16" else 4,
        completions_per_rank=t.per_device_train_batch_size,
        completion_tokens=t.max_completion_length,
        prompt_tokens=prompt.tokens if prompt else PROMPT_TOKENS,
        prompt_how=prompt.how if prompt else "assumed",
        push_buffer_bytes=t.ipc_buffer_mb * 2**20 if p.weight_transfer_backend == "ipc" else 0,
        vllm_data_parallel=v.data_parallel_size,
        expert_parallel=v.enable_expert_parallel,
    )


def options(p: Plan) -> Options:
    t = p.config.trainer
    return Options(
        t.activation_checkpointing,
        t.cpu_offload,
        t.model_loading == "sharded",
        reference_model=t.beta > 0,
        lora_r=t.lora.r,
        lora_targets=tuple(t.lora.target_modules),
        lora_merged=p.lora_push == MERGED,
        lora_adapter_staged=p.lora_push == ADAPTER and t.lora.adapter_transport == ENGINE,
        attention=t.attn_implementation,
    )


def disk_size(n: float) -> str:
    return f"{n / GB:.1f} GB" if n >= GB / 10 else f"{n / 1e6:.1f} MB"


def disk_line(shape: ModelShape, lay: Layout, opt: Options, keep: int, save_model: bool, job_dir: str | None = None) -> str:
    """What a run leaves on disk: each checkpoint (fp32 parameters + AdamW moments: 12 bytes a trained parameter), the
    peak of checkpoints/ (keep + 1: the oldest is pruned only once the newest is complete), the final model in the
    trainer's dtype (a LoRA run: the fp32 adapter), the peak of the two together (the last checkpoints stay), and the
    job folder's free space beside it (room)."""
    trained = adapter_layer_params(shape, opt.lora_r, opt.lora_targets) * shape.layers if opt.lora_r else shape.params
    each = 12 * trained
    what = (
        "LoRA adapters' fp32 parameters + AdamW moments; the frozen base is not saved"
        if opt.lora_r
        else "fp32 parameters + AdamW moments"
    )
    final, where = 0.0, ""
    if opt.lora_r:
        final, where = 4 * trained, "the final adapter ~{} (adapter/)"
    elif save_model:
        final, where = lay.compute_bytes * shape.params, "the final model ~{} (model/, trainer.dtype)"
    line = f"on disk: a checkpoint ~{disk_size(each)} ({what})"
    if not keep:
        line += ", keep all (trainer.keep_checkpoints 0): one more each save"
        return line + (f"; {where.format(disk_size(final))}" if final else "") + room(job_dir, each + final)
    peak = (keep + 1) * each
    line += f", keep {keep}: up to {keep + 1} at once (the oldest goes once a new one is complete) ~{disk_size(peak)}"
    if final:
        line += f"; {where.format(disk_size(final))}; peak ~{disk_size(peak + final)}"
    return line + room(job_dir, peak + final)


def room(job_dir: str | None, need: float) -> str:
    """The job folder's file system's free space now (its nearest existing folder), and how much short of `need` it
    falls: the trainer skips a periodic checkpoint it has no room for (trainer.checkpoint.room_for)."""
    if not job_dir:
        return ""
    path, free = free_space(Path(job_dir))
    if free >= need:
        return f"; {path} has {disk_size(free)} free"
    return (
        f"; {path} has only {disk_size(free)} free, {disk_size(need - free)} short: periodic and final checkpoints "
        "without room are skipped, a preemption's stops the job (free space, lower trainer.keep_checkpoints or move "
        "job.job_dir)"
    )


def checkpoint_copy_line(shape: ModelShape, lay: Layout, opt: Options) -> str:
    """trainer.async_checkpoint: each rank copies its share of a checkpoint (12 bytes a trained parameter over the
    ranks sharing the shards) into host memory and a thread writes it; the node holds its ranks' copies until then."""
    trained = adapter_layer_params(shape, opt.lora_r, opt.lora_targets) * shape.layers if opt.lora_r else shape.params
    per_node = 12 * trained * lay.ranks_per_node / lay.shard_ranks
    return (
        f"checkpoints written in the background (trainer.async_checkpoint): a copy in host memory ~{disk_size(per_node)} "
        f"per node while each is written (trainer.async_checkpoint=false writes in the step instead)"
    )


def plan_report(p: Plan) -> list[str]:
    """The dry-run section for a plan; empty when the model's config.json cannot be read here, one line saying why when
    it cannot be counted (a hybrid without its layer pattern)."""
    shape = ModelShape.parse(p.config.vllm.model)
    if isinstance(shape, str):
        return [] if shape.startswith(NO_CONFIG) else [f"no estimate: {shape}"]
    t, lay, opt = p.config.trainer, layout(p, prompt_length(p.config)), options(p)
    copy = [checkpoint_copy_line(shape, lay, opt)] if t.async_checkpoint and t.save_steps else []
    disk = disk_line(shape, lay, opt, t.keep_checkpoints, t.save_model, p.job_dir)
    return [*report(shape, lay, opt), disk, *copy]


def memory_problems(p: Plan) -> list[str] | None:
    """What cannot run whatever the trainer's options: vLLM's bf16 weights leaving under VLLM_HEADROOM_GB of the
    memory it gets of its GPUs (vllm_weights_fit), each a one-line refusal naming the tensor_parallel_size that fits
    (--skip-checks memory overrides it). None: cannot tell here (the model's config.json unreadable, or the GPU's
    memory unknown)."""
    shape = ModelShape.read(p.config.vllm.model)
    lay = layout(p)
    if not shape or not lay.gpu_gb:
        return None
    vllm_gb = lay.gpu_gb * lay.vllm_fraction
    dp, ep = lay.vllm_data_parallel, lay.expert_parallel
    weights = vllm_weights_gb(shape, lay.tensor_parallel_size, dp, ep)
    if vllm_weights_fit(shape, lay.tensor_parallel_size, vllm_gb, dp, ep):
        return []
    fix = vllm_weights_fix(shape, lay)
    return [
        f"vllm.tensor_parallel_size {lay.tensor_parallel_size}: vLLM's bf16 weights ({weights:.0f} GB per GPU) leave "
        f"under {VLLM_HEADROOM_GB:g} GB for its KV cache in the {vllm_gb:.0f} GB it gets of a {lay.gpu_gb:g} GB GPU (gpu_memory_utilization {lay.vllm_fraction:g}); {fix}"
    ]


def fit_table(lay: Layout, names: list[str] | None = None, base: Options | None = None) -> list[str]:
    """Which common model shapes fit nodes like this layout's: the smallest vLLM TP whose weights leave room for a
    KV cache, the trainer ranks left, and the cheapest options under hsdp and under fsdp. base: the config's LoRA
    (trainer.lora), kept in every row."""
    gpus = lay.ranks_per_node + (0 if lay.shared_gpu else lay.tensor_parallel_size)
    lora = f"LoRA r={base.lora_r} on a frozen base, " if base is not None and base.lora_r else ""
    lines = [
        f"memory: {lora}which models fit {lay.nodes} node(s) x {gpus} GPU(s) of {lay.gpu_gb:g} GB, vLLM at "
        f"gpu_memory_utilization {lay.vllm_fraction:g}, T = {lay.completions_per_rank} x ({lay.prompt_tokens} + "
        f"{lay.completion_tokens}) tokens per rank (estimate: launcher/memory.py)",
        f"  {'model':<14} {'params':>7} {'TP':>3} {'ranks':>5}  {'hsdp: cheapest options that fit':<48} {'fsdp (shards over all ranks)'}",
    ]
    for name in names or [*COMMON_SHAPES, *COMMON_MOE_SHAPES, *COMMON_HYBRID_CONFIGS]:
        shape = common_shape(name)
        tps = [t for t in (1, 2, 4, 8) if t < gpus and shape.heads % t == 0] if not lay.shared_gpu else [1]
        tp = smallest_vllm_tp(shape, lay.gpu_gb * lay.vllm_fraction, tps)
        if tp is None:
            lines.append(f"  {name:<14} {shape.params / 1e9:>6.1f}B   -     -  vLLM does not fit on {gpus} GPUs of a node")
            continue
        ranks = 1 if lay.shared_gpu else gpus - tp
        cells = []
        for shard in (ranks, ranks * lay.nodes):
            sub = Layout(**{**lay.__dict__, "tensor_parallel_size": tp, "ranks_per_node": ranks, "shard_ranks": shard})
            fix = cheapest_fit(shape, sub, base=base, try_fsdp=False)  # each column keeps its own sharding
            if fix is None:
                cells.append("does not fit")
                continue
            f = estimate(shape, sub, fix)
            short = fix.describe().replace("trainer.", "").replace("=true", "").replace("activation_checkpointing", "AC")
            short = short.split(", ", 1)[1] if fix.lora_r and ", " in short else ("none" if fix.lora_r else short)
            cells.append(
                f"{short} (~{f.gpu_gb:.0f} GB/GPU" + (f", {f.host_gb_per_node:.0f} GB host/node)" if fix.cpu_offload else ")")
            )
        lines.append(f"  {name:<14} {shape.params / 1e9:>6.1f}B {tp:>3} {ranks:>5}  {cells[0]:<48} {cells[1]}")
    if any(k.name.startswith(SCANNED) for name in names or COMMON_HYBRID_CONFIGS for k in common_shape(name).kinds):
        lines.append(f"  ({SCAN_NOTE})")
    return lines
