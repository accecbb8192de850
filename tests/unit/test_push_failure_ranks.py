"""G11 of ../shared/GPU-AUDIT.md: a push that breaks half way on the node leader, with 2 ranks of one FSDP2 model (3 ran too: each non-leader ~0.4 s). The
non-leaders are then inside the next unit's all-gather with the leader; on GPUs of one node NCCL never sees a peer
that went away, so they would wait there for the process group's timeout (900 s by default). Modelled on CPU: gloo
ranks, a process-group timeout of 60 s, and a leader that stays alive after its failure (as a peer NCCL cannot see
leaving); the leader does what trainer.main does on an error (traceback, announce_failure). The non-leaders must be
gone within seconds, each naming the leader's cause, node and log (trainer.parallel.FailureWatch)."""

from __future__ import annotations

import os
import sys
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from launcher.node.diagnose import PEER_LOST, root_cause
from tests.support.ranks import free_port

PG_TIMEOUT_S = 60.0
WORLD = 2
LOG = "/jobs/x/logs/node0-trainer.log"


class BreaksHalfWay:
    """The leader's transport (trainer.push.senders.Sender): takes two units' tensors, then the connection breaks."""

    def push(self, params, meta, step: int) -> None:
        for i, _ in enumerate(params):
            if i == 3:
                from trainer.rollout.server import ServerError

                raise ServerError(f"sending weights (nccl) at step {step}: connection reset by the server")


def rank_main(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    sys.stderr = open(f"{out}/rank{rank}.err", "w", buffering=1)  # noqa: SIM115 - until the process ends
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=PG_TIMEOUT_S))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from trainer import parallel
    from trainer.push.pusher import NodePusher, PushSettings
    from trainer.rollout.server import VllmServer

    parallel.watch_failures(rank, 0, LOG)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)])
    mesh = init_device_mesh("cpu", (WORLD,))
    for m in model:
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    settings = PushSettings("nccl", free_port(), 1, 10.0, torch.float32, 2**20)
    client = VllmServer("http://127.0.0.1:9", "m", node=0, timeout_s=10.0) if rank == 0 else None
    pusher = NodePusher(model, client, settings, torch.device("cpu"))
    pusher.sender = BreaksHalfWay()  # type: ignore[assignment]
    try:
        pusher.push(step=7)
    except BaseException as e:  # trainer.main's handler: the traceback, then the others are told
        traceback.print_exc()
        open(f"{out}/failed_at", "w").write(str(time.time()))
        parallel.announce_failure(e)
        time.sleep(PG_TIMEOUT_S + 30)  # a peer NCCL cannot see leaving: the others must not depend on its exit
    os._exit(0)  # a non-leader that got out of the all-gather without being stopped: the test fails on its code


def test_a_push_broken_half_way_on_the_leader_stops_the_other_ranks_in_seconds_naming_it(tmp_path):
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, port, str(tmp_path))) for r in range(WORLD)]
    for p in procs:
        p.start()
    ended: dict[int, float] = {}
    deadline = time.time() + 120
    try:
        while len(ended) < WORLD - 1 and time.time() < deadline:
            for r in range(1, WORLD):
                if r not in ended and procs[r].exitcode is not None:
                    ended[r] = time.time()
            time.sleep(0.05)
        assert procs[0].is_alive(), (tmp_path / "rank0.err").read_text()[-3000:]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)
    failed_at = float((tmp_path / "failed_at").read_text())
    took = {r: round(t - failed_at, 2) for r, t in ended.items()}
    print(f"non-leaders gone after the leader's failure (s): {took}; process-group timeout {PG_TIMEOUT_S:g} s")
    assert set(took) == set(range(1, WORLD)), f"still waiting in the all-gather after 120 s: {took}"
    assert max(took.values()) < 5, f"{took}: far above the watch's 0.5 s poll"
    for r in range(1, WORLD):
        assert procs[r].exitcode == 1
        err = (tmp_path / f"rank{r}.err").read_text()
        line = next(ln for ln in err.splitlines() if "stopped by another rank's failure" in ln)
        assert f"trainer rank {r} of node 0 stops" in line and "trainer rank 0 of node 0 failed" in line, line
        assert "ServerError: sending weights (nccl) at step 7: connection reset" in line and LOG in line, line
        # the bootstrap's reading of such a log: a peer's failure (wait for its node's own cause), not this node's
        log = tmp_path / f"rank{r}.log"
        log.write_text("===== start\n" + err)
        cause = root_cause(log)
        assert any(m in cause for m in PEER_LOST), cause
    # the leader's own log names its cause first (printed before the others were told)
    lead = tmp_path / "rank0.log"
    lead.write_text("===== start\n" + (tmp_path / "rank0.err").read_text())
    assert root_cause(lead).startswith("ServerError: sending weights (nccl) at step 7"), root_cause(lead)


@pytest.mark.parametrize("first", ["trainer rank 2 of node 1 failed (ValueError: x); its traceback is in /l"])
def test_only_the_first_failure_is_kept(first):
    """Several ranks may fail at once (the same bad input everywhere): the first announcement is the one named."""
    from trainer.parallel import FAILED_KEY, FailureWatch

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store.set(FAILED_KEY, first)
    w = FailureWatch.__new__(FailureWatch)  # no thread: its own rank's announcement only
    w.store, w.me, w.log = store, "trainer rank 0 of node 0 failed", "/l0"
    w.announce(RuntimeError("later"))
    assert store.get(FAILED_KEY).decode() == first


def test_the_poll_period_bounds_the_load_on_node_0s_store():
    """Every rank polls node 0's store (which also holds the rendezvous): 0.5 s up to 500 ranks, then slower, so all
    ranks together never check more than STORE_POLLS_PER_S times a second."""
    from trainer.parallel import STORE_POLLS_PER_S, WATCH_S, poll_period_s

    assert poll_period_s(2) == poll_period_s(500) == WATCH_S
    for world in (501, 1792, 8192):
        assert world / poll_period_s(world) <= STORE_POLLS_PER_S and poll_period_s(world) < 10
