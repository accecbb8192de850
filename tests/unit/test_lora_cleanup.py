"""The node-local folders of pushed LoRA adapters (JobDir.adapter_pushes, in TMPDIR or /tmp) do not outlive the job's
node: the bootstrap removes them once its processes have stopped, after a failure too (the finished run's removal is
asserted in tests/integration/test_lora_integration.py)."""

from __future__ import annotations

from launcher.core.jobdir import JobDir, remove_pushed_adapters
from tests.support.fakes import fake_vllm
from tests.unit.test_bootstrap_start import bootstrap, events, job


def test_removing_a_nodes_adapters_keeps_another_nodes_and_then_the_jobs_folder_goes(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    d = JobDir(tmp_path / "job")
    for node in (0, 1):
        (d.adapter_push(node, 3)).mkdir(parents=True)
        (d.adapter_push(node, 3) / "adapter_model.safetensors").write_bytes(b"x")
    remove_pushed_adapters(str(d.root), 0)
    assert not d.adapter_pushes(0).exists() and d.adapter_push(1, 3).exists()  # the test cluster's nodes share /tmp
    remove_pushed_adapters(str(d.root), 1)
    assert not d.adapter_pushes(1).parent.exists()
    assert sorted(p.name for p in (tmp_path / "tmp").iterdir()) == []
    remove_pushed_adapters(str(d.root), 1)  # nothing left: no error


def test_a_failed_lora_node_leaves_no_adapter_folder(tmp_path, tiny_model):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    fake = fake_vllm(tmp_path, "fake vLLM: out of memory", exit_code=1)
    d = job(tmp_path, tiny_model, lora={"r": 8})
    pushed = JobDir(d).adapter_push(0, 2)
    pushed = tmp / pushed.relative_to(pushed.parents[2])  # as the trainer writes it under the node's TMPDIR
    pushed.mkdir(parents=True)  # what a trainer that pushed before the failure left
    r = bootstrap(str(d / "plan.json"), "--node", "0", fake=fake, TMPDIR=str(tmp))
    assert r.returncode == 1 and "fake vLLM: out of memory" in r.stderr, r.stderr
    assert "failed" in events(d) and "bootstrap_end" in events(d)
    assert list(tmp.iterdir()) == [], list(tmp.iterdir())
