"""The model-folder check (launcher.core.inputs.check_model, launcher.core.weights) refuses folders that cannot load,
read cheaply without torch: no tokenizer vocabulary (tokenizer_config.json alone), an index whose shards are missing,
a truncated or empty safetensors file. Before, each passed as `model ok` (REVIEW-newcomer item 4)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from launcher.core.inputs import PreflightError, check_model
from launcher.core.weights import WeightsError, safetensors_header, weight_shapes

NAMES = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"]


def model_folder(d: Path, names: list[str] = NAMES, shards: int = 1) -> Path:
    """A folder transformers' conventions call complete: config.json, tokenizer.json and safetensors weights (one file,
    or `shards` files with an index), each tensor a small 2-D array."""
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    (d / "tokenizer.json").write_text("{}")
    (d / "tokenizer_config.json").write_text("{}")
    tensors = {n: np.zeros((4, 2), dtype=np.float32) for n in names}
    if shards == 1:
        save_file(tensors, str(d / "model.safetensors"))
        return d
    files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map = {n: files[i % shards] for i, n in enumerate(names)}
    for f in files:
        save_file({n: t for n, t in tensors.items() if weight_map[n] == f}, str(d / f))
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return d


def test_complete_folders_pass_and_their_tensor_names_are_read(tmp_path):
    for shards in (1, 2):
        m = model_folder(tmp_path / f"m{shards}", shards=shards)
        check_model(str(m))
        assert weight_shapes(m) == {n: [4, 2] for n in NAMES}
    slow = model_folder(tmp_path / "slow")  # a slow tokenizer's vocabulary files instead of tokenizer.json
    (slow / "tokenizer.json").unlink()
    (slow / "vocab.json").write_text("{}")
    (slow / "merges.txt").write_text("")
    check_model(str(slow))
    kimi = model_folder(tmp_path / "kimi")  # Kimi-K2 and Moonlight: a custom tokenizer reading tiktoken.model
    (kimi / "tokenizer.json").unlink()
    (kimi / "tiktoken.model").write_text("")
    check_model(str(kimi))
    # a Mistral repo downloaded with the HF shards only: consolidated.safetensors.index.json (Mistral's own format)
    # names shards that are not there; vLLM and transformers read model.safetensors.index.json, and so does the check
    mistral = model_folder(tmp_path / "mistral", shards=2)
    (mistral / "consolidated.safetensors.index.json").write_text(
        '{"weight_map": {"layers.0.attention.wq.weight": "consolidated-00001-of-00002.safetensors"}}'
    )
    check_model(str(mistral))
    assert weight_shapes(mistral) == {n: [4, 2] for n in NAMES}


def break_folder(m: Path, how: str) -> None:
    if how == "tokenizer_config.json only":
        (m / "tokenizer.json").unlink()
    elif how == "vocab.json without merges.txt":
        (m / "tokenizer.json").unlink()
        (m / "vocab.json").write_text("{}")
    elif how == "index shards missing":
        for f in m.glob("model-*.safetensors"):
            f.unlink()
    elif how == "stale index beside one file":  # make-tiny-model re-run into a folder first made sharded
        shutil.copy(m / "model-00001-of-00002.safetensors", m / "model.safetensors")
        (m / "model-00002-of-00002.safetensors").unlink()
    elif how == "truncated":
        f = m / "model-00001-of-00002.safetensors"
        f.write_bytes(f.read_bytes()[:-10])
    elif how == "truncated inside the header":
        f = m / "model-00001-of-00002.safetensors"
        f.write_bytes(f.read_bytes()[:40])
    elif how == "empty":
        (m / "model-00002-of-00002.safetensors").write_bytes(b"")


@pytest.mark.parametrize(
    "how, needle",
    [
        ("tokenizer_config.json only", "missing a tokenizer's vocabulary (tokenizer.json, or tokenizer.model"),
        ("vocab.json without merges.txt", "missing a tokenizer's vocabulary"),
        ("index shards missing", "names 2 shards, 2 missing here (model-00001-of-00002.safetensors, model-00002"),
        ("stale index beside one file", "names 2 shards, 1 missing here (model-00002-of-00002.safetensors)"),
        ("truncated", "model-00001-of-00002.safetensors is {size} bytes but its header describes {size_plus_10}: truncated"),
        ("truncated inside the header", "its header claims"),
        ("empty", "model-00002-of-00002.safetensors is 0 bytes, too short for a safetensors file"),
    ],
)
def test_a_folder_that_cannot_load_is_refused_in_one_line(tmp_path, how, needle):
    m = model_folder(tmp_path / "m", shards=2)
    size = (m / "model-00001-of-00002.safetensors").stat().st_size - 10 * (how == "truncated")
    break_folder(m, how)
    needle = needle.format(size=size, size_plus_10=size + 10)
    with pytest.raises(PreflightError) as got:
        check_model(str(m))
    assert needle in str(got.value) and str(got.value).startswith(f"vllm.model {str(m)!r}"), got.value
    assert "\n" not in str(got.value)


def test_a_header_is_read_from_the_first_bytes_and_garbage_refused(tmp_path):
    f = tmp_path / "w.safetensors"
    save_file({"a": np.zeros((1000, 100), dtype=np.float32)}, str(f))
    assert safetensors_header(f)["a"]["shape"] == [1000, 100]
    f.write_bytes(b"not a safetensors file at all")
    with pytest.raises(WeightsError, match="header claims"):
        safetensors_header(f)
