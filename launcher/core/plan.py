"""plan(config) -> Plan: every per-node number derived once, checked, and written to plan.json.

Nothing downstream (bootstrap, trainer) recomputes a rank, a GPU list or a port: they read the Plan.
Pure: no I/O except reading the model's config.json when it is a local folder (to check TP vs heads).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from launcher.core import emulation, quantization, vllm_start
from launcher.core import platform as platform_mod
from launcher.core.config import ROUTING_REPLAY_FAMILIES, ConfigError, JobConfig, rebuild
from launcher.core.lora import architecture, lora_push, resolve_targets, unresolved_note
from launcher.core.shape import ModelShape

# The rendezvous host is only known inside the allocation (the first hostname of SLURM_JOB_NODELIST);
# the bootstrap resolves this sentinel. Local runs use 127.0.0.1.
FIRST_NODE = "<first node of the allocation>"


@dataclass(frozen=True)
class RankPlan:
    global_rank: int
    local_rank: int
    node: int
    gpu: int
    """The node-local GPU index this rank uses (a CPU slot on CPU builds)."""
    cuda_index: int
    """The rank's CUDA device index inside its torchrun, whose CUDA_VISIBLE_DEVICES lists the node's trainer GPUs
    (on rocm every process sees all of the node's GPUs: this is `gpu`)."""


@dataclass(frozen=True)
class NodePlan:
    node: int
    vllm_gpus: list[int]
    trainer_gpus: list[int]
    server_url: str
    """The node's own vLLM server; only this node's ranks talk to it."""
    weight_transfer_port: int
    ranks: list[RankPlan]
    shared_gpu: bool = False
    """vLLM and the trainer share the node's GPUs (slurm.layout shared; a one-GPU node): vLLM gets a memory fraction
    of each, a trainer rank sits on each."""


@dataclass(frozen=True)
class Plan:
    job_name: str
    job_dir: str
    device: str
    num_nodes: int
    gpus_per_node: int
    ranks_per_node: int
    world_size: int
    tensor_parallel_size: int
    weight_transfer_backend: str
    rendezvous_host: str
    rendezvous_port: int
    vllm_port: int
    nodes: list[NodePlan]
    config: JobConfig
    """The resolved config the plan was made from (typed; plan.json holds its plain form)."""
    process_group_timeout_s: float
    """torch.distributed timeout: a push or a request may take its whole deadline while other ranks wait."""
    trainer_shutdown_s: int
    """torchrun --shutdown-timeout: how long the ranks get for a preemption checkpoint before torchrun kills them."""
    bootstrap_grace_s: int
    """How long the bootstrap waits for torchrun after SIGTERM: torchrun's own shutdown, plus a margin."""
    derivation: list[str] = field(default_factory=list)
    """One line per derived number: the rule that produced it (written by `derivation(plan)`, printed by dry-run)."""
    data_parallel_size: int = 1
    """vLLM engines behind each node's server (vllm.data_parallel_size), each on tensor_parallel_size GPUs."""
    platform: str = "cuda"
    """job.platform: cuda (a mask per process) or rocm (every process sees the node's GPUs; launcher.core.platform)."""
    lora_push: str = ""
    """trainer.lora on: 'adapter' (only the adapter moves; vLLM started with LoRA) or 'merged' (launcher.core.lora)."""
    emulated: bool = False
    """job.emulate_gpus (tests and benchmarks only): this layout, every logical GPU on one physical GPU
    (launcher.core.emulation); each node's server_url and weight_transfer_port carry its own port."""

    @property
    def server_world(self) -> int:
        """The server's workers, all of which receive every weight push: TP x DP (the transfer world is this + 1)."""
        return self.tensor_parallel_size * self.data_parallel_size

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=False)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Plan:
        nodes = [NodePlan(**{**n, "ranks": [RankPlan(**r) for r in n["ranks"]]}) for n in d["nodes"]]
        return Plan(**{**d, "nodes": nodes, "config": rebuild(d["config"])})

    @staticmethod
    def load(path: str | Path) -> Plan:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"plan file {str(p)!r} not found; it is written by `slurm-grpo submit|local` into the job folder")
        plan = Plan.from_dict(json.loads(p.read_text()))
        # LoRA's default targets on an MoE, settled again where the model is read (the nodes): a submit host that could
        # not read vllm.model left them as they were (launcher.core.lora.resolve_targets; a no-op once settled)
        resolved = resolve_targets(plan.config)
        return plan if resolved is plan.config else replace(plan, config=resolved)

    def server_port(self, node: int) -> int:
        """The port of the node's vLLM server (vllm.port; + node index when emulated nodes share a host)."""
        return emulation.node_port(self.vllm_port, node, self.emulated)

    def rank(self, global_rank: int) -> RankPlan:
        return self.nodes[global_rank // self.ranks_per_node].ranks[global_rank % self.ranks_per_node]


def resolve_backend(cfg: JobConfig, shared_gpu: bool) -> str:
    b = cfg.vllm.weight_transfer_backend
    if b != "auto":
        if shared_gpu and b == "nccl":
            raise ConfigError(
                "vllm.weight_transfer_backend nccl needs the trainer on another GPU than vLLM (NCCL refuses "
                "two ranks on one GPU); on a one-GPU node use ipc or auto"
            )
        if not shared_gpu and b == "ipc":
            raise ConfigError(
                "vllm.weight_transfer_backend ipc needs vLLM and the trainer on the same GPU "
                "(slurm.gpus_per_node: 1); with more GPUs use nccl or auto"
            )
        return b
    if cfg.job.device == "cpu":
        return "gloo"
    return "ipc" if shared_gpu else "nccl"


SHARED_MULTI_GPU = (
    "slurm.layout shared with {g} GPUs on CUDA cannot push weights: the leader's IPC handle names its own GPU and the "
    "other GPUs' engines refuse it; use slurm.layout: split (the default)"
)


def shared_runs(device: str, gpus_per_node: int) -> bool:
    """The shared layout can push on this node: one GPU (vLLM and the trainer on it), or CPU slots (gloo reaches every
    engine). On GPUs with more than one per node it cannot (SHARED_MULTI_GPU): the layout advice never picks it there."""
    return device == "cpu" or gpus_per_node == 1


def check_layout(cfg: JobConfig, shared: bool) -> None:
    """The node's GPUs hold the server and at least one trainer rank, the model is not quantized, and TP divides the
    model's heads."""
    tp, dp, g = cfg.vllm.tensor_parallel_size, cfg.vllm.data_parallel_size, cfg.slurm.gpus_per_node
    if shared and not shared_runs(cfg.job.device, g):
        raise ConfigError(SHARED_MULTI_GPU.format(g=g))
    if shared and cfg.job.device == "cpu" and cfg.slurm.gpus_per_node == 1:
        raise ConfigError(
            "slurm.gpus_per_node 1 with job.device cpu leaves no slot for a trainer rank beside vLLM; "
            "use gpus_per_node >= 2 (one vLLM slot plus trainer slots)"
        )
    if tp * dp > g:
        raise ConfigError(
            f"vllm.tensor_parallel_size x data_parallel_size ({tp} x {dp}) is larger than the node ({g} GPUs); "
            f"lower them or raise slurm.gpus_per_node"
        )
    quantized = quantization.read(cfg.vllm.model)
    if quantized is not None:  # vLLM would serve quantized weights the trainer's bf16 pushes cannot land in exactly
        raise ConfigError(quantization.refusal(cfg.vllm.model, quantized))
    shape = ModelShape.read(cfg.vllm.model)
    if shape is not None:
        nh = shape.heads
        if nh % tp:
            raise ConfigError(
                f"vllm.tensor_parallel_size ({tp}) does not divide the model's {nh} attention heads "
                f"({cfg.vllm.model}/config.json); pick a TP size that divides {nh}"
            )
        attention = cfg.trainer.attn_implementation
        if shape.eager_attention and attention in SINKLESS_ATTENTION:
            raise ConfigError(
                f"trainer.attn_implementation {attention}: {cfg.vllm.model} has attention sinks (gpt-oss), which "
                f"{SINKLESS_ATTENTION[attention]}; use '' (eager), flex_attention or kernels-community/vllm-flash-attn3"
            )
    if cfg.vllm.enable_expert_parallel:
        engines = g // tp if shared else dp  # the shared layout's server spans every GPU of the node
        if tp * engines < 2:
            raise ConfigError(
                f"vllm.enable_expert_parallel splits the experts over the server's GPUs, but TP x DP is {tp} x {engines}; "
                "raise vllm.tensor_parallel_size or data_parallel_size, or remove it"
            )
        if shape is not None and not shape.experts:
            raise ConfigError(
                f"vllm.enable_expert_parallel: {cfg.vllm.model} is not a mixture of experts (no experts in its "
                "config.json); remove it"
            )

    if cfg.trainer.routing_replay:
        check_routing_replay(cfg.vllm.model)
    check_family(cfg.vllm.model)


UNSUPPORTED_FAMILIES = {
    "olmo_hybrid": "transformers 5.19 fuses its q/k/v conv1d, saving it back in equal thirds (key and value widths "
    "differ); vLLM 0.32 loads the 3 parts only",
    "hrm_text": "transformers 5.19 splits its fused gqkv_proj into 4 on load; vLLM 0.32 loads the fused one only",
    "kimi_linear": "transformers 5.19 fuses its q/k/v short convolutions on load, vLLM 0.32 takes them apart: a push "
    "cannot name the fused one",
    "longcat_flash": "transformers 5.19 sizes its fused gate_up_proj for the zero (identity) experts too; vLLM 0.32's "
    "loader has no experts for them",
}
"""model_type -> why a push cannot hand vLLM the trained weights (found by the family sweep, trainer.tiny_families)."""

UNSUPPORTED_ARCHITECTURES = {
    "Gemma3nForCausalLM": "vLLM 0.32's text-only Gemma-3n class leaves out the per-layer token embeddings (served 0.38 "
    "off transformers); the released Gemma3nForConditionalGeneration checkpoints are served whole",
}
"""config.json architecture -> why vLLM 0.32 serves it unlike transformers (found by tests/unit/test_families.py's
forward check: Gemma3nForCausalLM.forward passes per_layer_inputs None and only the multimodal class computes them)."""


NO_GQA_FAMILIES = frozenset({"gpt_neox"})
"""Families whose transformers model has as many kv heads as heads and ignores num_key_value_heads, while vLLM 0.32
(its Transformers backend) sizes the served attention by it: a config.json carrying fewer would be served wrong."""


ALWAYS_TIED_FAMILIES = frozenset({"cohere", "cohere2", "cohere2_moe", "gemma2", "gemma3n_text", "lfm2", "lfm2_moe", "zamba2"})
"""Families whose vLLM 0.32 class computes logits from the embedding whatever the config says (Cohere drops the
checkpoint's lm_head; Gemma-2 and Gemma-3n have none; LFM2, LFM2-MoE and Zamba2 tie it): an untied checkpoint would be
served with the wrong head."""


NEVER_TIED_FAMILIES = frozenset(
    {
        "afmoe",
        "axk1",
        "deepseek_v2",
        "deepseek_v3",
        "deepseek_v32",
        "glm4_moe",
        "glm4_moe_lite",
        "glm_moe_dsa",
        "gpt_oss",
        "jamba",
        "minimax_m2",
        "mimo_v2_flash",
        "nemotron_h",
        "olmoe",
        "qwen3_next",
    }
)
"""Families whose vLLM 0.32 class keeps its own lm_head whatever the config says: a tied checkpoint holds no
lm_head.weight, so vLLM would generate from a head never loaded (a tiny tied DeepSeek-V3 on an H100: uniform logprobs,
parity 1.99 from the first push; NaN on CPU). The released models of these families are all untied.
tests/unit/test_families.py reads each family's vLLM class to keep this and ALWAYS_TIED_FAMILIES true."""


DEEPSEEK_ROUTER: dict[str, object] = {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}
SERVED_FIELDS: dict[str, dict[str, object]] = {
    "deepseek_v3": DEEPSEEK_ROUTER,
    "deepseek_v32": DEEPSEEK_ROUTER,
    "glm_moe_dsa": DEEPSEEK_ROUTER,
    "mimo_v2_flash": {"add_swa_attention_sink_bias": True},
}
"""model_type -> config fields vLLM 0.32 reads and transformers 5.19's config class lacks, with the value transformers
always computes by: a config.json written from that class lacks them, and vLLM's default serves another model.
DeepSeek's router (DeepseekV2MoE): scoring_func (vLLM's default softmax: a tiny DeepSeek-V3 on vLLM's CPU build, fp32,
0.22 apart; with the field 1.9e-6) and topk_method (without noaux_tc vLLM drops the score-correction bias transformers
adds to every choice). MiMo-V2-Flash: transformers gives every sliding-window layer attention sinks, vLLM only with
add_swa_attention_sink_bias (without it the checkpoint's sinks are dropped: 0.13-0.57 apart). The released config.json
files carry them."""


def check_family(model: str) -> None:
    """The model's family is one whose trained weights reach vLLM and whose config both sides read alike (a model
    folder not readable here is not checked)."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return
    model_type = config.get("model_type")
    unsupported = [a for a in config.get("architectures") or [] if a in UNSUPPORTED_ARCHITECTURES]
    if unsupported:
        raise ConfigError(f"vllm.model: {unsupported[0]} is not supported: {UNSUPPORTED_ARCHITECTURES[unsupported[0]]}")
    if model_type in UNSUPPORTED_FAMILIES:
        raise ConfigError(f"vllm.model: {model_type} is not supported: {UNSUPPORTED_FAMILIES[model_type]}; pick another model")
    kv, heads = config.get("num_key_value_heads"), config.get("num_attention_heads")
    if model_type in NO_GQA_FAMILIES and kv is not None and kv != heads:
        raise ConfigError(
            f"vllm.model: its {model_type} config.json sets num_key_value_heads {kv} (heads {heads}), which transformers "
            "ignores and vLLM serves with; remove that field"
        )
    if model_type in ALWAYS_TIED_FAMILIES and config.get("tie_word_embeddings") is False:
        raise ConfigError(
            f"vllm.model: {model_type} with tie_word_embeddings false is not supported: vLLM 0.32 always computes its "
            "logits from the embedding; pick a tied checkpoint"
        )
    for key, value in SERVED_FIELDS.get(model_type, {}).items():
        want = json.dumps(value)
        if key not in config:  # a config.json written from transformers' config class: the released value is meant
            raise ConfigError(
                f"vllm.model: its {model_type} config.json has no {key}; transformers computes as with {want}, vLLM 0.32 "
                f'by this field: set "{key}": {want} in it'
            )
        if config[key] != value:  # another model: transformers cannot train it as vLLM would serve it
            raise ConfigError(
                f"vllm.model: {model_type} with {key} {json.dumps(config[key])} is not supported: transformers 5.19 "
                f"computes {model_type} as with {want} only"
            )
    if model_type in NEVER_TIED_FAMILIES and config.get("tie_word_embeddings") is True:
        raise ConfigError(
            f"vllm.model: {model_type} with tie_word_embeddings true is not supported: vLLM 0.32 serves its own lm_head, "
            "which a tied checkpoint lacks; save it with tie_word_embeddings false and lm_head.weight = the embedding"
        )


SINKLESS_ATTENTION = {
    "sdpa": "transformers has no SDPA path for",
    "flash_attention_2": "flash-attn 2 does not take (transformers drops them silently)",
    "flash_attention_3": "the flash-attn 3 package does not take (transformers drops them silently)",
}
"""Attention implementations that cannot run a model with attention sinks (ModelShape.eager_attention), and why."""


def check_routing_replay(model: str) -> None:
    """trainer.routing_replay: the model is one of the MoE families the trainer has a router override for (its
    config.json's architecture; a model folder not readable here is checked by the trainer when it loads it)."""
    arch = architecture(model)
    if arch is not None and arch not in ROUTING_REPLAY_FAMILIES.values():
        raise ConfigError(
            f"trainer.routing_replay: {arch} is not an MoE family it replays "
            f"({', '.join(ROUTING_REPLAY_FAMILIES)}); remove trainer.routing_replay"
        )


def generation_steps(cfg: JobConfig, world: int) -> int:
    """Optimizer steps per generation batch as TRL counts them: trainer.grpo's generation_batch_size / (per-rank batch x
    ranks), else its steps_per_generation, else its gradient_accumulation_steps, else 1."""
    g, batch = cfg.trainer.grpo, cfg.trainer.per_device_train_batch_size
    gbs = g.get("generation_batch_size")
    if isinstance(gbs, int) and gbs > 0:
        return max(1, gbs // (batch * world))
    steps = g.get("steps_per_generation") or g.get("gradient_accumulation_steps") or 1
    return steps if isinstance(steps, int) and steps > 0 else 1


def check_batch(cfg: JobConfig, world: int, per_node: int) -> None:
    """The global batch splits into whole GRPO groups, and hsdp has ranks to shard over."""
    t = cfg.trainer
    batch, steps = t.per_device_train_batch_size, generation_steps(cfg, world)
    gbs = t.grpo.get("generation_batch_size")
    if gbs is not None:  # TRL's other way to say steps_per_generation, checked by it only on the nodes
        if "steps_per_generation" in t.grpo:
            raise ConfigError("trainer.grpo sets generation_batch_size and steps_per_generation; TRL takes one of them")
        if not isinstance(gbs, int) or gbs <= 0 or gbs % (batch * world) or gbs % t.num_generations:
            raise ConfigError(
                f"trainer.grpo.generation_batch_size ({gbs}) must be a multiple of per_device_train_batch_size x ranks "
                f"({batch} x {world}) and of trainer.num_generations ({t.num_generations})"
            )
        if t.max_staleness and steps > 1:  # the config's own check sees no world, so not this way of saying it
            raise ConfigError(
                f"trainer.max_staleness {t.max_staleness} makes one generation per optimizer step; trainer.grpo's "
                f"generation_batch_size ({gbs}) makes one every {steps}: remove it"
            )
    if (batch * world * steps) % t.num_generations:
        of = f" x {steps} steps_per_generation" if steps > 1 else ""
        raise ConfigError(
            f"completions per generation ({batch} per rank x {world} ranks{of} = {batch * world * steps}) is not a multiple "
            f"of trainer.num_generations ({t.num_generations}); make per_device_train_batch_size x ranks divisible by it"
        )
    if t.fsdp == "hsdp" and cfg.slurm.nodes > 1 and per_node < 1:
        raise ConfigError("trainer.fsdp hsdp needs at least one trainer rank per node")


def plan(cfg: JobConfig, job_dir: str) -> Plan:
    """The numbers; `derivation` writes the rule behind each one."""
    cfg = resolve_targets(cfg)  # LoRA's default targets on an MoE: attention only
    s, v, t = cfg.slurm, cfg.vllm, cfg.trainer
    tp, dp, g = v.tensor_parallel_size, v.data_parallel_size, s.gpus_per_node
    shared = s.layout == "shared" or (g == 1 and tp * dp == 1)
    if shared:  # vLLM data parallel over every GPU of the node, a trainer rank on each beside an engine
        dp = g // tp
    check_layout(cfg, shared)
    emulated = cfg.job.emulate_gpus
    if emulated:
        emulation.check(cfg)
    vllm_gpus = list(range(g)) if shared else list(range(tp * dp))
    trainer_gpus = list(range(g)) if shared else list(range(tp * dp, g))
    per_node = len(trainer_gpus)
    world = per_node * s.nodes
    check_batch(cfg, world, per_node)
    nodes = [
        NodePlan(
            node=n,
            vllm_gpus=vllm_gpus,
            trainer_gpus=trainer_gpus,
            server_url=f"http://127.0.0.1:{emulation.node_port(v.port, n, emulated)}",
            weight_transfer_port=emulation.node_port(t.weight_transfer_port, n, emulated),
            ranks=[
                RankPlan(
                    global_rank=n * per_node + i,
                    local_rank=i,
                    node=n,
                    gpu=gpu,
                    # emulated: every rank's mask is the one GPU
                    cuda_index=0 if emulated else platform_mod.device_index(cfg.job.platform, i, gpu),
                )
                for i, gpu in enumerate(trainer_gpus)
            ],
            shared_gpu=shared,
        )
        for n in range(s.nodes)
    ]
    # the ranks get the time-limit warning minus 30 s for their checkpoint; the bootstrap outwaits torchrun by 10 s
    shutdown = max(30, s.signal_seconds - 30)
    p = Plan(
        job_name=cfg.job.name,
        job_dir=job_dir,
        device=cfg.job.device,
        num_nodes=s.nodes,
        gpus_per_node=g,
        ranks_per_node=per_node,
        world_size=world,
        tensor_parallel_size=tp,
        weight_transfer_backend=resolve_backend(cfg, shared),
        rendezvous_host="127.0.0.1" if s.nodes == 1 or emulated else FIRST_NODE,
        rendezvous_port=t.rendezvous_port,
        vllm_port=v.port,
        nodes=nodes,
        config=cfg,
        process_group_timeout_s=t.push_timeout_s + t.request_timeout_s,
        trainer_shutdown_s=shutdown,
        bootstrap_grace_s=shutdown + 10,
        data_parallel_size=dp,
        platform=cfg.job.platform,
        lora_push=lora_push(cfg, dp)[0],
        emulated=emulated,
    )
    return replace(
        p,
        derivation=derivation(p)
        + platform_mod.derivation_lines(p)
        + vllm_start.derivation_lines(p, generation_steps(cfg, world))
        + emulation.derivation_lines(p),  # last: its announcement closes the plan
    )


def derivation(p: Plan) -> list[str]:
    """One line per derived number of the plan: the rule that produced it, with its inputs (dry-run prints these)."""
    v, t = p.config.vllm, p.config.trainer
    tp, dp, g = p.tensor_parallel_size, p.data_parallel_size, p.gpus_per_node
    n0, per_node, world = p.nodes[0], p.ranks_per_node, p.world_size
    shared, batch, steps = n0.shared_gpu, t.per_device_train_batch_size, generation_steps(p.config, p.world_size)
    how = "set" if v.weight_transfer_backend != "auto" else "auto: " + p.device + (", shared GPU" if shared else "")
    shape = ModelShape.read(v.model) if p.lora_push else None
    moe_lora = shape is not None and bool(shape.experts)
    sharding = "shard over the node's ranks, replicate across nodes" if t.fsdp == "hsdp" else "shard over all ranks"
    if shared and g > 1:
        gpus = [
            f"layout = shared (slurm.layout): vLLM data parallel over all {g} GPUs, DP = gpus_per_node / TP = {g} / {tp} "
            f"= {dp} engines at gpu_memory_utilization {v.gpu_memory_utilization:g} of each GPU = {n0.vllm_gpus}",
            f"trainer ranks per node = gpus_per_node = {per_node}, one beside each engine; the push: the node leader to "
            "every engine over gloo (CPU slots only: on GPUs this layout is refused, see SHARED_MULTI_GPU)",
        ]
    else:
        gpus = [
            f"layout = {'shared (a one-GPU node always is)' if shared else 'split (slurm.layout)'}: vLLM GPUs per node = "
            f"first tensor_parallel_size x data_parallel_size = {tp} x {dp} = {n0.vllm_gpus}"
            + (" (shared with the trainer: one-GPU node)" if shared else ""),
            f"trainer ranks per node = gpus_per_node - TP x DP = {g} - {tp * dp} = {per_node}"
            if not shared
            else "trainer ranks per node = 1 (shares GPU 0 with vLLM)",
        ]
    correction = (
        f"{t.grpo['vllm_importance_sampling_mode']} (set by you)"
        if "vllm_importance_sampling_mode" in t.grpo
        else f"{t.grpo_settings.get('vllm_importance_sampling_mode', 'sequence_mask')} (per token unless clip_max is null: "
        "TRL's per-sequence default masks every completion a step old)"
    )
    staleness = [
        f"max_staleness = {t.max_staleness}: vLLM's logprobs corrected by trainer.grpo.vllm_importance_sampling_mode = {correction}"
    ]
    return [
        *gpus,
        f"world size = ranks per node x nodes = {per_node} x {p.num_nodes} = {world}",
        f"completions per step = per_device_train_batch_size x world = {batch} x {world} = {batch * world} "
        + (
            f"= {batch * world // t.num_generations} prompts x {t.num_generations} generations"
            if steps == 1
            else f"(one generation of {batch * world * steps} completions = "
            f"{batch * world * steps // t.num_generations} prompts x {t.num_generations} feeds {steps} steps: trainer.grpo's "
            "gradient accumulation or steps_per_generation)"
        ),
        f"weight push world per node = 1 sender (the node leader) + TP x DP = {tp} x {dp} server workers = {1 + p.server_world}",
        f"weight push backend = {p.weight_transfer_backend} ({how})",
        f"sharding = {t.fsdp}: {sharding}",
        f"rendezvous = {p.rendezvous_host}:{p.rendezvous_port} (torchrun static rendezvous: a TCPStore on the first node, "
        "so ranks follow the plan)",
        f"process-group timeout = push_timeout_s + request_timeout_s = {t.push_timeout_s:g} + {t.request_timeout_s:g} s",
        f"trainer shutdown = max(30, signal_seconds - 30) = {p.trainer_shutdown_s} s (preemption checkpoint), "
        f"bootstrap grace {p.bootstrap_grace_s} s",
        *(staleness if t.max_staleness else []),
    ] + (
        [
            f"LoRA push = {p.lora_push}: {lora_push(p.config, p.data_parallel_size)[1]}",
            f"LoRA targets = {', '.join(t.lora.target_modules)}"
            + (" (a mixture of experts: attention only)" if moe_lora else "")
            + (f" ({note})" if (note := unresolved_note(p.config)) else ""),
        ]
        if p.lora_push
        else []
    )
