"""The vLLM worker's side of a LoRA adapter push through the weight-transfer engine (trainer.lora.adapter_transport
engine): the adapter's tensors arrive as a full push's weights do (the gloo, nccl_adapter or mapped_ipc engine, the
same packed chunks or staging buffer), and instead of the model's load_weights they become a LoRAModel, built the way
vLLM 0.32 builds one from a peft folder (WorkerLoRAManager._load_adapter: PEFTHelper, validate_legal, the expected
modules, LoRAModel.from_lora_tensors), with the adapter's config sent once with the engine's init info. No file is
written or read.

Installed how: at the push's finish the LoRAModel is kept in this worker process under the adapter's name (PUSHED)
and the adapter of that name is removed from the worker's LoRA manager; the next engine step naming it re-adds it
through vLLM's own per-step path (LRUCacheWorkerLoRAManager.add_adapter -> _load_adapter), which the plugin
(vllm_plugin.load_adapters_once) points at PUSHED instead of the disk: same name, same id, same slot, so requests in
flight go on under the pushed weights, as after a disk load in place. Not installed at once because the worker's
finish_weight_update ends with reset_lora_state(), which removes every adapter (vLLM assumes the base changed); the
per-step path brings it back either way.

The name must be known to the API server first (its one /v1/load_lora_adapter, the zero adapter from a folder: the
id comes from there, IDS). An explicit load from a folder (load_inplace, /v1/load_lora_adapter) wins over pushed
tensors: the file is the newer.

TP > 1: every worker of the server is in the transfer group and receives the whole adapter; vLLM's LoRA layers slice
A and B per TP rank when the adapter is activated (BaseLinearLayerWithLoRA.set_lora -> slice_lora_a / slice_lora_b,
column- and row-parallel alike), exactly as they slice an adapter read from a file.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

TENSORS_MARK = "slurm-grpo vLLM plugin: LoRA adapter installed from pushed tensors"
"""Printed (name, id, push count) each time a worker's per-step path installs a pushed adapter: one per push."""

PUSHED: dict[str, Any] = {}
"""Adapter name -> the LoRAModel built from its last pushed tensors, in this worker process."""
IDS: dict[str, int] = {}
"""Adapter name -> the int id the API server gave it (seen when it was first loaded by name)."""
PUSH_COUNT: dict[str, int] = {}


def load_adapter(manager: Any, lora_request: Any, read: Callable[[Any, Any], Any]) -> Any:
    """WorkerLoRAManager._load_adapter as the plugin patches it: the pushed LoRAModel of the request's name where there
    is one and the request is the per-step re-add (load_inplace off), else `read` (vLLM's own: the folder)."""
    name = lora_request.lora_name
    IDS[name] = lora_request.lora_int_id
    lora = PUSHED.get(name)
    if lora_request.load_inplace or lora is None:  # an explicit load from a folder: newer than any pushed tensors
        PUSHED.pop(name, None)
        return read(manager, lora_request)
    print(
        f"{TENSORS_MARK}: {name} id {lora_request.lora_int_id} push {PUSH_COUNT.get(name, 0)} (pid {os.getpid()})",
        flush=True,
    )
    return lora if lora.id == lora_request.lora_int_id else lora.clone(lora_request.lora_int_id)


def peft_helper(peft_config: dict, max_position_embeddings: int | None) -> Any:
    """vLLM's PEFTHelper of an adapter_config.json's content (as PEFTHelper.from_local_dir makes it)."""
    from vllm.lora.peft_helper import PEFTHelper

    return PEFTHelper.from_dict({**peft_config, "vllm_max_position_embeddings": max_position_embeddings})


def expected_modules(supported: list[str], packed: dict[str, list[str]]) -> set[str]:
    """The module names an adapter may target (WorkerLoRAManager._load_adapter's expected_lora_modules)."""
    out: set[str] = set()
    for module in supported:
        out.update(packed.get(module, [module]))
        if module == "experts":
            out.add(module)
    return out


def check_modules(names: list[str], expected: set[str], mapper: Any = None) -> None:
    """Every tensor targets a module vLLM adapts (from_local_checkpoint's check; from_lora_tensors has none)."""
    from vllm.lora.utils import parse_fine_tuned_lora_name

    bad = sorted({m for n in names if (m := parse_fine_tuned_lora_name(n, mapper)[0]).rsplit(".", 1)[-1] not in expected})
    if bad:
        raise ValueError(
            f"pushed LoRA adapter: modules {bad[:4]} are not among those vLLM adapts here {sorted(expected)}; narrow "
            "trainer.lora.target_modules to those, or set trainer.lora.adapter_transport: disk"
        )


