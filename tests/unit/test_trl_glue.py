"""Each TRL / transformers internal trainer/trl_glue.py names (its docstring's list, by number), pinned against the
installed versions: an upgrade that moves one fails here, naming it and the glue function that uses it."""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from trainer import trl_glue


def grpo_src(name: str) -> str:
    import trl.trainer.grpo_trainer as gt

    return inspect.getsource(getattr(gt.GRPOTrainer, name))


def test_1_the_backend_swap_is_seen_by_grpo_trainer_and_undone_after():
    import trl.trainer.grpo_trainer as gt

    old = gt.VLLMGeneration
    made = object()
    with trl_glue.trl_generation_backend(lambda **kw: made):
        assert gt.VLLMGeneration(model=None) is made  # what GRPOTrainer.__init__ calls by its module-level name
    assert gt.VLLMGeneration is old
    with pytest.raises(ValueError), trl_glue.trl_generation_backend(lambda **kw: made):
        raise ValueError("an error while building the trainer")
    assert gt.VLLMGeneration is old, "the swap must be undone when the trainer's construction fails"
    assert "VLLMGeneration(" in inspect.getsource(gt.GRPOTrainer.__init__), "GRPOTrainer builds its backend another way"


def test_2_the_backends_methods_trl_calls():
    import trl.trainer.grpo_trainer as gt

    src = inspect.getsource(gt.GRPOTrainer)
    for needle in ("self.vllm_generation.sync_weights()", "self.vllm_generation.generate(", "vllm_client.get_server_info()"):
        assert needle in src, f"GRPOTrainer no longer contains {needle!r}; trainer/rollout/node.py's adapter must follow"
    params = list(inspect.signature(gt.VLLMGeneration.generate).parameters)
    assert params[:5] == ["self", "prompts", "images", "num_generations", "profiler"], params


