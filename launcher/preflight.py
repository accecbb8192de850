"""Checks each node runs before it starts anything (torch-free): the model folder and the dataset are
readable there. A missing model or a malformed data line then fails in seconds, naming the node and the
file, instead of after a minute of vLLM start-up or inside a torchrun traceback."""

from __future__ import annotations

import json
from pathlib import Path

from launcher.config import JobConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
WEIGHT_GLOBS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")


class PreflightError(ValueError):
    pass


def looks_local(model: str) -> bool:
    """A hub name is `org/name` (or `name`); anything absolute, relative-dotted or home-based is a path."""
    return model.startswith(("/", "./", "../", "~")) or Path(model).expanduser().exists()


def check_model(model: str) -> None:
    if not looks_local(model):
        return  # a hub name: vLLM and transformers resolve it (from the node's HF cache when offline)
    p = Path(model).expanduser()
    if not p.is_dir():
        raise PreflightError(
            f"vllm.model {model!r}: no such folder on this node (model folders must be on a "
            f"file system every node mounts; build a test one with `slurm-grpo make-tiny-model DIR`)"
        )
    missing = []
    if not (p / "config.json").is_file():
        missing.append("config.json")
    if not any((p / f).is_file() for f in TOKENIZER_FILES):
        missing.append("a tokenizer (tokenizer.json or tokenizer_config.json)")
    if not any(any(p.glob(g)) for g in WEIGHT_GLOBS):
        missing.append("weights (*.safetensors)")
    if missing:
        raise PreflightError(f"vllm.model {model!r} is not a complete model folder: missing {', '.join(missing)}")
    try:
        json.loads((p / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise PreflightError(f"vllm.model {model!r}: config.json is unreadable ({e})") from None


def read_jsonl_prompts(path: str) -> list[dict]:
    """Every non-empty line a JSON object with a 'prompt'; the error names the file and the line."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise PreflightError(f"trainer.dataset {path!r} is unreadable: {e.strerror}") from None
    rows = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise PreflightError(f"trainer.dataset {path}: line {i} is not valid JSON ({e}); fix or remove that line") from None
        if not isinstance(row, dict) or "prompt" not in row:
            raise PreflightError(
                f'trainer.dataset {path}: line {i} has no \'prompt\' field; each line must be an object like {{"prompt": "..."}}'
            )
        rows.append(row)
    if not rows:
        raise PreflightError(f"trainer.dataset {path} is empty")
    return rows


def check_dataset(path: str) -> None:
    p = Path(path)
    if not p.exists():
        raise PreflightError(
            f"trainer.dataset {path!r} does not exist on this node (paths are read on the nodes; "
            f"use an absolute path on a shared file system)"
        )
    if p.is_dir():
        if not any((p / f).exists() for f in ("dataset_info.json", "state.json", "dataset_dict.json")):
            raise PreflightError(f"trainer.dataset {path!r} is a folder but not one saved by `datasets` (no dataset_info.json)")
    elif p.suffix in (".jsonl", ".json"):
        read_jsonl_prompts(path)
    elif p.suffix != ".parquet":
        raise PreflightError(f"trainer.dataset {path!r}: unknown format; use .jsonl, .parquet or a `datasets` folder")


def check_node_inputs(config: JobConfig) -> None:
    check_model(config.vllm.model)
    check_dataset(config.trainer.dataset)
