"""The only file that touches TRL's and transformers' internals (TRL 1.16.0, pinned in pyproject.toml). Each one is
pinned by tests/unit/test_trl_glue.py against the installed versions, so an upgrade that moves one fails there, naming
it, instead of deep in a job:

  1. trl.trainer.grpo_trainer.VLLMGeneration: the module-level name GRPOTrainer instantiates in server mode with its
     own keyword arguments (model=, accelerator=, processing_class=, temperature=, ...); `trl_generation_backend`
     binds it to the node-local adapter while the trainer is built.
  2. GRPOTrainer.vllm_generation: the backend it built; TRL calls `.generate(prompts=, images=, num_generations=,
     profiler=)` -> (prompt_ids, completion_ids, logprobs[seq][tok][k], logprob_token_ids), `.sync_weights()` when
     global_step changed, and `.vllm_client.get_server_info()` on the main process.
  3. Trainer.callback_handler.callbacks: the list the callbacks run in (`put_first`), and its on_log(args, state,
     control, logs), which `report` calls with an evaluation's figures; CallbackHandler.call_event passes
     model=, optimizer=, lr_scheduler= to every event, and Trainer's training loop points the handler at its own
     model, optimizer and scheduler before on_train_begin (the project's callback takes them from there for resume
     and for every checkpoint it writes at on_step_end).
  4. GRPOTrainer._get_train_sampler(dataset=None): replaced on the instance (`replace_train_sampler`), before
     train() builds the dataloader with it (the resume cursor).
  5. GRPOTrainer.get_train_dataloader(): wrapped on the instance (`wrap_train_dataloader`: the lookahead). This one
     binding stays after construction: TRL builds the dataloader inside train(), and only this hook reaches it
     (trainer.data.LookaheadPrompts.attach; the rollout holds the LookaheadPrompts from before the trainer).
  6. GRPOTrainer._tokenize_prompts(prompts) -> (prompt ids, ...): how TRL tokenizes before it calls the backend.
  7. GRPOTrainer._step: the micro-step counter TRL regenerates by (`_step % (steps_per_generation x num_iterations)`);
     `set_micro_step` puts a resumed run where the uninterrupted one was.
  8. transformers' PreTrainedModel._init_weights(module): computes non-persistent buffers (rotary caches).
  9. model._is_distributed_loading_by_transformers: transformers' Trainer leaves a model that set it unwrapped (no
     DDP/FSDP on top of ours); `mark_self_sharded` sets it.
 10. GRPOConfig (`grpo_config`): public, but the options the project sets are named here only.
 11. GRPOTrainer(tools=, environment_factory=, rollout_func=): TRL's multi-turn arguments (public, "experimental"),
     passed by `build_trainer`'s `agents`.
 12. GRPOTrainer._generate(prompts) -> (prompt_ids, completion_ids, tool_mask, completions, logprobs, extra_fields,
     images, tool_images): wrapped on the instance (`after_generate`), where an episode batch is complete (its turns
     are counted from tool_mask: 0 on tool-result tokens).
 13. GRPOTrainer._metrics[mode][name]: values the trainer averages into its next log record (`log_metric`).
 14. GRPOTrainer._compute_loss(model, inputs): inputs["tool_mask"] is the mask of tool-result tokens that reaches the
     loss (`before_loss`; the integration tier reads it there).
 15. GRPOTrainer._generate_and_score_completions(inputs): the batch's dataset rows, before its generation
     (`before_generate_and_score`: the project's episode loop resets environments with them).
 16. trl.chat_template_utils: TRL's response schemas, training chat templates and response parser (`response_parsing`,
     `parse_response`; `qwen2_5_chat_template` for the tiny tool model): the project's episode loop parses and renders
     exactly as TRL's tool loop does.
 17. GRPOTrainer._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, ...): every
     logprob forward of the policy (the loss's, the old logprobs' for importance sampling, the reference's); wrapped
     on the instance (`around_logprobs`: trainer.routing_replay replays vLLM's routes in exactly these forwards).
 18. GRPOTrainer.vllm_importance_sampling_correction (and _mode, _clip_min, _clip_max), read by
     _generate_and_score_completions (which then runs the no-grad old-logprobs forward and writes
     inputs["importance_sampling_ratio"] and the sampling/* figures) and by _compute_loss (which multiplies the loss by
     that ratio right after its own logprob forward); inputs["sampling_per_token_logps"], ["completion_mask"],
     ["tool_mask"] (`importance_ratio_from_loss`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import torch

from launcher.core.config import TrainerConfig
from trainer import tracking


@contextmanager
def trl_generation_backend(make: Callable[..., Any]) -> Iterator[None]:
    """(1) Within the block, TRL's GRPOTrainer builds `make(**its kwargs)` as its vLLM generation backend."""
    import trl.trainer.grpo_trainer as gt

    if not hasattr(gt, "VLLMGeneration"):
        raise RuntimeError(
            "trl.trainer.grpo_trainer.VLLMGeneration is gone: this TRL is not the pinned 1.16.0; "
            "install the version in pyproject.toml"
        )
    old = gt.VLLMGeneration
    gt.VLLMGeneration = make  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        gt.VLLMGeneration = old  # type: ignore[misc]


