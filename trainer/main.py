"""The trainer entry point, run by torchrun on every node (the launcher's bootstrap starts it):

    python -m torch.distributed.run --nproc-per-node 2 -m trainer.main <job_dir>/plan.json

Reads the plan, sets up torch.distributed (a group per node, the FSDP2/HSDP mesh), builds the model,
tokenizer, data and rewards, trains with TRL's GRPOTrainer on node-local generation and per-node
weight pushes, pushes the final weights and checks parity once more, writes the final checkpoint,
summary and plot, and closes. Exit code 3 means "checkpointed on a preemption signal".
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

PREEMPTED_EXIT = 3  # launcher.bootstrap.PREEMPTED_EXIT


def main(plan_path: str) -> int:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed

    from launcher.bootstrap import Events
    from launcher.topology import Plan
    from trainer import checkpoint, data, grpo, parallel, rewards
    from trainer.generation import NodeLocalGeneration
    from trainer.metrics import MetricsWriter, write_summary_and_plot

    grpo.install_preemption_handlers()
    plan = Plan.load(plan_path)
    t, v = plan.config["trainer"], plan.config["vllm"]
    job_dir = Path(plan.job_dir)
    par = parallel.init(plan, timeout_s=t["push_timeout_s"] + t["request_timeout_s"])
    log = (lambda *a: print(f"[trainer rank {par.rank} node {par.node}]", *a, flush=True))
    log(f"world {par.world}, node ranks {par.node_ranks}, leader {par.leader}, mesh {par.mesh}, device {par.device}")
    # an all-reduce across every rank of every node, checked: the cheapest proof the world is wired right
    probe = torch.tensor([float(par.rank + 1)], device=par.device)
    dist.all_reduce(probe)
    allreduce = {"got": probe.item(), "expected": par.world * (par.world + 1) / 2}
    if allreduce["got"] != allreduce["expected"]:
        raise RuntimeError(f"all-reduce over {par.world} ranks gave {allreduce['got']}, expected {allreduce['expected']}")
    set_seed(t["seed"])
    node_event = Events(job_dir, par.node) if par.is_leader else (lambda *a, **k: None)
    node_event("rendezvous_done", world=par.world)

    dtype = getattr(torch, t["dtype"])
    tokenizer = AutoTokenizer.from_pretrained(v["model"])
    # fp32 master weights; FSDP2 computes in the configured dtype (bf16 on GPU)
    model = AutoModelForCausalLM.from_pretrained(v["model"], dtype=torch.float32)
    model = parallel.shard_model(model.to(par.device), par, param_dtype=dtype)
    node_event("model_loaded")
    dataset = data.load_prompts(t["dataset"])
    reward_funcs = [rewards.resolve(r) for r in t["reward_funcs"]]

    stats = grpo.NodeStats(par)
    NodeLocalGeneration.context = {"parallel": par, "on_stats": stats, "settings": {
        "server_url": plan.nodes[par.node].server_url, "model": v["model"], "backend": plan.weight_transfer_backend,
        "weight_transfer_port": plan.nodes[par.node].weight_transfer_port, "server_world": plan.tensor_parallel_size,
        "request_timeout_s": t["request_timeout_s"], "push_timeout_s": t["push_timeout_s"],
        "parity_tolerance": t["parity_tolerance"], "parity_action": t["parity_action"],
        "parity_probe": "the quick brown fox jumps over a lazy dog and a cat sat on a mat",
        "push_dtype": dtype}}
    callback = grpo.SlurmGrpoCallback(job_dir, par, t, stats, on_first_step=lambda: node_event("first_step"))
    trainer = grpo.build_trainer(model, tokenizer, dataset, reward_funcs,
                                 grpo.grpo_config(job_dir, t, plan.device, plan.num_nodes), callback)
    gen = trainer.vllm_generation
    t0 = time.time()
    trainer.train()
    train_s = time.time() - t0
    # the trained parameters must still be FSDP2 shards (DTensors), not a silent DDP fallback
    from torch.distributed.tensor import DTensor

    n_dt = sum(isinstance(p, DTensor) for p in trainer.model.parameters())
    dtensor_params = {"dtensor": n_dt, "total": sum(1 for _ in trainer.model.parameters())}
    step = trainer.state.global_step
    if callback.preempted:
        log(f"preempted at step {step}: checkpoint written, exiting {PREEMPTED_EXIT} for requeue")
        dist.destroy_process_group()
        return PREEMPTED_EXIT

    # The last optimizer step is never pushed during training (a push precedes each generation):
    # push it now, so every server ends holding the final weights, and prove it with parity.
    gen.step = step
    gen.sync_weights()
    final = {"node": par.node, "parity_final": gen.stats.get("parity"), "push_s_final": gen.stats.get("push_s"),
             "pushes": gen.pusher.pushes,
             "server_requests": gen.vllm_client.requests_sent if gen.vllm_client else None,
             "trainer_peak_gpu_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2) if plan.device == "cuda" else None,
             "parity_history": [{k: h[k] for k in ("step", "kind", "max_diff")} for h in gen.parity.history]}
    finals: list = [None] * par.world
    dist.all_gather_object(finals, final if par.is_leader else None)
    callback.save(trainer.state)
    if par.rank == 0:
        per_node = {str(f["node"]): f for f in finals if f is not None}
        MetricsWriter(job_dir).write({"event": "final", "step": step, "nodes": per_node})
        write_summary_and_plot(job_dir, {"train_s": round(train_s, 2), "final_step": step,
                                         "resumed_from": callback.resumed_from, "nodes": per_node,
                                         "allreduce_check": allreduce, "dtensor_params": dtensor_params,
                                         "final_checkpoint": str(checkpoint.latest(job_dir / "checkpoints")[1])})
    dist.barrier()
    dist.destroy_process_group()
    log("done")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m trainer.main <job_dir>/plan.json  (normally started by torchrun via launcher.bootstrap)")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main(sys.argv[1]))
