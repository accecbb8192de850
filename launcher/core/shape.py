"""The decoder shape of a model, read from its config.json: what the plan checks (TP divides the heads) and what
the memory estimate sizes. Torch-free and I/O-light (one small JSON file), so every process may read it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelShape:
    """The decoder shape that decides memory: Llama/Qwen2/Mistral layout (GQA attention, SwiGLU MLP)."""

    hidden: int
    layers: int
    intermediate: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool

    @classmethod
    def read(cls, model: str) -> ModelShape | None:
        """From a local model folder's config.json (a multimodal one's text_config); None if not readable."""
        try:
            c = json.loads((Path(model) / "config.json").read_text())
        except (OSError, ValueError):
            return None
        c = c.get("text_config", c)
        need = ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size", "num_attention_heads")
        if not all(isinstance(c.get(k), int) for k in need):
            return None
        heads = c["num_attention_heads"]
        return cls(
            hidden=c["hidden_size"],
            layers=c["num_hidden_layers"],
            intermediate=c["intermediate_size"],
            vocab=c["vocab_size"],
            heads=heads,
            kv_heads=int(c.get("num_key_value_heads") or heads),
            head_dim=int(c.get("head_dim") or c["hidden_size"] // heads),
            tied=bool(c.get("tie_word_embeddings", False)),
        )

    @property
    def layer_params(self) -> int:
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return h * q + q + 2 * (h * kv + kv) + q * h + 3 * h * self.intermediate + 2 * h

    @property
    def root_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.root_params

    @property
    def largest_tensor(self) -> int:
        return max(self.vocab * self.hidden, self.hidden * self.intermediate)
