"""The TRL / transformers / vLLM / submitit internals slurm-grpo relies on. If an upgrade moves one,
this fails with a message naming it, instead of the trainer failing somewhere deep in a job."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

import pytest


def test_trl_generation_injection_point():
    import trl.trainer.grpo_trainer as gt

    assert hasattr(gt, "VLLMGeneration"), "trl.trainer.grpo_trainer.VLLMGeneration is gone (trainer/trl_glue.py swaps it)"
    src = inspect.getsource(gt.GRPOTrainer)
    for needle in (
        "VLLMGeneration(",
        "self.vllm_generation.sync_weights()",
        "self.vllm_generation.generate(",
        "vllm_client.get_server_info()",
    ):
        assert needle in src, f"GRPOTrainer no longer contains {needle!r}; trainer/rollout/node.py must follow TRL"
    params = list(inspect.signature(gt.VLLMGeneration.generate).parameters)
    assert params[:5] == ["self", "prompts", "images", "num_generations", "profiler"], params


def test_the_data_cursor_hook_is_where_trainer_data_puts_it():
    import trl.trainer.grpo_trainer as gt

    # trainer/data.continue_data_order replaces the instance's _get_train_sampler before train() builds the dataloader
    src = inspect.getsource(gt.GRPOTrainer.get_train_dataloader)
    assert "sampler_fn=self._get_train_sampler" in src, "GRPOTrainer builds its train sampler another way now"
    assert "batch_size=self._train_batch_size * self.args.steps_per_generation" in src, (
        "GRPOTrainer's dataloader batch changed: trainer/data.indices_per_step must follow"
    )


def test_transformers_leaves_self_sharded_models_alone():
    import transformers.trainer as tt

    assert "is_distributed_loading_by_transformers" in inspect.getsource(tt.Trainer.__init__), (
        "transformers' Trainer no longer reads is_distributed_loading_by_transformers (trainer/parallel.py sets it)"
    )


def test_vllm_weight_transfer_hooks():
    import vllm
    import vllm.model_executor.layers.utils as lu
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    assert hasattr(WeightTransferEngineFactory, "register_engine") and hasattr(WeightTransferEngineFactory, "_registry")
    for m in ("init_transfer_engine", "receive_weights", "update_weights", "parse_update_info"):
        assert hasattr(NCCLWeightTransferEngine, m), f"NCCLWeightTransferEngine.{m} is gone (trainer/push/gloo_engine.py)"
    assert hasattr(lu, "dispatch_cpu_unquantized_gemm"), "vLLM's CPU gemm dispatch moved (trainer/push/vllm_plugin.py patches it)"
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    assert hasattr(BaseModelLoader, "load_model"), "BaseModelLoader.load_model is gone (trainer/push/vllm_plugin.py wraps it)"
    assert vllm.__version__.startswith("0.32"), vllm.__version__


def test_the_vllm_loaders_and_activation_the_plugin_patches_still_do_what_it_fixes():
    """trainer.push.vllm_plugin: MiMo-V2-Flash's and gpt-oss's loaders write the attention sinks with copy_ (a push's
    layerwise reload never sees it: wrap_mimo_sink_loader, wrap_gpt_oss_loader), and vLLM's xIELU computes from its
    beta/eps buffers with its float constants beside them (xielu_from_its_constants). If vLLM changes either, the
    patch must be looked at again."""
    from vllm.model_executor.layers.activation import XIELU
    from vllm.model_executor.models import gpt_oss, mimo_v2

    mimo = inspect.getsource(mimo_v2.MiMoV2Model.load_weights)
    assert 'if "attention_sink_bias" in name:' in mimo and "param.data.copy_(narrow_weight)" in mimo
    oss = inspect.getsource(gpt_oss.GptOssModel)
    assert 'elif "sinks" in name:' in oss and "param.data.copy_(narrow_weight)" in oss
    init = inspect.getsource(XIELU.__init__)
    assert 'self.register_buffer("beta"' in init and "self._beta_scalar = float(" in init, "XIELU keeps beta otherwise"
    assert 'self.register_buffer("eps"' in init and "self._eps_scalar = float(" in init, "XIELU keeps eps otherwise"


def test_the_patched_xielu_computes_vllms_values_whatever_its_buffers_hold():
    """trainer.push.vllm_plugin.xielu_from_its_constants: with beta/eps buffers as a push's reload leaves them
    (garbage), vLLM's xIELU still gives what it gave before (the formula of its own Python path)."""
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.activation import XIELU

    from trainer.push.vllm_plugin import xielu_from_its_constants

    environ = dict(os.environ)
    try:  # VllmConfig() sets VLLM_WORKER_MULTIPROC_METHOD in os.environ (the launcher reads it: tests/unit/test_vllm_start.py)
        with set_current_vllm_config(VllmConfig()):
            act = XIELU(dtype=torch.float32)
    finally:
        os.environ.clear()
        os.environ.update(environ)
    x = torch.linspace(-6, 6, 241)
    want = XIELU._xielu_python(act, x)  # before the patch in a fresh process; the patch itself after (same values)
    xielu_from_its_constants()
    assert getattr(XIELU._xielu_python, "_slurm_grpo", False)
    with torch.no_grad():
        act.beta.fill_(2.75e-21)  # as after a push on a tiny Apertus (tests/unit/test_families.py XIELU_CONSTANTS)
        act.eps.fill_(-1.9e26)
    assert torch.allclose(act.forward_native(x), want, atol=1e-6)


