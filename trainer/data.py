"""Training prompts from local files only: JSONL, Parquet, or a folder saved by `datasets`."""

from __future__ import annotations

import json
from pathlib import Path


def load_prompts(path: str):
    from datasets import Dataset, load_from_disk

    p = Path(path)
    if not p.exists():
        raise ValueError(f"trainer.dataset {path!r} does not exist (paths are read on the nodes; use an absolute path)")
    if p.is_dir():
        ds = load_from_disk(str(p))
    elif p.suffix == ".parquet":
        ds = Dataset.from_parquet(str(p))
    elif p.suffix in (".jsonl", ".json"):
        rows = []
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except ValueError as e:
                raise ValueError(f"trainer.dataset {path}: line {i} is not valid JSON ({e}); fix or remove that line") from None
        ds = Dataset.from_list(rows)
    else:
        raise ValueError(f"trainer.dataset {path!r}: unknown format; use .jsonl, .parquet or a `datasets` folder")
    if "prompt" not in ds.column_names:
        raise ValueError(f"trainer.dataset {path}: no 'prompt' column (columns: {', '.join(ds.column_names)})")
    if len(ds) == 0:
        raise ValueError(f"trainer.dataset {path} is empty")
    return ds
