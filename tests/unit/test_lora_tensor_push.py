"""The LoRA adapter pushed as tensors (trainer.lora.adapter_transport engine): the trainer's stream, cut into vLLM's
packed chunks, names and carries what peft's folder holds, and the worker builds from it the same LoRAModel vLLM 0.32
builds from that folder (trainer.push.adapter_receiver); the worker's per-step path then serves the pushed model, and
an explicit load from a folder wins over it. The server itself runs in tests/integration/test_lora_integration.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Literal

import pytest
import torch

from launcher.core.config import LoraConfig
from tests.unit.test_lora_push import trained
from trainer import lora as trainer_lora

pytest.importorskip("vllm")
pytestmark = pytest.mark.filterwarnings("ignore:Tensor .* exceeds buffer_size_bytes")  # vLLM's, for our small bucket

QWEN2_SUPPORTED = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
QWEN2_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
"""vLLM 0.32's Qwen2ForCausalLM LoRA modules (supported_lora_modules after packing, packed_modules_mapping)."""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from trainer.tiny_model import make_tiny_model

    path = tmp_path_factory.mktemp("tiny")
    make_tiny_model(path)
    return str(path)


def over_the_wire(stream: list[tuple[str, torch.Tensor]], meta, bucket: int) -> list[list[tuple[str, torch.Tensor]]]:
    """The packed push without its broadcast (tests/unit/test_distributed_unit.py runs that over gloo): the sender's
    chunks (vLLM's pack_tensors) unpacked by the receiver's cut of the announced metadata (wire.chunk_metas)."""
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors, unpack_tensor

    from trainer.push.wire import chunk_metas

    it = iter(stream)
    out = []
    for cut in chunk_metas(meta, bucket):
        chunk = pack_tensors(it, lambda item: item[1], bucket)
        assert chunk is not None
        sizes = [m.nbytes for m in cut]
        assert chunk.packed_tensor.numel() == sum(sizes)  # both ends cut alike
        buf = chunk.packed_tensor.clone()  # the receiver's own buffer
        out.append(
            unpack_tensor(buf, [m.name for m in cut], [m.shape for m in cut], [getattr(torch, m.dtype) for m in cut], sizes)
        )
    assert pack_tensors(it, lambda item: item[1], bucket) is None
    return out


class Manager:
    """The worker's LoRA model manager (model.lora_manager) as the receiver reads it: the modules vLLM adapts on a Qwen2,
    and the adapters it holds (remove_adapter: the push drops the old one so the next step re-adds the pushed one)."""

    supported_lora_modules = QWEN2_SUPPORTED
    packed_modules_mapping = QWEN2_PACKED

    def __init__(self) -> None:
        self.removed: list[int] = []

    def remove_adapter(self, adapter_id: int) -> bool:
        self.removed.append(adapter_id)
        return True


def stand_in_engine(lora_rank: Literal[8, 16]) -> SimpleNamespace:
    """What an engine gives its AdapterReceiver: vLLM's LoRA config (lora_dtype as the server resolves it), the model
    (with its lora_manager), the model config, the device."""
    from vllm.config.lora import LoRAConfig

    lora_config = LoRAConfig(max_lora_rank=lora_rank, max_loras=1)
    lora_config.lora_dtype = torch.float32  # "auto" is resolved against the model when the server starts
    text = SimpleNamespace(max_position_embeddings=512)
    return SimpleNamespace(
        vllm_config=SimpleNamespace(lora_config=lora_config),
        model=SimpleNamespace(lora_manager=Manager()),
        model_config=SimpleNamespace(hf_config=SimpleNamespace(get_text_config=lambda: text), get_vocab_size=lambda: 300),
        device=torch.device("cpu"),
    )


@pytest.fixture
def patched(monkeypatch):
    """The plugin's patch of vLLM's LoRA worker manager (vllm_plugin.load_adapters_once), undone after the test."""
    from vllm.lora import worker_manager as wm

    from trainer.push.vllm_plugin import load_adapters_once

    for cls, attr in ((wm.LRUCacheWorkerLoRAManager, "_apply_adapters"), (wm.WorkerLoRAManager, "_load_adapter")):
        monkeypatch.setattr(cls, attr, getattr(cls, attr))
    load_adapters_once()


