"""The server's start, sized to the run: what the launcher adds to each node's vLLM command so that a start costs less
and generation does not get slower, with the reason of each choice (dry-run prints `derivation_lines`).

Where a start went on the H200 (gpu/results/2026-12-04-round2-0.36b, 0.36 B body, healthy after 114.7 s): 25 s the API
server's imports, 21 s the model-class inspection (vLLM imports the model in a fresh Python process when its cache in
VLLM_CACHE_ROOT is cold: every job folder's first start), 22 s the engine core's start (`vllm serve` spawns it: a fresh
interpreter imports vLLM again), then 40 s of engine init: 3 s weights, 15.5 s torch.compile, about 11 s of Triton
kernels compiled at the warm-up, 5-7 s capturing CUDA graphs twice (memory profiling, then for real) over vLLM's 51
default sizes. A restart (same job folder) skipped the compile and the inspection (the caches are in the job folder)
but paid the imports and the spawn again: 63.6 s.

  engine_start  fork: the engine core is a copy of the API server with vLLM already imported (vllm.engine_start: fork;
                auto forks a one-worker server on CUDA: measured on an H100, 2026-12-06, engine core start 18-21 s -> 0,
                vLLM healthy 85-94 s -> 70 s, gpu/results/2026-12-06-agents; a TP or DP server keeps vLLM's spawn
                until its workers have been forked on GPUs)
  inspection    in the API server's own process, through the vLLM plugin (vllm.inspect_in_process)
  CUDA graphs   vllm.cudagraph_max_size 0 (the default): captured up to 2 x the sequences in flight per server,
                vLLM's own rule for max_num_seqs applied to the run's real concurrency rather than to max_num_seqs'
                default of 1024: a decode batch never exceeds the sequences in flight, so every decode batch keeps its
                graph (a mixed prefill step of more tokens than the size runs without one); on the H100 (the same
                runs, multi-turn agents: their tool turns' prefills ride beside decodes, the case a smaller size
                could slow) 11 sizes in 4 s against 51 in 8-9 s, generation within the spread of the default's runs

  LoRA graphs   trainer.lora with the adapter pushed: one set of CUDA graphs, with LoRA (LORA_ONE_GRAPH_SET)

  KV cache      vllm.kv_cache work (the default): where vLLM shares its GPU with the trainer, a KV cache that holds
                every sequence in flight at vllm.max_model_len (work_kv_bytes; launcher.node.kv_reuse passes it as
                --kv-cache-memory-bytes where it fits the server's share): no memory profiling, no profiling CUDA
                graph capture (17 s of a 7 B LoRA server's first start on an H100), and the rest of the GPU to the
                trainer

  GDN prefill   a model with Gated DeltaNet layers (Qwen3.5, Qwen3-Next): vLLM's Triton prefill kernel, see
                GDN_PREFILL_TRITON

None of it reaches a CPU build: it captures no graphs and always spawns (vLLM's CPU platform forces it). On ROCm, auto
leaves `vllm serve`'s spawn (vLLM's ROCm platform would fork if told: `fork` is not refused there).

  CPU eager     a CPU build runs the model eagerly (CPU_EAGER): vLLM's torch.compile is start cost there (a tiny model
                on 2 cores: healthy after 23-24 s eager against 46 s compiling, 30 s on a warm compile cache) and
                bought generation speed within the machine's spread; vllm.extra_args that decide the compilation win
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from launcher.core.lora import ADAPTER
from launcher.core.shape import ModelShape

if TYPE_CHECKING:
    from launcher.core.plan import Plan

START_METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"
"""How vLLM starts its engine core and workers (fork or spawn)."""

VLLM_MAX_CAPTURE = 512
"""vLLM 0.32's largest default capture size (1024 on Blackwell data-center GPUs): at or above it, vLLM's default stays."""

USER_GRAPH_ARGS = ("cudagraph", "--enforce-eager", "speculative")
"""vllm.extra_args that already decide the capture (any spelling naming cudagraph sizes or mode, or no graphs at all):
then the launcher adds none of its own (vLLM refuses the flag and the compilation config's field together); a
speculative decoding config too: its decode steps are sequences x (draft tokens + 1) tokens, which the size below does
not count."""

GDN_PREFILL_TRITON = "--additional-config.gdn_prefill_backend=triton"
"""vLLM 0.32 on Hopper picks FlashInfer's Gated DeltaNet prefill when asked "auto" without checking that FlashInfer is
installed (`_resolve_gdn_prefill_backend`, model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py), and the engine dies
at its warm-up's first prefill: `No module named 'flashinfer'` (H100, 2026-12-06, gpu/results/2026-12-06-moe). The
pinned stack has no FlashInfer; Triton's kernel (FLA's) is what vLLM runs on every other GPU. Where FlashInfer is
installed, `vllm.extra_args: [--additional-config.gdn_prefill_backend=flashinfer]` takes it back."""


LORA_ONE_GRAPH_SET = "--compilation-config.cudagraph_specialize_lora=false"
"""vLLM 0.32 with --enable-lora captures every CUDA graph size twice, with and without an active adapter
(`cudagraph_specialize_lora`, default true). With the adapter pushed (trainer.lora.push adapter) every request the
trainer sends names it (generation, parity probes, evaluation), so the graphs without LoRA are never replayed: one set
halves the capture (7 B, r 16, H100: 38 sizes in 18 s against the merged push's 19 sizes in 6 s, vLLM healthy 99.7 s
against 72.1 s; gpu/results/2026-12-07-ds3-lora-restart/). Model Runner V2, vLLM 0.32's GPU runner, keeps capturing
both sets with the flag off (38 sizes again, gpu/results/2026-12-07-resume-agents-7b/): the vLLM plugin completes it
(Env.LORA_ACTIVE_GRAPHS_ONLY, trainer.push.vllm_plugin.lora_graphs_active_only)."""


NO_JIT_WARMUP = "--kernel-config.enable_jit_warmup=false"
"""vLLM 0.32's Model Runner V2 runs, before its graph capture, prefill, decode and mixed batches with every sampling
feature on to JIT-compile Triton kernels (`warmup_kernels`, v1/worker/gpu/warmup.py). On a 7 B adapter's first start
(H100, 2026-12-07, gpu/results/2026-12-07-kv-work-jit-warmup/) that took 19-20 s, for kernels the trainer's requests
mostly never run: vLLM's own JIT monitor still caught the top-k log-softmax and LoRA shrink kernels compiling at the
first generation. Without it vLLM was healthy after 75.6 s, against 116.2 s with it and TRL 1.16 + peft's build of
119.5 s (engine init 47.4 against 77.8 s; imports and torch.compile about 15 s of the difference, the machine warmer).
The first step came 1.1 s later (vLLM healthy -> step 1 7.99 against 6.91 s); the step was unchanged. A restart finds
the kernels in the job folder's Triton cache either way. `vllm.extra_args: [--kernel-config.enable_jit_warmup=true]`
(or any kernel config of the user's) takes vLLM's warm-up back.
Only for dense GQA bodies (jit_warmup_off): the warm-up is the one run before the graph capture with real attention,
and an attention backend that grows vLLM's shared workspace on first use (decode context parallelism, TurboQuant KV
caches; v1/worker/workspace.py) would otherwise grow it during the capture and free what the MoE layers' captured
graphs point at (gpu_worker.py's own comment: "A workspace resize after capture frees what the graphs point at")."""

KEEP_WARMUP_ARGS = ("decode-context-parallel", "decode_context_parallel", "-dcp", "kv-cache-dtype", "kv_cache_dtype")
"""vllm.extra_args after which the warm-up stays on: attention backends that size vLLM's workspace at first use."""


def names_kernel_config(arg: str) -> bool:
    """An extra arg that sets vLLM's kernel config (JSON --kernel-config or dotted): vLLM keeps one of the two, so the
    launcher adds NO_JIT_WARMUP only where the user sets none."""
    return "kernel-config" in arg or "kernel_config" in arg


def jit_warmup_off(p: Plan) -> bool:
    """Whether the server skips vLLM's JIT kernel warm-up (NO_JIT_WARMUP): a CUDA GPU server of a dense model of one
    kind of GQA attention (no experts, MLA, mixed, hybrid or state-space layers: the bodies measured) whose
    vllm.extra_args set no kernel config and no KEEP_WARMUP_ARGS. CPU servers run eagerly; ROCm's kernels (aiter) have
    not been measured without it."""
    extra = p.config.vllm.extra_args
    if p.device == "cpu" or p.platform != "cuda":
        return False
    if any(names_kernel_config(a) or any(k in a for k in KEEP_WARMUP_ARGS) for a in extra):
        return False
    shape = ModelShape.read(p.config.vllm.model)
    return shape is not None and not (shape.experts or shape.kinds or shape.attention_weights or shape.mixed_attention)


DEFERRING_FLAGS = (LORA_ONE_GRAPH_SET, GDN_PREFILL_TRITON, NO_JIT_WARMUP)
"""Flags the launcher adds only where vllm.extra_args hold none of their kind: the user's own compilation or additional
config wins (not owned: launcher.core.config VLLM_OWNED does not refuse them)."""


CPU_EAGER = "--enforce-eager"
"""What a CPU build's server runs with: no torch.compile. Measured on 2 cores (the CI's kind of machine; the tiny Qwen2
of `make-tiny-model`, float32, max-model-len 256, 2026-12-07): healthy after 46 s compiling on a cold compile cache and
30 s on a warm one, 23-24 s eager; generation of 8 prompts x 8 samples, 16 and 128 tokens each, 0.13-0.21 s and
0.76-1.12 s compiled against 0.14-0.16 s and 0.83-0.86 s eager (one 1.47 s outlier): within the machine's spread, at
most a tenth slower, which a smoke or test-size run never wins back (configs/smoke_cpu.yaml's 30 steps of 64 x 16
tokens generate for about 5 s in all). A long run on CPU that wants vLLM's compile says so in vllm.extra_args
(USER_COMPILE_ARGS, e.g. -O2, vLLM's default level)."""

USER_COMPILE_ARGS = ("--enforce-eager", "optimization-level", "optimization_level")
"""vllm.extra_args that decide the compilation (as do -O<level> and a compilation config): then CPU_EAGER is not added, the
user's choice wins."""


def names_compilation_config(arg: str) -> bool:
    """An extra arg that sets vLLM's compilation config (JSON --compilation-config, dotted, or -cc)."""
    return "compilation-config" in arg or "compilation_config" in arg or arg == "-cc" or arg.startswith("-cc.")


def user_decides_compile(extra_args: list[str]) -> bool:
    return any(any(k in a for k in USER_COMPILE_ARGS) or a.startswith("-O") or names_compilation_config(a) for a in extra_args)


def cpu_eager(p: Plan) -> str | None:
    """Why the server runs eagerly (CPU_EAGER), None where it does not: not a CPU build, or vllm.extra_args decide the
    compilation."""
    if p.device != "cpu":
        return None
    if user_decides_compile(p.config.vllm.extra_args):
        return None
    return "CPU build: vLLM's torch.compile would cost a third to half of the start for little generation speed"


def training_sequences(p: Plan, steps: int) -> tuple[int, str]:
    """The training batches' sequences one node's server holds at once (those generated ahead included), and the sum."""
    t = p.config.trainer
    train = p.ranks_per_node * t.per_device_train_batch_size * steps * (t.max_staleness + 1)
    return train, (
        f"ranks per node x per_device_train_batch_size x steps per generation x (max_staleness + 1) = "
        f"{p.ranks_per_node} x {t.per_device_train_batch_size} x {steps} x {t.max_staleness + 1} = {train}"
    )


def in_flight(p: Plan, steps: int) -> tuple[int | None, str]:
    """The most sequences one node's server has at once, and the sum behind it; None where the launcher cannot know
    (a rollout_func of the user's, or an eval over a whole file). steps: optimizer steps per generation
    (launcher.core.plan.generation_steps, which imports this module)."""
    t = p.config.trainer
    if t.rollout_func:
        return None, "trainer.rollout_func sends requests of its own"
    train, why = training_sequences(p, steps)
    if not t.eval.enabled:
        return train, why
    if not t.eval.max_prompts:
        return None, "trainer.eval asks for every prompt of its file at once (set trainer.eval.max_prompts to bound it)"
    evals = t.eval.max_prompts * t.eval.samples_per_prompt
    if evals > train:
        return evals, f"eval: max_prompts x samples_per_prompt = {t.eval.max_prompts} x {t.eval.samples_per_prompt} = {evals}"
    return train, why


def capture_grid(n: int) -> int:
    """The smallest of vLLM's default capture sizes (1, 2, 4, then multiples of 8 below 256 and of 16 from 256) that
    is >= n: vLLM truncates a maximum off its grid down to the grid, which would leave the top batch without a graph."""
    if n <= 4:
        return 1 if n <= 1 else 2 if n == 2 else 4
    step = 8 if n < 256 else 16
    return -(-n // step) * step


def user_decides_graphs(extra_args: list[str]) -> bool:
    return any(any(k in a for k in USER_GRAPH_ARGS) for a in extra_args)


def capture_size(p: Plan, steps: int) -> tuple[int | None, str]:
    """--max-cudagraph-capture-size for the node's server (None: vLLM's default), and why."""
    v = p.config.vllm
    if p.device == "cpu":
        return None, "CPU build: no CUDA graphs"
    if user_decides_graphs(v.extra_args):
        return None, "vllm.extra_args decide the CUDA graphs"
    if v.cudagraph_max_size == -1:
        return None, "vllm.cudagraph_max_size -1: vLLM's default (0, the default, sizes them to the work)"
    if v.cudagraph_max_size > 0:
        size = capture_grid(v.cudagraph_max_size)
        return size, f"vllm.cudagraph_max_size {v.cudagraph_max_size}" + (
            f" on vLLM's grid: {size}" if size != v.cudagraph_max_size else ""
        )
    n, why = in_flight(p, steps)
    if n is None:
        return None, f"vLLM's default: {why}"
    size = capture_grid(2 * n)
    if size >= VLLM_MAX_CAPTURE:
        return None, f"vLLM's default: 2 x {n} sequences in flight reach its {VLLM_MAX_CAPTURE} ({why})"
    return size, f"2 x {n} sequences in flight per server, on vLLM's grid ({why})"


VLLM_HEADROOM_GB = 4.0
"""The one fit threshold for vLLM's weights (launcher.memory.vllm_weights_fit): its bf16 weights per GPU must leave
this much of the memory it gets (gpu_memory_utilization x the GPU) for the rest: its profile run's activations, CUDA
graphs and a KV cache (vLLM refuses to start with none). A fixed amount, not a share: Qwen3-30B-A3B at TP 1 on an 80
GB GPU (61 of 68 GB) runs. The refusal (memory_problems), the dry-run's line, the split/layout fits, simulate's TP
suggestion and a KV cache sized to the work (kv_share_left) all use it."""

KV_BLOCK_TOKENS = 128
"""A sequence holds whole KV cache blocks: vLLM's are 16 tokens on CUDA, 128 where FA4 serves head_dim 256 (Blackwell);
counting in the larger costs at most 127 tokens a sequence."""

KV_SPARE_SEQUENCES = 2
"""Beside the run's own sequences: the parity probe's (48 tokens) and one more (an evaluation's, a health check's)."""

USER_KV_ARGS = ("kv-cache", "kv_cache", "num-gpu-blocks", "num_gpu_blocks", "block-size", "block_size", "speculative")
"""vllm.extra_args that change what a sequence's KV cache costs or how much there is: then vLLM measures."""


def serving_bytes(p: Plan) -> int:
    """Bytes of one KV element as the server stores it: 4 where it serves float32, else 2 (auto: the model's own dtype,
    which the trainer's is held to; float32 counted where either says so)."""
    return 4 if "float32" in (p.config.vllm.dtype, p.config.trainer.dtype) else 2


def kv_sequences(p: Plan, steps: int) -> tuple[int | None, str]:
    """The sequences a node's server may hold KV cache for at once: in_flight's training batches, plus an evaluation's
    requests where trainer.eval runs (an evaluation's push pauses a batch generated ahead and resumes it beside the
    evaluation: both at once), or None and why."""
    n, why = in_flight(p, steps)
    e = p.config.trainer.eval
    if n is None or not e.enabled:
        return n, why
    train, why = training_sequences(p, steps)
    evals = e.max_prompts * e.samples_per_prompt
    return train + evals, f"{why} training + max_prompts x samples_per_prompt = {e.max_prompts} x {e.samples_per_prompt} eval"


def kv_share_left(p: Plan, gpu_bytes: int) -> int | None:
    """Bytes of one vLLM worker's share of its GPU (gpu_memory_utilization x gpu_bytes) left for a KV cache after its
    weights (in the serving dtype) and VLLM_HEADROOM_GB (activations, CUDA graphs); None without the model's shape."""
    shape = ModelShape.read(p.config.vllm.model)
    if shape is None:
        return None
    v = p.config.vllm
    weights = shape.vllm_weight_bytes(p.tensor_parallel_size, p.data_parallel_size, v.enable_expert_parallel, serving_bytes(p))
    return int(v.gpu_memory_utilization * gpu_bytes - weights - VLLM_HEADROOM_GB * 1e9)


def kv_size_given(p: Plan, node: int) -> bool:
    """Whether node `node`'s server start may be given a KV cache size (the work's, or an earlier start's measure:
    launcher.node.kv_reuse): it shares a CUDA GPU with the trainer (not an emulated node: it passes its own)."""
    return p.nodes[node].shared_gpu and p.device != "cpu" and p.platform == "cuda" and not p.emulated


def work_kv_bytes(p: Plan, steps: int) -> tuple[int | None, str]:
    """The KV cache each vLLM worker of a node's server needs for every sequence the run has in flight at
    vllm.max_model_len (vllm.kv_cache work: passed as --kv-cache-memory-bytes by launcher.node.kv_reuse, so vLLM skips
    its memory profiling), or None and why vLLM measures it instead. GQA attention only (2 x layers x KV heads per
    worker x head_dim per token): a sliding window or a quantized cache needs less, never more. steps: optimizer steps
    per generation (launcher.core.plan.generation_steps)."""
    v = p.config.vllm
    if p.device == "cpu":
        return None, "CPU build: its KV cache space is its own setting"
    if v.kv_cache == "measure":
        return None, "vllm.kv_cache measure"
    if any(k in a for a in v.extra_args for k in USER_KV_ARGS):
        return None, "vllm.extra_args decide the KV cache"
    if not v.max_model_len:
        return None, "vllm.max_model_len 0: vLLM derives the sequence length from the model"
    n, why = kv_sequences(p, steps)
    if n is None:
        return None, why
    shape = ModelShape.read(v.model)
    if shape is None:
        return None, "the model's config.json gives no shape"
    if shape.kinds or shape.attention_weights or shape.mixed_attention:
        return None, (
            "layers other than one kind of Llama-style attention (MLA, sliding-window beside full, hybrid, state-space, "
            "fused-qkv bodies): vLLM's profile sizes them"
        )
    kv_heads = max(1, shape.kv_heads // p.tensor_parallel_size)  # vLLM replicates KV heads over TP beyond their count
    per_token = 2 * shape.layers * kv_heads * shape.head_dim * serving_bytes(p)
    tokens = -(-v.max_model_len // KV_BLOCK_TOKENS) * KV_BLOCK_TOKENS
    seqs = n + KV_SPARE_SEQUENCES
    return seqs * tokens * per_token, (
        f"({n} sequences in flight + {KV_SPARE_SEQUENCES} spare) x {tokens} tokens x {per_token} bytes "
        f"({shape.layers} layers x K and V x {kv_heads} KV heads x {shape.head_dim} x {serving_bytes(p)} bytes); {why}"
    )


def engine_method(p: Plan) -> str | None:
    """VLLM_WORKER_MULTIPROC_METHOD for the server, None to leave vLLM's choice (spawn under `vllm serve`)."""
    how = p.config.vllm.engine_start
    if how != "auto":
        return how
    # auto: fork where it has run on a GPU (one worker, CUDA); vLLM's own choice elsewhere (its CPU build always
    # spawns, `vllm serve` spawns on ROCm unless told; TP/DP workers forked on GPUs have not run yet)
    one_worker = p.server_world == 1
    return "fork" if p.device != "cpu" and p.platform == "cuda" and one_worker else None


def gdn_prefill(p: Plan) -> str | None:
    """Why the server runs Triton's Gated DeltaNet prefill (GDN_PREFILL_TRITON), None where it does not: no GDN layer,
    no CUDA, or vllm.extra_args already hold an additional config (the user's choice: vLLM keeps one of a JSON
    --additional-config and a dotted one, so ours would drop theirs or be dropped)."""
    if p.device == "cpu" or p.platform != "cuda":
        return None
    if any("additional-config" in a or "additional_config" in a for a in p.config.vllm.extra_args):
        return None
    shape = ModelShape.read(p.config.vllm.model)
    if shape is None or not any("gated_deltanet" in k.name for k in shape.kinds):
        return None
    return "the model has Gated DeltaNet layers; vLLM's auto takes FlashInfer's kernel on Hopper, which the stack lacks"


def vllm_args(p: Plan, steps: int) -> list[str]:
    size, _ = capture_size(p, steps)
    graphs = [] if size is None else ["--max-cudagraph-capture-size", str(size)]
    eager = [CPU_EAGER] if cpu_eager(p) else []
    lora = [LORA_ONE_GRAPH_SET] if lora_graphs(p) else []
    warmup = [NO_JIT_WARMUP] if jit_warmup_off(p) else []
    return graphs + eager + lora + warmup + ([GDN_PREFILL_TRITON] if gdn_prefill(p) else [])


def lora_graphs(p: Plan) -> bool:
    """Whether the server captures one set of CUDA graphs, with LoRA (LORA_ONE_GRAPH_SET): a GPU server of an adapter
    push whose vllm.extra_args decide neither the graphs nor a compilation config (vLLM keeps one of a JSON
    --compilation-config and a dotted one)."""
    extra = p.config.vllm.extra_args
    if p.device == "cpu" or p.lora_push != ADAPTER or user_decides_graphs(extra):
        return False
    return not any(names_compilation_config(a) for a in extra)


NO_TORCH_COMPILE_ENV = {"TORCH_COMPILE_DISABLE": "1"}
"""Beside CPU_EAGER: torch.compile off in the server's processes. --enforce-eager leaves vLLM's sampler ops that are
compiled at their first call (vllm/v1/sample/ops/logprobs.py batched_count_greater_than, the rank of a requested
logprob: Inductor builds C++ for it); on 2 cores the first request asking for logprobs took 12.1 s against 0.04 s with
torch's own switch (the tiny model, 2026-12-07): the smoke run's evaluation before step 1 (its parity probe's prompt
logprobs) took 17 s. The op is a comparison and a sum, no slower eager."""


def vllm_env(p: Plan) -> dict[str, str]:
    """The engine core's start method, and torch.compile off where the server runs eagerly (NO_TORCH_COMPILE_ENV); the
    in-process inspection's switch is launcher.core.jobdir's Env (set by the command, launcher.node.commands: jobdir
    imports the plan, which imports this module)."""
    method = engine_method(p)
    return ({START_METHOD_ENV: method} if method else {}) | (NO_TORCH_COMPILE_ENV if cpu_eager(p) else {})


def derivation_lines(p: Plan, steps: int) -> list[str]:
    """The start's choices, one line each with its reason (dry-run prints them under the plan)."""
    v = p.config.vllm
    size, why = capture_size(p, steps)
    graphs = f"vLLM CUDA graphs up to batch {size}: {why}" if size else f"vLLM CUDA graphs: {why}"
    method = engine_method(p)
    how = "vllm.engine_start " + v.engine_start
    if p.device == "cpu":
        start = f"vLLM engine core as vLLM starts it ({how}: its CPU build always spawns)"
    elif method == "fork":
        start = f"vLLM engine core forked from the API server, vLLM already imported ({how})" + (
            "; a VLLM_WORKER_MULTIPROC_METHOD exported on the node wins over auto" if v.engine_start == "auto" else ""
        )
    elif method == "spawn":
        start = f"vLLM engine core spawned, a fresh interpreter ({how})"
    elif p.platform != "cuda":
        start = f"vLLM engine core as vLLM starts it ({how}: on ROCm `vllm serve` spawns it unless told otherwise)"
    else:
        start = (
            f"vLLM engine core as vLLM starts it, spawned ({how}: {p.tensor_parallel_size} x {p.data_parallel_size} "
            "workers; fork, about 20 s sooner, has run on one-worker servers only)"
        )
    inspect = (
        "vLLM inspects the model class in its API server process (vllm.inspect_in_process; a restart reads vLLM's cache)"
        if v.inspect_in_process
        else "vLLM inspects the model class in a fresh Python process on a cold cache (vllm.inspect_in_process false)"
    )
    gdn = gdn_prefill(p)
    lora = (
        [f"vLLM CUDA graphs with LoRA only ({LORA_ONE_GRAPH_SET}): every request names the pushed adapter"]
        if lora_graphs(p)
        else []
    )
    eager = cpu_eager(p)
    compiled = [f"vLLM runs the model eagerly ({CPU_EAGER}): {eager}"] if eager else []
    kv_bytes, kv_why = work_kv_bytes(p, steps)
    given = any(kv_size_given(p, n) for n in range(len(p.nodes)))
    kv = (
        [
            f"vLLM KV cache {kv_bytes / 2**30:.2f} GiB per worker, no memory profiling (vllm.kv_cache work; the node "
            f"passes it where it fits the server's share of the GPU, else vLLM measures): {kv_why}"
        ]
        if kv_bytes is not None and given
        else [f"vLLM KV cache measured by vLLM's profile: {kv_why}"]
        if given
        else []
    )
    warmup = (
        [f"vLLM skips its JIT kernel warm-up ({NO_JIT_WARMUP}): 19-20 s of a first start, kernels compiled at first use"]
        if jit_warmup_off(p)
        else []
    )
    return [graphs, start, inspect, *compiled, *lora, *kv, *warmup] + (
        [f"vLLM Gated DeltaNet prefill on Triton ({GDN_PREFILL_TRITON}): {gdn}"] if gdn else []
    )
