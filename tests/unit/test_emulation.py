"""job.emulate_gpus (issue 33 item 1): a cluster's nodes x GPUs laid out on one physical GPU. For every layout the GPU
runs of issue 33 item 2 use, the emulated plan and per-node commands equal the real ones except the device mapping,
the NCCL host ids (and the loopback/vLLM settings that go with them) and, for several nodes on one host, the ports;
the worker class vLLM starts for TP x DP > 1 sets the one GPU and its own host id before vLLM's own init_device."""

from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace

import pytest

from launcher.core import config as C
from launcher.core import emulation
from launcher.core.jobdir import Env
from launcher.core.plan import SHARED_MULTI_GPU, Plan, plan
from launcher.dryrun import render_dry_run
from launcher.node.commands import trainer_command, vllm_command

LAYOUTS: dict[str, dict] = {
    "split 1+3": {"slurm": {"gpus_per_node": 4}},
    "tp2 + 2": {"slurm": {"gpus_per_node": 4}, "vllm": {"tensor_parallel_size": 2}},
    "2 nodes x (1+2)": {"slurm": {"nodes": 2, "gpus_per_node": 3}, "trainer": {"fsdp": "hsdp"}},
    "lora adapter tp2": {"slurm": {"gpus_per_node": 4}, "vllm": {"tensor_parallel_size": 2}, "trainer": {"lora": {"r": 8}}},
    "lora merged dp2": {"slurm": {"gpus_per_node": 4}, "vllm": {"data_parallel_size": 2}, "trainer": {"lora": {"r": 8}}},
}
ALLOCATED = "5,6,7,4"  # what SLURM (or the device) gave the bootstrap: the emulated processes all take its first


def config(layout: dict, emulate: bool) -> C.JobConfig:
    d: dict = {"job": {"name": "emu", "emulate_gpus": emulate}, "vllm": {"model": "/m"}, "trainer": {"num_generations": 2}}
    for section, over in layout.items():
        d[section] = {**d.get(section, {}), **over}
    return C.from_dict(d)


def pair(name: str) -> tuple[Plan, Plan]:
    return plan(config(LAYOUTS[name], True), "/jobs/x"), plan(config(LAYOUTS[name], False), "/jobs/x")


def without_devices(p: Plan) -> dict:
    """The plan less what emulation may change: the flag, the devices, per-node ports, the rendezvous host."""
    d = dataclasses.asdict(p)
    for n in d["nodes"]:
        n.pop("server_url"), n.pop("weight_transfer_port")
        for r in n["ranks"]:
            r.pop("cuda_index")
    d["config"]["job"].pop("emulate_gpus")
    for k in ("emulated", "derivation", "rendezvous_host"):
        d.pop(k)
    return d


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_emulated_plan_is_the_clusters_but_for_devices_and_host_ids(name):
    emu, real = pair(name)
    assert emu.emulated and not real.emulated
    assert without_devices(emu) == without_devices(real)
    assert emu.weight_transfer_backend == real.weight_transfer_backend == "nccl"  # not ipc: the trainer is off vLLM's GPUs
    assert all(r.cuda_index == 0 for n in emu.nodes for r in n.ranks)
    assert [r.cuda_index for r in real.nodes[0].ranks] == list(range(real.ranks_per_node))
    same = [[d for d in p.derivation if not d.startswith("rendezvous")] for p in (emu, real)]  # 127.0.0.1: one host
    assert same[0][:-1] == same[1] and emulation.ANNOUNCE in emu.derivation[-1]
    host_ids = set()
    for node in range(emu.num_nodes):
        ev, rv = vllm_command(emu, node, allocated=ALLOCATED), vllm_command(real, node, allocated=ALLOCATED)
        et, rt = (trainer_command(p, node, "$FIRST_NODE", allocated=ALLOCATED) for p in (emu, real))
        # devices: every process sees the one GPU; on the real node vLLM its first TP x DP, torchrun the rest
        assert ev.env["CUDA_VISIBLE_DEVICES"] == et.env["CUDA_VISIBLE_DEVICES"] == "5"
        assert rv.env["CUDA_VISIBLE_DEVICES"] == ",".join(ALLOCATED.split(",")[: real.server_world])
        added_v = {**emulation.NCCL_ENV, **emulation.VLLM_ENV, "NCCL_HOSTID": f"emu-n{node}-vllm", Env.NODE: str(node)}
        assert ev.env == {**rv.env, "CUDA_VISIBLE_DEVICES": "5", **added_v}
        assert et.env == {**rt.env, "CUDA_VISIBLE_DEVICES": "5", **emulation.NCCL_ENV}
        assert et.argv == rt.argv, "torchrun is started as on the real node"
        extra = ["--worker-cls", emulation.WORKER_CLS, "--distributed-executor-backend", "mp", "--disable-custom-all-reduce"]
        port = rv.argv.index("--port") + 1
        assert ev.argv[port] == str(8000 + node) and rv.argv[port] == "8000"
        want = rv.argv[:port] + [str(8000 + node)] + rv.argv[port + 1 :]
        if emu.server_world > 1:  # before the config's own extra_args, after everything else
            at = len(want) - len(real.config.vllm.extra_args)
            want = want[:at] + extra + want[at:]
        assert ev.argv == want
        host_ids.add(ev.env["NCCL_HOSTID"])
        host_ids |= {emulation.rank_host_id(emu, node, r.local_rank) for r in emu.nodes[node].ranks}
        assert all(emulation.rank_host_id(real, node, r.local_rank) is None for r in real.nodes[node].ranks)
    assert len(host_ids) == emu.num_nodes * (1 + emu.ranks_per_node), "one host id per process"