def test_submitit_internals():
    from submitit.slurm.slurm import SlurmExecutor

    assert hasattr(SlurmExecutor, "_submit_command") and hasattr(SlurmExecutor, "_make_submission_file_text")


WORKER = """
import os, signal, sys, time
rank, how = int(os.environ["RANK"]), sys.argv[1]
# the two ranks order their ends by handshakes (files in the cwd, each rank's pid), not by sleeps
with open(f"pid{rank}.tmp", "w") as f:
    f.write(str(os.getpid()))
os.rename(f"pid{rank}.tmp", f"pid{rank}")

def wait_for(cond, what):
    deadline = time.time() + 60
    while not cond():
        if time.time() > deadline:
            sys.exit(f"rank {rank}: no {what} within 60 s")
        time.sleep(0.001)

def ended(r):  # the peer's process is gone or a zombie (torchrun has not reaped it yet)
    if not os.path.exists(f"pid{r}"):
        return False
    try:
        stat = open(f"/proc/{open(f'pid{r}').read()}/stat").read()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2] in "ZX"

def survivor_line():
    print("RuntimeError: [pair.cc:537] Read error: Connection reset by peer. remote worker", file=sys.stderr, flush=True)

if how == "peer-first":  # the survivor exits just before the kill: both land in one torchrun poll
    if rank == 0:
        wait_for(lambda: os.path.exists("pid1"), "rank 1")
        survivor_line()
        sys.exit(1)
    wait_for(lambda: ended(0), "exit of rank 0")
    os.kill(os.getpid(), signal.SIGKILL)
if how == "kill":  # rank 0's line comes first in the log (the worst case), then rank 1 is killed
    if rank == 0:
        wait_for(lambda: os.path.exists("pid1"), "rank 1")
        survivor_line()
        open("said", "w").close()
        time.sleep(60)  # torchrun's SIGTERM ends it
    wait_for(lambda: os.path.exists("said"), "rank 0's line")
    os.kill(os.getpid(), signal.SIGKILL)  # what the OOM killer does
# raise: rank 1 raises; rank 0 reports its peer lost after that, as survivors do, and waits for torchrun's SIGTERM
if rank == 1:
    raise ValueError("boom in rank 1")
wait_for(lambda: ended(1), "exit of rank 1")
survivor_line()
time.sleep(60)
"""


