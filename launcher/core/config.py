"""The job configuration: YAML -> nested frozen dataclasses, strictly validated.

Precedence is defaults < YAML < ``--set section.key=value``. Every field carries a docstring (the
string literal under it) that the README's config reference is generated from, so docs cannot drift.
Errors are ``ConfigError`` (a ``ValueError``) and say what is wrong, why, and how to fix it.

This module must stay free of torch/vLLM imports: it runs on login nodes and in dry-runs.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import importlib.util
import inspect
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml

BUILTIN_REWARDS: dict[str, str] = {
    "letter_a_fraction": "trainer.rewards:letter_a_fraction",
    "short_completion": "trainer.rewards:short_completion",
    "math_accuracy": "trainer.verifiable_rewards:math_accuracy",
    "think_answer_format": "trainer.verifiable_rewards:think_answer_format",
    "boxed_format": "trainer.verifiable_rewards:boxed_format",
}
"""Built-in reward names and the function each names (launcher.core.reward_check and trainer/rewards.py resolve them from here)."""


class ConfigError(ValueError):
    """A user mistake in the config or the command line; the message holds the fix."""


@dataclass(frozen=True)
class ContainerConfig:
    image: str = ""
    """Container image: pyxis takes a registry name (nvcr.io#nvidia/pytorch:25.01-py3) or a .sqsh file, Apptainer a .sif file; empty = no container."""
    runtime: Literal["pyxis", "apptainer"] = "pyxis"
    """How srun enters the container: pyxis is NVIDIA's SLURM plugin (srun --container-image ...), apptainer runs srun ... apptainer exec --nv IMAGE ... (Singularity too)."""
    mounts: list[str] = field(default_factory=list)
    """Bind mounts SRC:DST[:ro] (shared file systems with models, data, the venv); the job folder is always mounted at its own path."""
    workdir: str = ""
    """Working directory inside the container; empty = the image's own (then slurm-grpo must be installed in the image, or mount its folder and name it here)."""

    def check(self) -> None:
        for m in self.mounts:
            if m.count(":") not in (1, 2) or "," in m or not all(m.split(":")[:2]):
                raise ConfigError(f"slurm.container.mounts entry {m!r} must be SRC:DST or SRC:DST:ro, without commas")
        if self.workdir and not self.workdir.startswith("/"):
            raise ConfigError(
                f"slurm.container.workdir {self.workdir!r} must be an absolute path inside the image, e.g. /workspace"
            )
        if (self.mounts or self.workdir) and not self.image:
            raise ConfigError("slurm.container has mounts or a workdir but no image; set slurm.container.image")


@dataclass(frozen=True)
class SlurmConfig:
    partition: str = ""
    """SLURM partition (sbatch --partition); empty = the cluster's default partition."""
    account: str = ""
    """SLURM account to charge (sbatch --account); empty = your default account."""
    qos: str = ""
    """Quality of service (sbatch --qos); empty = none."""
    time: str = "01:00:00"
    """Wall-clock limit, SLURM format: MM, HH:MM:SS or D-HH:MM:SS."""
    nodes: int = 1
    """Number of nodes; each runs one vLLM server and the trainer ranks on its other GPUs."""
    gpus_per_node: int = 8
    """GPUs (GRES gpu) per node. On a CPU-only cluster they are slots: one per vLLM TP rank and one per trainer rank."""
    cpus_per_task: int = 0
    """CPUs for the one task per node (sbatch --cpus-per-task); 0 = not set."""
    mem: str = ""
    """Memory per node (sbatch --mem), e.g. 200G; empty = not set; '0' = all of it."""
    exclusive: bool = False
    """Ask for whole nodes (sbatch --exclusive)."""
    constraint: str = ""
    """Node features (sbatch --constraint), e.g. h100; empty = none."""
    extra_sbatch: dict[str, str] = field(default_factory=dict)
    """More sbatch flags, name -> value without the leading dashes, e.g. {reservation: big}; '' = a flag without a value (overcommit: ''). Flags the launcher writes itself (nodes, time, gres, ...) are refused naming their key."""
    setup_profile: str = "generic"
    """Cluster profile under slurm_templates/ (<name>.sh.j2) whose lines run before the job starts."""
    setup_vars: dict[str, str] = field(default_factory=dict)
    """Values the setup profile may use, e.g. {venv: /path/to/venv, modules: 'cuda/12.4 nccl'}."""
    gpu_memory_gb: float = 0
    """Memory of one GPU in GB, for the memory estimate of dry-run; 0 = from a known GPU name in constraint or partition (a100, h100, h200, b200, ...)."""
    signal_seconds: int = 120
    """Seconds before the time limit at which SLURM warns the job (USR2) so it can checkpoint and requeue."""
    requeue: bool = True
    """On preemption or the time-limit warning, checkpoint and requeue the job."""
    node_loss_action: Literal["auto", "requeue_now", "wait"] = "auto"
    """When a node of the job is lost whole (its heartbeat stopped), what the lowest-index surviving node asks SLURM, instead of SLURM's own wait until it declares the node down (SlurmdTimeout, often 300 s): auto = cancel at once with slurm.requeue false (nothing to requeue), else wait for SLURM's own requeue; requeue_now = requeue at once without the lost nodes (every process gone within job.node_timeout_s + the site's KillWait; slurm-wlm 22.05 restarts a GPU (GRES) job requeued so with a broken GPU allocation: its first srun fails, then `slurm-grpo resume`); wait = never ask."""
    container: ContainerConfig = field(default_factory=ContainerConfig)
    """Run each node's processes in a container: {image, runtime, mounts, workdir} (keys below)."""
    layout: Literal["split", "shared"] = "split"
    """How a node's GPUs are shared out: split = vLLM on the first TP x DP GPUs, a trainer rank on each of the others; shared = vLLM data parallel over all of the node's GPUs (DP = GPUs / TP) at vllm.gpu_memory_utilization, a trainer rank on every GPU beside an engine (a one-GPU node is always shared; with 2+ GPUs it runs on CPU slots only: on CUDA its push cannot reach the other GPUs' engines, refused). `slurm-grpo simulate` models both; dry-run says which the config gets and why."""
    stage_env: str = ""
    """A packed environment on the shared file system, copied to each node's local storage with sbcast before any Python starts and used from there: a packed venv (.tar, .tar.gz, .tgz; made with venv-pack/conda-pack or tar of a venv) or a container image (.sif, .sqsh, .squashfs; the same file as slurm.container.image, runtime apptainer); empty = run from where it is."""
    stage_dir: str = "/tmp/slurm-grpo-$USER-$SLURM_JOB_ID"
    """Node-local folder slurm.stage_env is copied into ($USER and $SLURM_JOB_ID are expanded on the node, nothing else); on Frontier the NVMe: /mnt/bb/$USER/slurm-grpo-$SLURM_JOB_ID (with constraint nvme)."""
    gpu_cores: list[str] = field(default_factory=list)
    """CPU cores nearest each node-local GPU, one entry per GPU in index order (e.g. Frontier's 8 GCDs: 49-55, 57-63, 17-23, 25-31, 1-7, 9-15, 33-39, 41-47): vLLM runs on its GPUs' cores, each trainer rank on its GPU's (OLCF's -c7 binding, for one task per node); empty = no binding."""

    def check(self) -> None:
        _positive("slurm.nodes", self.nodes, "ask for at least one node")
        _positive("slurm.gpus_per_node", self.gpus_per_node, "every node needs GPUs (or CPU slots) for vLLM and the trainer")
        if self.cpus_per_task < 0:
            raise ConfigError(f"slurm.cpus_per_task must be 0 (not set) or positive, got {self.cpus_per_task}")
        if not _TIME.match(self.time):
            raise ConfigError(f"slurm.time {self.time!r} is not a SLURM time; use MM, HH:MM:SS or D-HH:MM:SS, e.g. 04:00:00")
        if self.signal_seconds < 0 or self.signal_seconds > 3600:
            raise ConfigError(f"slurm.signal_seconds must be between 0 and 3600, got {self.signal_seconds}")
        if not _PROFILE.match(self.setup_profile):
            raise ConfigError(
                f"slurm.setup_profile {self.setup_profile!r} must be the name of a file in slurm_templates/ without .sh.j2"
            )
        # sbatch's own parser of #SBATCH lines takes a backslash as an escape even inside single quotes, so such a
        # value would reach SLURM changed (the shell quoting that protects it elsewhere does not hold there)
        header = {"partition": self.partition, "account": self.account, "qos": self.qos, "mem": self.mem}
        header |= {"constraint": self.constraint, **{f"extra_sbatch.{k}": str(v) for k, v in self.extra_sbatch.items()}}
        for key, value in header.items():
            if "\\" in value:
                raise ConfigError(
                    f"slurm.{key} {value!r} contains a backslash; #SBATCH lines are read by sbatch's own parser, "
                    "which would drop it: remove it"
                )
        if time_seconds(self.time) is None:
            raise ConfigError(f"slurm.time {self.time!r}: minutes and seconds must be below 60, e.g. 04:00:00 or 1-00:00:00")
        if self.mem and not _MEM.match(self.mem):
            raise ConfigError(f"slurm.mem {self.mem!r} is not a SLURM size: a whole number with K, M, G or T (no B), e.g. 200G")
        for key in ("partition", "account", "qos", "constraint"):
            if not _SLURM_NAME.match(getattr(self, key)):
                raise ConfigError(
                    f"slurm.{key} {getattr(self, key)[:40]!r} is not a SLURM name: ASCII only, at most 256 characters"
                )
        for k in self.extra_sbatch:
            check_extra_sbatch_key(k, self)
        if self.gpu_memory_gb < 0:
            raise ConfigError(f"slurm.gpu_memory_gb must be >= 0 (0 = from the GPU name), got {self.gpu_memory_gb}")
        self.container.check()


@dataclass(frozen=True)
class VllmConfig:
    model: str = ""
    """Model to serve and train: a local directory or a hub name (required)."""
    tensor_parallel_size: int = 1
    """GPUs per vLLM engine (tensor parallelism); the node's server uses the first TP x DP GPUs, the rest run trainer ranks."""
    data_parallel_size: int = 1
    """vLLM engines behind the node's one server (vLLM's own data parallelism, one endpoint): more GPUs generating."""
    port: int = 8000
    """HTTP port of each node's server; it listens on 127.0.0.1 only."""
    gpu_memory_utilization: float = 0.9
    """Fraction of its GPUs' memory vLLM may use (on CPU builds: kept small, see the README)."""
    max_model_len: int = 0
    """Context length; 0 = the model's own."""
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """Serving dtype: auto (the model's own) or trainer.dtype; another one is refused, as parity compares the two."""
    extra_args: list[str] = field(default_factory=list)
    """More api_server arguments, as a list, e.g. ['--enforce-eager']."""
    health_timeout_s: int = 900
    """Deadline for a server to answer /health after start; past it the node fails naming its log."""
    weight_transfer_backend: Literal["auto", "nccl", "gloo", "ipc"] = "auto"
    """Weight push transport; auto picks ipc on a GPU shared with the trainer, nccl on other GPUs, gloo on CPU."""
    cpu_kvcache_gib: int = 1
    """CPU builds only: KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE)."""
    enable_expert_parallel: bool = False
    """MoE models: vLLM's expert parallelism (--enable-expert-parallel): the experts are split over the server's TP x DP GPUs instead of each expert being sliced by TP; needs TP x DP >= 2 and an MoE model; more of vLLM's expert options (--expert-placement-strategy, --enable-eplb) go in extra_args."""
    cache_dir: str = ""
    """Where each node's server keeps its compile caches (vLLM's torch.compile, Inductor, Triton; a folder per node), so a restart skips the compile; empty = the job folder's cache/ (a requeue or resume finds it); a shared folder lets other jobs of the same model reuse it."""
    cudagraph_max_size: int = 0
    """GPU only: the largest batch (tokens of one engine step) vLLM captures a CUDA graph for (--max-cudagraph-capture-size); fewer graphs, a shorter start. 0 = sized to the work: vLLM's own rule (2 x max_num_seqs, at most 512) on the sequences the run has in flight per server (dry-run shows the sum; decode batches keep their graphs, a mixed prefill step above the size runs without; on an H100: 11 sizes in 4 s against 51 in 8-9 s, generation of multi-turn agents within the spread of two runs of the default, gpu/results/2026-12-06-agents; a rollout_func and an eval over a whole file keep vLLM's own); -1 = vLLM's default (51 sizes up to 512)."""
    kv_cache: Literal["work", "measure"] = "work"
    """GPU, vLLM sharing its GPU with the trainer: work = the KV cache holds every sequence the run has in flight per server at max_model_len (--kv-cache-memory-bytes; vLLM then skips its memory profiling and its profiling CUDA graph capture, 17 s of a 7 B LoRA server's first start on an H100, and the trainer gets the rest of the GPU); measure = vLLM sizes it from gpu_memory_utilization by profiling (a restart reuses the size measured). work falls back to measure, saying why in dry-run, where the launcher cannot count it: vllm.max_model_len 0, a rollout_func, an eval over a whole file, layers other than one kind of Llama-style attention (MLA, sliding-window beside full as in Gemma 2/3, hybrid, state-space), a KV setting in vllm.extra_args, or more than the server's share of the GPU."""
    engine_start: Literal["auto", "fork", "spawn"] = "auto"
    """How vLLM's API server starts its engine core (VLLM_WORKER_MULTIPROC_METHOD): fork copies the server with vLLM already imported (expected about 20 s sooner: the spawn's cost measured on the H200), spawn starts a fresh interpreter (vLLM's CLI default); auto = fork for a one-worker server on CUDA (measured on an H100: engine core start 18-21 s -> 0, healthy 85-94 s -> 70 s, gpu/results/2026-12-06-agents), vLLM's own spawn for TP or DP servers (their forked workers have not run on GPUs yet) and on ROCm (`vllm serve` spawns unless told); the CPU build always spawns. A VLLM_WORKER_MULTIPROC_METHOD exported on the node wins over auto."""
    inspect_in_process: bool = True
    """vLLM inspects the model class in the API server itself instead of in a fresh Python process (20-30 s on a job's first start on the H200, 8 s on CPU; a restart reads vLLM's cache of it in the job folder); false = vLLM's subprocess."""

    def check(self) -> None:
        if not self.model:
            raise ConfigError(
                "vllm.model is required: a local model folder (e.g. one made by `slurm-grpo make-tiny-model DIR`) or a hub name"
            )
        _positive("vllm.tensor_parallel_size", self.tensor_parallel_size, "vLLM needs at least one GPU")
        _positive("vllm.data_parallel_size", self.data_parallel_size, "the server needs at least one engine")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"vllm.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_model_len < 0:
            raise ConfigError(f"vllm.max_model_len must be 0 (the model's own) or positive, got {self.max_model_len}")
        _positive("vllm.health_timeout_s", self.health_timeout_s, "servers need time to load the model")
        _port("vllm.port", self.port)
        for i, arg in enumerate(self.extra_args):
            owner = owned_vllm_flag(arg) if arg.startswith("-") else None
            if owner:
                shown = arg if len(arg) <= 40 else arg[:37] + "..."
                raise ConfigError(f"vllm.extra_args[{i}] {shown!r} is set by slurm-grpo from {owner}; set that key instead")
        if self.cache_dir and not self.cache_dir.startswith("/"):
            raise ConfigError(
                f"vllm.cache_dir {self.cache_dir!r} must be an absolute path (every node reads it); "
                "e.g. /shared/cache/vllm, or leave it empty for the job folder's cache/"
            )
        if self.cudagraph_max_size < -1:
            raise ConfigError(
                f"vllm.cudagraph_max_size must be 0 (auto), -1 (vLLM's default) or a batch size, got {self.cudagraph_max_size}"
            )


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The default adapted layers: every linear projection of a Llama/Qwen2/Mistral decoder layer."""
LORA_REFUSED_TARGETS = ("embed_tokens", "lm_head", "wte", "word_embeddings")
LORA_MAX_RANK = 512
ROUTING_REPLAY_FAMILIES = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}
"""trainer.routing_replay: model_type -> architecture of the MoE families with a router override (trainer.routing_replay)."""


@dataclass(frozen=True)
class LoraConfig:
    r: int = 0
    """LoRA rank; 0 = off (full fine-tuning). With r > 0 the base model is frozen in trainer.dtype (no fp32 copy, no gradients, no optimizer state) and only the adapters (fp32) train; vLLM serves them with --max-lora-rank r rounded up to one of its ranks."""
    alpha: int = 0
    """LoRA alpha (the update is scaled by alpha / r); 0 = 2 x r."""
    dropout: float = 0.0
    """Dropout on the adapters' input while training (parity and generation run without it)."""
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """Linear layers that get adapters, by module name (peft's target_modules). The default (a Llama's names) is resolved per model at plan time from its weight names: every linear layer of its decoder layers (LFM2's in_proj/out_proj/w1-w3, MLA's q_a_proj ... kv_b_proj, GPT-NeoX's query_key_value/dense*), on an MoE those outside its MLP block, never one transformers or peft bypasses (Mamba's dt_proj); dry-run's `LoRA targets` line names them, or says why not (a hub name is not resolved: name the layers yourself). The embedding and the LM head are refused (vLLM 0.32 serves adapters on linear projections)."""
    push: Literal["auto", "adapter", "merged"] = "auto"
    """How a push reaches the servers: adapter = only the adapter (peft format, loaded at run time, generation names it); merged = the base with the adapter merged in, through vllm.weight_transfer_backend; auto = adapter where vLLM can serve it (dry-run says which and why)."""
    adapter_transport: Literal["engine", "disk"] = "engine"
    """How an adapter push (push adapter) reaches vLLM: engine = its tensors through the push's weight-transfer engine (vllm.weight_transfer_backend), from which each vLLM worker builds the LoRA model in memory, no file; disk = a peft folder per push on node-local disk, loaded by /v1/load_lora_adapter (for a vLLM whose LoRA manager the project's plugin cannot reach: the server says so at the first push)."""
    save_merged: bool = False
    """Also write the merged model (base + adapter, safetensors, from_pretrained-loadable) into the job folder at the end; the adapter itself is always written (peft format)."""

    def check(self) -> None:
        if not 0 <= self.r <= LORA_MAX_RANK:
            raise ConfigError(
                f"trainer.lora.r must be 0 (off) to {LORA_MAX_RANK} (vLLM's largest LoRA rank), got {self.r}; 8 to 64 is usual"
            )
        if self.alpha < 0:
            raise ConfigError(f"trainer.lora.alpha must be >= 0 (0 = 2 x r), got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"trainer.lora.dropout must be in [0, 1), got {self.dropout}")
        if self.r and not self.target_modules:
            raise ConfigError(f"trainer.lora.target_modules is empty: name the linear layers to adapt, e.g. {LORA_TARGETS}")
        bad = [m for m in self.target_modules if m in LORA_REFUSED_TARGETS]
        if bad:
            raise ConfigError(
                f"trainer.lora.target_modules {bad}: adapters on the embedding or the LM head are not served by vLLM 0.32 "
                f"and would change the vocabulary rows every push; adapt the linear projections only, e.g. {LORA_TARGETS}"
            )

    @property
    def enabled(self) -> bool:
        return self.r > 0

    @property
    def scale_alpha(self) -> int:
        """alpha as peft gets it (0 = 2 x r)."""
        return self.alpha or 2 * self.r


EVAL_MAX_SAMPLES = 1024


@dataclass(frozen=True)
class EvalConfig:
    dataset: str = ""
    """Held-out prompts: a JSONL/Parquet file or a saved `datasets` folder with a 'prompt' column, as trainer.dataset; "" = no evaluation."""
    every_steps: int = 0
    """Evaluate after every N optimizer steps, and always after the last one; 0 = after the last one only."""
    before_training: bool = True
    """Also evaluate the starting weights, before step 1 (a resumed run does not repeat it)."""
    samples_per_prompt: int = 4
    """k: completions sampled per eval prompt (trainer.temperature, trainer.max_completion_length); pass@j is reported for j = 1, 2, 4, ... up to k, and mean@k."""
    reward_funcs: list[str] = field(default_factory=list)
    """Rewards that score the eval completions (built-in names or 'pkg.module:function', summed); [] = trainer.reward_funcs (and an environment's get_reward)."""
    pass_threshold: float = 1.0
    """A completion passes when its summed eval reward is >= this (1.0 suits 0/1 verifiable rewards)."""
    max_prompts: int = 0
    """Evaluate the first N prompts of the file only; 0 = all of them."""

    def check(self, multi_turn_loop: bool = False) -> None:
        """multi_turn_loop: trainer.rollout_func is set (a loop of the user's own, which eval cannot run)."""
        for name in ("every_steps", "max_prompts"):
            if getattr(self, name) < 0:
                raise ConfigError(f"trainer.eval.{name} must be >= 0, got {getattr(self, name)}")
        if not 1 <= self.samples_per_prompt <= EVAL_MAX_SAMPLES:
            raise ConfigError(
                f"trainer.eval.samples_per_prompt must be 1 to {EVAL_MAX_SAMPLES}, got {self.samples_per_prompt}; 4 to 16 is usual"
            )
        if self.reward_funcs:  # [] = trainer.reward_funcs
            _check_reward_funcs(self.reward_funcs, key="trainer.eval.reward_funcs")
        if self.dataset and multi_turn_loop:
            raise ConfigError(
                "trainer.eval with trainer.rollout_func: slurm-grpo cannot run your own episode loop on eval prompts; "
                'set trainer.eval.dataset: "" (tools and environments can be evaluated)'
            )

    @property
    def enabled(self) -> bool:
        return bool(self.dataset)


ATTENTION = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3")
"""transformers' own attention implementations (trainer.attn_implementation; besides them a kernels-hub repo)."""
_KERNELS_REPO = re.compile(r"^[\w.-]+/[\w.-]+(@[\w.-]+)?(:[\w]+)?$")


def _check_attention(value: str) -> None:
    if value and value not in ATTENTION and not _KERNELS_REPO.match(value):
        raise ConfigError(
            f"trainer.attn_implementation {repr(value)[:32]} is not one of {', '.join(ATTENTION)}: "
            "set one, or a kernels-hub org/name"
        )


@dataclass(frozen=True)
class TrainerConfig:
    dataset: str = "data/letters.jsonl"
    """Training prompts: a JSONL/Parquet file or a saved `datasets` folder with a 'prompt' column."""
    reward_funcs: list[str] = field(default_factory=lambda: ["letter_a_fraction"])
    """Rewards: built-in names (letter_a_fraction, short_completion, math_accuracy, think_answer_format, boxed_format) or dotted paths 'pkg.module:function'."""
    columns: dict[str, str] = field(default_factory=dict)
    """Dataset columns renamed for the run, the run's name -> the dataset's column, e.g. {prompt: question, solution: answer} for GSM8K as it comes; the trainer reads 'prompt', each reward gets the other columns by name; {} = as stored."""
    system_prompt: str = ""
    """A system message put first in every prompt: a plain-string prompt becomes [system, user] and so goes through the chat template; a row with its own system message keeps it; "" = none."""
    chat_template: str = ""
    """The chat template conversational prompts are rendered with instead of the model's own: a Jinja file's path (read on the nodes) or the Jinja text itself; "" = the tokenizer's."""
    max_steps: int = 20
    """Optimizer steps to run."""
    per_device_train_batch_size: int = 8
    """Completions per rank per step (prompts x generations)."""
    num_generations: int = 8
    """Completions sampled per prompt (the GRPO group size)."""
    max_completion_length: int = 256
    """Tokens generated per completion (TRL's default; the CPU smoke configs set 16)."""
    learning_rate: float = 1e-6
    """AdamW learning rate (TRL's GRPO default; the CPU smoke configs set their own)."""
    beta: float = 0.0
    """KL coefficient; 0 = no reference model."""
    temperature: float = 1.0
    """Sampling temperature."""
    seed: int = 0
    """Random seed (data order, sampling)."""
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Trainer dtype (CPU: use float32)."""
    fsdp: Literal["hsdp", "fsdp"] = "hsdp"
    """Sharding: hsdp shards within a node and replicates across nodes (the push gather stays in the node); fsdp shards over all ranks."""
    save_steps: int = 10
    """Write a checkpoint every N steps (and at the end); 0 = only at the end."""
    final_checkpoint: bool = True
    """Write a checkpoint when the run ends (off for benchmark runs whose optimizer state would not fit the disk)."""
    keep_checkpoints: int = 2
    """Complete checkpoints kept in checkpoints/ (the newest; an older one is deleted only once a newer one is complete); 0 = keep all. Each holds the fp32 parameters and AdamW's two moments: the dry-run prints its size."""
    async_checkpoint: bool = True
    """Write the periodic checkpoints in the background: the step is held only while each rank copies its shards (fp32 parameters and AdamW's moments, 12 bytes per parameter over the shard's ranks) into host memory (on CUDA pinned buffers, reused by every checkpoint until the run's end), and a thread writes them while training goes on; the checkpoint counts (meta.json) once written. A preemption's and the final checkpoint are written in the step. false: every checkpoint in the step (where host memory cannot hold that copy, e.g. with trainer.cpu_offload, whose state is there already)."""
    save_model: bool = True
    """Full fine-tuning: write the final model in Hugging Face format into JOB/model at the end (sharded safetensors in trainer.dtype, config, tokenizer, generation config; `vllm serve JOB/model` loads it). LoRA runs write adapter/ instead."""
    resume: bool = True
    """Resume from the newest complete checkpoint in the job folder if there is one (model, optimizer, LR schedule, every rank's RNG states, the data cursor); false starts over and sets earlier checkpoints aside in checkpoints/set-aside-*/."""
    request_timeout_s: float = 300.0
    """Deadline for every HTTP request to the node's vLLM server (generation, weight routes)."""
    push_timeout_s: float = 600.0
    """Deadline for one whole weight push (all parameters) to the node's server."""
    bucket_mb: int = 64
    """Largest gathered bucket of parameters during a push, in MB (bounds the push's extra memory)."""
    ipc_buffer_mb: int = 2048
    """ipc push only (vLLM and the trainer on one GPU): the staging buffer on the GPU, kept for the run and mapped by the server once; a model up to this size moves in one request, a bigger one in windows of it. Counted in the memory estimate."""
    parity_tolerance: float = 0.0
    """Largest allowed |logprob(vLLM) - logprob(trainer)| after a push, per probe token, on top of the rounding of its logits in the push's dtype (eps x (|its logit| + the softmax-weighted mean |logit|): 2^-7 in bf16, what a sharp, trained model needs); 0 = by dtype (float32 1e-3, bf16 0.25; 0.5 in bf16 for attention vLLM computes in another order: MLA as in DeepSeek, sinks as in gpt-oss)."""
    parity_action: Literal["fail", "warn"] = "fail"
    """What a failed parity check does: stop the job, or log a warning and go on."""
    rendezvous_port: int = 29500
    """torchrun c10d rendezvous port on the first node."""
    weight_transfer_port: int = 29600
    """Port of each node leader's weight-transfer store (127.0.0.1, node-local)."""
    model_loading: Literal["sharded", "full"] = "sharded"
    """How ranks load the model: sharded builds it on the meta device, then each rank reads only its shard's rows from the safetensors files; full runs from_pretrained of the whole fp32 model on every rank, then shards (for checkpoints whose tensor names need renaming)."""
    attn_implementation: str = ""
    """The trainer's attention (transformers' attn_implementation; vLLM keeps its own): '' = transformers' choice (SDPA where the family has it, else eager: gpt-oss), or eager, sdpa, flex_attention, flash_attention_2, flash_attention_3, or a kernels-hub repo already in the nodes' Hugging Face cache (e.g. kernels-community/vllm-flash-attn3: flash attention with gpt-oss's sinks; nothing is downloaded at run time). TRL's reference model takes the same."""
    activation_checkpointing: bool = True
    """Recompute each decoder layer's activations in the backward instead of keeping them (less memory, about a third more compute); TRL's GRPOConfig default too."""
    routing_replay: bool = False
    """MoE models (qwen3_moe, qwen2_moe, olmoe, mixtral, gpt_oss): the trainer's forward and backward route each token to the experts vLLM routed it to when generating (vLLM --enable-return-routed-experts, Model Runner V2: GPU only), so its logprobs match vLLM's routing; the router still gets gradients."""
    importance_ratio_from_loss: bool = True
    """Take the importance ratio against vLLM's logprobs (trainer.grpo's vllm_importance_sampling_*) from the training forward's own logprobs, instead of TRL's extra no-grad forward of the whole batch before the first micro-step: the weights do not move between the two (one pass over each batch, generation aligned with the gradient accumulation), so they are the same logprobs. Saves about a fifth of the training time; where TRL's conditions for it do not hold (num_iterations > 1, vespo) TRL's forward stays."""
    cpu_offload: bool = False
    """Keep the sharded fp32 parameters, gradients and optimizer state in host memory (FSDP2 CPUOffloadPolicy; the optimizer step runs on the CPU): a big model on few GPUs."""
    report_to: list[Literal["wandb", "tensorboard", "none"]] = field(default_factory=list)
    """Experiment trackers ([] or [none] = none). Rank 0 reports TRL's figures and the project's (per-node push seconds, parity, tokens/s, staleness); files go to the job folder (wandb/, tensorboard/)."""
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    """W&B mode; offline by default, as compute nodes seldom reach the Internet (upload later with `slurm-grpo sync JOB`). One W&B run per job folder: a requeued or resumed job continues it."""
    wandb_project: str = "slurm-grpo"
    """W&B project name."""
    max_staleness: int = 0
    """Asynchronous generation per node: 0 = generate, then train (synchronous); k = each node's server generates the batches of the next k steps with the weights it has while the node's ranks train, so a completion is used at most k optimizer steps after the weights that started it (TRL's importance-sampling correction on vLLM's logprobs). With k >= 2 a push pauses requests in flight (vLLM /pause mode keep) and they finish under the new weights. With k >= 1 the correction is per token (trainer.grpo.vllm_importance_sampling_mode token_truncate unless set: TRL's per-sequence default stops learning one step off)."""
    profile_steps: list[int] = field(default_factory=list)
    """[first, last]: run torch.profiler over these steps on each node leader and write its tables (CPU and device time per operator, sorted) to profile/node{N}-rank{R}.txt in the job folder; [] = off. Costs time while it runs."""
    stall_timeout_s: int = 900
    """The bootstrap stops the node if the trainer writes no metrics for this long after its first step; 0 = off."""
    grpo: dict[str, Any] = field(default_factory=dict)
    """Any other trl.GRPOConfig field, passed through as is (e.g. {loss_type: dapo})."""
    start_with_server: bool = True
    """Start the trainer ranks together with the node's server: they launch, rendezvous, load and shard while vLLM starts, and wait for its /health (vllm.health_timeout_s) only before their first request; false = start them once the server is healthy (a GPU too full for both to load at once)."""
    parity_every: int = 10
    """Every push is proven by parity after it (the server's logprobs equal the trainer's); the probe before it, which only measures how far the server lagged, runs at an attempt's first push and every N steps; 0 = only at the first push."""
    tools: list[str] = field(default_factory=list)
    """Tools the model may call, 'pkg.module:function' each (type hints and a Google-style docstring: TRL renders its schema into the prompt). Run on the calling rank's CPU, next to its node's server; multi-turn settings (max_tool_calling_iterations, ...) go in trainer.grpo."""
    environment: str | dict[str, str] = ""
    """Environment factory 'pkg.module:factory' (one instance per rollout: reset(**row), its public methods are tools, an optional get_reward() scores the episode), or a mapping name -> factory routed by the dataset's 'environment' column; "" = none."""
    rollout_func: str = ""
    """Your own episode loop 'pkg.module:function' (TRL's rollout_func(prompts, trainer) -> dict of prompt_ids, completion_ids, logprobs[, env_mask, extra fields]); its trainer's generation backend (generate(prompts=ids, images=None, num_generations=1)) asks this rank's node server with no collective; "" = none."""
    tool_timeout_s: float = 60.0
    """Deadline for one tool call (or environment method); a call that raises or passes it becomes a recorded tool failure the model sees as {"error": ...}, never a stuck rank."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA: train adapters on a frozen base and push only the adapter: {r, alpha, dropout, target_modules, push, save_merged} (keys below; r 0 = off)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Evaluation on held-out prompts, before training and every N steps, on every node's own server: {dataset, every_steps, before_training, samples_per_prompt, reward_funcs, pass_threshold, max_prompts} (keys below); pass@k and mean@k go to metrics.jsonl, the trackers, `slurm-grpo status` and metrics.png."""

    MAX_STALENESS: ClassVar[int] = 4
    """max_staleness above this is refused: the policy would learn from completions of a model that old."""

    def check(self) -> None:
        if not self.dataset:
            raise ConfigError("trainer.dataset is required: a JSONL/Parquet file or a `datasets` folder with a 'prompt' column")
        _check_reward_funcs(self.reward_funcs, self.environment)
        _check_data_fields(self)
        for name in (
            "max_steps",
            "per_device_train_batch_size",
            "num_generations",
            "max_completion_length",
            "bucket_mb",
            "ipc_buffer_mb",
        ):
            _positive(f"trainer.{name}", getattr(self, name), "it counts something that must exist")
        for name in ("request_timeout_s", "push_timeout_s"):
            _positive(f"trainer.{name}", getattr(self, name), "every wait needs a deadline")
        if self.num_generations < 2:
            raise ConfigError(
                f"trainer.num_generations ({self.num_generations}) must be at least 2: GRPO compares completions within a group"
            )
        if self.learning_rate <= 0:
            raise ConfigError(f"trainer.learning_rate must be positive, got {self.learning_rate}")
        if self.beta < 0:
            raise ConfigError(f"trainer.beta must be >= 0, got {self.beta}")
        if self.temperature <= 0:
            raise ConfigError(f"trainer.temperature must be positive, got {self.temperature}")
        for name, zero in (("save_steps", "only at the end"), ("stall_timeout_s", "off"), ("parity_tolerance", "by dtype")):
            if getattr(self, name) < 0:
                raise ConfigError(f"trainer.{name} must be >= 0 (0 = {zero}), got {getattr(self, name)}")
        if self.keep_checkpoints < 0:
            raise ConfigError(f"trainer.keep_checkpoints must be >= 0 (0 = keep all), got {self.keep_checkpoints}")
        if self.parity_every < 0:
            raise ConfigError(
                f"trainer.parity_every must be >= 0 (the stale probe's period in steps; 0 = only at the first push), got {self.parity_every}"
            )
        if not 0 <= self.max_staleness <= self.MAX_STALENESS:
            raise ConfigError(
                f"trainer.max_staleness must be 0 (synchronous) to {self.MAX_STALENESS} (steps off), got {self.max_staleness}; "
                "1 already overlaps generation with training completely when generation is the shorter of the two"
            )
        ps = self.profile_steps
        if ps and (len(ps) != 2 or not all(isinstance(x, int) for x in ps) or not 1 <= ps[0] <= ps[1]):
            raise ConfigError(
                f"trainer.profile_steps must be [first, last] with 1 <= first <= last (e.g. [3, 4]), or [] for off; got {ps}"
            )
        _port("trainer.rendezvous_port", self.rendezvous_port)
        _port("trainer.weight_transfer_port", self.weight_transfer_port)
        _check_attention(self.attn_implementation)
        _check_grpo(self.grpo)
        _check_agents(self)
        if self.routing_replay and self.multi_turn:  # the table keys one sequence per request; episodes have several
            raise ConfigError(
                "trainer.routing_replay replays single-turn completions only; remove it or the tools/environment/rollout_func"
            )
        self.lora.check()
        self.eval.check(multi_turn_loop=bool(self.rollout_func))

    @property
    def multi_turn(self) -> bool:
        """Tools, an environment or a rollout_func: each rank generates on its node's server by itself."""
        return bool(self.tools or self.environment or self.rollout_func)

    @property
    def grpo_settings(self) -> dict[str, Any]:
        """trainer.grpo as trl.GRPOConfig receives it. With max_staleness >= 1 and no vllm_importance_sampling_mode of
        the user's: token_truncate. TRL's default, sequence_mask, weighs a completion by exp(the sum over its tokens of
        trainer minus vLLM logprob) and zeroes it above 3; a completion one optimizer step old differs by 0.2-0.8 a token
        on a GPU run, so over 256 tokens every ratio is 0 or masked and nothing learns (a 2.8 B body one step off: mean
        ratio 1e-16 to 0.15, reward 0.03 -> 0.19 in 16 steps, where the synchronous run reached 1.0 at step 6;
        gpu/results/2026-12-06-agents-lora-q3b/). Per token, truncated at 3, each token keeps its own correction."""
        g = self.grpo
        # a truncation needs a bound: with clip_max null and no clip_min the user chose masking below; leave it to TRL
        unbounded = "vllm_importance_sampling_clip_max" in g and g["vllm_importance_sampling_clip_max"] is None
        if (
            self.max_staleness
            and "vllm_importance_sampling_mode" not in g
            and not (unbounded and g.get("vllm_importance_sampling_clip_min") is None)
        ):
            return {**g, "vllm_importance_sampling_mode": "token_truncate"}
        return dict(g)

    @property
    def run_kind(self) -> str:
        """What the GPU benchmarks compare like with like by (gpu/report.py, gpu/trl_colocate.py): agents, lora, dense,
        or agents+lora."""
        return "+".join(k for k, on in (("agents", self.multi_turn), ("lora", self.lora.enabled)) if on) or "dense"


@dataclass(frozen=True)
class JobSection:
    name: str = "grpo"
    """Job name (sbatch --job-name); letters, digits, '-', '_' and '.' only."""
    job_dir: str = ""
    """Job folder; empty = runs/<name>-<YYYYmmdd-HHMMSS> under the current directory."""
    device: Literal["cuda", "cpu"] = "cuda"
    """What the nodes compute on: cuda runs vLLM's CUDA build and NCCL, cpu vLLM's CPU build and gloo (for tests and the smoke run)."""
    python: str = "python"
    """Python interpreter the job runs on the nodes (after the setup profile ran)."""
    node_timeout_s: int = 30
    """A node whose bootstrap shows no heartbeat (in the job folder) for this long is lost: the others stop, naming it."""
    emulate_gpus: bool = False
    """Tests and benchmarks only, never a real job: lay out slurm.nodes x gpus_per_node exactly as on a cluster, but run every process on this machine's one GPU, each with its own NCCL host id, several nodes on one host with per-node ports (launcher.core.emulation; with job.device cpu only the nodes part)."""
    platform: Literal["cuda", "rocm"] = "cuda"
    """GPU platform of job.device cuda: cuda (NVIDIA: CUDA_VISIBLE_DEVICES per process, NCCL, CUDA IPC) or rocm (AMD, e.g. Frontier: every node process sees all of the node's GPUs and picks its own by index, RCCL, HIP IPC only on a shared GCD); site profiles set it (configs/site/frontier.yaml)."""

    def check(self) -> None:
        if not _NAME.match(self.name):
            raise ConfigError(
                f"job.name {self.name!r} may use letters, digits, '-', '_' and '.' only (1-64 characters), e.g. grpo-7b"
            )
        _positive("job.node_timeout_s", self.node_timeout_s, "a lost node must be declared lost at some point")
        if not self.python:
            raise ConfigError("job.python must be a path or name of a Python interpreter")


@dataclass(frozen=True)
class JobConfig:
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    vllm: VllmConfig = field(default_factory=VllmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    job: JobSection = field(default_factory=JobSection)


SECTIONS: dict[str, type] = {"slurm": SlurmConfig, "vllm": VllmConfig, "trainer": TrainerConfig, "job": JobSection}


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """typing.get_type_hints of a config dataclass, once (the loader asks for them per key)."""
    return typing.get_type_hints(cls)


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a config dataclass, read from its source."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for prev, node in zip(body, body[1:]):
        if isinstance(prev, ast.AnnAssign) and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            docs[prev.target.id] = str(node.value.value)  # type: ignore[attr-defined,union-attr]
    return docs


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()  # type: ignore[misc,operator]


def did_you_mean(word: str, options: typing.Iterable[str]) -> str:
    """ "; did you mean 'x'?" for the nearest option (difflib), or "" when none is near."""
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.7)
    return f"; did you mean {close[0]!r}?" if close else ""


KNOWN_AS = {
    "rank": "r",
    "lora_r": "r",
    "alpha": "lora_alpha",
    "dropout": "lora_dropout",
    "lr": "learning_rate",
    "kl_coef": "beta",
    "kl": "beta",
    "group_size": "num_generations",
    "batch_size": "per_device_train_batch_size",
    "tp": "tensor_parallel_size",
    "dp": "data_parallel_size",
    "max_new_tokens": "max_completion_length",
    "max_tokens": "max_completion_length",
}
"""Other libraries' names for a key (peft's, TRL's, vLLM's shorthand): suggested where spelling alone finds nothing."""


def unknown_key(where: str, key: str, cls: type) -> ConfigError:
    """A misspelt key: the nearest valid one, and where the full list is (not in the message: it is long)."""
    names = [f.name for f in dataclasses.fields(cls)]
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.7)  # on the bare names: a shared prefix matches nothing
    close = close or [n for n in (KNOWN_AS.get(key),) if n in names]
    hint = f"; did you mean '{where}.{close[0]}'?" if close else f"; keys of {where}: slurm-grpo config-reference {where}"
    return ConfigError(f"unknown key '{where}.{key}'{hint}")


SCIENTIFIC = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


@dataclass(frozen=True)
class Menu:
    """How an error names the values of a choice field; the values themselves come from the field's Literal."""

    notes: dict[str, str] = field(default_factory=dict)
    """A note after a value: hsdp (shard in a node, replicate across nodes)."""
    one_of: bool = False
    """"one of a, b, c" instead of "a, b or c"."""
    example: str = ""

    def say(self, choices: tuple[str, ...]) -> str:
        """The values as the error says them; a Literal has two or more."""
        named = [f"{c} ({self.notes[c]})" if c in self.notes else c for c in choices]
        text = "one of " + ", ".join(named) if self.one_of else ", ".join(named[:-1]) + " or " + named[-1]
        return text + (f", e.g. {self.example}" if self.example else "")


MENUS = {
    "slurm.container.runtime": Menu(notes={"pyxis": "srun --container-image"}),
    "slurm.node_loss_action": Menu(
        notes={"auto": "cancel without slurm.requeue, else SLURM's own requeue", "requeue_now": "requeue without the lost nodes"}
    ),
    "vllm.dtype": Menu(one_of=True),
    "vllm.kv_cache": Menu(notes={"work": "every sequence in flight, no profiling", "measure": "vLLM's profile"}),
    "trainer.fsdp": Menu(notes={"hsdp": "shard in a node, replicate across nodes"}),
    "trainer.model_loading": Menu(notes={"sharded": "each rank reads its shard"}),
    "trainer.report_to": Menu(example="[wandb, tensorboard]"),
    "trainer.wandb_mode": Menu(notes={"offline": "then `slurm-grpo sync JOB`"}),
    "trainer.lora.push": Menu(notes={"adapter": "only the adapter moves", "merged": "base + adapter, full weights"}),
    "trainer.lora.adapter_transport": Menu(
        notes={"engine": "the weight-transfer engine, no file", "disk": "a peft folder per push"}
    ),
}
"""The error's wording of a choice field, where it says more than "KEY 'x' must be a, b or c"."""


def choices(annotation: Any) -> tuple[str, ...]:
    """The values of a choice field (a Literal, or a list of one); () for any other field."""
    if typing.get_origin(annotation) is list:
        (annotation,) = typing.get_args(annotation)
    return typing.get_args(annotation) if typing.get_origin(annotation) is Literal else ()


def _choice_error(key: str, value: str, annotation: Any, entry: bool = False) -> ConfigError:
    return ConfigError(f"{key}{' entry' if entry else ''} {value!r} must be {MENUS.get(key, Menu()).say(choices(annotation))}")


def _text(where: str, value: Any) -> str:
    """A choice field's value as text, refused if not text or if it holds a control character."""
    text = _coerce(where, value, str)
    _refuse_control_characters(where, text)
    return text


def _coerce(where: str, value: Any, annotation: Any) -> Any:
    """Check a YAML value against a field's type; ints are accepted for floats, nothing else is guessed."""
    origin = typing.get_origin(annotation)
    if annotation is Any:
        return plain(value)
    if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):  # a nested group of keys, e.g. slurm.container
        return _build(annotation, where, value)
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where} must be true or false, got {value!r}")
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return int(value)
        if isinstance(value, str) and re.fullmatch(r"[-+]?0[0-9_]+", value.strip()):
            raise ConfigError(f"{where} {value!r} has a leading zero (YAML 1.1 reads octal there); write it without")
        if isinstance(value, str) and re.fullmatch(r"[-+]?[0-9_]+", value.strip()):  # "8": YAML reads quotes as text
            raise ConfigError(f"{where} must be an integer, got the string {value!r}: write {value.strip()} unquoted")
        raise ConfigError(f"{where} must be an integer, got {value!r}")
    if annotation is float:
        # a quoted '1e-5' too: a learning rate written that way is what everyone types (and YAML 1.1 reads it as a
        # string); nothing looser
        if isinstance(value, str) and SCIENTIFIC.fullmatch(value.strip()):
            value = _Float(value)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ConfigError(f"{where} must be a number, got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{where} must be a finite number, got {written(value)}")
        return float(value)
    if annotation is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return expand_home(where, written(value))  # the text as typed: 0123 and 1.10 stay as they are
        if isinstance(value, bool):
            raise ConfigError(f"{where} is {str(value).lower()} to YAML (an unquoted yes/no/on/off/true/false); quote it: '...'")
        if isinstance(value, (dict, list)):  # `Format: think first` is a mapping to YAML, `[x] y` a list
            kind = "a mapping (its text holds ': ')" if isinstance(value, dict) else "a list"
            raise ConfigError(f"{where} must be a string, but YAML read {kind}: {value!r}; quote the whole value: '...'")
        raise ConfigError(
            f"{where} must be a string, got {value!r}" + ("; give a value or remove the line" if value is None else "")
        )
    if origin is Literal:
        text = _text(where, value)
        if text not in choices(annotation):
            raise _choice_error(where, text, annotation)
        return text
    if origin is list:
        return _coerce_list(where, value, annotation)
    if origin in (typing.Union, types.UnionType):  # trainer.environment: one factory or a mapping of them
        kinds = typing.get_args(annotation)
        for kind in kinds:
            if isinstance(value, dict) if typing.get_origin(kind) is dict else isinstance(value, str):
                return _coerce(where, value, kind)
        raise ConfigError(f"{where} must be {' or '.join(_kind_name(k) for k in kinds)}, got {value!r}")
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a mapping (key: value), got {value!r}")
        _, item = typing.get_args(annotation)
        return {written(k): _coerce(f"{where}.{written(k)}", v, item) for k, v in value.items()}
    raise AssertionError(f"unsupported annotation {annotation!r} for {where}")