def grpo_config(job_dir: Path, t: TrainerConfig, device: str, **overrides: Any):
    """(10) TRL's GRPOConfig for the trainer section. overrides: what gpu/trl_colocate.py changes to run TRL's own
    colocate mode on the same work (the same function builds both, so the comparison cannot drift)."""
    from trl import GRPOConfig

    bf16 = t.dtype == "bfloat16" and device == "cuda"
    settings: dict[str, Any] = dict(
        output_dir=str(job_dir / "hf"),
        max_steps=t.max_steps,
        per_device_train_batch_size=t.per_device_train_batch_size,
        num_generations=t.num_generations,
        max_completion_length=t.max_completion_length,
        learning_rate=t.learning_rate,
        beta=t.beta,
        temperature=t.temperature,
        seed=t.seed,
        logging_steps=1,
        save_strategy="no",
        report_to=tracking.trackers(t) or "none",
        run_name=job_dir.name,
        use_cpu=device == "cpu",
        bf16=bf16,
        use_vllm=True,
        vllm_mode="server",
        disable_tqdm=True,
        dataloader_num_workers=0,
        # TRL defaults this to True; trainer.activation_checkpointing decides (the loader applies it per layer)
        gradient_checkpointing=t.activation_checkpointing,
    )
    return GRPOConfig(**{**settings, **t.grpo_settings, **overrides})


def build_trainer(
    model,
    tokenizer,
    dataset,
    rewards,
    args,
    callback,
    make_backend: Callable[..., Any],
    backend_type: type,
    agents: dict[str, Any] | None = None,
):
    """TRL's GRPOTrainer with `make_backend` as its generation backend (1, 2) and `callback` first in line (3): its
    on_log adds the project's figures to the record the reporting callbacks (W&B, TensorBoard) send next.
    agents: tools=, environment_factory=, rollout_func= (11)."""
    from trl import GRPOTrainer

    with trl_generation_backend(make_backend):
        tr = GRPOTrainer(
            model=model,
            reward_funcs=rewards,
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[callback],
            **(agents or {}),
        )
    if not isinstance(generation_backend(tr), backend_type):
        raise RuntimeError("GRPOTrainer did not use the node-local generation backend; TRL changed how it builds it")
    if tr.model is not model:  # the rollout, built before the trainer, pushes and checks parity on `model`
        raise RuntimeError("GRPOTrainer wrapped or replaced the model it was given; the rollout would push another object")
    put_first(tr, callback)
    return tr


def generation_backend(trainer) -> Any:
    """(2) The backend the trainer built (None outside vLLM mode)."""
    return getattr(trainer, "vllm_generation", None)