@pytest.mark.parametrize(
    "how, needles",
    [
        ("kill", ("rank 1", "local rank 1", "SIGKILL")),
        ("peer-first", ("rank 1", "local rank 1", "SIGKILL")),  # torchrun names rank 0 first; the kill is the cause
        ("raise", ("ValueError: boom in rank 1",)),
    ],
)
def test_torchrun_failure_summary_names_the_killed_rank(tmp_path, how, needles):
    """launcher.node.bootstrap.root_cause reads torchrun's failure summary (its format is torch's): a rank killed
    by a signal is the node's own cause, not the survivor's "reset by peer" (which would make the node wait
    for another node's abort, and name the wrong cause); an exception in a rank is named as it was raised."""
    from launcher.node.diagnose import PEER_LOST, root_cause
    from tests.support.ranks import free_port

    (tmp_path / "w.py").write_text(WORKER)
    log = tmp_path / "trainer.log"
    with open(log, "w") as f:
        f.write("===== test start\n")
        f.flush()
        subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node",
                "2",
                "--max-restarts",
                "0",
                "--master-port",
                str(free_port()),
                "--monitor-interval",
                "3",
                str(tmp_path / "w.py"),
                how,
            ],
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=120,
            cwd=tmp_path,
        )
    cause = root_cause(log)
    for n in needles:
        assert n in cause, (cause, log.read_text()[-3000:])
    assert not any(m in cause for m in PEER_LOST), cause


def test_every_payload_the_senders_post_is_accepted_by_vllms_own_dataclasses(monkeypatch):
    """The init and update payloads of the gloo, nccl and ipc senders, built by the project's code, parsed by
    vLLM 0.32's own info classes (the worker does exactly this); a field vLLM renames or drops fails here."""

    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferInitInfo, NCCLWeightTransferUpdateInfo

    from trainer.push.gloo_engine import GlooWeightTransferEngine, GlooWeightTransferInitInfo
    from trainer.push.senders import BroadcastSender
    from trainer.push.wire import ParamMeta, update_info
    from trainer.rollout.server import VllmServer

    meta = [ParamMeta("model.embed_tokens.weight", "bfloat16", [10, 4]), ParamMeta("lm_head.weight", "bfloat16", [10, 4])]
    # the init info BroadcastSender posts (captured at the HTTP boundary), for nccl and for gloo
    posted: list[dict] = []

    class Client(VllmServer):  # the real route methods; only the HTTP call is recorded
        def __init__(self):
            super().__init__("http://127.0.0.1:1", "m", node=0, timeout_s=5.0)

        def post(self, route, body=None, timeout_s=None, step=0, engine=None):
            posted.append(body)

    monkeypatch.setattr(BroadcastSender, "join", lambda self, port, world: None)
    BroadcastSender(Client(), 29600, 2, 5.0, 2**20)  # type: ignore[arg-type]
    nccl = NCCLWeightTransferInitInfo(**posted[0]["init_info"])
    assert (nccl.packed, nccl.packed_buffer_size_bytes, nccl.packed_num_buffers, nccl.world_size) == (True, 2**20, 2, 3)
    assert NCCLWeightTransferUpdateInfo(**update_info(meta)).names == [m.name for m in meta]
    gloo = GlooWeightTransferInitInfo(**{**posted[0]["init_info"], "timeout_s": 5.0})
    assert GlooWeightTransferEngine.init_info_cls is GlooWeightTransferInitInfo and gloo.timeout_s == 5.0
    # ipc is the project's own engine (trainer.push.ipc_engine): its payloads round-trip through its own dataclasses in
    # test_the_ipc_push_runs_no_collective_and_the_server_loads_every_byte


def test_the_vllm_names_the_senders_use_exist():
    import inspect as ins

    from vllm.distributed import utils as vdu
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.weight_transfer import packed_tensor

    for name in ("pack_tensors", "unpack_tensor", "packed_nccl_broadcast_producer"):
        assert hasattr(packed_tensor, name), (
            f"vllm.distributed.weight_transfer.packed_tensor.{name} is gone (trainer/push/senders.py)"
        )
    assert {"iterator", "group", "src", "post_iter_func", "buffer_size_bytes", "num_buffers"} <= set(
        ins.signature(packed_tensor.packed_nccl_broadcast_producer).parameters
    )
    assert "store_timeout" in ins.signature(vdu.StatelessProcessGroup.create).parameters
    src = ins.getsource(PyNcclCommunicator.__init__)
    assert "self.disabled" in src and "self.available" in src, "PyNcclCommunicator no longer says when it is disabled"


COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "init_process_group",
    "irecv",
    "isend",
    "monitored_barrier",
    "new_group",
    "new_subgroups",
    "recv",
    "recv_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
    "send_object_list",
)


