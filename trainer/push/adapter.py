"""The weight push of a LoRA run (trainer.lora), two ways, as the plan decided (launcher.core.lora):

  adapter  every rank takes part in gathering the adapter's parameters (a few MB; the frozen base never moves); the
           node leader sends them to its own server, then resets the prefix cache; generation and parity requests name
           the adapter (GenerationSettings.model). Two transports (trainer.lora.adapter_transport):
             engine  through the push's weight-transfer engine (gloo, nccl or mapped_ipc, the full push's senders and
                     chunks), its init info naming the adapter and its peft config; each vLLM worker builds the LoRA
                     model from the tensors and installs it under the same name and id (trainer.push.adapter_receiver).
                     No file per push.
             disk    in peft's format (adapter_model.safetensors + adapter_config.json) into a new node-local folder
                     (JobDir.adapter_push), loaded by its server under one name (/v1/load_lora_adapter, load_inplace).
           Before the first push the leader loads a zero adapter (B = 0: exactly the base) from a folder, either way:
           the server then knows the name (and gives it its id) and answers requests naming it from the start (the
           parity check before a resumed run's first push).
  merged   where vLLM cannot serve the adapter: the base with the adapter merged in (W + alpha/r B A, computed in fp32
           per layer, sent in the serving dtype) under the base's names, through the ordinary senders.

Both count the bytes a push moves (`bytes_last`)."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from launcher.core.config import LoraConfig
from launcher.core.jobdir import JobDir
from launcher.core.lora import ADAPTER, ADAPTER_NAME, ENGINE, MERGED
from launcher.core.plan import Plan
from trainer import lora as trainer_lora
from trainer.push.gather import _live_cuda, hand_over, iter_unsharded_params
from trainer.push.pusher import NodePusher, PushSettings, make_sender, with_requests_paused
from trainer.push.wire import ParamMeta
from trainer.rollout.server import VllmServer

KEEP_PUSHED = 2
"""Adapter folders kept on the node (the newest ones); vLLM has read each by the time its load answers."""


@dataclass(frozen=True)
class LoraPush:
    """What a node's push needs of trainer.lora, from the plan."""

    mode: str
    """launcher.core.lora.ADAPTER or MERGED."""
    lora: LoraConfig
    base_model: str
    folder: str
    """Node-local folder of the pushed adapters (JobDir.adapter_pushes)."""

    @staticmethod
    def from_plan(plan: Plan, node: int) -> LoraPush | None:
        if not plan.lora_push:
            return None
        folder = JobDir(Path(plan.job_dir)).adapter_pushes(node)
        return LoraPush(plan.lora_push, plan.config.trainer.lora, plan.config.vllm.model, str(folder))

    @property
    def via_engine(self) -> bool:
        """The adapter's tensors go through the weight-transfer engine (trainer.lora.adapter_transport engine)."""
        return self.mode == ADAPTER and self.lora.adapter_transport == ENGINE

    @property
    def served_name(self) -> str | None:
        """The model name generation and parity requests give: the adapter's on the adapter path."""
        return ADAPTER_NAME if self.mode == ADAPTER else None


def make_pusher(model, client: VllmServer | None, push: PushSettings, lora: LoraPush | None, device: torch.device) -> Any:
    """The node's pusher: NodePusher without LoRA, else AdapterPusher or MergedPusher (same push/pushes interface)."""
    if lora is None:
        return NodePusher(model, client, push, device)
    if lora.mode == MERGED:
        return MergedPusher(model, client, push, device, lora.lora)
    return AdapterPusher(model, client, push, lora, device)


def push_bytes(pusher: Any) -> int:
    """What one push moves to the server: the adapter's bytes, or every sent tensor's (a full or merged push)."""
    return getattr(pusher, "bytes_last", 0) or sum(m.nbytes for m in pusher.meta)


def write_adapter(folder: Path, tensors: dict[str, torch.Tensor], lora: LoraConfig, base_model: str) -> int:
    """peft's adapter format (what PeftModel.from_pretrained and vLLM read); returns the tensor bytes written."""
    from safetensors.torch import save_file

    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True, mode=0o700)
    save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
    trainer_lora.peft_config(lora, base_model).save_pretrained(str(tmp))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)  # complete or absent: the server never reads half an adapter
    return sum(t.numel() * t.element_size() for t in tensors.values())


def gather_adapter(model: torch.nn.Module, dtype: torch.dtype, keep: bool, cpu: bool = True) -> dict[str, torch.Tensor]:
    """Every adapter parameter whole, in `dtype`, under peft's file names. Collective over the model's mesh (every
    rank calls it; each full_tensor is an all-gather); keep: this rank keeps the tensors (the node leader); cpu: moved
    to host memory (for a file), else left where they were gathered (for the weight-transfer engine)."""
    out: dict[str, torch.Tensor] = {}
    params = trainer_lora.adapter_params(model)
    whole = all(whole_locally(p) for _, p in params)
    with torch.no_grad():
        for name, p in params:
            if whole:  # no collective and no DTensor dispatch (about 0.1 ms a parameter, hundreds of them at 7B)
                full = (p.to_local() if isinstance(p, DTensor) else p).detach().to(dtype)
            else:
                t = p.detach().to(dtype)
                full = t.full_tensor() if isinstance(t, DTensor) else t
            if keep:
                out[trainer_lora.peft_file_name(name)] = full.contiguous().cpu() if cpu else full.contiguous()
    return out