def generate_on_node(trainer, prompt_ids: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
    """For a user's rollout_func (TRL's rollout_func(prompts, trainer)): one completion per prompt, generated by this
    rank's own client of its node's vLLM server (item 2's backend), under the trainer's sampling settings ->
    (completion ids, the sampled tokens' logprobs). The one name a rollout_func needs, so that it names no TRL
    internal itself (tests/support/agent_rollout.py is the example)."""
    _, completion_ids, logprobs, _ = generation_backend(trainer).generate(prompts=prompt_ids, images=None, num_generations=1)
    return completion_ids, [[lp[0] for lp in seq] for seq in logprobs]  # top-1 of each: the sampled token


def put_first(trainer, callback) -> None:
    """(3) `callback` runs before every other callback of the trainer."""
    trainer.callback_handler.callbacks.remove(callback)
    trainer.callback_handler.callbacks.insert(0, callback)


def report(trainer, logs: dict[str, float]) -> None:
    """(3) `logs` to the trainer's callbacks (the trackers': W&B, TensorBoard) as a log record of the current
    global_step, outside TRL's own step record (an evaluation's figures). The trainer's log_history is left alone
    (checkpoints read the last step's reward there)."""
    trainer.callback_handler.on_log(trainer.args, trainer.state, trainer.control, logs)


def replace_train_sampler(trainer, wrap: Callable[[Any], Any]) -> None:
    """(4) The trainer's train sampler becomes wrap(the sampler it would have built). Before trainer.train()."""
    make = trainer._get_train_sampler
    trainer._get_train_sampler = lambda dataset=None: wrap(make(dataset))


def wrap_train_dataloader(trainer, wrap: Callable[[Any], Any]) -> None:
    """(5) Every train dataloader the trainer builds becomes wrap(that dataloader)."""
    make = trainer.get_train_dataloader
    trainer.get_train_dataloader = lambda: wrap(make())


def tokenize_prompts(trainer, prompts: list) -> list[list[int]]:
    """(6) The prompt ids TRL hands the generation backend for these prompts."""
    ids = trainer._tokenize_prompts(prompts)[0]
    return [list(map(int, p)) for p in ids]


def set_micro_step(trainer, micro_steps: int) -> None:
    """(7) TRL's micro-step counter: a resumed run regenerates at the micro-steps the uninterrupted run did."""
    trainer._step = micro_steps


def init_module_weights(model: torch.nn.Module, module: torch.nn.Module) -> None:
    """(8) transformers' own initialisation of `module` (what from_pretrained runs for what no checkpoint holds)."""
    model._init_weights(module)  # type: ignore[operator]


def mark_self_sharded(model: torch.nn.Module) -> None:
    """(9) transformers' Trainer then leaves the model alone (no DDP/accelerate FSDP wrap on top of ours): the same
    flag `from_pretrained(distributed_config=...)` sets."""
    model._is_distributed_loading_by_transformers = True  # type: ignore[assignment]
    if hasattr(model, "get_base_model"):  # a peft model (trainer.lora): the Trainer reads the flag through to the base
        model.get_base_model()._is_distributed_loading_by_transformers = True  # type: ignore[operator,union-attr]


GenerateOutput = tuple
"""(prompt_ids, completion_ids, tool_mask or None, completions, logprobs, extra_fields, images, tool_images)"""


def after_generate(trainer, fn: Callable[[list[list[int]], list[list[int]], list[list[int]] | None], None]) -> None:
    """(12) fn(prompt_ids, completion_ids, tool_mask) after each of the trainer's generations of a batch (every turn
    of every episode done; tool_mask None for single-turn)."""
    make = trainer._generate

    def generate(prompts):
        out = make(prompts)
        fn(out[0], out[1], out[2])
        return out

    trainer._generate = generate


def log_metric(trainer, name: str, value: float) -> None:
    """(13) `value` joins the trainer's next log record under `name` (averaged with others logged before it)."""
    mode = "train" if trainer.model.training else "eval"
    trainer._metrics[mode][name].append(value)


def before_loss(trainer, fn: Callable[[dict[str, Any]], None]) -> None:
    """(14) fn(inputs) before each loss computation: the batch the loss sees (completion_ids, completion_mask,
    tool_mask when multi-turn)."""
    make = trainer._compute_loss

    def compute_loss(model, inputs):
        fn(inputs)
        return make(model, inputs)

    trainer._compute_loss = compute_loss


def before_generate_and_score(trainer, fn: Callable[[list[dict[str, Any]]], None]) -> None:
    """(15) fn(rows) with the dataset rows of each batch, before the trainer generates and scores it."""
    make = trainer._generate_and_score_completions

    def generate_and_score(inputs):
        fn(inputs)
        return make(inputs)

    trainer._generate_and_score_completions = generate_and_score


def around_logprobs(trainer, context: Callable[[], AbstractContextManager[Any]]) -> None:
    """(17) Each of the trainer's logprob computations (its model forwards, chunked or not) runs inside context()."""
    make = trainer._get_per_token_logps_and_entropies

    def logprobs(*args, **kwargs):
        with context():
            return make(*args, **kwargs)

    trainer._get_per_token_logps_and_entropies = logprobs


def response_parsing(tokenizer) -> str | None:
    """(16) Readies `tokenizer` for TRL's response parser as GRPOTrainer does (a response schema TRL knows for its chat
    template, when it has none) and returns the chat template multi-turn renders with: None (the tokenizer's own) when
    it keeps earlier turns as they were, else TRL's training template."""
    from trl.chat_template_utils import add_response_schema, get_training_chat_template, is_chat_template_prefix_preserving

    if getattr(tokenizer, "response_template", None) is None and getattr(tokenizer, "response_schema", None) is None:
        add_response_schema(tokenizer)
    return None if is_chat_template_prefix_preserving(tokenizer) else get_training_chat_template(tokenizer)


def parse_response(tokenizer, ids: list[int], prefix: list[int], tools: list[Callable]) -> dict[str, Any]:
    """(16) The assistant message TRL's loop makes of completion `ids` after `prefix` (its tool calls parsed)."""
    from trl.chat_template_utils import parse_response as trl_parse_response

    return trl_parse_response(tokenizer, ids, prefix=prefix, tools=list(tools))


def qwen2_5_chat_template() -> str:
    """(16) TRL's copy of Qwen2.5's chat template, the one its response schema for Qwen2.5 parses."""
    from trl.chat_template_utils import qwen2_5_chat_template as template

    return template


def importance_ratio_from_loss(trainer) -> bool:
    """(18) The importance ratio against vLLM's logprobs taken from the loss's own forward, not from TRL's extra no-grad
    forward of the whole batch: True when installed. TRL skips that forward itself when nothing asks for it (one pass
    over each batch, generation aligned with the gradient accumulation: `_generate_and_score_completions`), except
    that its vLLM correction always asks; then the weights the loss's forward runs with are those the extra forward
    would have used, so its logprobs (detached) are the same numbers. The flag is off while TRL scores a batch (no
    forward, no ratio) and on in the loss, where the ratio and TRL's sampling/* figures are computed per micro-batch
    exactly as TRL computes them per batch (a min or max figure is then the mean of the micro-batches' minima or maxima)."""
    args = trainer.args
    aligned = args.gradient_accumulation_steps % (args.steps_per_generation * trainer.num_iterations) == 0
    if not (trainer.use_vllm and trainer.vllm_importance_sampling_correction and aligned and trainer.num_iterations == 1):
        return False
    if trainer.loss_type == "vespo":  # its loss reads the ratio before the forward
        return False
    score = trainer._generate_and_score_completions
    loss = trainer._compute_loss

    def generate_and_score(inputs):
        trainer.vllm_importance_sampling_correction = False
        try:
            return score(inputs)
        finally:
            trainer.vllm_importance_sampling_correction = True

    def compute_loss(model, inputs):
        forward = trainer._get_per_token_logps_and_entropies  # as wrapped now (routing replay's included)

        def first_forward(*a, **kw):
            # _compute_loss's first logprob forward is the policy's own (TRL's reference forward runs while it scores)
            trainer._get_per_token_logps_and_entropies = forward
            out = forward(*a, **kw)
            if (a[0] if a else kw.get("model")) is not model:
                raise RuntimeError(
                    "trainer.importance_ratio_from_loss: TRL's _compute_loss ran another model's logprob forward first; "
                    "this TRL is not the pinned 1.16.0 (set trainer.importance_ratio_from_loss: false)"
                )
            inputs["importance_sampling_ratio"] = _importance_ratio(trainer, out[0].detach(), inputs)
            return out

        trainer._get_per_token_logps_and_entropies = first_forward
        try:
            return loss(model, inputs)
        finally:
            trainer._get_per_token_logps_and_entropies = forward

    trainer._generate_and_score_completions = generate_and_score
    trainer._compute_loss = compute_loss
    return True


def _importance_ratio(trainer, logps: torch.Tensor, inputs: dict[str, Any]) -> torch.Tensor:
    """TRL 1.16's vLLM importance ratio and its figures (`_generate_and_score_completions`), from `logps`."""
    sampling = inputs["sampling_per_token_logps"]
    mask = inputs["completion_mask"] if inputs.get("tool_mask") is None else inputs["completion_mask"] * inputs["tool_mask"]
    diff = torch.nan_to_num((logps - sampling) * mask, nan=0.0)  # a token vLLM could not score: ratio 1
    mode = trainer.vllm_importance_sampling_mode
    sequence = mode in ("sequence_mask", "sequence_truncate")
    ratio = torch.exp(diff.sum(dim=-1, keepdim=True) if sequence else diff)
    low, high = trainer.vllm_importance_sampling_clip_min, trainer.vllm_importance_sampling_clip_max
    if mode in ("sequence_truncate", "token_truncate"):
        ratio = torch.clamp(ratio, min=low, max=high)
    elif mode in ("sequence_mask", "token_mask"):
        low_v = -float("inf") if low is None else low
        high_v = float("inf") if high is None else high
        ratio = ratio.masked_fill((ratio < low_v) | (ratio > high_v), 0.0)
    else:
        raise ValueError(f"unknown vllm_importance_sampling_mode {mode!r}")
    metrics = trainer._metrics["train" if trainer.model.training else "eval"]
    gather = trainer.accelerator.gather
    zero = torch.tensor(0.0, device=logps.device)
    keep = mask.bool()
    delta = torch.abs(logps - sampling)[keep]
    delta = delta[~torch.isnan(delta)]
    metrics["sampling/sampling_logp_difference/mean"].append(gather(delta.mean() if delta.numel() else zero).mean().item())
    metrics["sampling/sampling_logp_difference/max"].append(gather(delta.max() if delta.numel() else zero).max().item())
    flat = ratio.flatten() if sequence else ratio[keep]
    for name, reduce, across_ranks in (
        ("min", torch.min, torch.min),
        ("mean", torch.mean, torch.nanmean),
        ("max", torch.max, torch.max),
    ):
        metrics[f"sampling/importance_sampling_ratio/{name}"].append(
            across_ranks(gather(reduce(flat) if flat.numel() else zero)).item()
        )
    return ratio