def test_the_ipc_push_runs_no_collective_and_the_server_loads_every_byte(monkeypatch):
    """vLLM's own stateful ipc engine all-gathers on the default group, which here spans every node: ours must not.
    MappedIpcSender's whole path (init, two pushes) runs with every torch.distributed collective (and group creation)
    raising, and the process group reported as initialized, so a collective anywhere below it fails here. Its requests
    go to the server's real engine (trainer.push.ipc_engine), whose mapping of the buffer is the buffer itself (no GPU
    here: the CUDA calls are answered on the CPU, the library boundary): the model receives every parameter's bytes,
    under its name and shape, window by window, and one mapping serves both pushes."""
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    import trainer.push.ipc_engine as engine_mod
    from trainer.push.senders import MappedIpcSender
    from trainer.push.wire import ParamMeta
    from trainer.rollout.server import VllmServer

    called: list[str] = []

    def forbidden(name: str):
        def fn(*a, **k):
            called.append(name)
            raise AssertionError(f"MappedIpcSender ran torch.distributed.{name}")

        return fn

    names = [n for n in COLLECTIVES if hasattr(c10d, n)]
    assert {"all_gather", "all_reduce", "broadcast", "barrier", "all_gather_object", "new_group"} <= set(names), names
    for mod in (dist, c10d):
        for n in names:
            if hasattr(mod, n):
                monkeypatch.setattr(mod, n, forbidden(n))
        monkeypatch.setattr(mod, "is_initialized", lambda: True)
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, device=None, **k: real_empty(*a, **k))  # the CUDA buffer, on the CPU
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: type("P", (), {"uuid": "GPU-test"})())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: type("S", (), {"synchronize": lambda self: None})())
    exported: list[torch.Tensor] = []

    def reduce_tensor(t):  # torch's own arguments for a CUDA tensor, the allocation named by its handle's bytes
        exported.append(t)
        n = t.numel()
        handle = f"h{len(exported) - 1}".encode()
        return None, (torch.Tensor, t.size(), t.stride(), 0, torch.storage.TypedStorage, t.dtype, 0, handle, n, 0, False,
                      b"rc", 0, b"ev", True)  # fmt: skip

    def rebuild_cuda_tensor(*args):  # the same bytes, mapped; the classes and dtype as the JSON handle gives them back
        assert args[0] is torch.Tensor and args[4] is torch.storage.TypedStorage and args[5] is torch.uint8, args
        return exported[int(args[7][1:])]

    monkeypatch.setattr("torch.multiprocessing.reductions.reduce_tensor", reduce_tensor)
    monkeypatch.setattr(engine_mod, "rebuild_cuda_tensor", rebuild_cuda_tensor)

    class Model:
        loads: list[list[tuple[str, list[int], list[float]]]] = []

        def load_weights(self, weights):
            self.loads.append([(n, list(t.shape), t.flatten().tolist()) for n, t in weights])

    receiver = engine_mod.MappedIpcWeightTransferEngine.__new__(engine_mod.MappedIpcWeightTransferEngine)
    receiver.device, receiver.model, receiver.model_config = torch.device("cuda", 0), Model(), None
    posted: list[str] = []

    class Client(VllmServer):  # the real route methods; the HTTP call goes straight to the engine
        def __init__(self):
            super().__init__("http://127.0.0.1:1", "m", node=0, timeout_s=5.0)

        def post(self, route, body=None, timeout_s=None, step=0, engine=None):
            posted.append(route)
            if route == self.INIT_WEIGHTS:  # through JSON, as over HTTP
                receiver.init_transfer_engine(receiver.parse_init_info(json.loads(json.dumps(body["init_info"]))))
            elif route == self.UPDATE_WEIGHTS:
                receiver.receive_weights(receiver.parse_update_info(body["update_info"]))

    meta = [ParamMeta(f"p{i}", "float32", [4, 4]) for i in range(5)]  # 64 bytes each
    sender = MappedIpcSender(Client(), 30.0, 128, meta)  # type: ignore[arg-type]  # two tensors per 128-byte window
    for push in range(2):
        params = [(m.name, torch.full((4, 4), float(10 * push + i))) for i, m in enumerate(meta)]
        sender.push(iter(params), meta, step=push + 1)
    assert not called, called
    assert len(exported) == 1, "the buffer is exported once, at init"
    one_push = ["/start_weight_update"] + ["/update_weights"] * 3 + ["/finish_weight_update"]
    assert posted == ["/init_weight_transfer_engine"] + one_push * 2
    windows = [[n for n, _, _ in load] for load in Model.loads]
    assert windows == [["p0", "p1"], ["p2", "p3"], ["p4"]] * 2, windows
    received = {
        (push, n): (shape, values)
        for push in range(2)
        for load in Model.loads[3 * push : 3 * push + 3]
        for n, shape, values in load
    }
    for push in range(2):
        for i in range(5):
            assert received[(push, f"p{i}")] == ([4, 4], [float(10 * push + i)] * 16), (push, i)

    whole = MappedIpcSender(Client(), 30.0, 2**30, meta)  # type: ignore[arg-type]
    assert whole.buffer_bytes == 5 * 64 and len(whole.windows) == 1, "a model that fits the buffer moves in one request"