def whole_locally(p: torch.Tensor) -> bool:
    """Every rank's local tensor of p is the whole parameter: p is no DTensor, or it is sharded only over mesh
    dimensions of size 1 (one rank per shard group: one GPU per node). Decided from the mesh, never from this rank's
    shard (with uneven sharding one rank may hold all the rows and another none), so every rank takes the same path."""
    if not isinstance(p, DTensor):
        return True
    return all(p.device_mesh.size(i) == 1 for i, pl in enumerate(p.placements) if pl.is_shard())


def adapter_config(lora: LoraConfig, base_model: str) -> dict:
    """adapter_config.json's content (what peft's save_pretrained writes, sets as sorted lists): the receiving engine
    builds vLLM's PEFTHelper from it, as vLLM does from the file."""
    import json

    d = trainer_lora.peft_config(lora, base_model).to_dict()
    return json.loads(json.dumps(d, default=lambda o: sorted(o) if isinstance(o, set) else str(o)))


def adapter_target(lora: LoraConfig, base_model: str) -> dict:
    """The server engine's init info for an adapter push (trainer.push.adapter_receiver.AdapterReceiver reads it)."""
    return {"lora_adapter": {"name": ADAPTER_NAME, "peft_config": adapter_config(lora, base_model)}}


class AdapterPusher:
    """Pushes only the adapter (see the module docstring). Runs on every rank; the node leader talks to the server."""

    def __init__(
        self,
        model: torch.nn.Module,
        client: VllmServer | None,
        settings: PushSettings,
        lora: LoraPush,
        device: torch.device | None = None,
    ):
        self.model, self.client, self.settings, self.lora = model, client, settings, lora
        self.device = device or torch.device("cpu")
        self.folder = Path(lora.folder)
        self.pushes = 0
        self.bytes_last = 0
        self.sender: Any = None
        """adapter_transport engine: the leader's sender, built at the first push (its init names the adapter)."""
        self.phases: dict[str, float] = {}
        """The last push's seconds by part (gather, send, reset_prefix_cache): the trainer log prints them."""
        self.meta = [
            ParamMeta(trainer_lora.peft_file_name(n), str(settings.dtype).removeprefix("torch."), list(p.shape))
            for n, p in trainer_lora.adapter_params(model)
        ]
        self.zero_loaded = False
        """A zero adapter (B = 0) is loaded before anything names the adapter: at the first push or request. Not here:
        the server may still be starting (trainer.start_with_server) while the other ranks go on into collectives."""

    def ensure_loaded(self) -> None:
        """Leader: make the adapter's name servable (the zero adapter) if no push has loaded one yet."""
        if self.client is not None and not self.zero_loaded and self.pushes == 0:
            zeros = {m.name: torch.zeros(m.shape, dtype=self.settings.dtype) for m in self.meta}
            self._load(zeros, step=-1)
            self.zero_loaded = True

    def _load(self, tensors: dict[str, torch.Tensor], step: int) -> int:
        assert self.client is not None
        folder = self.folder / (f"step-{step:06d}" if step >= 0 else "initial")
        written = write_adapter(folder, tensors, self.lora.lora, self.lora.base_model)
        self.client.load_lora_adapter(ADAPTER_NAME, str(folder), max(step, 0), timeout_s=self.settings.timeout_s)
        for old in sorted(p for p in self.folder.iterdir() if p.name.startswith("step-") and p != folder)[:-KEEP_PUSHED]:
            shutil.rmtree(old, ignore_errors=True)
        return written

    def _send(self, tensors: dict[str, torch.Tensor], step: int) -> int:
        """adapter_transport engine: the adapter through the weight-transfer engine, in self.meta's order."""
        assert self.client is not None
        if self.sender is None:
            target = adapter_target(self.lora.lora, self.lora.base_model)
            self.sender = make_sender(self.settings, self.client, self.meta, self.device, target)
        home = torch.cuda.current_stream() if _live_cuda() else None  # where the gathers ran
        # each tensor handed over to the stream it is pulled under (vLLM's nccl producer packs on its side streams)
        self.sender.push(((m.name, hand_over(tensors[m.name], home)) for m in self.meta), self.meta, step)
        return sum(m.nbytes for m in self.meta)

    def push(self, step: int, keep_in_flight: bool = False) -> float:
        """As NodePusher.push: collective over the model's mesh; seconds on the leader, 0.0 elsewhere."""
        t0 = time.time()
        engine = self.lora.via_engine
        tensors = gather_adapter(self.model, self.settings.dtype, keep=self.client is not None, cpu=not engine)
        if self.client is None:
            return 0.0
        client = self.client
        t_gathered = time.time()

        def send() -> None:
            self.bytes_last = self._send(tensors, step) if engine else self._load(tensors, step)
            t_sent = time.time()
            client.reset_prefix_cache(step, running=keep_in_flight)  # KV cached under the old adapter
            self.phases = {
                "gather_s": t_gathered - t0,
                "send_s": t_sent - t_gathered,
                "reset_prefix_cache_s": time.time() - t_sent,
            }

        with_requests_paused(client, step, keep_in_flight, send)
        self.pushes += 1
        took = time.time() - t0
        parts = ", ".join(f"{k.removesuffix('_s')} {v * 1e3:.1f}" for k, v in self.phases.items())
        how = "engine" if engine else "disk"
        print(f"[push node {client.node} step {step}] adapter ({how}) {took * 1e3:.1f} ms: {parts} (ms)", flush=True)
        return took