def test_several_emulated_nodes_share_one_host_on_ports_of_their_own():
    emu, real = pair("2 nodes x (1+2)")
    assert [n.server_url for n in emu.nodes] == ["http://127.0.0.1:8000", "http://127.0.0.1:8001"]
    assert [n.weight_transfer_port for n in emu.nodes] == [29600, 29601]
    assert [emu.server_port(n) for n in (0, 1)] == [8000, 8001] and [real.server_port(n) for n in (0, 1)] == [8000, 8000]
    assert emu.rendezvous_host == "127.0.0.1" and real.rendezvous_host != "127.0.0.1"
    assert {n.weight_transfer_port for n in real.nodes} == {29600}
    assert emu.world_size == real.world_size == 4 and emu.ranks_per_node == 2


def test_the_lora_layouts_push_as_on_a_cluster():
    assert pair("lora adapter tp2")[0].lora_push == "adapter" and pair("lora merged dp2")[0].lora_push == "merged"
    emu = pair("lora merged dp2")[0]
    assert emu.server_world == 2 and emu.data_parallel_size == 2
    assert "--worker-cls" in vllm_command(emu, 0).argv, "two DP engines on one GPU need the worker class"


def test_the_shared_layout_of_two_gpus_is_refused_emulated_or_not():
    for emulate in (True, False):
        with pytest.raises(C.ConfigError, match="slurm.layout shared with 2 GPUs on CUDA cannot push"):
            plan(config({"slurm": {"gpus_per_node": 2, "layout": "shared"}}, emulate), "/j")
    assert SHARED_MULTI_GPU.format(g=2).endswith("use slurm.layout: split (the default)")


def test_dry_run_says_emulation_is_on_and_the_default_is_off():
    emu_cfg = config(LAYOUTS["tp2 + 2"], True)
    out = render_dry_run(emu_cfg, plan(emu_cfg, "/j"))
    assert "EMULATION ON (job.emulate_gpus, tests and benchmarks only)" in out and "emulate_gpus: true" in out
    assert "--worker-cls trainer.emulated_worker.EmulatedGpuWorker" in out
    real_cfg = config(LAYOUTS["tp2 + 2"], False)
    assert "EMULATION" not in render_dry_run(real_cfg, plan(real_cfg, "/j"))
    assert C.JobSection().emulate_gpus is False


@pytest.mark.parametrize(
    "over, message",
    [
        ({"job": {"platform": "rocm"}}, "job.emulate_gpus maps NVIDIA GPUs"),
        ({"slurm": {"nodes": 2, "gpus_per_node": 2}, "trainer": {"rendezvous_port": 8001}}, "are both 8001"),
    ],
)
def test_what_emulation_cannot_lay_out_is_refused_naming_the_key(over, message):
    with pytest.raises(C.ConfigError, match=message):
        plan(config(over, True), "/j")