def test_the_server_entry_point_the_nodes_run_still_starts_the_server():
    """GPU-AUDIT N9: launcher/node/commands.py runs `python -m vllm.entrypoints.openai.api_server`, deprecated in vLLM
    0.32 ("may be removed"). Pinned: the module still exists and its __main__ still hands over to the launcher's
    entry point; a vLLM that drops it fails here, not on every node at start-up."""
    import importlib.util

    spec = importlib.util.find_spec("vllm.entrypoints.openai.api_server")
    assert spec is not None and spec.origin, "vllm.entrypoints.openai.api_server is gone: change launcher/node/commands.py"
    src = open(spec.origin).read()
    assert 'if __name__ == "__main__":' in src and "from vllm.entrypoints.launchers.api_server.entry import main" in src
    from vllm.entrypoints.launchers.api_server.entry import main

    assert callable(main)


def test_the_ipc_handle_crosses_http_as_json_and_nothing_else_is_accepted():
    """The mapped_ipc init info carries the buffer's CUDA IPC handle: as JSON, with torch's reduce_tensor fields (pinned
    here against rebuild_cuda_tensor's parameters), back to the exact arguments, and anything else refused, so a
    process of the node that posts to the server's init route can never make it unpickle (and run) an object."""
    import base64
    import pickle

    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    from trainer.push.wire import decode_cuda_handle, encode_cuda_handle

    params = list(inspect.signature(rebuild_cuda_tensor).parameters)
    assert len(params) == 15 and params[6:8] == ["storage_device", "storage_handle"], params  # torch's order, pinned
    from torch.multiprocessing.reductions import reduce_tensor  # what the sender exports: the classes the codec fixes

    src = inspect.getsource(reduce_tensor)
    assert "storage = tensor._typed_storage()" in src and "type(tensor)," in src and "type(storage)," in src, src
    assert type(torch.empty(8, dtype=torch.uint8)._typed_storage()) is torch.storage.TypedStorage
    args = (torch.Tensor, torch.Size([1024]), (1,), 0, torch.storage.TypedStorage, torch.uint8, 3, b"\x00cuda\xff",
            1024, 512, False, b"/torch_123_456", 64, b"\x01event", True)  # fmt: skip
    wire = json.loads(json.dumps(encode_cuda_handle(args)))
    assert decode_cuda_handle(wire) == args
    assert encode_cuda_handle(args[:10] + (False, None, 0, None, False))["event_handle"] is None  # no event: null
    with pytest.raises(TypeError, match="flat uint8"):
        encode_cuda_handle((torch.nn.Parameter,) + args[1:])
    bad = [
        base64.b64encode(pickle.dumps(args)).decode(),  # the old format: a pickle
        {**wire, "tensor_cls": "os.system"},  # an extra field
        {k: v for k, v in wire.items() if k != "event_handle"},  # a missing one
        {**wire, "storage_device": "0"},  # a wrong type
        {**wire, "requires_grad": 1},
        {**wire, "storage_handle": "not base64!"},
    ]
    for d in bad:
        with pytest.raises(ValueError):
            decode_cuda_handle(d)  # type: ignore[arg-type]