class MergedPusher(NodePusher):
    """Pushes the base with the adapter merged in, under the base's names, through the ordinary senders."""

    def __init__(self, model, client: VllmServer | None, settings: PushSettings, device: torch.device, lora: LoraConfig):
        super().__init__(model, client, settings, device)
        self.scale = trainer_lora.scaling(lora)
        self.transposed = trainer_lora.transposed_modules(model)
        dtype = str(settings.dtype).removeprefix("torch.")
        self.meta = self.as_served(
            [
                ParamMeta(name, dtype, list(p.shape))
                for n, p in model.named_parameters()
                if (name := trainer_lora.base_name(n)) is not None
            ]
        )
        self.bytes_last = sum(m.nbytes for m in self.meta)

    def params(self) -> Iterator[tuple[str, torch.Tensor]]:
        walk = iter_unsharded_params(self.model, self.settings.dtype)
        return merged_params(walk, self.scale, self.settings.dtype, self.transposed)


def merged_params(
    params: Iterator[tuple[str, torch.Tensor]], scale: float, dtype: torch.dtype, transposed: frozenset[str] = frozenset()
) -> Iterator[tuple[str, torch.Tensor]]:
    """The peft model's parameter stream (base_layer weight, its bias, lora_A, lora_B per adapted module, in
    named_parameters order) as the base's, in the same order: an adapted module's base parameters are held until its
    B arrives, then its weight goes out as W + scale B A (in fp32, sent in `dtype`), followed by its bias; for the
    modules in `transposed` (trainer.lora.transposed_modules: GPT-2's Conv1D, weight [in, out]) W + scale (B A)^T.

    CUDA streams, as trainer.push.gather.iter_unsharded_params orders them for the full-weight push (N1/N3/N6):
    `params` is pulled and every merge computed on the stream current HERE, at the call (the caller's, which the
    optimizer wrote on), never on whichever stream the consumer pulls under (vLLM's nccl producer pulls under its two
    side streams in turn); each tensor yielded is handed over to the consumer's stream (gather.hand_over: it waits
    for the merge, and the allocator keeps the block until the consumer's use). So the merge's fp32 temporaries live
    in the caller's pool (training reuses it), not in the producer streams' pools, and a merged weight is never read
    before it is written, whatever the producer's stream. On CPU (or without live CUDA) nothing is ordered."""
    from trainer.push.gather import _live_cuda

    home = torch.cuda.current_stream() if _live_cuda() else None
    return _merged(params, scale, dtype, home, transposed)


def _merged(
    params: Iterator[tuple[str, torch.Tensor]],
    scale: float,
    dtype: torch.dtype,
    home: torch.cuda.Stream | None,
    transposed: frozenset[str] = frozenset(),
) -> Iterator[tuple[str, torch.Tensor]]:
    from trainer.push.gather import _on, _stream, hand_over

    held: dict[str, list[tuple[str, torch.Tensor]]] = {}
    a: dict[str, torch.Tensor] = {}
    for name, t in _on(home, params):  # each pull with `home` current: the walk hands over to `home` (a no-op)
        module, _, rest = name.rpartition(".lora_")
        if rest.startswith("A."):
            a[module] = t
            continue
        if rest.startswith("B."):
            for held_name, w in held.pop(module):
                if held_name.endswith(".weight"):
                    with _stream(home):
                        delta = t.float() @ a.pop(module).float()
                        w = (w.float() + scale * (delta.T if module in transposed else delta)).to(dtype)
                yield held_name, hand_over(w, home)
            continue
        base = trainer_lora.base_name(name)
        assert base is not None
        owner, sep, _ = name.partition(".base_layer.")
        if sep:  # an adapted module's weight or bias: wait for its adapter
            held.setdefault(owner, []).append((base, t))
        else:
            yield base, hand_over(t, home)
    assert not held and not a, f"adapted weights without their adapter: {sorted(held)} {sorted(a)}"