def test_the_pushed_tensors_build_the_lora_model_vllm_builds_from_the_adapter_folder(tiny, tmp_path, patched):
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    from launcher.core.lora import ADAPTER, ADAPTER_NAME
    from trainer.push import adapter_receiver as rx
    from trainer.push.adapter import AdapterPusher, LoraPush, adapter_target, gather_adapter, write_adapter
    from trainer.push.pusher import PushSettings

    lora = LoraConfig(r=4, alpha=16)
    model = trained(tiny, lora)
    settings = PushSettings("gloo", 0, 1, 10.0, torch.float32, 1 << 20)
    pusher = AdapterPusher(model, None, settings, LoraPush(ADAPTER, lora, tiny, str(tmp_path / "pushes")))
    tensors = gather_adapter(model, torch.float32, keep=True, cpu=False)
    stream = [(m.name, tensors[m.name]) for m in pusher.meta]  # what AdapterPusher._send hands the sender
    assert [n for n, _ in stream] == sorted(tensors, key=[m.name for m in pusher.meta].index)  # every tensor, meta order
    assert all(n.startswith("base_model.model.model.layers.") and ".lora_" in n for n, _ in stream)  # peft's file names

    target = adapter_target(lora, tiny)["lora_adapter"]
    assert target["name"] == ADAPTER_NAME
    engine = stand_in_engine(8)
    receiver = rx.AdapterReceiver(target, engine)
    receiver.start()
    chunks = over_the_wire(stream, pusher.meta, 3000)  # bytes: several chunks for the tiny adapter
    assert len(chunks) > 3
    for chunk in chunks:
        receiver.collect(chunk)
    rx.PUSHED.clear(), rx.IDS.clear()
    rx.IDS[ADAPTER_NAME] = 7  # the API server's id for the name, seen when its zero adapter was loaded
    receiver.finish()
    assert engine.model.lora_manager.removed == [7]  # the adapter held under the name goes: the next step re-adds
    pushed = rx.PUSHED[ADAPTER_NAME]

    # vLLM's own read of the folder that the disk transport writes for the same adapter
    folder = tmp_path / "a"
    write_adapter(folder, gather_adapter(model, torch.float32, keep=True), lora, tiny)
    expected = rx.expected_modules(QWEN2_SUPPORTED, QWEN2_PACKED)
    from_folder = LoRAModel.from_local_checkpoint(
        str(folder), expected, PEFTHelper.from_local_dir(str(folder), 512), lora_model_id=7, device="cpu", dtype=torch.float32
    )
    assert pushed.id == 7 and pushed.rank == from_folder.rank == 4
    assert sorted(pushed.loras) == sorted(from_folder.loras)
    assert "model.layers.0.self_attn.q_proj" in pushed.loras  # vLLM's module names of the served model
    assert len(pushed.loras) == 7 * 2  # 7 projections x 2 layers of the tiny model
    for name, want in from_folder.loras.items():
        got = pushed.loras[name]
        assert got.scaling == want.scaling == 16 / 4, name
        assert torch.equal(got.lora_a, want.lora_a) and torch.equal(got.lora_b, want.lora_b), name


def test_the_per_step_path_serves_the_pushed_adapter_and_a_load_from_a_folder_wins(tmp_path):
    import inspect

    from vllm.lora import worker_manager as wm
    from vllm.lora.model_manager import LoRAModelManager
    from vllm.lora.request import LoRARequest

    from trainer.push import adapter_receiver as rx

    # the vLLM 0.32 code the engine path rests on: the engine finds the manager on its model, and the per-step path
    # re-adds an adapter it does not hold through _load_adapter (where the plugin serves the pushed one)
    assert "self.model.lora_manager = self" in inspect.getsource(LoRAModelManager.__init__)
    add = inspect.getsource(wm.LRUCacheWorkerLoRAManager.add_adapter)
    assert "not in self.list_adapters()" in add and "self._load_adapter(lora_request)" in add

    rx.PUSHED.clear(), rx.IDS.clear()
    reads: list[str] = []

    def read(manager, request):  # vLLM's _load_adapter: the folder
        reads.append(request.lora_path)
        return SimpleNamespace(id=request.lora_int_id, source="folder")

    class Pushed(SimpleNamespace):
        def clone(self, lora_id: int):
            return Pushed(id=lora_id, source=self.source)

    zero = LoRARequest("a", 3, "/n/initial", load_inplace=True)  # /v1/load_lora_adapter: an explicit load
    assert rx.load_adapter(None, zero, read).source == "folder" and rx.IDS == {"a": 3}
    per_step = LoRARequest("a", 3, "/n/initial")  # the stored request, flag off (vllm_plugin.load_adapters_once)
    assert rx.load_adapter(None, per_step, read).source == "folder"  # nothing pushed yet: the folder
    rx.PUSHED["a"] = Pushed(id=3, source="tensors")
    assert reads == ["/n/initial", "/n/initial"]
    served = rx.load_adapter(None, per_step, read)
    assert served.source == "tensors" and served.id == 3 and len(reads) == 2  # no folder read
    assert rx.load_adapter(None, LoRARequest("a", 4, "/n/initial"), read).id == 4  # re-ided if the server's id differs
    assert rx.load_adapter(None, LoRARequest("b", 5, "/n/b"), read).source == "folder"  # another name: its folder
    assert rx.load_adapter(None, LoRARequest("a", 3, "/n/step-9", load_inplace=True), read).source == "folder"
    assert "a" not in rx.PUSHED  # an explicit load from a folder is newer than the pushed tensors
    rx.PUSHED.clear(), rx.IDS.clear()


