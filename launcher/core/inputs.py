"""Checks each node runs before it starts anything (torch-free): the model folder loads (a tokenizer vocabulary, every
shard whole: launcher.core.weights) and the LoRA targets are among its layers, the dataset is readable there with
string or conversation prompts and at least one step's worth of rows. A missing model or a malformed data line then
fails in seconds, naming the node and the file, instead of after a minute of vLLM start-up or inside a torchrun
traceback.

`submit_path_problems` runs the same checks on the submit host before sbatch (plus: each reward read from its source
down to its function's signature and imports, each tool, environment and rollout_func read from source down to its
name, the setup venv present), so a typo fails at once instead of after the job waited in the queue. `local_problems` runs
them before `slurm-grpo local` starts anything, and resolves the rewards, tools, environments and rollout_func as the trainer will (this host runs it)."""

from __future__ import annotations

import difflib
import functools
import json
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from launcher.core.config import ConfigError, JobConfig
from launcher.core.dataset_schema import DatasetError, Schema, read_jsonl, read_schema
from launcher.core.lora import kernel_bypass_warning, resolve_targets, target_problems
from launcher.core.reward_check import Unparsable, find_def, reward_needs, source_of
from launcher.core.weights import WeightsError, looks_local, weight_shapes

FAST_TOKENIZER = "tokenizer.json"
"""The fast tokenizer's file: what transformers 5 and vLLM load first (and what the memory estimate counts with)."""
TOKENIZER_VOCABS = (
    (FAST_TOKENIZER,),
    ("tokenizer.model",),  # sentencepiece (Llama, Mistral, Gemma) or tiktoken, converted at load
    ("spiece.model",),
    ("sentencepiece.bpe.model",),
    ("vocab.json", "merges.txt"),  # byte-level BPE (GPT-2, Qwen)
    ("vocab.txt",),  # WordPiece
)
"""Files a tokenizer loads its vocabulary from (transformers' VOCAB_FILES_NAMES conventions): one set must be whole;
tokenizer_config.json alone holds no vocabulary (AutoTokenizer: "Couldn't instantiate the backend tokenizer")."""
WEIGHT_GLOBS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")


class PreflightError(ValueError):
    pass


TINY_MODEL = "slurm-grpo make-tiny-model DIR"
TINY_TOOL_MODEL = "python -m trainer.agents.tiny_tool_model DIR"
"""The test model of a run with tools or an environment: make-tiny-model's has no tool-calling chat template, which
TRL needs to parse the model's tool calls."""