def test_the_worker_class_gives_every_worker_the_one_gpu_and_its_own_host_id(monkeypatch):
    """Imported as vLLM imports it (its CPU build here); init_device's own work needs CUDA, so the original is the
    recording stand-in: what matters is what is set before it runs."""
    from vllm.v1.worker.gpu_worker import Worker

    from trainer import emulated_worker as ew

    seen = []
    monkeypatch.setattr(Worker, "init_device", lambda self: seen.append((os.environ["NCCL_HOSTID"], self.parallel_config)))
    monkeypatch.setattr(ew.current_platform, "visible_device_id_to_physical_device_id", lambda i: {0: 5}[i])
    monkeypatch.setenv("NCCL_HOSTID", "emu-n0-vllm")
    ids = set()
    for dp in (0, 1):
        for rank in (0, 1):
            w = ew.EmulatedGpuWorker.__new__(ew.EmulatedGpuWorker)
            w.parallel_config, w.rank = SimpleNamespace(data_parallel_index=dp), rank  # type: ignore[assignment]
            os.environ["NCCL_HOSTID"] = "emu-n0-vllm"  # each worker process inherits the server's
            w.init_device()
            host, pc = seen[-1]
            assert pc.assigned_physical_gpu_ids == [5] * ew.LOGICAL_GPUS
            assert host == f"emu-n0-vllm-dp{dp}-w{rank}"
            ids.add(host)
    assert len(ids) == 4


@pytest.mark.parametrize("name", sorted(__import__("tests.support.emulated", fromlist=["LAYOUTS"]).LAYOUTS))
def test_every_gpu_run_of_issue_33_plans_and_dry_runs_on_cpu(name):
    """The configs gpu/emulated.sh runs on the device (configs/gpu_emulated.yaml + each layout's sets), checked here
    where they cannot run: the plan is the cluster's (nccl push, the ranks and server world the layout names) and
    dry-run shows the emulated commands."""
    from tests.support.emulated import LAYOUTS, load_config

    layout = LAYOUTS[name]
    cfg = load_config(layout, "/tmp/model-emu", "/tmp/job-emu")
    p = plan(cfg, "/tmp/job-emu")
    assert p.emulated and p.weight_transfer_backend == "nccl" and p.config.trainer.max_steps == layout.steps
    assert p.ranks_per_node == p.gpus_per_node - p.server_world >= 2
    assert (p.world_size, p.server_world) == {
        "tp2_ranks2": (2, 2), "lora_adapter_tp2": (2, 2), "lora_merged_dp2": (2, 2), "nodes2": (4, 1)
    }.get(name, (3, 1))  # fmt: skip
    assert (p.config.trainer.per_device_train_batch_size * p.world_size) % p.config.trainer.num_generations == 0
    out = render_dry_run(cfg, p)
    assert emulation.ANNOUNCE in out and "--kv-cache-memory-bytes" in out and "NCCL_HOSTID=grpo-emu-n0-vllm" in out
    assert ("--worker-cls" in out) == (p.server_world > 1)
    assert layout.timeout_s <= 400, "a run, the install and the model build inside one 550 s device call"


def test_on_cpu_slots_emulation_is_several_nodes_on_one_host_only():
    """job.device cpu: no GPU to map, vLLM's CPU workers (no worker class); the nodes get ports of their own."""
    cfg = config({"job": {"device": "cpu"}, "slurm": {"nodes": 2, "gpus_per_node": 3}, "vllm": {"tensor_parallel_size": 2},
                  "trainer": {"dtype": "float32", "fsdp": "hsdp"}}, True)  # fmt: skip
    p = plan(cfg, "/j")
    assert p.emulated and p.weight_transfer_backend == "gloo" and p.server_port(1) == 8001
    v, t = vllm_command(p, 1), trainer_command(p, 1, "127.0.0.1")
    assert "--worker-cls" not in v.argv and v.argv[v.argv.index("--port") + 1] == "8001"
    assert v.env["CUDA_VISIBLE_DEVICES"] == t.env["CUDA_VISIBLE_DEVICES"] == ""