def test_an_adapter_for_modules_vllm_does_not_adapt_is_refused():
    from trainer.push.adapter_receiver import check_modules, expected_modules

    expected = expected_modules(QWEN2_SUPPORTED, QWEN2_PACKED)
    check_modules(["base_model.model.model.layers.0.mlp.up_proj.lora_A.weight"], expected)
    with pytest.raises(ValueError, match="lm_head"):
        check_modules(["base_model.model.lm_head.lora_B.weight"], expected)


def test_the_receiver_needs_a_server_started_with_lora_and_the_plugins_patch(monkeypatch):
    from vllm.lora import worker_manager as wm

    from trainer.push.adapter_receiver import AdapterReceiver

    monkeypatch.setattr(wm.LRUCacheWorkerLoRAManager, "_apply_adapters", lambda self, requests: None)  # unpatched
    with pytest.raises(ValueError, match="SLURM_GRPO_LORA_LOAD_ONCE"):  # vLLM as shipped: the folder would be read
        AdapterReceiver({"name": "a", "peft_config": {}}, stand_in_engine(8))
    engine = stand_in_engine(8)
    engine.vllm_config.lora_config = None
    with pytest.raises(ValueError, match="--enable-lora"):
        AdapterReceiver({"name": "a", "peft_config": {}}, engine)
    with pytest.raises(ValueError, match="name and peft_config"):
        AdapterReceiver({"name": "a"}, stand_in_engine(8))


