"""What a training dataset file holds, read cheaply where no torch or `datasets` is (the login node, a node before its
trainer starts): its format, found from the content and not the file name, its columns and whether it has a row.

- JSONL: every line is parsed (a JSON object each), so a malformed line fails here, naming its number.
- Parquet (magic `PAR1`): the footer only (schema and row count).
- Arrow, IPC file (`ARROW1`) or stream (what `datasets` writes): the schema and the first record batch.
- A folder saved by `datasets` (`save_to_disk`): its state.json names the Arrow files; a DatasetDict folder (several
  splits) is refused with the split folders to pick from.
"""

from __future__ import annotations

import functools
import heapq
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

FORMATS = "JSONL (one JSON object a line), Parquet, Arrow, or a folder saved by `datasets` (save_to_disk)"


class DatasetError(ValueError):
    """A dataset that cannot be read as one of FORMATS, or that is empty: one line naming the file and the fix."""


@dataclass(frozen=True)
class Schema:
    format: str
    """jsonl, parquet, arrow or datasets-folder."""
    columns: tuple[str, ...]
    """Column names as stored (before trainer.columns renames them)."""
    files: tuple[str, ...] = ()
    """The Arrow files of a `datasets` folder (empty otherwise)."""
    list_columns: tuple[str, ...] = ()
    """Columns holding lists (a conversational prompt is a list of messages): JSONL's first row, Arrow's types."""
    rows: int | None = None
    """Rows in the whole dataset (JSONL's objects, Parquet's footer, the Arrow batches' lengths); None = not counted."""
    non_prompt_types: dict[str, str] = field(default_factory=dict)
    """Arrow and Parquet: column -> its type, for the columns whose type can hold no prompt (neither a string nor a
    list of {role, content} structs)."""
    longest_prompts: tuple[str, ...] = ()
    """JSONL read with its prompt column named: the LONGEST_KEPT longest prompts by characters (a conversation as its
    messages' contents joined), for the memory estimate's prompt length (TRL pads a batch to its longest prompt)."""


def read_schema(path: str, required: tuple[str, ...] = (), prompt: str = "") -> Schema:
    """The dataset's format and columns; DatasetError if it is unreadable or empty, or (JSONL) a line lacks a column
    of `required` (the names as stored) that the first rows have, or the column `prompt` (its stored name) holds
    something other than prompts (a string, or a list of {role, content} messages): JSONL every line's value,
    Arrow and Parquet the column's type."""
    schema = _read_once(path, required, prompt, _file_state(path))
    if prompt and schema.format != "jsonl" and prompt in schema.columns and prompt in schema.non_prompt_types:
        raise DatasetError(
            f"trainer.dataset {path}: column {prompt!r} holds {schema.non_prompt_types[prompt]}, not prompts; {PROMPT_IS}"
        )
    return schema


@functools.lru_cache(maxsize=16)
def _read_once(path: str, required: tuple[str, ...], prompt: str, state: tuple[int, int] | None) -> Schema:
    """_read_schema once per file state: a dry-run's data check and its plan's epochs line read a multi-GB JSONL once."""
    return _read_schema(path, required, prompt)


def _file_state(path: str) -> tuple[int, int] | None:
    """The file's (or folder's) modification time and size: a changed file is read again."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


PROMPT_IS = "a prompt is a string or a list of {role, content} messages: fix the data or map another column with trainer.columns"


LONGEST_KEPT = 8
"""Prompts kept by length for the memory estimate: characters rank them, the tokenizer measures these few."""


def prompt_text(value: str | list) -> str:
    """A prompt's text: the string, or a conversation's message contents joined (what the tokenizer mostly sees); a
    content of parts ([{type: text, text}], TRL's) counts its text parts."""
    if isinstance(value, str):
        return value
    return "\n".join(_content_text(m["content"]) for m in value)


def _content_text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(c.get("text", "")) for c in content if isinstance(c, dict))
    return json.dumps(content)


def prompt_problem(value: object) -> str | None:
    """What is wrong with one row's prompt value (None: a string, or a non-empty list of {role, content} messages)."""
    if isinstance(value, str):
        return None
    if (
        isinstance(value, list)
        and value
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in value)
    ):
        return None
    shown = json.dumps(value)
    return f"{shown[:60]}{'...' if len(shown) > 60 else ''} ({type(value).__name__})"


def _read_schema(path: str, required: tuple[str, ...], prompt: str) -> Schema:
    p = Path(path)
    if p.is_dir():
        return _folder(p)
    try:
        with p.open("rb") as f:
            head = f.read(8)
    except OSError as e:
        raise DatasetError(f"trainer.dataset {path!r} is unreadable: {e.strerror}") from None
    if not head.strip():
        raise DatasetError(f"trainer.dataset {path} is empty")
    if head.startswith(b"PAR1"):
        return _parquet(p)
    if head.startswith(b"ARROW1") or head.startswith(b"\xff\xff\xff\xff"):
        return _arrow(p, "arrow")
    if head.lstrip()[:1] == b"{":
        lines = _jsonl_lines(path)
        columns = tuple(dict.fromkeys(k for _, row in lines[:100] for k in row))  # the first rows' keys, in order
        # a column no first row has is the caller's one-line column error; one that only some lines lack, this one's
        _require(path, lines, [c for c in required if c in columns])
        longest: list[tuple[int, int, str]] = []  # a bounded heap of (characters, line, text): the longest few only
        for i, row in lines if prompt else ():  # a null or a number fails in the chat template, on the nodes
            bad = prompt_problem(row[prompt]) if prompt in row else None
            if bad:
                raise DatasetError(f"trainer.dataset {path}: line {i}'s {prompt!r} is {bad}; {PROMPT_IS}")
            if prompt in row:
                text = prompt_text(row[prompt])
                if len(longest) < LONGEST_KEPT:
                    heapq.heappush(longest, (len(text), i, text))
                elif len(text) > longest[0][0]:
                    heapq.heappushpop(longest, (len(text), i, text))
        lists = tuple(k for k, v in lines[0][1].items() if isinstance(v, list))
        kept = tuple(t for _, _, t in sorted(longest, reverse=True))
        return Schema("jsonl", columns, list_columns=lists, rows=len(lines), longest_prompts=kept)
    raise DatasetError(f"trainer.dataset {path!r}: not a format slurm-grpo reads; use {FORMATS}")


