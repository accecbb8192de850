"""plan(): the per-node arithmetic for 1, 2 and 8 nodes with TP 1/2/4, and its JSON round trip."""

from __future__ import annotations

import pytest

from launcher.core import config as C
from launcher.core.plan import FIRST_NODE, Plan, plan


def make(nodes: int, gpus: int, tp: int, **trainer):
    cfg = C.from_dict(
        {
            "vllm": {"model": "/m", "tensor_parallel_size": tp},
            "slurm": {"nodes": nodes, "gpus_per_node": gpus},
            "trainer": trainer,
        }
    )
    return plan(cfg, "/jobs/x")


@pytest.mark.parametrize("nodes", [1, 2, 8])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_rank_table(nodes, tp):
    p = make(nodes, 8, tp)
    per = 8 - tp
    assert p.ranks_per_node == per and p.world_size == per * nodes
    seen = []
    for n in p.nodes:
        assert n.vllm_gpus == list(range(tp))
        assert n.trainer_gpus == list(range(tp, 8))
        assert set(n.vllm_gpus).isdisjoint(n.trainer_gpus)
        assert n.server_url == "http://127.0.0.1:8000"  # every node's own loopback server
        for i, r in enumerate(n.ranks):
            assert (r.node, r.local_rank, r.gpu) == (n.node, i, tp + i)
            assert r.global_rank == n.node * per + i
            seen.append(r.global_rank)
    assert seen == list(range(p.world_size))
    assert p.rendezvous_host == ("127.0.0.1" if nodes == 1 else FIRST_NODE)
    assert p.weight_transfer_backend == "nccl"


def test_one_gpu_node_shares_the_gpu_with_ipc():
    p = make(1, 1, 1, per_device_train_batch_size=8)
    n = p.nodes[0]
    assert n.shared_gpu and n.vllm_gpus == [0] and n.trainer_gpus == [0] and p.world_size == 1
    assert p.weight_transfer_backend == "ipc"
    # the same config still plans for SLURM nodes
    assert make(4, 1, 1).world_size == 4


def test_cpu_backend_is_gloo():
    cfg = C.from_dict(
        {"vllm": {"model": "/m"}, "slurm": {"gpus_per_node": 3}, "job": {"device": "cpu"}, "trainer": {"dtype": "float32"}}
    )
    assert plan(cfg, "/j").weight_transfer_backend == "gloo"


def test_json_round_trip():
    p = make(2, 4, 2)
    q = Plan.from_dict(__import__("json").loads(p.to_json()))
    assert q == p
    assert q.rank(3).node == 1 and q.rank(3).local_rank == 1


def test_gpu_indices_map_through_the_allocation_slurm_gave_the_node():
    """On clusters without device cgroups a node's bootstrap sees CUDA_VISIBLE_DEVICES=4,5,6,7 (its share of the
    machine): vLLM must get 4 and the trainer 5,6,7, never 0 and 1,2,3 (another job's GPUs)."""
    from launcher.node.commands import trainer_command, vllm_command

    cfg = C.from_dict({"slurm": {"nodes": 1, "gpus_per_node": 4}, "vllm": {"model": "m"}})
    p = plan(cfg, "/tmp/j")
    assert vllm_command(p, 0, allocated="4,5,6,7").env["CUDA_VISIBLE_DEVICES"] == "4"
    assert trainer_command(p, 0, "127.0.0.1", allocated="4,5,6,7").env["CUDA_VISIBLE_DEVICES"] == "5,6,7"
    assert (
        trainer_command(p, 0, "127.0.0.1", allocated="GPU-a,GPU-b,GPU-c,GPU-d").env["CUDA_VISIBLE_DEVICES"] == "GPU-b,GPU-c,GPU-d"
    )
    assert trainer_command(p, 0, "127.0.0.1").env["CUDA_VISIBLE_DEVICES"] == "1,2,3"  # nothing set: the node's own 0..N-1
    assert [r.cuda_index for r in p.nodes[0].ranks] == [0, 1, 2]  # each rank's index inside its torchrun's list
    with pytest.raises(C.ConfigError, match=r"CUDA_VISIBLE_DEVICES='4,5' lists 2"):
        trainer_command(p, 0, "127.0.0.1", allocated="4,5")


@pytest.mark.parametrize("tp,dp", [(1, 4), (2, 2), (1, 1)])
def test_vllm_data_parallelism_takes_tp_x_dp_gpus_and_every_engine_joins_the_push(tp, dp):
    """vllm.data_parallel_size: the node's one server runs dp engines of tp GPUs each on the first tp x dp GPUs, the
    trainer ranks get the rest, the weight push's world is 1 sender + tp x dp workers, and the command says so."""
    from launcher.dryrun import render_dry_run
    from launcher.node.commands import vllm_command

    cfg = C.from_dict(
        {"vllm": {"model": "/m", "tensor_parallel_size": tp, "data_parallel_size": dp}, "slurm": {"nodes": 2, "gpus_per_node": 8}}
    )
    p = plan(cfg, "/jobs/x")
    n = p.nodes[1]
    assert n.vllm_gpus == list(range(tp * dp)) and n.trainer_gpus == list(range(tp * dp, 8))
    assert p.ranks_per_node == 8 - tp * dp and p.server_world == tp * dp
    cmd = vllm_command(p, 1, allocated="8,9,10,11,12,13,14,15")
    assert cmd.env["CUDA_VISIBLE_DEVICES"] == ",".join(str(8 + g) for g in range(tp * dp))
    assert ("--data-parallel-size" in cmd.argv) == (dp > 1)
    if dp > 1:
        assert cmd.argv[cmd.argv.index("--data-parallel-size") + 1] == str(dp)
    assert cmd.argv[cmd.argv.index("--tensor-parallel-size") + 1] == str(tp)
    text = render_dry_run(cfg, p)
    assert (
        f"weight push world per node = 1 sender (the node leader) + TP x DP = {tp} x {dp} server workers = {1 + tp * dp}" in text
    )
    assert Plan.from_dict(__import__("json").loads(p.to_json())).server_world == tp * dp
    # the trainer side reads the same number: GenerationSettings sizes the transfer group from the plan
    from trainer.rollout.node import GenerationSettings

    g = GenerationSettings.from_plan(p, 1, __import__("torch").float32)
    assert g.push.server_world == tp * dp and g.server_engines == dp


def test_data_parallelism_that_leaves_no_trainer_gpu_is_refused_with_the_fix():
    with pytest.raises(C.ConfigError, match=r"tensor_parallel_size x data_parallel_size \(2 x 4\) leaves no trainer GPU"):
        C.validate(
            C.from_dict(
                {"vllm": {"model": "/m", "tensor_parallel_size": 2, "data_parallel_size": 4}, "slurm": {"gpus_per_node": 8}}
            )
        )