PATH_KEYS = frozenset(
    (
        "vllm.model",
        "vllm.cache_dir",
        "trainer.dataset",
        "trainer.chat_template",
        "trainer.eval.dataset",
        "job.job_dir",
        "job.python",
        "slurm.stage_env",
        "slurm.container.image",
        "slurm.setup_vars.venv",
    )
)
"""Keys that hold a path (besides each slurm.container.mounts source): a leading ~ is expanded where the config is
built, once, so the checks, the node commands (quoted: no shell expands it there) and the trainer see one path."""
_MOUNT = re.compile(r"^slurm\.container\.mounts\[\d+\]$")


def expand_home(where: str, text: str) -> str:
    """A path-valued key's ~ or ~user expanded (os.path.expanduser); any other value, a hub name or a template's
    text as it is."""
    if not text.startswith("~"):
        return text
    if _MOUNT.match(where):  # SRC:DST[:ro]: the source is on this file system, the destination inside the image
        src, sep, rest = text.partition(":")
        return os.path.expanduser(src) + sep + rest
    inline = where == "trainer.chat_template" and ("{{" in text or "{%" in text)
    return os.path.expanduser(text) if where in PATH_KEYS and not inline else text


def _kind_name(kind: Any) -> str:
    return "a mapping (key: value)" if typing.get_origin(kind) is dict else "a string"