def build_lora_model(
    tensors: dict[str, torch.Tensor],
    peft_config: dict,
    lora_id: int,
    *,
    lora_config: Any,
    expected: set[str],
    vocab_size: int,
    max_position_embeddings: int | None,
    device: torch.device,
    weights_mapper: Any = None,
    skip_prefixes: list[str] | None = None,
) -> Any:
    """A LoRAModel of peft-named tensors, as vLLM's _load_adapter builds one from a folder (its arguments, but the
    tensors stay on `device`: on a GPU they arrived there, and activation copies them into the slots from there)."""
    from vllm.lora.lora_model import LoRAModel

    helper = peft_helper(peft_config, max_position_embeddings)
    helper.validate_legal(lora_config)
    check_modules(list(tensors), expected, weights_mapper)
    return LoRAModel.from_lora_tensors(
        lora_model_id=lora_id,
        tensors=tensors,
        peft_helper=helper,
        device=str(device),
        dtype=lora_config.lora_dtype,
        model_vocab_size=vocab_size,
        weights_mapper=weights_mapper,
        skip_prefixes=skip_prefixes,
    )


class AdapterReceiver:
    """One engine's adapter push: start() begins it, collect() takes each received (name, tensor) batch (a copy: the
    chunk buffers and the ipc staging buffer are reused), finish() builds the LoRAModel and hands it over (PUSHED),
    dropping the adapter the worker holds under that name."""

    def __init__(self, target: dict, engine: Any):
        if set(target) != {"name", "peft_config"}:
            raise ValueError(f"lora_adapter init info: expected name and peft_config, got {sorted(target)}")
        self.name: str = target["name"]
        self.peft_config: dict = target["peft_config"]
        self.engine = engine
        self.tensors: dict[str, torch.Tensor] = {}
        vc = engine.vllm_config
        if vc.lora_config is None:
            raise ValueError(
                "a LoRA adapter push needs vLLM started with --enable-lora (the launcher adds it with trainer.lora.push "
                "adapter); set trainer.lora.adapter_transport: disk or check vllm.extra_args"
            )
        manager = getattr(engine.model, "lora_manager", None)
        if manager is None:
            raise ValueError(
                "this vLLM's model has no lora_manager (vLLM 0.32 sets model.lora_manager): the adapter cannot be built "
                "from pushed tensors here; set trainer.lora.adapter_transport: disk"
            )
        self.manager: Any = manager
        from vllm.lora import worker_manager as wm

        if not getattr(wm.LRUCacheWorkerLoRAManager._apply_adapters, "_slurm_grpo", False):
            # without the plugin's patch the per-step re-add would read the name's folder: the zero adapter, silently
            raise ValueError(
                "the adapter push through the engine needs the plugin's LoRA patch (SLURM_GRPO_LORA_LOAD_ONCE=1, set by "
                "the launcher with trainer.lora.push adapter) in every vLLM process; set trainer.lora.adapter_transport: disk"
            )

    def start(self) -> None:
        self.tensors = {}

    def collect(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        for name, t in weights:
            self.tensors[name] = t.clone()

    def finish(self) -> None:
        engine, manager = self.engine, self.manager
        text = engine.model_config.hf_config.get_text_config()
        mapper = getattr(engine.model, "hf_to_vllm_mapper", None)
        lora = build_lora_model(
            self.tensors,
            self.peft_config,
            IDS.get(self.name, 1),  # the id is the API server's; load_adapter re-ids a clone if it differs
            lora_config=engine.vllm_config.lora_config,
            expected=expected_modules(manager.supported_lora_modules, manager.packed_modules_mapping),
            vocab_size=engine.model_config.get_vocab_size(),
            max_position_embeddings=getattr(text, "max_position_embeddings", None),
            device=engine.device,
            weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
            skip_prefixes=getattr(engine.model, "lora_skip_prefixes", None),
        )
        PUSHED[self.name] = lora
        PUSH_COUNT[self.name] = PUSH_COUNT.get(self.name, 0) + 1
        if self.name in IDS:  # the next step naming it re-adds it from PUSHED (load_adapter)
            manager.remove_adapter(IDS[self.name])
        self.tensors = {}


class AdapterOrWeights:
    """Mixed in before a vLLM weight-transfer engine whose pushes are either a LoRA adapter's (self.adapter, set by
    init_transfer_engine from the init info) or full weights (the engine's own start and finish)."""

    adapter: AdapterReceiver | None = None

    def start_weight_update(self) -> None:
        if self.adapter is not None:
            self.adapter.start()
        else:
            super().start_weight_update()  # type: ignore[misc]

    def finish_weight_update(self) -> None:
        if self.adapter is not None:
            self.adapter.finish()
        else:
            super().finish_weight_update()  # type: ignore[misc]


def receiver(init_info: Any, engine: Any) -> AdapterReceiver | None:
    """The engine's AdapterReceiver when its init info names an adapter (lora_adapter), else None (a full push)."""
    target = getattr(init_info, "lora_adapter", None)
    return AdapterReceiver(target, engine) if target else None