def read_jsonl(path: str, required: tuple[str, ...] = ()) -> list[dict]:
    """Every non-empty line a JSON object holding each column of `required`; the error names the file and the line."""
    lines = _jsonl_lines(path)
    _require(path, lines, required)
    return [row for _, row in lines]


def _jsonl_lines(path: str) -> list[tuple[int, dict]]:
    """(line number, object) of every non-empty line; DatasetError naming the first line that is no JSON object."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise DatasetError(f"trainer.dataset {path!r} is unreadable as JSONL text: {getattr(e, 'strerror', None) or e}") from None
    rows = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise DatasetError(f"trainer.dataset {path}: line {i} is not valid JSON ({e}); fix or remove that line") from None
        if not isinstance(row, dict):
            raise DatasetError(
                f'trainer.dataset {path}: line {i} is not a JSON object; each line must be like {{"prompt": "..."}}'
            )
        rows.append((i, row))
    if not rows:
        raise DatasetError(f"trainer.dataset {path} is empty")
    return rows


def _require(path: str, lines: list[tuple[int, dict]], required: tuple[str, ...] | list[str]) -> None:
    for i, row in lines:
        missing = [c for c in required if c not in row]
        if missing:
            raise DatasetError(
                f"trainer.dataset {path}: line {i} has no {missing[0]!r} field (keys: {', '.join(row) or 'none'}); "
                f"add it to every line or map another column with trainer.columns"
            )


def _parquet(p: Path) -> Schema:
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(p).metadata
    except Exception as e:  # pyarrow raises ArrowInvalid/OSError for a truncated or foreign file
        raise DatasetError(f"trainer.dataset {p}: unreadable Parquet ({_first_line(e)})") from None
    if meta.num_rows == 0:
        raise DatasetError(f"trainer.dataset {p} is empty (a Parquet file with no rows)")
    return _schema("parquet", meta.schema.to_arrow_schema(), rows=meta.num_rows)


def _schema(fmt: str, arrow_schema, files: tuple[str, ...] = (), rows: int | None = None) -> Schema:
    import pyarrow as pa

    lists = tuple(f.name for f in arrow_schema if pa.types.is_list(f.type) or pa.types.is_large_list(f.type))
    bad = {f.name: str(f.type) for f in arrow_schema if not _prompt_type(f.type)}
    return Schema(fmt, tuple(arrow_schema.names), files, lists, rows, bad)


def _prompt_type(t) -> bool:
    """An Arrow type that holds prompts: a string, or a list of structs with role and content."""
    import pyarrow as pa

    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):  # string_view: Polars'
        return True
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_list_view(t):
        v = t.value_type
        return pa.types.is_struct(v) and {"role", "content"} <= {v.field(i).name for i in range(v.num_fields)}
    return False


def _arrow_rows(p: Path):
    """(schema, rows) of an Arrow IPC file or stream, memory-mapped: the batches' lengths, no column data read."""
    import pyarrow as pa

    try:
        with pa.memory_map(str(p)) as source:
            try:
                reader = pa.ipc.open_file(source)
                return reader.schema, sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))
            except pa.ArrowInvalid:
                source.seek(0)
                stream = pa.ipc.open_stream(source)
                return stream.schema, sum(b.num_rows for b in stream)
    except Exception as e:
        raise DatasetError(f"trainer.dataset {p}: unreadable Arrow ({_first_line(e)})") from None


def _arrow(p: Path, fmt: str, files: tuple[str, ...] = ()) -> Schema:
    schema, rows = _arrow_rows(p)
    rows += sum(_arrow_rows(Path(f))[1] for f in files[1:])  # a `datasets` folder's other files
    if not rows:
        raise DatasetError(f"trainer.dataset {p} is empty (an Arrow file with no rows)")
    return _schema(fmt, schema, files, rows)


def _folder(p: Path) -> Schema:
    if (p / "dataset_dict.json").is_file():
        splits = sorted(q.name for q in p.iterdir() if (q / "state.json").is_file())
        pick = "train" if "train" in splits or not splits else splits[0]  # never point a training run at `test`
        raise DatasetError(
            f"trainer.dataset {str(p)!r} holds several splits ({', '.join(splits)}); name one folder, e.g. "
            f"trainer.dataset={p / pick}"
        )
    state = p / "state.json"
    try:
        files = [str(p / f["filename"]) for f in json.loads(state.read_text())["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError):
        raise DatasetError(
            f"trainer.dataset {str(p)!r} is a folder but not one saved by `datasets` (no readable state.json); use {FORMATS}"
        ) from None
    if not files:
        raise DatasetError(f"trainer.dataset {p} is empty (its state.json lists no data file)")
    return _arrow(Path(files[0]), "datasets-folder", tuple(files))


def _first_line(e: Exception) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0][:150]