def _coerce_list(where: str, value: Any, annotation: Any) -> list[Any]:
    """A list field: one string is a one-item list; a list of choices names its first wrong value in sorted order."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise ConfigError(f"{where} must be a list, got {value!r}")
    (item,) = typing.get_args(annotation)
    if choices(item):
        items = [_text(f"{where}[{i}]", v) for i, v in enumerate(value)]
        bad = sorted(set(items) - set(choices(item)))
        if bad:
            raise _choice_error(where, bad[0], item, entry=True)
        return items
    return [_coerce(f"{where}[{i}]", v, item) for i, v in enumerate(value)]


def _build(cls: type, section: str, raw: Any) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"section '{section}' must be a mapping, got {raw!r}")
    hints = _hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise unknown_key(section, unknown[0], cls)
    kwargs = {k: _coerce(f"{section}.{k}", v, hints[k]) for k, v in raw.items()}
    return cls(**kwargs)


def _split_override(text: str) -> tuple[list[str], str]:
    """'trainer.max_steps=5' -> (['trainer', 'max_steps'], '5'): the key checked for its form, the value as typed."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r} is not of the form section.key=value, e.g. --set slurm.nodes=4")
    key, _, value = text.partition("=")
    parts = key.strip().split(".")
    if len(parts) < 2 or not all(parts):
        raise ConfigError(
            f"--set key {key!r} must be section.key (or section.group.key), e.g. trainer.max_steps or slurm.container.image; "
            f"sections: {', '.join(SECTIONS)}"
        )
    return [parts[0], ".".join(parts[1:])], value