def test_3_callbacks_run_in_list_order_and_get_the_model_and_optimizer():
    from transformers.trainer_callback import CallbackHandler

    src = inspect.getsource(CallbackHandler.call_event)
    assert "for callback in self.callbacks" in src, "CallbackHandler no longer runs callbacks in list order (put_first)"
    for kw in ("model=self.model", "optimizer=self.optimizer", "lr_scheduler=self.lr_scheduler"):
        assert kw in src, f"CallbackHandler.call_event no longer passes {kw} to every event (trainer/callback.py reads it)"
    import transformers.trainer as tt

    loop = inspect.getsource(tt.Trainer)
    assert 'for attr in ("model", "optimizer", "lr_scheduler"):' in loop, "the training loop no longer updates the handler"
    assert "setattr(self.callback_handler, attr, getattr(self, attr))" in loop, (
        "Trainer no longer points the CallbackHandler at its model/optimizer/scheduler before on_train_begin: "
        "the callback's checkpoints (on_step_end) would save None"
    )
    # report: an evaluation's figures reach every callback's on_log (the trackers'), with the trainer's state
    from types import SimpleNamespace

    from transformers import TrainerCallback, TrainerControl, TrainerState

    from trainer.trl_glue import report

    got: list = []

    class Tracker(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            got.append((state.global_step, logs))

    state = TrainerState(global_step=7)
    handler = CallbackHandler([Tracker()], None, None, None, None)
    report(SimpleNamespace(callback_handler=handler, args=None, state=state, control=TrainerControl()), {"eval_pass@1": 0.5})
    assert got == [(7, {"eval_pass@1": 0.5})]


def test_4_and_5_the_sampler_and_dataloader_hooks():
    src = grpo_src("get_train_dataloader")
    assert "sampler_fn=self._get_train_sampler" in src, "GRPOTrainer builds its train sampler another way (replace_train_sampler)"
    assert "dataset" in inspect.signature(_grpo("_get_train_sampler")).parameters, "replace_train_sampler passes dataset"
    assert list(inspect.signature(_grpo("get_train_dataloader")).parameters) == ["self"], "wrap_train_dataloader calls it bare"


def _grpo(name: str):
    import trl.trainer.grpo_trainer as gt

    return getattr(gt.GRPOTrainer, name)


def test_4_5_6_7_the_hooks_act_on_an_object_as_they_do_on_the_trainer():
    """The glue's hooks on a stand-in with the trainer's method names: each replaces or wraps exactly its one name."""

    class Stub:
        _step = 0

        def _get_train_sampler(self, dataset=None):
            return ["sampler", dataset]

        def get_train_dataloader(self):
            return "loader"

        def _tokenize_prompts(self, prompts):
            return [torch.tensor([1, 2]), [3]], None

    s = Stub()
    trl_glue.replace_train_sampler(s, lambda inner: ("wrapped", inner))
    assert s._get_train_sampler("ds") == ("wrapped", ["sampler", "ds"]) and s._get_train_sampler() == (
        "wrapped",
        ["sampler", None],
    )
    trl_glue.wrap_train_dataloader(s, lambda inner: ("ahead", inner))
    assert s.get_train_dataloader() == ("ahead", "loader")
    assert trl_glue.tokenize_prompts(s, ["p", "q"]) == [[1, 2], [3]]
    trl_glue.set_micro_step(s, 12)
    assert s._step == 12


def test_6_tokenize_prompts_returns_the_ids_first():
    src = grpo_src("_tokenize_prompts")
    assert list(inspect.signature(_grpo("_tokenize_prompts")).parameters) == ["self", "prompts"]
    assert "return" in src


def test_7_trl_regenerates_by_its_micro_step_counter():
    src = grpo_src("_prepare_inputs")
    assert "self._step % generate_every == 0" in src, "TRL regenerates by another rule now (set_micro_step, data.py)"
    assert "self._step += 1" in grpo_src("training_step"), "TRL counts micro-steps elsewhere now (set_micro_step)"
    assert "generate_every = self.args.steps_per_generation * self.num_iterations" in src


def test_8_transformers_initialises_a_module_with_init_weights():
    from transformers import PreTrainedModel

    assert list(inspect.signature(PreTrainedModel._init_weights).parameters) == ["self", "module"]


def test_9_transformers_leaves_self_sharded_models_alone():
    import transformers.trainer as tt
    from transformers import PreTrainedModel

    assert 'getattr(model, "is_distributed_loading_by_transformers", False)' in inspect.getsource(tt.Trainer.__init__), (
        "transformers' Trainer no longer reads is_distributed_loading_by_transformers (trl_glue.mark_self_sharded)"
    )
    prop = inspect.getattr_static(PreTrainedModel, "is_distributed_loading_by_transformers")
    assert isinstance(prop, property) and "self._is_distributed_loading_by_transformers" in inspect.getsource(prop.fget), (
        "PreTrainedModel.is_distributed_loading_by_transformers no longer reads the flag mark_self_sharded sets"
    )


def test_10_the_grpo_config_options_the_project_sets_exist():
    from trl import GRPOConfig

    fields = set(GRPOConfig.__dataclass_fields__)
    for name in ("steps_per_generation", "num_iterations", "num_generations", "max_completion_length", "vllm_mode", "use_vllm"):
        assert name in fields, f"GRPOConfig has no {name} (trl_glue.grpo_config)"


def test_11_grpo_trainer_takes_the_multi_turn_arguments():
    from trl import GRPOTrainer

    params = inspect.signature(GRPOTrainer.__init__).parameters
    for name in ("tools", "environment_factory", "rollout_func"):
        assert name in params, f"GRPOTrainer takes no {name}= (trl_glue.build_trainer's agents)"
    assert "max_tool_calling_iterations" in __import__("trl").GRPOConfig.__dataclass_fields__


def test_12_to_15_the_multi_turn_hooks():
    """after_generate reads _generate's (prompt_ids, completion_ids, tool_mask, ...); log_metric appends to
    _metrics[mode][name]; before_loss sees _compute_loss's inputs with tool_mask; before_generate_and_score sees the rows."""
    assert list(inspect.signature(_grpo("_generate")).parameters) == ["self", "prompts"]
    assert "return prompt_ids, completion_ids, tool_mask, completions, logprobs, extra_fields" in grpo_src("_generate")
    assert 'self._metrics[mode]["tools/call_frequency"].append' in grpo_src("_generate"), "TRL keeps its metrics elsewhere"
    assert list(inspect.signature(_grpo("_compute_loss")).parameters) == ["self", "model", "inputs"]
    assert 'inputs["tool_mask"]' in grpo_src("_compute_loss"), "the loss no longer reads tool_mask (before_loss)"
    assert list(inspect.signature(_grpo("_generate_and_score_completions")).parameters) == ["self", "inputs"]
    # the project's episode loop mirrors these parts of TRL's own (trainer.agents.episodes; test_agents_episodes)
    assert 'tool_mask = extra_fields.pop("env_mask", None)' in grpo_src("_generate")
    assert "def _get_tool_suffix_ids(self, tool_messages)" in grpo_src("_get_tool_suffix_ids")

    class Fake:
        def __init__(self):
            self.calls = []
            self.model = torch.nn.Linear(1, 1)
            self._metrics = {"train": __import__("collections").defaultdict(list)}

        def _generate(self, prompts):
            return ([[1]], [[2, 3]], [[1, 0]], None, None, {}, None, None)

        def _compute_loss(self, model, inputs):
            return 0.0

        def _generate_and_score_completions(self, inputs):
            return {}

    fake, seen = Fake(), []
    trl_glue.after_generate(fake, lambda p, c, m: seen.append((p, c, m)))
    trl_glue.before_loss(fake, lambda inputs: seen.append(inputs))
    trl_glue.before_generate_and_score(fake, lambda rows: seen.append(rows))
    fake._generate(["p"])
    fake._compute_loss(None, {"tool_mask": 1})
    fake._generate_and_score_completions([{"prompt": "p"}])
    trl_glue.log_metric(fake, "agents/x", 2.0)
    assert seen == [([[1]], [[2, 3]], [[1, 0]]), {"tool_mask": 1}, [{"prompt": "p"}]]
    assert fake._metrics["train"]["agents/x"] == [2.0]


def test_16_trls_response_parsing_and_templates(tiny_model):
    """response_parsing gives the Qwen2.5 template a response schema and keeps it (it is prefix-preserving);
    parse_response turns a tool-call completion into an assistant message with the call parsed."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.chat_template = trl_glue.qwen2_5_chat_template()
    assert "<tool_call>" in tok.chat_template
    assert trl_glue.response_parsing(tok) is None
    assert getattr(tok, "response_template", None) is not None or getattr(tok, "response_schema", None) is not None

    def countdown() -> str:
        """Counts down.

        Returns:
            what is left.
        """
        return "DONE"

    prefix = tok.apply_chat_template([{"role": "user", "content": "go"}], add_generation_prompt=True, tokenize=True,
                                     return_dict=False, tools=[countdown])  # fmt: skip
    ids = tok.encode('<tool_call>\n{"name": "countdown", "arguments": {}}\n</tool_call><|im_end|>')
    msg = trl_glue.parse_response(tok, ids, list(prefix), [countdown])
    assert msg["role"] == "assistant" and [c["function"]["name"] for c in msg["tool_calls"]] == ["countdown"], msg


def test_17_the_logprob_computation_takes_the_batch_and_runs_the_forwards():
    params = list(inspect.signature(_grpo("_get_per_token_logps_and_entropies")).parameters)
    assert params[:5] == ["self", "model", "input_ids", "attention_mask", "logits_to_keep"], params
    seen: list[str] = []

    @contextmanager
    def ctx():
        seen.append("in")
        yield
        seen.append("out")

    obj = SimpleNamespace(_get_per_token_logps_and_entropies=lambda *a, **k: seen.append("call") or (a, k))
    trl_glue.around_logprobs(obj, ctx)
    assert obj._get_per_token_logps_and_entropies(1, 2, batch_size=3) == ((1, 2), {"batch_size": 3})
    assert seen == ["in", "call", "out"]


def _train_one_step(model_dir: str, job_dir, from_loss: bool, mode: str) -> tuple[dict, int, list[dict]]:
    """A real TRL GRPOTrainer (the project's GRPOConfig, vLLM server mode) for one optimizer step of two micro-steps, its
    generation backend a stand-in at the process boundary: fixed completions with vLLM logprobs of -2.0 a token, so
    the importance ratio is not 1. Returns the parameters after the step, the logprob forwards run, the logged records."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from tests.conftest import cpu_trainer

    torch.manual_seed(0)
    grpo = {"gradient_accumulation_steps": 2, "vllm_importance_sampling_mode": mode}
    t = cpu_trainer(
        model_dir, per_device_train_batch_size=4, num_generations=4, max_completion_length=3, learning_rate=0.1, grpo=grpo
    )

    class Backend:  # TRL's VLLMGeneration, as trainer.rollout.node.TrlAdapter is
        def __init__(self, **kw):
            self.vllm_client = SimpleNamespace(get_server_info=lambda: {"model_config": {"logprobs_mode": "processed_logprobs"}})

        def generate(self, prompts, images, num_generations, profiler=None):
            completions = [[5 + i % 3, 7, 9 + i % 2] for i in range(len(prompts))]
            return prompts, completions, [[[-2.0] for _ in c] for c in completions], None

        def sync_weights(self):
            pass

    records: list[dict] = []

    class Logs(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            records.append(dict(logs or {}))

    def reward(prompts, completions, completion_ids, **kw):
        return [float(ids[0]) for ids in completion_ids]  # rewards differ within each group: advantages are not 0

    args = trl_glue.grpo_config(job_dir, t, "cpu", max_steps=1)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with trl_glue.trl_generation_backend(Backend):
        from trl import GRPOTrainer

        tr = GRPOTrainer(
            model=model,
            reward_funcs=[reward],
            args=args,
            train_dataset=Dataset.from_list([{"prompt": f"count {i}"} for i in range(8)]),
            processing_class=AutoTokenizer.from_pretrained(model_dir),
            callbacks=[Logs()],
        )
    assert trl_glue.importance_ratio_from_loss(tr) if from_loss else True
    forwards = [0]
    inner = tr._get_per_token_logps_and_entropies

    def counted(*a, **k):
        forwards[0] += 1
        return inner(*a, **k)

    tr._get_per_token_logps_and_entropies = counted  # type: ignore[method-assign]
    tr.train()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, forwards[0], records


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
def test_18_the_importance_ratio_from_the_loss_trains_as_trls_extra_forward_does_without_it(tiny_model, tmp_path, mode):
    """TRL's vLLM importance ratio taken from the loss's own forward: the same parameters after the step and the same
    figures, one logprob forward per micro-step instead of TRL's extra forward of the whole batch first."""
    src = grpo_src("_generate_and_score_completions")
    assert "self.use_vllm and self.vllm_importance_sampling_correction" in src and "old_per_token_logps" in src
    assert 'inputs["importance_sampling_ratio"]' in grpo_src("_compute_loss")
    theirs, their_forwards, their_logs = _train_one_step(tiny_model, tmp_path / "a", False, mode)
    ours, our_forwards, our_logs = _train_one_step(tiny_model, tmp_path / "b", True, mode)
    assert (their_forwards, our_forwards) == (3, 2), "TRL: the batch's old logprobs, then each micro-step's loss"
    moved = max((theirs[n] - p).abs().max().item() for n, p in ours.items())
    assert moved < 1e-5, f"the step differs by {moved}"
    # AdamW's first step is about lr x sign(grad): the loss and the gradient's norm show the ratio's weighting itself
    for k in ("loss", "grad_norm"):
        assert our_logs[0][k] == pytest.approx(their_logs[0][k], rel=1e-4), k
    first = {k: v for k, v in their_logs[0].items() if k.startswith("sampling/")}
    assert first and first["sampling/importance_sampling_ratio/mean"] != 1.0
    for k, v in first.items():  # a batch's min and max: ours the mean of its micro-batches' (within TRL's bounds)
        if k.endswith("/mean"):
            assert our_logs[0][k] == pytest.approx(v, rel=1e-4), k
        else:
            assert (v <= our_logs[0][k] + 1e-6) if k.endswith("/min") else (our_logs[0][k] <= v + 1e-6), k
    # TRL's conditions for skipping its forward do not hold: left as it is
    args = SimpleNamespace(gradient_accumulation_steps=2, steps_per_generation=2)
    many = SimpleNamespace(args=args, use_vllm=True, vllm_importance_sampling_correction=True, num_iterations=2, loss_type="dapo")
    assert trl_glue.importance_ratio_from_loss(many) is False
