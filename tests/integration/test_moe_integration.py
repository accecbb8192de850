"""Integration tier, MoE: a tiny Qwen3-MoE (3 experts, top-2, expert width 48: vLLM's CPU kernel pads it to 64) and a
tiny gpt-oss (biased experts, attention sinks, a sliding-window layer, YaRN) through the default sharded loader, a real
vLLM CPU server and the gloo push: parity after every push, as for the dense model (the issue's failure: 0.064 after
the first push, vLLM's CPU MoE kernel not re-prepacked; gpt-oss's pushes once did not land at all). The other families are
checked against vLLM's own load_weights in-process (tests/unit/test_families.py); the dense qwen2 runs in every other
integration test."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.conftest import PY, REPO
from tests.integration.test_integration import Ports, local, ports  # noqa: F401 - the fixture

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_an_moe_trains_with_parity_after_every_push(tmp_path, ports, family):  # noqa: F811 - the fixture
    model = tmp_path / family
    subprocess.run(
        [PY, "-m", "launcher", "make-tiny-model", str(model), "--family", family, "--untied"],
        check=True,
        cwd=REPO,
        capture_output=True,
    )
    job = tmp_path / "run"
    # parity_every=1: a stale probe before every push too (by default every 10 steps), so each push must change logprobs
    r = local(job, str(model), ports, "trainer.max_steps=3", "trainer.save_steps=3", "trainer.parity_every=1")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    s = json.loads((job / "summary.json").read_text())
    hist = s["nodes"]["0"]["parity_history"]
    after = [h["max_diff"] for h in hist if h["kind"] == "after_push"]
    stale = [h["max_diff"] for h in hist if h["kind"] == "stale"]
    assert len(after) >= 3 and max(after) <= 1e-4, after  # the server holds the trainer's experts after every push
    assert stale and min(stale) > 1e-3, stale  # ... and each push changed what the server computes
    assert s["nodes"]["0"]["parity_final"] <= 1e-4
    assert (job / "checkpoints" / "step-000003").is_dir()