def _yaml_value(text: str, value: str) -> Any:
    """An --set value read as YAML; refused where YAML would drop part of it as a comment (' #' starts one)."""
    if not value.strip():
        return ""
    try:
        parsed = read_yaml(value)
        comment = yaml_comment(value)
    except ConfigError as e:
        raise ConfigError(f"--set {text!r}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {text!r}: the value is not valid YAML ({e.__class__.__name__})") from None
    if comment is not None:
        raise ConfigError(
            f"--set {text!r}: YAML reads {value[comment:].splitlines()[0]!r} as a comment and would drop it; "
            "quote the text that holds the #: '...'"
        )
    return parsed


def yaml_comment(text: str) -> int | None:
    """Where a YAML comment starts in text (a # at the start or after a blank, outside every token); None if none."""
    covered = [(t.start_mark.index, t.end_mark.index) for t in yaml.scan(text, Loader=ConfigLoader)]
    for i, c in enumerate(text):
        if c == "#" and (i == 0 or text[i - 1] in " \t\n") and not any(a <= i < b for a, b in covered):
            return i
    return None


def _is_text(annotation: Any) -> bool:
    """A field whose value is one piece of text: a string or a choice (a Literal)."""
    return annotation is str or typing.get_origin(annotation) is Literal


def _override_value(text: str, value: str, annotation: Any) -> Any:
    """An --set value for a field of this annotation: the text as typed for a text field (a system prompt may hold
    ': ' or ' #'), unquoted as YAML would where the whole value is one quoted YAML string; YAML for any other field."""
    if not _is_text(annotation):
        return _yaml_value(text, value)
    stripped = value.strip()
    if len(stripped) >= 2 and stripped[0] == stripped[-1] and stripped[0] in "'\"":
        try:
            unquoted = read_yaml(stripped)
        except (yaml.YAMLError, ConfigError):  # quotes inside the text, not around it: "a" and "b"
            return value
        if isinstance(unquoted, str):
            return unquoted
    return value


