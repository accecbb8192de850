"""The trainer entry point, run by torchrun on every node (the launcher's bootstrap starts it):

    python -m torch.distributed.run --nproc-per-node 2 -m trainer.main <job_dir>/plan.json

Reads the plan, sets up torch.distributed (a group per node, the FSDP2/HSDP mesh, a checked all-reduce),
builds the run (trainer.run), trains with TRL's GRPOTrainer on node-local generation and per-node weight
pushes, finishes (final push and parity, checkpoint, summary), and closes. Exit code PREEMPTED_EXIT (3)
means "checkpointed on a preemption signal"; any error exits 1 at once (see __main__).
"""

from __future__ import annotations

import os
import sys
import traceback


def main(plan_path: str) -> int:
    from launcher.core.jobdir import PREEMPTED_EXIT
    from launcher.core.plan import Plan
    from trainer import parallel, run, tracking
    from trainer.callback import PreemptionFlag

    preemption = PreemptionFlag()  # first: a preemption signal during the minutes of start-up must not kill us
    plan = Plan.load(plan_path)
    par = parallel.init(plan)
    par.log(par.describe())
    r = run.build(plan, par, preemption)
    if r.train() is run.Outcome.PREEMPTED:
        tracking.finish()  # this attempt's part of the W&B run is complete; the requeued attempt continues the run
        par.close()
        return PREEMPTED_EXIT
    r.finish()
    tracking.finish()
    par.close()
    par.log("done")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m trainer.main <job_dir>/plan.json  (normally started by torchrun via launcher.node.bootstrap)")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        code = main(sys.argv[1])
    except BaseException:  # noqa: BLE001
        # Exit at once: interpreter shutdown would run process-group destructors that wait on the transfer
        # the failure left in flight (a paused server's broadcast), and the bootstrap would see the error late.
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        # then the other ranks stop within a second, naming this one (trainer.parallel.FailureWatch): the ones in a
        # collective with this rank would otherwise wait there up to the process group's timeout
        from trainer.parallel import announce_failure, run_failure_exit_hooks

        announce_failure(sys.exc_info()[1])  # type: ignore[arg-type]
        run_failure_exit_hooks()  # a checkpoint being written in the background: completed if it ends soon
        sys.stdout.flush()
        os._exit(1)
    # Success exits at once too: everything is written (checkpoint, metrics, summary) and the process groups are
    # destroyed; interpreter teardown has been seen to abort a rank after "done" (a native thread destroyed while
    # joinable: "terminate called without an active exception", SIGABRT), failing a finished run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
