"""Training prompts from local files only: JSONL, Parquet, or a folder saved by `datasets`."""

from __future__ import annotations

from pathlib import Path


def load_prompts(path: str):
    from datasets import Dataset, load_from_disk

    from launcher.preflight import check_dataset, read_jsonl_prompts

    check_dataset(path)  # the same checks the bootstrap ran before starting the node
    p = Path(path)
    if p.is_dir():
        ds = load_from_disk(str(p))
    elif p.suffix == ".parquet":
        ds = Dataset.from_parquet(str(p))
    else:
        ds = Dataset.from_list(read_jsonl_prompts(path))
    if "prompt" not in ds.column_names:
        raise ValueError(f"trainer.dataset {path}: no 'prompt' column (columns: {', '.join(ds.column_names)})")
    if len(ds) == 0:
        raise ValueError(f"trainer.dataset {path} is empty")
    return ds