def parse_override(text: str) -> tuple[list[str], Any]:
    """'trainer.max_steps=5' -> (['trainer', 'max_steps'], 5); the value is read as YAML (merge_raw reads it by the
    key's type: a text field takes it as typed). A key into a nested group keeps its rest dotted:
    'slurm.container.image=x' -> (['slurm', 'container.image'], 'x')."""
    path, value = _split_override(text)
    return path, _yaml_value(text, value)


def _is_group(annotation: Any) -> bool:
    """A field that holds keys of its own: a nested dataclass (slurm.container), a mapping (slurm.setup_vars,
    slurm.extra_sbatch, trainer.grpo) or a free-form value (inside trainer.grpo)."""
    return (
        annotation is Any
        or typing.get_origin(annotation) is dict
        or (isinstance(annotation, type) and dataclasses.is_dataclass(annotation))
    )


def _check_override_path(text: str, section: str, path: list[str]) -> Any:
    """Every step of a dotted --set key must exist: a nested dataclass's keys are known (an unknown one fails naming
    the valid ones); a mapping's keys are free; a plain value has no keys. Returns the key's annotation."""
    annotation: Any = SECTIONS[section]
    where = section
    for part in path:
        if not _is_group(annotation):
            raise ConfigError(f"--set {text!r}: {where} is a single value, not a group of keys; set it as --set {where}=VALUE")
        if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
            hints = _hints(annotation)
            if part not in hints:
                raise unknown_key(where, part, annotation)
            annotation = hints[part]
        elif annotation is not Any:  # a mapping: any key, values of its value type
            annotation = typing.get_args(annotation)[1]
        where = f"{where}.{part}"
    return annotation


def override_value(text: str) -> Any:
    """An --set 'section.key=value' text's value as merge_raw reads it, by the key's type (a sweep's --grid values)."""
    (section, dotted), typed = _split_override(text)
    if section not in SECTIONS:
        raise ConfigError(f"--set {text!r}: unknown section '{section}'{did_you_mean(section, SECTIONS)}")
    return _override_value(text, typed, _check_override_path(text, section, dotted.split(".")))


