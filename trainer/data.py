"""Training prompts from local files only (JSONL, Parquet, Arrow, or a folder saved by `datasets`), with the config's
column mapping, system prompt and chat template applied, and the data cursor that lets a resumed run continue their
order."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from torch.utils.data import Sampler

from launcher.core.dataset_schema import read_jsonl
from trainer import trl_glue


def load_prompts(path: str, columns: dict[str, str] | None = None, system_prompt: str = ""):
    """The dataset as the trainer reads it: the format found from the content (JSONL, Parquet, Arrow, a `datasets`
    folder), `columns` renamed (run name -> stored name: {prompt: question}) and `system_prompt` put first in every
    prompt (prompts_with_system)."""
    from datasets import Dataset, load_from_disk

    from launcher.core.inputs import check_dataset

    columns = columns or {}
    schema = check_dataset(path, ("prompt",), columns)  # the same checks the bootstrap ran before starting the node
    if schema.format == "datasets-folder":
        ds = load_from_disk(path)
    elif schema.format == "parquet":
        ds = Dataset.from_parquet(path)
    elif schema.format == "arrow":
        ds = _arrow(path)
    else:
        ds = Dataset.from_list(read_jsonl(path, (columns.get("prompt", "prompt"),)))
    ds = ds.rename_columns({stored: name for name, stored in columns.items() if stored != name})
    if system_prompt:
        ds = ds.map(lambda row: {"prompt": prompts_with_system(row["prompt"], system_prompt)})
    return ds


def _arrow(path: str):
    import pyarrow as pa
    from datasets import Dataset

    try:  # the stream format `datasets` writes (cache files, save_to_disk shards)
        return Dataset.from_file(path)
    except Exception:  # the IPC file format (pyarrow.ipc.new_file, `feather` v2)
        with pa.memory_map(path) as source:
            return Dataset(pa.ipc.open_file(source).read_all())


def prompts_with_system(prompt, system_prompt: str) -> list[dict]:
    """A prompt with `system_prompt` first: a plain string becomes [system, user] (so it goes through the chat
    template); a conversation that opens with its own system message keeps it."""
    if isinstance(prompt, str):
        return [{"role": "system", "content": system_prompt}, {"role": "user", "content": prompt}]
    messages = list(prompt)
    if messages and messages[0].get("role") == "system":
        return messages
    return [{"role": "system", "content": system_prompt}, *messages]


def use_chat_template(tokenizer, template: str) -> None:
    """trainer.chat_template: conversational prompts are rendered with it instead of the model's own template (TRL
    renders them with the tokenizer's). `template` is the Jinja text itself or a file holding it; "" keeps the model's."""
    from launcher.core.inputs import is_inline_template

    if not template:
        return
    tokenizer.chat_template = template if is_inline_template(template) else Path(template).expanduser().read_text()


class FastForward(Sampler):
    """The trainer's own sampler, with the first `skip` indices of its stream dropped (across as many passes over
    the data as they span): a resumed run then sees the prompts an uninterrupted run would have seen from that
    step on. Later passes are the inner sampler's own (its generator carries on, as it would have)."""

    def __init__(self, inner: Sampler, skip: int):
        self.inner, self.skip = inner, skip

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]  # the Trainer's epoch arithmetic stays the inner one's

    def __iter__(self) -> Iterator[int]:
        skip, self.skip = self.skip, 0
        per_pass = len(self.inner)  # type: ignore[arg-type]
        while per_pass and skip >= per_pass:  # whole passes: draw their order (the generator advances), drop it
            for _ in self.inner:
                pass
            skip -= per_pass
        return itertools.islice(iter(self.inner), skip, None)


def indices_per_step(trainer) -> int:
    """Sampler indices one optimizer step consumes over the whole world (`step_indices` of the trainer's own)."""
    return step_indices(trainer.args, trainer.accelerator.num_processes)


def step_indices(args, world: int) -> int:
    """Sampler indices one optimizer step consumes over `world` processes, from GRPOConfig alone (known before the
    trainer is built): each of the gradient-accumulation micro-steps takes one dataloader batch
    (per_device x steps_per_generation indices) on every process."""
    return args.gradient_accumulation_steps * world * args.per_device_train_batch_size * args.steps_per_generation


def continue_data_order(trainer, consumed: int) -> None:
    """Make the trainer's sampler skip the `consumed` indices of the run so far, and its micro-step counter count on
    from there. Call before trainer.train() (which builds the dataloader)."""
    trl_glue.replace_train_sampler(trainer, lambda sampler: FastForward(sampler, consumed))
    # TRL regenerates when its micro-step counter is a multiple of steps_per_generation x num_iterations: it counts
    # from 0, so a run resumed between two generations would regenerate at other steps than the uninterrupted one
    per_micro_step = indices_per_step(trainer) // trainer.args.gradient_accumulation_steps
    trl_glue.set_micro_step(trainer, consumed // per_micro_step)


@dataclass(frozen=True)
class DataCursor:
    """How far into the sampler's stream a step is: recorded with each checkpoint, because a resumed run on another
    number of ranks consumes indices at another rate and cannot recompute the past from its own."""

    base_indices: int
    """Indices consumed before this attempt's first step (0, or what the resumed checkpoint recorded)."""
    base_step: int
    per_step: int
    """Indices one optimizer step of this attempt consumes (indices_per_step)."""

    def at(self, step: int) -> int:
        return self.base_indices + (step - self.base_step) * self.per_step


class Lookahead:
    """The trainer's train dataloader, read `depth` batches ahead: while the trainer works on batch k, `following[j-1]`
    is batch k+j of the same pass (the list is shorter at a pass's end), so the node's server can generate their
    completions during batch k's training (trainer.max_staleness). Everything else is the inner dataloader's."""

    def __init__(self, inner, depth: int = 1) -> None:
        self.inner, self.depth = inner, depth
        self.following: list = []

    @property
    def next_batch(self):
        return self.following[0] if self.following else None

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def __iter__(self):
        it = iter(self.inner)
        window = list(itertools.islice(it, self.depth + 1))
        while window:
            current, self.following = window[0], window[1:]
            yield current
            window = window[1:] + list(itertools.islice(it, 1))
        self.following = []


class LookaheadPrompts:
    """This rank's prompt ids of the next `depth` batches (fewer at a pass's end), tokenized the way TRL tokenizes them
    before it calls the generation backend (a difference only costs a lookahead miss). Made before the trainer and
    handed to the rollout (trainer.rollout.node.NodeRollout); `attach(trainer)` then wraps the trainer's train
    dataloader in a Lookahead (trainer.trl_glue hook 5: the dataloader exists only inside train())."""

    def __init__(self, depth: int = 1) -> None:
        self.depth = depth
        self.loader: Lookahead | None = None
        self.tokenize: Callable[[list], list[list[int]]] | None = None

    def attach(self, trainer) -> None:
        trl_glue.wrap_train_dataloader(trainer, self._wrap)
        self.tokenize = lambda prompts: trl_glue.tokenize_prompts(trainer, prompts)

    def _wrap(self, loader) -> Lookahead:
        self.loader = Lookahead(loader, self.depth)
        return self.loader

    def __call__(self) -> list[list[list[int]]]:
        if self.loader is None or self.tokenize is None:
            return []
        return [self.tokenize([x["prompt"] for x in batch]) for batch in self.loader.following]