def check_model(model: str, tool_calling: bool = False) -> None:
    """tool_calling: the run has tools or an environment (a missing folder's hint names the tool-calling test model)."""
    if not looks_local(model):
        return  # a hub name: vLLM and transformers resolve it (from the node's HF cache when offline)
    p = Path(model).expanduser()
    if not p.is_dir():
        raise PreflightError(
            f"vllm.model {model!r}: no such folder on this node (model folders must be on a file system every node "
            f"mounts; build a test one with `{TINY_TOOL_MODEL if tool_calling else TINY_MODEL}`)"
        )
    missing = []
    if not (p / "config.json").is_file():
        missing.append("config.json")
    if not has_tokenizer_vocab(p):
        missing.append("a tokenizer's vocabulary (tokenizer.json, or tokenizer.model, or vocab.json + merges.txt)")
    if not any(any(p.glob(g)) for g in WEIGHT_GLOBS):
        missing.append("weights (*.safetensors)")
    if missing:
        raise PreflightError(f"vllm.model {model!r} is not a complete model folder: missing {', '.join(missing)}")
    try:
        json.loads((p / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise PreflightError(f"vllm.model {model!r}: config.json is unreadable ({e})") from None
    try:
        weight_shapes(p)  # every shard there and whole, by its header
    except WeightsError as e:
        raise PreflightError(f"vllm.model {model!r}: {e}") from None


def calls_tools(config: JobConfig) -> bool:
    """The model must call tools: trainer.tools or trainer.environment (whose public methods are tools)."""
    return bool(config.trainer.tools or config.trainer.environment)


def lora_target_findings(config: JobConfig) -> tuple[list[str], list[str]]:
    """(problems, warnings) of trainer.lora.target_modules against the model folder's weight names (LoRA on, a model
    folder here with safetensors weights; else nothing to compare with)."""
    model = config.vllm.model
    if not config.trainer.lora.enabled or not looks_local(model) or not Path(model).expanduser().is_dir():
        return [], []
    try:
        shapes = weight_shapes(Path(model).expanduser())
    except WeightsError:
        return [], []  # check_model names it
    try:  # the default as the plan resolves it for this model (a config not planned yet: dry-run's, a test's)
        resolved = resolve_targets(config)
    except ConfigError as e:
        return [str(e)], []
    return target_problems(resolved, shapes) if shapes else ([], [])


def check_lora_targets(config: JobConfig) -> None:
    """peft adapts the modules whose names end in a target; one that matches nothing is a typo the job would carry
    silently (peft errors only when no target matches), or a crash at the first step when none does."""
    problems, _ = lora_target_findings(config)
    if problems:
        raise PreflightError(problems[0])


def has_tokenizer_vocab(folder: Path) -> bool:
    """One whole set of TOKENIZER_VOCABS, or a tiktoken or sentencepiece file of another name (Kimi-K2's and
    Moonlight's custom tokenizers load tiktoken.model; a custom tokenizer names its own file)."""
    whole = any(all((folder / f).is_file() for f in files) for files in TOKENIZER_VOCABS)
    return whole or any(folder.glob("*.tiktoken")) or any(f.is_file() for f in folder.glob("*.model"))


def read_jsonl_prompts(path: str) -> list[dict]:
    """Every non-empty line a JSON object with a 'prompt'; the error names the file and the line."""
    try:
        return read_jsonl(path, ("prompt",))
    except DatasetError as e:
        raise PreflightError(str(e)) from None


def check_dataset(
    path: str, needed: tuple[str, ...] = ("prompt",), columns: dict[str, str] | None = None, why: dict[str, str] | None = None
) -> Schema:
    """The dataset exists, is a format the trainer reads (from its content) and, after `columns` renames (run name ->
    stored name), holds every column of `needed`; `why` says who needs a column for the error."""
    p, columns, why = Path(path), columns or {}, why or {}
    if not p.exists():
        raise PreflightError(
            f"trainer.dataset {path!r} does not exist on this node (paths are read on the nodes; "
            f"use an absolute path on a shared file system)"
        )
    try:
        prompt = columns.get("prompt", "prompt") if "prompt" in needed else ""
        schema = read_schema(path, required=tuple(columns.get(c, c) for c in needed), prompt=prompt)
    except DatasetError as e:
        raise PreflightError(str(e)) from None
    have = ", ".join(schema.columns)
    for run_name, stored in columns.items():
        if stored not in schema.columns:
            raise PreflightError(
                f"trainer.columns maps {run_name!r} to {stored!r}, which trainer.dataset {path} lacks (columns: {have})"
            )
        if run_name in schema.columns and run_name not in columns.values():
            raise PreflightError(
                f"trainer.columns renames {stored!r} to {run_name!r}, which trainer.dataset {path} already has; "
                f"map {run_name!r} to another name too, or drop it from the data"
            )
    missing = [name for name in needed if columns.get(name, name) not in schema.columns]
    if missing:  # every missing column in the one line: a fix per round trip would take several
        free = [c for c in schema.columns if c not in columns.values() and c not in needed]
        guess: dict[str, str] = {}  # a column only where its name says it (GSM8K's question/answer), else a placeholder
        for name in missing:
            left = [c for c in free if c not in guess.values()]
            known = [c for c in left if c.lower() in COLUMN_SYNONYMS.get(name, ())]
            guess[name] = (known or difflib.get_close_matches(name, left, n=1, cutoff=0.6) or ["COLUMN"])[0]
        raise PreflightError(
            f"trainer.dataset {path} has no "
            + " and no ".join(f"{n!r} column{why.get(n, '')}" for n in missing)
            + f" (columns: {have}); map {'one' if len(missing) == 1 else 'them'} with trainer.columns="
            + "{"
            + ", ".join(f"{n}: {c}" for n, c in guess.items())
            + "}"
        )
    return schema


COLUMN_SYNONYMS = {
    "prompt": ("question", "problem", "query", "instruction", "input", "text", "messages", "conversations"),
    "solution": ("answer", "answers", "ans", "target", "label", "output", "ground_truth", "reference", "final_answer"),
}
"""What datasets call the columns the run needs (the missing-column hint suggests these, never an arbitrary column)."""


def data_needs(config: JobConfig, rewards: list[str] | None = None) -> tuple[tuple[str, ...], dict[str, str]]:
    """(the columns the run reads: 'prompt' and every column a reward (trainer.reward_funcs, or `rewards`) requires,
    who needs each for the error)."""
    needed: list[str] = ["prompt"]
    why: dict[str, str] = {}
    if config.trainer.rollout_func:  # its extra fields reach the rewards as keyword arguments too (TRL): a reward's
        return tuple(needed), why  # parameter may name one of them, which no dataset holds
    for entry in config.trainer.reward_funcs if rewards is None else rewards:
        for c in reward_needs(entry).columns:
            if c not in needed:
                needed.append(c)
                why[c] = f" (reward {entry} needs it)"
    return tuple(needed), why


def check_data(config: JobConfig) -> None:
    """The dataset holds what the run reads; trainer.chat_template's file is there; conversational prompts (or a
    system prompt, which makes them so) have a chat template to be rendered with."""
    t = config.trainer
    needed, why = data_needs(config)
    schema = check_dataset(t.dataset, needed, t.columns, why)
    check_rows(config, schema)
    if t.chat_template and not is_inline_template(t.chat_template) and not Path(t.chat_template).expanduser().is_file():
        raise PreflightError(
            f"trainer.chat_template {t.chat_template!r}: no such file on this node (give a Jinja file on a shared file "
            "system, or the template text itself)"
        )
    check_template_for(config, schema, "trainer.dataset")


@dataclass(frozen=True)
class StepDraw:
    """What one generation batch draws from the dataset (TRL's RepeatSampler: a batch of `prompts` distinct rows, each
    generated num_generations times, then trained on for `steps` optimizer steps)."""

    prompts: int
    rule: str
    """How `prompts` was derived, with the numbers."""
    steps: int
    """Optimizer steps one generation batch feeds (num_iterations x steps_per_generation / gradient accumulation)."""


def step_draw(config: JobConfig) -> StepDraw | None:
    """From the plan's world size and trainer.grpo (None when the config does not plan: its own check says why)."""
    from launcher.core.plan import generation_steps, plan

    try:
        world = plan(config, "").world_size
    except (ConfigError, ValueError):
        return None
    t = config.trainer
    spg, batch, g = generation_steps(config, world), t.per_device_train_batch_size, t.num_generations
    accum, iterations = (t.grpo.get(k) for k in ("gradient_accumulation_steps", "num_iterations"))
    accum = accum if isinstance(accum, int) and accum > 0 else 1
    iterations = iterations if isinstance(iterations, int) and iterations > 0 else 1
    per_gen = f" x {spg} steps_per_generation" if spg > 1 else ""
    rule = f"per_device_train_batch_size {batch} x {world} ranks{per_gen} / num_generations {g}"
    return StepDraw(batch * world * spg // g, rule, max(1, iterations * spg // accum))


def check_rows(config: JobConfig, schema: Schema) -> None:
    """TRL's RepeatSampler drops an incomplete batch of prompts (trl/trainer/utils.py RepeatSampler.__iter__): a
    dataset with fewer rows than one generation batch draws gives the trainer no batch at all, and the job stops at
    step 0 after the queue and vLLM's start. More rows than that repeat over epochs up to max_steps."""
    draw = step_draw(config)
    if schema.rows is None or draw is None or schema.rows >= draw.prompts:
        return
    raise PreflightError(
        f"trainer.dataset {config.trainer.dataset} has {schema.rows} rows, fewer than the {draw.prompts} prompts one step "
        f"draws ({draw.rule}): TRL would run no step; lower trainer.per_device_train_batch_size or slurm.nodes, or add rows"
    )


def dataset_reading(config: JobConfig) -> Schema | None:
    """The data check's very reading of trainer.dataset, reused (dataset_schema reads a file once per state); None
    where it is not readable here (the data check says why)."""
    needed, why = data_needs(config)
    try:
        return check_dataset(config.trainer.dataset, needed, config.trainer.columns, why)
    except (PreflightError, OSError):
        return None


def epochs_note(config: JobConfig) -> str | None:
    """The plan's line on how the dataset feeds the run: 'N rows = K steps per epoch; max_steps M = E epochs' (None
    when the dataset is not readable here or too small: the data check says why)."""
    draw = step_draw(config)
    schema = dataset_reading(config)
    rows = schema.rows if schema else None
    if draw is None or rows is None or rows < draw.prompts:
        return None
    per_epoch = rows // draw.prompts * draw.steps
    epochs = config.trainer.max_steps / per_epoch
    left = rows % draw.prompts
    unused = f", {left} rows unused per epoch (reshuffled each)" if left else ""
    return (
        f"data: {rows} rows = {per_epoch} step{'s' * (per_epoch != 1)} per epoch of {draw.prompts} prompts{unused}; "
        f"max_steps {config.trainer.max_steps} = {epochs:.3g} epochs"
    )


CHAT_TEMPLATE_TOKENS = 32
"""What a chat template adds around a prompt (role markers, a default system line), allowed on top of its text."""
CHARS_PER_TOKEN = 3
"""Without the model's tokenizer.json here: a token per 3 characters (English runs nearer 4: the estimate errs long)."""


@dataclass(frozen=True)
class PromptLength:
    tokens: int
    """The longest prompt's tokens, the chat template's allowance included."""
    how: str
    """Where the figure comes from, for the estimate's line."""


def prompt_length(config: JobConfig) -> PromptLength | None:
    """The dataset's longest prompt in tokens, for the memory estimate (TRL pads a batch to its longest prompt): the
    longest few by characters measured with the model's tokenizer.json where the model is a folder here, else
    CHARS_PER_TOKEN; plus the chat template's CHAT_TEMPLATE_TOKENS. None: the dataset is not readable here or not
    JSONL (the estimate then assumes its default)."""
    schema = dataset_reading(config)
    texts = schema.longest_prompts if schema else ()
    if not texts:
        return None
    system = config.trainer.system_prompt
    if system:  # prepended to every prompt by the trainer
        texts = tuple(f"{system}\n{t}" for t in texts)
    extra = " + system prompt" if system else ""
    counted = count_tokens(str(Path(config.vllm.model) / FAST_TOKENIZER), texts)
    if counted is not None:
        how = f"the dataset's longest prompt{extra}, by its tokenizer, + template"
        return PromptLength(counted + CHAT_TEMPLATE_TOKENS, how)
    chars = max(len(t) for t in texts)
    tokens = math.ceil(chars / CHARS_PER_TOKEN) + CHAT_TEMPLATE_TOKENS
    return PromptLength(tokens, f"the dataset's longest prompt{extra}, {chars} chars / {CHARS_PER_TOKEN}, + template")


def count_tokens(tokenizer_json: str, texts: tuple[str, ...]) -> int | None:
    """The most tokens of `texts` under the tokenizer file (the `tokenizers` library, no torch); None without it.
    Cached per file state: simulate lays out many plans of one config."""
    try:
        st = os.stat(tokenizer_json)
    except OSError:
        return None
    return _count_tokens(tokenizer_json, (st.st_mtime_ns, st.st_size), texts)


@functools.lru_cache(maxsize=8)
def _count_tokens(tokenizer_json: str, state: tuple[int, int], texts: tuple[str, ...]) -> int | None:
    try:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(tokenizer_json)
        return max(len(e.ids) for e in tok.encode_batch(list(texts), add_special_tokens=False))
    except Exception:  # an unreadable or newer-format file: the character rule instead
        return None


def input_notes(config: JobConfig) -> list[str]:
    """What dry-run's plan says of the inputs beside the checks: how the dataset feeds max_steps, and a WARNING where
    the LoRA targets leave a fused projection of the model without adapters, or name a layer a mamba-ssm kernel bypasses."""
    return [n for n in (epochs_note(config), *lora_target_findings(config)[1], kernel_bypass_warning(config)) if n]


def check_template_for(config: JobConfig, schema: Schema, key: str) -> None:
    """Conversational prompts in the dataset of `key` (or a system prompt, which makes them so) have a chat template to
    be rendered with: trainer.chat_template or the model's own. Tools and environments need conversations: an episode
    is rendered turn by turn with the chat template (TRL parses tool calls only from conversational completions)."""
    t = config.trainer
    conversational = t.columns.get("prompt", "prompt") in schema.list_columns
    if (t.tools or t.environment) and not (conversational or t.system_prompt):  # a rollout_func takes any prompt
        raise PreflightError(
            f"{key}'s prompts are plain strings; tools and environments need conversations ([{{role, content}}, ...]): "
            "convert them, or set trainer.system_prompt (it makes them so)"
        )
    if (conversational or t.system_prompt) and not t.chat_template and has_chat_template(config.vllm.model) is False:
        why_template = (
            "trainer.system_prompt makes the prompts conversations" if t.system_prompt else f"{key}'s prompts are conversations"
        )
        raise PreflightError(
            f"vllm.model {config.vllm.model!r} has no chat template and {why_template}: set trainer.chat_template (a "
            "Jinja file or the text), or use plain-string prompts without trainer.system_prompt"
        )


def has_chat_template(model: str) -> bool | None:
    """Whether a model folder's tokenizer has a chat template (tokenizer_config.json's, or chat_template.jinja/.json
    beside it); None for a hub name or an unreadable folder (the other checks name those)."""
    p = Path(model).expanduser()
    if not looks_local(model) or not p.is_dir():
        return None
    if (p / "chat_template.jinja").is_file() or (p / "chat_template.json").is_file():
        return True
    try:
        return bool(json.loads((p / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return None


def is_inline_template(text: str) -> bool:
    """trainer.chat_template holds the Jinja text itself rather than a file path."""
    return "{{" in text or "{%" in text


def check_context_length(config: JobConfig) -> None:
    """vLLM refuses to start with a max_model_len above the model's own context (found only after its imports, minutes
    in on a GPU): compared here with config.json's max_position_embeddings, for a model folder on this host."""
    want, model = config.vllm.max_model_len, config.vllm.model
    cfg_file = Path(model).expanduser() / "config.json"
    if not looks_local(model) or not cfg_file.is_file():
        return
    try:
        own = json.loads(cfg_file.read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        return  # check_model names an unreadable config.json
    if not want and isinstance(own, int) and config.trainer.max_completion_length >= own:
        raise PreflightError(
            f"trainer.max_completion_length ({config.trainer.max_completion_length}) leaves no room for the prompt in the "
            f"model's context ({own}, {cfg_file}); lower it"
        )
    if isinstance(own, int) and want > own:
        raise PreflightError(
            f"vllm.max_model_len ({want}) is above the model's max_position_embeddings ({own}) in {cfg_file}; vLLM would "
            f"refuse to start: set vllm.max_model_len={own} or lower (0 = the model's own)"
        )


def check_eval_dataset(config: JobConfig) -> None:
    """trainer.eval.dataset, when set: the same checks as trainer.dataset, the error naming its own key."""
    path = config.trainer.eval.dataset
    if not path:
        return
    t = config.trainer
    needed, why = data_needs(config, t.eval.reward_funcs or t.reward_funcs)
    try:
        schema = check_dataset(path, needed, t.columns, why)
    except PreflightError as e:
        raise PreflightError(str(e).replace("trainer.dataset", "trainer.eval.dataset", 1)) from None
    check_template_for(config, schema, "trainer.eval.dataset")


def check_node_inputs(config: JobConfig) -> None:
    check_model(config.vllm.model, calls_tools(config))
    check_context_length(config)
    check_lora_targets(config)
    check_data(config)
    check_eval_dataset(config)


def reward_problems(entries: list[str]) -> list[str]:
    """Each reward read from its source, not imported (launcher.core.reward_check): its module and function exist,
    its signature takes TRL's call, the modules it imports are installed here. One line each."""
    return [p for e in entries for p in reward_needs(e).problems]


def module_problem(key: str, entry: str) -> str | None:
    """A 'pkg.module:name' entry of `key` (a tool, environment or rollout_func) whose module cannot be found from here,
    or defines no `name`: read from its source as the rewards are (launcher.core.reward_check), not imported (its
    imports may need the GPU stack this host lacks)."""
    if ":" not in entry:
        return None
    module, _, name = entry.partition(":")
    source = source_of(module)
    if source is None:
        return (
            f"{key} {entry!r}: module {module!r} is not importable here; put its folder on PYTHONPATH "
            f"(the job's nodes get the same) or install it into the job's venv"
        )
    if source.suffix != ".py":
        return None  # a compiled module or a namespace package: found; the trainer resolves the name
    try:
        found = find_def(module, source, name, depth=0)
    except Unparsable as e:  # the ranks would die importing it
        return f"{key} {entry!r}: {e}; fix the file"
    if found is None:
        return f"{key} {entry!r}: module {module!r} has no {name!r}; fix the name after the ':' (defined in a way this reading of the source misses: --skip-checks agents)"
    return None


def _caught(*checks) -> list[str]:
    """Run each check; a PreflightError becomes its one-line problem, worded for the host running it."""
    problems = []
    for check in checks:
        try:
            check()
        except PreflightError as e:
            problems.append(str(e).replace(" on this node", " on this host"))
    return problems


def input_problems(config: JobConfig) -> list[str]:
    """The nodes' own checks (model folder, dataset), run on this host: each a one-line error."""
    return _caught(
        lambda: check_model(config.vllm.model, calls_tools(config)),
        lambda: check_context_length(config),
        lambda: check_lora_targets(config),
        lambda: check_data(config),
        lambda: check_eval_dataset(config),
    )


CHECK_KINDS = {
    "model": "vllm.model: a complete model folder (tokenizer, every shard whole), max_model_len within its context, "
    "LoRA targets among its layers",
    "data": "trainer.dataset readable (by content), with the columns the run needs",
    "rewards": "trainer.reward_funcs: module, function and signature (read from source), their imports installed",
    "agents": "trainer.tools/environment/rollout_func: each module importable, the name defined (read from source)",
    "venv": "slurm.setup_vars.venv has bin/activate",
}
"""The kinds of submit-host path checks, each skippable on its own (--skip-checks KIND,...; all of them: all, or
--skip-path-checks)."""
MEMORY = "memory"
"""The memory check (launcher/memory.py's estimate of vLLM's weights): no path, so neither `all` nor
--skip-path-checks skips it; only --skip-checks memory, for when the estimate is wrong."""
SKIP_KINDS = (*CHECK_KINDS, MEMORY)


def venv_problems(config: JobConfig) -> list[str]:
    venv = config.slurm.setup_vars.get("venv", "")
    if venv and not (Path(venv).expanduser() / "bin" / "activate").is_file():
        return [f"slurm.setup_vars.venv {venv!r}: no bin/activate there; create it (python -m venv {venv}) or fix the path"]
    return []


def submit_checks(config: JobConfig) -> dict[str, Callable[[], list[str]]]:
    """Kind (CHECK_KINDS) -> the check, run on the submit host; each returns one-line problems."""
    return {
        "model": lambda: _caught(
            lambda: check_model(config.vllm.model, calls_tools(config)),
            lambda: check_context_length(config),
            lambda: check_lora_targets(config),
        ),
        "data": lambda: _caught(lambda: check_data(config), lambda: check_eval_dataset(config)),
        "rewards": lambda: (
            reward_problems(config.trainer.reward_funcs)
            + [
                p.replace("trainer.reward_funcs", "trainer.eval.reward_funcs", 1)
                for p in reward_problems(config.trainer.eval.reward_funcs)
            ]
        ),
        "agents": lambda: agent_module_problems(config),
        "venv": lambda: venv_problems(config),
    }


def unchecked(config: JobConfig) -> dict[str, str]:
    """Kind -> why its check had nothing to look at here (a hub name, no venv set): shown as skipped with the reason,
    never as ok."""
    out = {}
    if not looks_local(config.vllm.model):
        out["model"] = f"hub name {config.vllm.model!r}: checked after the download at submit"
    if not agent_entries(config):
        out["agents"] = "none set (trainer.tools, trainer.environment, trainer.rollout_func)"
    if not config.slurm.setup_vars.get("venv"):
        here = shutil.which(config.job.python) or "not on this PATH"
        out["venv"] = f"none set: the nodes run job.python ({config.job.python}) from the PATH sbatch passes on, here {here}"
    return out


def submit_path_problems(config: JobConfig, skip: Iterable[str] = ()) -> list[str]:
    """What the nodes would find missing, checked on the submit host (but the kinds in skip): each a one-line error."""
    return [p for kind, check in submit_checks(config).items() if kind not in skip for p in check()]


def parse_skip(text: str) -> frozenset[str]:
    """--skip-checks model,data (or all: the path kinds; memory only by name) -> the kinds; an unknown kind is a
    one-line error with the menu."""
    kinds = {k.strip() for k in text.split(",") if k.strip()}
    bad = sorted(kinds - {*SKIP_KINDS, "all"})
    if bad:
        close = difflib.get_close_matches(bad[0], SKIP_KINDS, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(f"--skip-checks {bad[0]!r} is not a kind of check; {hint}kinds: {', '.join(SKIP_KINDS)} or all")
    return frozenset((kinds - {"all"}) | (set(CHECK_KINDS) if "all" in kinds else set()))


REWARD_CHECK_TIMEOUT_S = 300


def reward_import_problems(entries: list[str], python: str = sys.executable) -> list[str]:
    """The 'pkg.module:function' rewards resolved exactly as this host's trainer ranks will (trainer.rewards, in a
    child of the ranks' interpreter, cwd and environment: the modules' own imports stay out of the launcher), so a
    module that cannot be imported or lacks the function fails before vLLM starts. Each problem one line."""
    dotted = [e for e in entries if ":" in e]
    if not dotted:
        return []
    return _child_problems([python, "-m", "trainer.rewards", *dotted], f"trainer.reward_funcs {dotted}")


def _child_problems(argv: list[str], what: str) -> list[str]:
    """Run a trainer-side checker (its last stdout line: a JSON list of one-line problems) and return its problems."""
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=REWARD_CHECK_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return [f"{what}: importing them took over {REWARD_CHECK_TIMEOUT_S} s here; fix the module's imports"]
    lines = r.stdout.strip().splitlines()
    try:
        found = json.loads(lines[-1]) if lines else None
    except ValueError:
        found = None
    if isinstance(found, list) and (found or r.returncode == 0):
        return [str(x) for x in found]
    last = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
    return [f"{what}: checking them with `{' '.join(argv[:3])}` failed (exit {r.returncode}: {last})"]


def local_problems(config: JobConfig, python: str = sys.executable) -> list[str]:
    """What `slurm-grpo local` would find only after vLLM started: the nodes' checks, run here, and the rewards
    resolved as the trainer will. (No venv check: local runs in this interpreter.)"""
    t = config.trainer
    return (
        input_problems(config)
        + _rewards_resolved(t.reward_funcs, "trainer.reward_funcs", python)
        + _rewards_resolved(t.eval.reward_funcs, "trainer.eval.reward_funcs", python)
        + agent_import_problems(config, python)
    )


def _rewards_resolved(entries: list[str], key: str, python: str) -> list[str]:
    """The static reward check, then the import in a child for the entries it passed; each problem labelled by key
    (the checks themselves say trainer.reward_funcs)."""
    static = {e: reward_problems([e]) for e in entries}
    unflagged = [e for e, found in static.items() if not found]  # the child finds what only importing shows
    found = [p for problems in static.values() for p in problems] + reward_import_problems(unflagged, python)
    return [p.replace("trainer.reward_funcs", key, 1) for p in found]


def agent_entries(config: JobConfig) -> list[tuple[str, str]]:
    """(config key, 'pkg.module:name') of every tool, environment factory and rollout_func."""
    t = config.trainer
    out = [("trainer.tools", e) for e in t.tools]
    if isinstance(t.environment, dict):
        out += [(f"trainer.environment.{n}", e) for n, e in t.environment.items()]
    elif t.environment:
        out.append(("trainer.environment", t.environment))
    if t.rollout_func:
        out.append(("trainer.rollout_func", t.rollout_func))
    return out


def agent_module_problems(config: JobConfig) -> list[str]:
    """Each tool, environment or rollout_func whose module cannot be found from the submit host, or lacks the name
    (read from source, not run)."""
    out = []
    for key, entry in agent_entries(config):
        problem = module_problem(key, entry)
        if problem:
            out.append(problem)
    return out


def agent_import_problems(config: JobConfig, python: str = sys.executable) -> list[str]:
    """Tools, environments and rollout_func resolved exactly as this host's trainer ranks will (trainer.agents.resolve
    in a child, as for the rewards): importable, the right kind of object, tools the model can be told about."""
    t = config.trainer
    if not t.multi_turn:
        return []
    envs = (
        [f"{n}={e}" for n, e in t.environment.items()]
        if isinstance(t.environment, dict)
        else [t.environment] * bool(t.environment)
    )
    argv = [python, "-m", "trainer.agents.resolve"]
    argv += [x for e in t.tools for x in ("--tool", e)] + [x for e in envs for x in ("--environment", e)]
    argv += ["--rollout-func", t.rollout_func] if t.rollout_func else []
    return _child_problems(argv, "trainer.tools/environment/rollout_func")