def merge_raw(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """--set overrides on top of the file's mapping, each value read by its key's type (_override_value). A dotted
    key into a nested group (slurm.container.image=x, slurm.setup_vars.venv=/v, trainer.grpo.loss_type=dapo) sets that
    one key and keeps the group's others, as the flat keys do in a section; a mapping value (slurm.container={image: x})
    replaces the whole group."""
    merged = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    for text in overrides:
        (section, dotted), typed = _split_override(text)
        if section not in SECTIONS:
            raise ConfigError(
                f"--set {text!r}: unknown section '{section}'{did_you_mean(section, SECTIONS)}; sections: {', '.join(SECTIONS)}"
            )
        path = dotted.split(".")
        value = _override_value(text, typed, _check_override_path(text, section, path))
        merged.setdefault(section, {})
        if not isinstance(merged[section], dict):
            raise ConfigError(f"section '{section}' must be a mapping")
        node, where = merged[section], section
        for part in path[:-1]:
            where = f"{where}.{part}"
            child = node.get(part)
            if child is None:
                child = {}
            elif not isinstance(child, dict):
                raise ConfigError(f"--set {text!r}: {where} is {child!r} in the config, not a mapping; set it as a mapping there")
            node[part] = child = dict(child)  # a copy: the file's own mapping stays as read
            node = child
        node[path[-1]] = value
    return merged


def from_dict(raw: dict[str, Any]) -> JobConfig:
    if not isinstance(raw, dict):
        raise ConfigError(f"the config must be a mapping of sections ({', '.join(SECTIONS)}), got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(SECTIONS))
    if unknown:
        hint = did_you_mean(unknown[0], SECTIONS)
        raise ConfigError(f"unknown section '{unknown[0]}'{hint}; valid sections: {', '.join(SECTIONS)}")
    cfg = JobConfig(**{name: _build(cls, name, raw.get(name)) for name, cls in SECTIONS.items()})
    validate(cfg)
    return cfg


def load(path: str | Path | None, overrides: list[str] | None = None) -> JobConfig:
    """Read a YAML config (and the files its `base:` names), apply --set overrides, validate. path=None starts from
    the defaults."""
    raw = read_raw(Path(path)) if path is not None else {}
    return from_dict(merge_raw(raw, overrides or []))


def deep_merge(under: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` on top of `under`: mappings merge key by key at every depth; any other value (lists too) replaces."""
    out = dict(under)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


# ----------------------------------------------------------------------------- the YAML reader


class _Int(int):
    """An int as YAML read it, with the text the user wrote (a string field takes the text: account 0123 stays 0123)."""

    text: str


class _Float(float):
    """A float as YAML read it, with the text the user wrote (partition 1.10 stays 1.10)."""

    text: str


class ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader without YAML 1.1's surprises, for config files and --set values alike: no base-60 numbers
    (time: 24:00:00 would be 86400), no octal or hex (0123 stays the text 0123), no dates, scientific notation
    without a dot is a float (1e-5), and a key given twice in one mapping is refused (PyYAML keeps the last)."""

    yaml_implicit_resolvers = {
        k: [
            (tag, rx)
            for tag, rx in v
            if tag not in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float", "tag:yaml.org,2002:timestamp")
        ]
        for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                line = key_node.start_mark.line + 1
                raise ConfigError(
                    f"key {key!r} is given twice in one mapping (line {seen[key]} and line {line}); keep one of them"
                )
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)

    def construct_int(self, node: yaml.ScalarNode) -> _Int:
        value = _Int(node.value.replace("_", ""))
        value.text = node.value
        return value

    def construct_float(self, node: yaml.ScalarNode) -> _Float:
        value = _Float(self.construct_yaml_float(node))
        value.text = node.value
        return value


ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(r"^[-+]?(?:0|[1-9][0-9_]*)$"), list("-+0123456789"))
ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?|[-+]?\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)
ConfigLoader.add_constructor("tag:yaml.org,2002:int", ConfigLoader.construct_int)
ConfigLoader.add_constructor("tag:yaml.org,2002:float", ConfigLoader.construct_float)


def read_yaml(text: str) -> Any:
    """YAML text read by ConfigLoader (the one reader of configs and --set values)."""
    return yaml.load(text, Loader=ConfigLoader)  # noqa: S506 (a SafeLoader subclass)


def yaml_error(e: yaml.YAMLError) -> str:
    """PyYAML's several-line message as one line: the problem and where."""
    mark = getattr(e, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{getattr(e, 'problem', None) or e.__class__.__name__}{where}"


def written(value: Any) -> str:
    """A scalar as the user wrote it: the YAML text of a number, else str()."""
    return getattr(value, "text", None) or str(value)


def plain(value: Any) -> Any:
    """A YAML value with ConfigLoader's number types made plain int/float again (for dumping and plan.json)."""
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, _Int):
        return int(value)
    return float(value) if isinstance(value, _Float) else value


def read_raw(path: Path, chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """One config file as a plain mapping, its `base:` files (one path or a list, relative to this file's folder)
    deep-merged under it in order, recursively. `chain`: the files that led here, to name a cycle."""
    where = f" (base of {chain[-1]})" if chain else ""
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r}{where} not found; pass a YAML file such as configs/smoke_cpu.yaml")
    real = path.resolve()
    if real in chain:
        raise ConfigError("config base cycle: " + " -> ".join(str(p) for p in (*chain, real)) + "; remove one of the base: lines")
    try:
        raw = read_yaml(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(path)!r}{where} is not valid YAML: {yaml_error(e)}") from None
    except ConfigError as e:
        raise ConfigError(f"config file {str(path)!r}{where}: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path!s}{where} must hold a mapping of sections ({', '.join(SECTIONS)})")
    bases = raw.pop("base", None) or []
    if isinstance(bases, str):
        bases = [bases]
    if not isinstance(bases, list) or not all(isinstance(b, str) and b for b in bases):
        raise ConfigError(f"config file {path!s}: base must be a file path or a list of them, got {bases!r}")
    merged: dict[str, Any] = {}
    for b in bases:
        merged = deep_merge(merged, read_raw(real.parent / b, (*chain, real)))
    return deep_merge(merged, raw)


def rebuild(d: dict[str, Any]) -> JobConfig:
    """The typed config back from its plain form in plan.json. It was validated when the plan was made,
    so nothing is checked again (the nodes may lack TRL's source that the grpo check reads)."""

    def typed(cls: type, raw: dict[str, Any]) -> Any:
        hints = _hints(cls)
        return cls(**{k: typed(hints[k], v) if dataclasses.is_dataclass(hints[k]) else v for k, v in raw.items()})

    return JobConfig(**{name: typed(cls, d[name]) for name, cls in SECTIONS.items()})


def to_dict(cfg: JobConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def non_defaults(cfg: JobConfig, redact: bool = False) -> list[tuple[str, Any]]:
    """(dotted key, value) of every setting not at its default, in the config's order: what a run sets, from its
    YAML, its base files and --set (dry-run shows these before the whole resolved config). redact: as to_yaml."""
    mine, default = to_dict(cfg), to_dict(JobConfig())
    if redact:
        mine["vllm"]["extra_args"] = redact_argv(mine["vllm"]["extra_args"])

    def walk(a: dict[str, Any], b: dict[str, Any], prefix: str) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        for k, v in a.items():
            if isinstance(v, dict) and isinstance(b.get(k), dict) and v and b[k]:
                out += walk(v, b[k], f"{prefix}{k}.")
            elif v != b.get(k):
                out.append((f"{prefix}{k}", v))
        return out

    return walk(mine, default, "")


def to_yaml(cfg: JobConfig, redact: bool = False) -> str:
    """The config as YAML. redact: for showing it (dry-run), the value of a secret flag in vllm.extra_args
    (--hf-token X, --api-key=X) is *** as in the shown commands; the job folder's copy keeps it (resume reads it).
    Each value stays on its key's line however long (PyYAML folds a plain string past 80 columns, e.g. a deep job_dir
    with a space): `grep job_dir config.yaml` finds the whole path."""
    d = to_dict(cfg)
    if redact:
        d["vllm"]["extra_args"] = redact_argv(d["vllm"]["extra_args"])
    return yaml.safe_dump(d, sort_keys=False, default_flow_style=False, width=float("inf"))


# Secrets that must never be written into the job folder, the sbatch text or the logs. The job
# inherits them from the submitting environment through SLURM (sbatch exports the environment).
SECRET_ENV_MARKERS = ("TOKEN", "SECRET", "PASSWORD", "API_KEY", "CREDENTIAL")


def is_secret(name: str) -> bool:
    up = name.upper()
    return any(m in up for m in SECRET_ENV_MARKERS)


def redact_argv(argv: list[str]) -> list[str]:
    """The argv as it may be shown (dry-run, log headers): the value after a flag such as --hf-token or
    --api-key, or in --flag=value form, is replaced by ***."""
    out, hide = [], False
    for a in argv:
        flag, eq, _ = a.partition("=")
        if hide:
            out.append("***")
            hide = False
        elif a.startswith("--") and is_secret(flag.replace("-", "_")):
            out.append(f"{flag}=***" if eq else a)
            hide = not eq
        else:
            out.append(a)
    return out


# ----------------------------------------------------------------------------- validation

_TIME = re.compile(r"^(\d+|\d+:\d{2}|\d+:\d{2}:\d{2}|\d+-\d+|\d+-\d+:\d{2}|\d+-\d+:\d{2}:\d{2})$")
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_PROFILE = re.compile(r"^[A-Za-z0-9_-]+$")
_FLAG = re.compile(r"^[a-z][a-z0-9-]*$")


_MEM = re.compile(r"^\d+[KMGTkmgt]?$")
_SLURM_NAME = re.compile(r"^[\x20-\x7e]{0,256}$")  # SLURM's names are ASCII; quoting keeps the rest safe


def time_seconds(text: str) -> int | None:
    """A SLURM time limit (MM, MM:SS, HH:MM:SS, D-HH[:MM[:SS]]) in seconds; None if a minute or second is >= 60.
    The caller has matched _TIME."""
    days, _, rest = text.rpartition("-") if "-" in text else ("0", "", text)
    parts = [int(x) for x in rest.split(":")]
    if "-" in text:  # D-HH, D-HH:MM, D-HH:MM:SS
        parts += [0] * (3 - len(parts))
    elif len(parts) == 1:  # MM
        parts = [0, parts[0], 0]
    elif len(parts) == 2:  # MM:SS
        parts = [0, *parts]
    h, m, sec = parts
    if sec >= 60 or (m >= 60 and (rest.count(":") == 2 or "-" in text)):  # MM and MM:SS take any minutes
        return None
    return int(days or 0) * 86400 + h * 3600 + m * 60 + sec


SBATCH_OWNED = {
    "job-name": "job.name",
    "nodes": "slurm.nodes",
    "time": "slurm.time",
    "partition": "slurm.partition",
    "account": "slurm.account",
    "qos": "slurm.qos",
    "constraint": "slurm.constraint",
    "mem": "slurm.mem",
    "cpus-per-task": "slurm.cpus_per_task",
    "exclusive": "slurm.exclusive",
    "signal": "slurm.signal_seconds",
    "requeue": "slurm.requeue",
    "no-requeue": "slurm.requeue",
    **dict.fromkeys(("gpus-per-node", "gpus", "gpus-per-task", "gres"), "slurm.gpus_per_node"),
    **dict.fromkeys(("ntasks", "ntasks-per-node", "ntasks-per-gpu", "tres-per-task"), "the launcher (one task per node)"),
    "gpus-per-socket": "slurm.gpus_per_node",
    "export": "the launcher (the job needs its environment: PATH, the venv, secrets)",
    **dict.fromkeys(("output", "error", "open-mode"), "the launcher (logs go to the job folder)"),
    "array": "slurm-grpo sweep",
    **dict.fromkeys(("container-image", "container-mounts", "container-workdir"), "slurm.container"),
}
"""sbatch flags the launcher writes itself -> the key that sets them (slurm.extra_sbatch may not repeat them)."""


def check_extra_sbatch_key(key: str, s: SlurmConfig) -> None:
    """An extra_sbatch key is a long sbatch flag (no dashes) the launcher does not write itself."""
    flag = key.replace("_", "-")
    if not _FLAG.match(flag) or len(flag) < 2:
        raise ConfigError(f"slurm.extra_sbatch key {key!r} must be a long sbatch flag name without the dashes, e.g. reservation")
    if flag != key:
        raise ConfigError(f"slurm.extra_sbatch key {key!r}: sbatch flags use dashes; write {flag}")
    owner = SBATCH_OWNED.get(flag) or next((o for f, o in SBATCH_OWNED.items() if f.startswith(flag)), None)
    if flag == "gres" and "gpu" not in str(s.extra_sbatch[key]):
        owner = None  # other generic resources (gres: nvme) are the user's
    if owner:
        raise ConfigError(f"slurm.extra_sbatch.{key} is written by slurm-grpo from {owner}; set that instead and remove it")
    if flag in ("mem-per-cpu", "mem-per-gpu") and s.mem:
        raise ConfigError(f"slurm.extra_sbatch.{key} and slurm.mem exclude each other in sbatch; keep one")
    if flag == "cpus-per-gpu" and s.cpus_per_task:
        raise ConfigError(f"slurm.extra_sbatch.{key} and slurm.cpus_per_task exclude each other in sbatch; keep one")


_VLLM_DP = "slurm-grpo (one server per node, its engines from vllm.data_parallel_size)"
VLLM_OWNED = {
    "model": "vllm.model",
    "host": "slurm-grpo (127.0.0.1 only: the dev routes must stay private)",
    "port": "vllm.port",
    "tensor-parallel-size": "vllm.tensor_parallel_size",
    "tp": "vllm.tensor_parallel_size",
    "data-parallel-size": "vllm.data_parallel_size",
    "dp": "vllm.data_parallel_size",
    **dict.fromkeys(("pipeline-parallel-size", "pp"), "slurm-grpo (no pipeline parallelism: TP x DP fill the server's GPUs)"),
    **dict.fromkeys(("enable-expert-parallel", "ep"), "vllm.enable_expert_parallel"),
    "enable-return-routed-experts": "trainer.routing_replay",
    **dict.fromkeys(("nnodes", "n", "node-rank", "r", "master-addr", "master-port", "headless"), _VLLM_DP),
    **dict.fromkeys(
        ("data-parallel-" + f for f in ("rank", "start-rank", "size-local", "address", "rpc-port", "backend")), _VLLM_DP
    ),
    **dict.fromkeys(("data-parallel-hybrid-lb", "data-parallel-external-lb", "data-parallel-multi-port-external-lb"), _VLLM_DP),
    **dict.fromkeys(("dpn", "dpr", "dpl", "dpa", "dpp", "dpb", "dph", "dpe", "dpm"), _VLLM_DP),
    **dict.fromkeys(("gpu-memory-utilization", "device-memory-utilization"), "vllm.gpu_memory_utilization"),
    "dtype": "vllm.dtype",
    "max-model-len": "vllm.max_model_len",
    "logprobs-mode": "slurm-grpo (parity needs processed_logprobs)",
    "weight-transfer-config": "vllm.weight_transfer_backend",
    "seed": "trainer.seed",
    **dict.fromkeys(("enable-lora", "max-lora-rank", "max-loras", "fully-sharded-loras"), "trainer.lora.r"),
    "served-model-name": "vllm.model (the ranks ask for it by that name)",
    **dict.fromkeys(
        ("worker-cls", "distributed-executor-backend", "disable-custom-all-reduce"), "job.emulate_gpus (and the launcher)"
    ),
    **dict.fromkeys(("max-cudagraph-capture-size", "cudagraph-capture-sizes"), "vllm.cudagraph_max_size"),
}
"""vLLM api_server flags the launcher passes itself (or whose placement it decides) -> the key that sets them
(vllm.extra_args may not repeat them). tests/unit/test_config_owned_flags.py renders the server's command for
several plans and checks each flag in it is here."""


def owned_vllm_flag(arg: str) -> str | None:
    """The key owning a vLLM flag; None for the user's own flags. Every spelling vLLM's parser takes counts:
    --port, --port=9000, --tensor_parallel_size, -tp, --no-enable-lora, the dotted JSON form
    --weight-transfer-config.backend, and unique prefixes (argparse's allow_abbrev: --tensor-parallel 2)."""
    name = arg.lstrip("-").partition("=")[0].partition(".")[0].replace("_", "-")
    if not name:
        return None
    for candidate in (name, name.removeprefix("no-")):
        if candidate in VLLM_OWNED:
            return VLLM_OWNED[candidate]
    return next((o for f, o in VLLM_OWNED.items() if f.startswith(name)), None)


def _positive(where: str, value: int | float, fix: str) -> None:
    if value <= 0:
        raise ConfigError(f"{where} must be positive, got {value}; {fix}")


def _annotations(path: Path, classes: tuple[str, ...]) -> dict[str, str]:
    """Field name -> annotation source of the named dataclasses in one Python file, read with ast (nothing imported)."""
    out: dict[str, str] = {}
    if not path.is_file():
        return out
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name in classes:
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    out[item.target.id] = ast.unparse(item.annotation)
    return out


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


@functools.cache
def grpo_config_annotations() -> dict[str, str] | None:
    """trl.GRPOConfig's fields (its own, TRL's base config's, transformers' TrainingArguments') -> annotation source,
    read from the installed sources without importing them (importing TRL imports torch, which a login node may not
    have). None when TRL is not installed."""
    trl, tf = _package_dir("trl"), _package_dir("transformers")
    if trl is None:
        return None
    out = _annotations(tf / "training_args.py", ("TrainingArguments",)) if tf else {}
    out |= _annotations(trl / "trainer/base_config.py", ("_BaseConfig",))
    out |= _annotations(trl / "trainer/grpo_config.py", ("GRPOConfig",))
    return out or None


def grpo_config_fields() -> set[str] | None:
    """Field names of trl.GRPOConfig and its parents (see grpo_config_annotations)."""
    found = grpo_config_annotations()
    return set(found) if found is not None else None


GRPO_OWNED = {
    **dict.fromkeys(("use_vllm", "vllm_mode", "vllm_server_base_url", "vllm_server_host", "vllm_server_port"), "servers"),
    "vllm_gpu_memory_utilization": "vllm.gpu_memory_utilization",
    "vllm_tensor_parallel_size": "vllm.tensor_parallel_size",
    "output_dir": "job.job_dir",
    "run_name": "job.name",
    "use_cpu": "job.device",
    **dict.fromkeys(("fsdp", "fsdp_config", "deepspeed", "accelerator_config", "parallelism_config"), "trainer.fsdp"),
    **dict.fromkeys(("fp16", "bf16", "fp16_full_eval", "bf16_full_eval"), "trainer.dtype"),
    **dict.fromkeys(("save_strategy", "save_only_model", "save_on_each_node"), "trainer.save_steps"),
    "save_total_limit": "trainer.keep_checkpoints",
    "resume_from_checkpoint": "trainer.resume",
    "num_train_epochs": "trainer.max_steps",
    "report_to": "trainer.report_to",
    "gradient_checkpointing": "trainer.activation_checkpointing",
    "vllm_max_model_length": "vllm.max_model_len",
    **dict.fromkeys(("logging_steps", "logging_strategy", "disable_tqdm"), "slurm-grpo (metrics every step)"),
    **dict.fromkeys(("dataloader_num_workers", "local_rank", "ddp_backend", "ddp_timeout"), "slurm-grpo"),
    **dict.fromkeys(("push_to_hub", "hub_model_id", "hub_strategy", "hub_token", "hub_private_repo"), "hub"),
    "log_completions_hub_repo": "hub",
    **dict.fromkeys(("eval_strategy", "eval_steps", "do_eval"), "trainer.eval.every_steps"),
    "eval_on_start": "trainer.eval.before_training",
    "num_generations_eval": "trainer.eval.samples_per_prompt",
    "per_device_eval_batch_size": "eval",
    "auto_find_batch_size": "batch",
}
"""trl.GRPOConfig fields trainer.grpo may not set -> the key that decides it, or a reason named in _GRPO_WHY (set by
the launcher itself, or not supported, and what to use instead)."""
_GRPO_WHY = {
    "servers": "slurm-grpo points TRL at its own vLLM server on each node (the vllm section)",
    "slurm-grpo (metrics every step)": "slurm-grpo logs every step (metrics.jsonl, the stall watchdog need it)",
    "slurm-grpo": "slurm-grpo sets it for its own torchrun and FSDP2",
    "hub": "the nodes run offline; the trained model is JOB/model (or `slurm-grpo export`), upload it yourself",
    "eval": "slurm-grpo runs the evaluation itself (on the vLLM servers); set trainer.eval (its dataset, samples_per_prompt)",
    "batch": "the batch is planned from trainer.per_device_train_batch_size (checked against memory)",
}
GRPO_ELSEWHERE = {"eval_dataset": "trainer.eval.dataset (a file read on the nodes)"}
"""trl.GRPOTrainer arguments (not GRPOConfig fields) users reach for in trainer.grpo -> the key to set instead."""
GRPO_VALUE_REFUSED = {
    ("remove_unused_columns", True): "the rewards read the dataset's other columns (e.g. solution); leave it false",
}
"""trainer.grpo values the project cannot run with -> why (the key itself is the user's)."""
GRPO_CHOICES: dict[str, tuple[Any, ...]] = {
    "loss_type": ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"),
    "scale_rewards": ("group", "batch", "none", True, False),
    "importance_sampling_level": ("token", "sequence"),
    "multi_objective_aggregation": ("sum_then_normalize", "normalize_then_sum"),
    "vllm_importance_sampling_mode": ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"),
}
"""The values TRL 1.16 accepts for its choice fields (tests/unit/test_config.py checks them against TRL's own help)."""


def _grpo_value_problem(key: str, value: Any, annotation: str) -> str | None:
    """Why a trainer.grpo value would fail in GRPOConfig, by the field's annotation; None if it looks right."""
    if key in GRPO_CHOICES:
        ok = GRPO_CHOICES[key]
        if not any(value == c and type(value) is type(c) for c in ok):
            return f"must be one of {', '.join(map(str, ok))}"
        return None
    if value is None:
        return None if "None" in annotation or "Optional" in annotation else "may not be null"
    kinds = set(re.findall(r"\b(bool|int|float|str|list|dict)\b", annotation))
    if not kinds or "Any" in annotation or "Union" in annotation:
        return None
    if isinstance(value, bool):
        return None if "bool" in kinds else f"must be {annotation}, got {value!r}"
    checks: dict[str, type | tuple[type, ...]] = {"int": int, "float": (int, float), "str": str, "list": list, "dict": dict}
    if any(isinstance(value, checks[k]) for k in kinds if k != "bool"):
        return None
    return f"must be {annotation}, got {value!r}"


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_CONTROL_NAMES = {"\n": "a newline (\\n)", "\r": "a carriage return (\\r)", "\x00": "a NUL character (\\0)", "\t": "a tab (\\t)"}
PASSED_AS_DATA = {"trainer.grpo", "trainer.system_prompt", "trainer.chat_template"}
"""Keys whose values only travel as data (plan.json -> trl.GRPOConfig) and never reach the sbatch text or a command
line: a generation stop string may well be a newline there."""


def control_character(value: str) -> str | None:
    """The first control character in value, named for an error message (a newline, a tab, ...); None if none."""
    m = _CONTROL.search(value)
    if m is None:
        return None
    return _CONTROL_NAMES.get(m.group(), f"a control character (\\x{ord(m.group()):02x})")


def _refuse_control_characters(where: str, value: Any) -> None:
    fix = "config values reach the sbatch header and command lines, remove it"
    if isinstance(value, str):
        bad = control_character(value)
        if bad:
            raise ConfigError(f"{where}: contains {bad}; {fix}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _refuse_control_characters(f"{where}[{i}]", item)
    elif isinstance(value, dict):
        for k, item in value.items():
            bad = control_character(str(k))
            if bad:
                raise ConfigError(f"{where} key {str(k)!r}: contains {bad}; {fix}")
            _refuse_control_characters(f"{where}.{k}", item)
    elif dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            if f"{where}.{f.name}" not in PASSED_AS_DATA:
                _refuse_control_characters(f"{where}.{f.name}", getattr(value, f.name))


def _port(where: str, port: int) -> None:
    if not 1024 <= port <= 65535:
        raise ConfigError(f"{where} ({port}) must be between 1024 and 65535 (ports below 1024 need root)")


def _check_reward_funcs(entries: list[str], environment: str | dict[str, str] = "", key: str = "trainer.reward_funcs") -> None:
    """Each entry a built-in reward's name or 'pkg.module:function'; key names the list in the messages."""
    if not entries and not environment:  # an environment may own the reward (get_reward), checked on the ranks' side
        raise ConfigError(f"{key} is empty; name at least one reward, e.g. [letter_a_fraction] or pkg.module:function")
    for r in entries:
        if ":" in r:
            _check_dotted(f"{key} entry", r)
        elif r not in BUILTIN_REWARDS:
            shown = r if len(r) <= 24 else r[:21] + "..."
            near = did_you_mean(r, BUILTIN_REWARDS)
            raise ConfigError(
                f"{key} entry {shown!r} is not a built-in reward"
                + (near or f" ({', '.join(BUILTIN_REWARDS)}) nor 'pkg.module:function'")
            )


def _check_data_fields(t: TrainerConfig) -> None:
    """trainer.columns, trainer.chat_template: well formed (whether the dataset has the columns is the submit check's)."""
    for run_name, stored in t.columns.items():
        if not run_name.isidentifier() or not stored:
            raise ConfigError(
                f"trainer.columns {run_name!r}: {stored!r} must map a run name (an identifier such as prompt or solution) "
                "to the dataset's column, e.g. {prompt: question}"
            )
    if len(set(t.columns.values())) < len(t.columns):
        raise ConfigError(f"trainer.columns {t.columns} maps one dataset column to two names; give each its own")
    if t.chat_template and not t.chat_template.strip():
        raise ConfigError('trainer.chat_template is blank; give a Jinja file path or the template text, or "" for the model\'s')


def _check_dotted(where: str, entry: str) -> None:
    mod, _, fn = entry.partition(":")
    if not re.match(r"^[A-Za-z_][\w.]*$", mod) or not fn.isidentifier():
        raise ConfigError(f"{where} {entry!r} is not a dotted path 'pkg.module:function'")


def _check_agents(t: TrainerConfig) -> None:
    """trainer.tools, trainer.environment, trainer.rollout_func: dotted paths, in a combination that runs."""
    for entry in t.tools:
        _check_dotted("trainer.tools entry", entry)
    envs = t.environment if isinstance(t.environment, dict) else ({"": t.environment} if t.environment else {})
    for name, entry in envs.items():
        _check_dotted("trainer.environment" + (f".{name}" if name else ""), entry)
    if isinstance(t.environment, dict) and not t.environment:
        raise ConfigError('trainer.environment is an empty mapping; give name: pkg.module:factory entries, or "" for none')
    if t.rollout_func:
        _check_dotted("trainer.rollout_func", t.rollout_func)
        if t.tools or t.environment:
            raise ConfigError(
                "trainer.rollout_func runs your own episode loop, so trainer.tools and trainer.environment would run a "
                "second one on its output; call your tools inside the rollout_func, or drop rollout_func"
            )
    if t.tool_timeout_s <= 0:
        raise ConfigError(f"trainer.tool_timeout_s must be positive, got {t.tool_timeout_s}; every tool call needs a deadline")
    if t.rollout_func and t.max_staleness:
        raise ConfigError(
            f"trainer.max_staleness ({t.max_staleness}) with a rollout_func is not supported: your loop runs inside the "
            "trainer's step, it cannot run ahead; set trainer.max_staleness: 0, or use trainer.tools/environment"
        )


def _check_grpo(grpo: dict[str, Any]) -> None:
    """trainer.grpo: no key the project decides (or a trainer.* key), each a trl.GRPOConfig field, each value of its type."""
    ours = {f.name for f in dataclasses.fields(TrainerConfig)}
    for key in sorted(grpo):
        if key in ours:
            raise ConfigError(f"trainer.grpo.{key} is a trainer key of its own: set trainer.{key} instead")
        if key in GRPO_ELSEWHERE:
            raise ConfigError(f"trainer.grpo.{key} is not a trl.GRPOConfig field; set {GRPO_ELSEWHERE[key]} instead")
        owner = GRPO_OWNED.get(key) or ("hub" if key.startswith("hub_") else None)
        if owner in _GRPO_WHY:
            raise ConfigError(f"trainer.grpo.{key}: {_GRPO_WHY[owner]}; remove it")
        if owner:
            raise ConfigError(f"trainer.grpo.{key} is set by slurm-grpo itself from {owner}; remove it")
        why = next((w for (k, v), w in GRPO_VALUE_REFUSED.items() if k == key and grpo[key] is v), None)
        if why:
            raise ConfigError(f"trainer.grpo.{key}: {grpo[key]!r} is not supported: {why}")
    known = grpo_config_annotations()
    if known is None:
        return
    for key in sorted(grpo):
        if key not in known:
            raise ConfigError(f"trainer.grpo.{key} is not a trl.GRPOConfig field{did_you_mean(key, known)}")
        problem = _grpo_value_problem(key, grpo[key], known[key])
        if problem:
            raise ConfigError(f"trainer.grpo.{key} {problem}")


def check_job(cfg: JobConfig) -> None:
    """The rules between keys: each section's check() has already passed."""
    s, v, t, j = cfg.slurm, cfg.vllm, cfg.trainer, cfg.job
    serving = v.tensor_parallel_size * v.data_parallel_size
    if s.layout == "shared":
        check_shared_layout(cfg)
    elif serving >= s.gpus_per_node and not (s.gpus_per_node == 1 and serving == 1):
        raise ConfigError(
            f"vllm.tensor_parallel_size x data_parallel_size ({v.tensor_parallel_size} x {v.data_parallel_size}) leaves "
            f"no trainer GPU on a {s.gpus_per_node}-GPU node; lower them or ask for more GPUs per node (slurm.gpus_per_node)"
        )
    seen: dict[int, str] = {}
    for name, port in (
        ("vllm.port", v.port),
        ("trainer.rendezvous_port", t.rendezvous_port),
        ("trainer.weight_transfer_port", t.weight_transfer_port),
    ):
        if port in seen:
            raise ConfigError(f"{name} and {seen[port]} are both {port}; every service on a node needs its own port")
        seen[port] = name
    if t.max_staleness and any(
        t.grpo.get(k, 1) != 1 for k in ("steps_per_generation", "num_iterations", "gradient_accumulation_steps")
    ):
        raise ConfigError(
            f"trainer.max_staleness {t.max_staleness} makes one generation per optimizer step: set steps_per_generation, "
            "num_iterations and gradient_accumulation_steps in trainer.grpo to 1"
        )
    limit = time_seconds(s.time)
    if limit and v.health_timeout_s >= limit:
        raise ConfigError(
            f"vllm.health_timeout_s ({v.health_timeout_s}) is not below slurm.time ({s.time} = {limit} s): the job would "
            "end before a slow server is declared failed; lower it or raise slurm.time"
        )
    if t.profile_steps and t.profile_steps[1] > t.max_steps:
        raise ConfigError(
            f"trainer.profile_steps {t.profile_steps} ends after trainer.max_steps ({t.max_steps}): its tables would never "
            "be written; profile steps up to max_steps"
        )
    if limit and s.signal_seconds >= limit:
        raise ConfigError(
            f"slurm.signal_seconds ({s.signal_seconds}) is not below slurm.time ({s.time} = {limit} s): the warning would "
            "come before the job starts; lower it or raise slurm.time"
        )
    if v.max_model_len and t.max_completion_length >= v.max_model_len:
        raise ConfigError(
            f"trainer.max_completion_length ({t.max_completion_length}) leaves no room for the prompt in "
            f"vllm.max_model_len ({v.max_model_len}); raise max_model_len or lower max_completion_length"
        )
    if v.dtype not in ("auto", t.dtype):
        raise ConfigError(
            f"vllm.dtype {v.dtype} differs from trainer.dtype {t.dtype}: parity after each push would fail; "
            f"set vllm.dtype: {t.dtype} (or auto)"
        )
    if j.device == "cpu" and v.weight_transfer_backend in ("nccl", "ipc"):
        raise ConfigError(
            f"vllm.weight_transfer_backend {v.weight_transfer_backend} needs GPUs; with job.device cpu use gloo (or auto)"
        )
    check_platform(cfg)  # job.platform (rocm's rules), slurm.stage_env/stage_dir, slurm.gpu_cores
    if t.routing_replay and j.device == "cpu":
        raise ConfigError(
            "trainer.routing_replay needs vLLM's Model Runner V2, GPU only (its Triton kernels); remove it with job.device cpu"
        )
    if t.routing_replay and any(
        a.lstrip("-").partition("=")[0].replace("_", "-") == "no-enable-prefix-caching" for a in v.extra_args
    ):
        raise ConfigError(
            "trainer.routing_replay needs vLLM's prefix caching (vLLM refuses routed experts without it); "
            "remove --no-enable-prefix-caching from vllm.extra_args"
        )
    if j.device == "cpu" and t.dtype != "float32":
        raise ConfigError(
            "trainer.dtype must be float32 with job.device cpu (vLLM's CPU build and gloo run float32 here); set trainer.dtype: float32"
        )


def check_shared_layout(cfg: JobConfig) -> None:
    """slurm.layout shared: every GPU holds an engine and a trainer rank, so TP must divide the node and DP follows."""
    s, v = cfg.slurm, cfg.vllm
    g, tp, dp = s.gpus_per_node, v.tensor_parallel_size, v.data_parallel_size
    if g % tp:
        raise ConfigError(
            f"slurm.layout shared puts vLLM engines of vllm.tensor_parallel_size ({tp}) GPUs on all {g} GPUs of a node: "
            f"TP must divide slurm.gpus_per_node; pick a TP that divides {g}"
        )
    if dp not in (1, g // tp):
        raise ConfigError(
            f"slurm.layout shared sets vLLM's data parallel size to GPUs / TP = {g} / {tp} = {g // tp}; "
            f"vllm.data_parallel_size {dp} says otherwise: remove it (or set it to {g // tp})"
        )


def check_lora(cfg: JobConfig) -> None:
    """LoRA's rules between sections (trainer.lora's own are LoraConfig.check)."""
    t = cfg.trainer
    if t.lora.enabled and t.beta:
        raise ConfigError(
            f"trainer.beta {t.beta:g} with trainer.lora: TRL would add a reference adapter to the model after it was sharded "
            "(FSDP2 would not manage it); set trainer.beta: 0 (the default) to train LoRA"
        )


# ----------------------------------------------------------------------------- platform rules (check_job calls these)


def check_platform(cfg: JobConfig) -> None:
    if cfg.job.platform == "rocm":
        check_rocm(cfg)
    check_stage(cfg)
    check_gpu_cores(cfg.slurm.gpu_cores, cfg.slurm.gpus_per_node)


def check_rocm(cfg: JobConfig) -> None:
    """What ROCm supports of the config, refused with the fix otherwise."""
    v, s = cfg.vllm, cfg.slurm
    if cfg.job.device != "cuda":
        raise ConfigError(
            "job.platform rocm needs job.device cuda (torch names AMD GPUs 'cuda' too); for CPU runs remove job.platform"
        )
    if s.layout == "shared" and s.gpus_per_node > 1:
        raise ConfigError(
            "slurm.layout shared on ROCm would put a vLLM data-parallel engine on every GCD (masked, which ROCm renumbers); "
            "use slurm.layout: split"
        )
    shared = s.gpus_per_node == 1 and v.tensor_parallel_size * v.data_parallel_size == 1
    b = v.weight_transfer_backend
    if b == "gloo":
        raise ConfigError("vllm.weight_transfer_backend gloo is for job.device cpu; on ROCm use nccl (an RCCL broadcast) or auto")
    if b == "ipc" and not shared:
        raise ConfigError(
            "vllm.weight_transfer_backend ipc (HIP IPC) works on ROCm only for vLLM and the trainer on one shared GCD "
            "(slurm.gpus_per_node: 1); with more GCDs use nccl or auto"
        )
    if b == "nccl" and shared:
        raise ConfigError(
            "vllm.weight_transfer_backend nccl (RCCL) needs the trainer on another GCD than vLLM (RCCL refuses two ranks "
            "on one device); on a one-GCD node use ipc (HIP IPC) or auto"
        )
    if v.data_parallel_size > 1:
        raise ConfigError(
            f"vllm.data_parallel_size {v.data_parallel_size} on ROCm: vLLM gives each DP engine its own device mask, "
            "which RCCL fails under; use 1 (raise tensor_parallel_size instead)"
        )


STAGE_VENV = (".tar", ".tar.gz", ".tgz")
STAGE_IMAGE = (".sif", ".sqsh", ".squashfs")
_STAGE_DIR = re.compile(r"^/([A-Za-z0-9._/-]|\$USER|\$SLURM_JOB_ID)+$")
_CORES = re.compile(r"^\d+(-\d+)?(,\d+(-\d+)?)*$")


def stage_kind(path: str) -> str:
    """venv or image, by the file's name; '' for anything else."""
    if path.endswith(STAGE_VENV):
        return "venv"
    return "image" if path.endswith(STAGE_IMAGE) else ""


def check_stage(cfg: JobConfig) -> None:
    s = cfg.slurm
    if not _STAGE_DIR.match(s.stage_dir) or "//" in s.stage_dir:
        raise ConfigError(
            f"slurm.stage_dir {s.stage_dir!r} must be an absolute node-local folder of letters, digits, . _ - / and "
            "only the variables $USER and $SLURM_JOB_ID, e.g. /tmp/slurm-grpo-$USER-$SLURM_JOB_ID"
        )
    if not s.stage_env:
        return
    kind = stage_kind(s.stage_env)
    if not s.stage_env.startswith("/") or not kind:
        raise ConfigError(
            f"slurm.stage_env {s.stage_env!r} must be an absolute path on the shared file system to a packed venv "
            f"({', '.join(STAGE_VENV)}) or an image ({', '.join(STAGE_IMAGE)})"
        )
    c = s.container
    if kind == "image" and (c.image != s.stage_env or c.runtime != "apptainer"):
        raise ConfigError(
            f"slurm.stage_env {s.stage_env} is an image: set slurm.container.image to the same file and "
            "slurm.container.runtime: apptainer (pyxis caches its images itself)"
        )
    if kind == "venv" and c.image:
        raise ConfigError(
            "slurm.stage_env is a packed venv but the job runs in a container (slurm.container.image); stage the image "
            "instead (slurm.stage_env: the .sif) or drop the container"
        )
    if kind == "venv" and "/" in cfg.job.python:
        raise ConfigError(
            f"job.python {cfg.job.python!r} is a path, so the staged venv (slurm.stage_env) would not be used; "
            "set job.python: python (the staged venv is first on PATH)"
        )


def check_gpu_cores(cores: list[str], gpus: int) -> None:
    if not cores:
        return
    if len(cores) != gpus:
        raise ConfigError(
            f"slurm.gpu_cores has {len(cores)} entries for {gpus} GPUs per node; give one core list per GPU in index "
            "order (e.g. 1-7) or none"
        )
    for i, c in enumerate(cores):
        if not _CORES.match(c.replace(" ", "")):
            raise ConfigError(f"slurm.gpu_cores[{i}] {c!r} is not a core list such as 1-7 or 0,2,4-6")


def validate(cfg: JobConfig) -> None:
    """Every check of a config whose values have their types (and choice fields a value of their menu)."""
    # first: a newline in any value (slurm.account: "acme\necho x\n#") would end the sbatch header there and run the
    # rest as shell on the batch host; sbatch would then drop every later #SBATCH line without a word
    for name in SECTIONS:
        _refuse_control_characters(name, getattr(cfg, name))
    for section in (cfg.slurm, cfg.vllm, cfg.trainer, cfg.job):
        section.check()
    check_job(cfg)
    check_lora(cfg)


def _choices_note(annotation: Any) -> str:
    """The reference's words for a choice field's values, from its Literal."""
    values = choices(annotation)
    if not values:
        return ""
    return ("Any of " if typing.get_origin(annotation) is list else "One of ") + ", ".join(f"`{c}`" for c in values) + ". "


def reference_markdown() -> str:
    """The README's config reference, generated from the dataclasses (tests check the README holds it)."""
    out = []
    for name, cls in SECTIONS.items():
        out.append(f"**`{name}`**\n\n| key | default | meaning |\n|---|---|---|")
        rows = [(f.name, f, field_docs(cls), _hints(cls)) for f in dataclasses.fields(cls)]
        while rows:
            key, f, docs, hints = rows.pop(0)
            ann = hints[f.name]
            if isinstance(ann, type) and dataclasses.is_dataclass(ann):  # a nested group: one row per key
                out.append(f"| `{key}` | | {docs.get(f.name, '')} |")
                rows[:0] = [(f"{key}.{g.name}", g, field_docs(ann), _hints(ann)) for g in dataclasses.fields(ann)]
                continue
            default = repr(_default(f)).replace("|", "\\|")
            meaning = _choices_note(ann) + docs.get(f.name, "")
            out.append(f"| `{key}` | `{default}` | {meaning.replace('|', '/')} |")
        out.append("")
    return "\n".join(out).strip()