def test_an_engine_push_sends_the_adapter_through_the_weight_routes_and_writes_no_folder(tiny, tmp_path, capsys):
    """AdapterPusher (the node leader) against a fake vLLM at the HTTP boundary that joins the trainer's gloo group as
    the gloo engine does: the zero adapter is loaded from a folder once (the name's first load), then each push is the
    weight-transfer protocol carrying the adapter (the init info names it and its peft config), and no folder is
    written per push. The disk transport on the same fake: a folder and a load per push, no weight route. The pusher's
    line per push is what bench/lora_push.py reads the send seconds from."""
    import threading

    import torch.distributed as dist

    from bench.lora_push import send_seconds
    from launcher.core.lora import ADAPTER, ADAPTER_NAME
    from tests.support.fakes import JsonHandler, LocalHttpServer, join_weight_group
    from tests.support.ranks import free_port
    from trainer.push.adapter import AdapterPusher, LoraPush, gather_adapter
    from trainer.push.gloo_engine import receive_packed
    from trainer.push.pusher import PushSettings
    from trainer.push.wire import ParamMeta
    from trainer.rollout.server import VllmServer

    class Fake(LocalHttpServer):
        def __init__(self) -> None:
            super().__init__(Handler)
            self.calls: list[str] = []
            self.init_info: dict = {}
            self.received: list[dict[str, torch.Tensor]] = []
            self.group: dist.ProcessGroupGloo | None = None
            self.bucket = 0
            self.lock = threading.Lock()
            self.start()

    class Handler(JsonHandler):
        server: Fake

        def do_POST(self) -> None:
            srv, body = self.server, self.read_json()
            with srv.lock:
                srv.calls.append(self.path)
            if self.path == "/init_weight_transfer_engine":
                srv.init_info = body["init_info"]
                srv.group, srv.bucket = join_weight_group(body["init_info"])  # type: ignore[assignment]
            elif self.path == "/update_weights":
                u = body["update_info"]
                meta = [ParamMeta(n, d, s) for n, d, s in zip(u["names"], u["dtype_names"], u["shapes"], strict=True)]
                assert srv.group is not None
                got = {n: t.clone() for chunk in receive_packed(srv.group, meta, srv.bucket) for n, t in chunk}
                srv.received.append(got)
            self.answer({"success": True})

    lora = LoraConfig(r=4, alpha=16)
    model = trained(tiny, lora)
    fake = Fake()
    try:
        for transport in ("engine", "disk"):
            fake.calls.clear()
            folder = tmp_path / transport
            settings = PushSettings("gloo", free_port(), 1, 30.0, torch.float32, 4096)
            push = LoraPush(ADAPTER, LoraConfig(r=4, alpha=16, adapter_transport=transport), tiny, str(folder))
            pusher = AdapterPusher(model, VllmServer(fake.url, ADAPTER_NAME, 0, 30.0), settings, push)
            pusher.ensure_loaded()
            sent = []
            for step in (1, 2):
                with torch.no_grad():  # as after an optimizer step: the adapter changed
                    for _, p in trainer_lora.adapter_params(model):
                        p.add_(0.01)
                sent.append({n: t.clone() for n, t in gather_adapter(model, torch.float32, keep=True).items()})
                pusher.push(step)
                assert len(send_seconds(capsys.readouterr().out)) == 1, transport
                assert pusher.bytes_last == sum(t.numel() * 4 for t in sent[-1].values())
            load, routes = "/v1/load_lora_adapter", ["/start_weight_update", "/update_weights", "/finish_weight_update"]
            if transport == "disk":
                assert fake.calls == [load] + [load, "/reset_prefix_cache"] * 2, fake.calls  # the zero one, then a push
                assert sorted(x.name for x in folder.iterdir()) == ["initial", "step-000001", "step-000002"]
                continue
            assert fake.calls == [load, "/init_weight_transfer_engine"] + (routes + ["/reset_prefix_cache"]) * 2, fake.calls
            assert sorted(x.name for x in folder.iterdir()) == ["initial"]  # the zero adapter's folder only
            target = fake.init_info["lora_adapter"]
            assert target["name"] == ADAPTER_NAME and target["peft_config"]["r"] == 4
            assert target["peft_config"]["lora_alpha"] == 16 and sorted(target["peft_config"]["target_modules"]) == sorted(
                lora.target_modules
            )
            assert len(fake.received) == 2
            for got, want in zip(fake.received, sent, strict=True):
                assert list(got) == [m.name for m in pusher.meta] and sorted(got) == sorted(want)
                assert all(torch.equal(got[n], want[n]) for n in want)  # bit for bit, each push's own tensors
    finally:
        fake.close()


def test_every_engine_reads_the_init_info_the_trainer_sends_for_an_adapter(tiny):
    """The init info of an adapter push (the senders' fields + adapter_target) parses into each engine's init info
    class with the adapter's target on it: gloo, nccl_adapter (registered by the plugin) and mapped_ipc."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from trainer.push.adapter import adapter_target
    from trainer.push.gloo_engine import GlooWeightTransferInitInfo
    from trainer.push.ipc_engine import MappedIpcInitInfo
    from trainer.push.nccl_adapter_engine import NcclAdapterInitInfo, NcclAdapterWeightTransferEngine
    from trainer.push.vllm_plugin import register

    register()
    assert "nccl_adapter" in WeightTransferEngineFactory._registry
    target = adapter_target(LoraConfig(r=4), tiny)
    broadcast = {  # trainer.push.senders.BroadcastSender's init info
        "master_address": "127.0.0.1",
        "master_port": 1,
        "rank_offset": 1,
        "world_size": 2,
        "packed": True,
        "packed_buffer_size_bytes": 1 << 20,
        "packed_num_buffers": 2,
    }
    gloo = GlooWeightTransferInitInfo(**broadcast, timeout_s=30.0, **target)
    nccl = NcclAdapterInitInfo(**broadcast, **target)
    ipc = MappedIpcInitInfo(handles={}, buffer_bytes=8, names=["a"], dtype_names=["float32"], shapes=[[2]], **target)
    for info in (gloo, nccl, ipc):
        assert info.lora_adapter == target["lora_adapter"], type(info).__name__
    assert NcclAdapterInitInfo(**broadcast).lora_adapter is None  # without it: vLLM's nccl engine, weights
    assert NcclAdapterWeightTransferEngine.init_info_cls is NcclAdapterInitInfo
