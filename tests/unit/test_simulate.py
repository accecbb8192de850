"""The scaling model's arithmetic (launcher.simulate.predict): what its docstring states, checked; and the
`slurm-grpo simulate` command (config, --calibration, --json, --plot) as a user runs it."""

import json
import struct
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from launcher.core.shape import ModelShape
from launcher.simulate import DEFAULTS, Row, predict


def test_one_node_is_the_same_design_and_the_gap_grows_with_nodes():
    rows = predict([1, 2, 16, 256], params_b=7.0, ranks_per_node=7, batch=16, tokens=1024, f=DEFAULTS)
    assert rows[0].speedup == 1.0 and rows[0].ours_step_s == rows[0].stock_step_s
    assert len({round(r.ours_step_s, 9) for r in rows}) == 1  # per-node generation and push: flat in N
    assert [r.stock_step_s for r in rows] == sorted(r.stock_step_s for r in rows)
    assert rows[-1].speedup > rows[1].speedup > 1


def test_figures_enter_as_documented():
    f = {
        **DEFAULTS,
        "tokens_per_s_server": 1000.0,
        "tps_anchor_params_b": 1.0,
        "bytes_per_param": 4.0,
        "intra_bw_gbs": 2.0,
        "inter_bw_gbs": 1.0,
        "train_s": 3.0,
    }
    one, two = predict([1, 2], params_b=2.0, ranks_per_node=2, batch=4, tokens=50, f=f)
    tps = 1000.0 * 1.0 / 2.0  # a model twice the anchor decodes at half the rate
    assert abs(one.ours_gen_s - 2 * 4 * 50 / tps) < 1e-9
    assert abs(one.ours_push_s - 4.0 * 2e9 / 2e9) < 1e-9  # b P / intra_bw
    assert abs(two.stock_gen_s - 2 * one.ours_gen_s) < 1e-9
    assert abs(two.stock_push_s - 2 * 4.0 * 2e9 / 1e9) < 1e-9  # gather + push over the inter-node link
    assert abs(two.ours_step_s - (one.ours_gen_s + one.ours_push_s + 3.0)) < 1e-9


def test_the_split_model_adds_up_and_recommends_the_balanced_split():
    from launcher.simulate import LAYOUT_DEFAULTS, recommend, split_rows

    f = {**DEFAULTS, **LAYOUT_DEFAULTS, "tokens_per_s_server": 1000.0, "tps_anchor_params_b": 1.0}
    rows = split_rows(8, 1, 4, params_b=1.0, completions=100, tokens=100, train_rank_s=70.0, f=f)
    ours = [r for r in rows if r.layout.startswith("per-node")]
    assert [r.vllm_gpus for r in ours] == list(range(1, 8)) and all(r.vllm_gpus + r.trainer_gpus == 8 for r in ours)
    for r in ours:
        assert abs(r.gen_s - 100 * 100 / (1000.0 * r.vllm_gpus)) < 1e-9 and abs(r.train_s - 70.0 / r.trainer_gpus) < 1e-9
        assert abs(r.sync_s - (r.gen_s + r.train_s + r.push_s)) < 1e-9
        # overlapping gains when both sides are long, and costs its overhead when one side is nearly nothing
        assert r.async_s is not None and r.async_s <= r.sync_s * (1 + f["async_overhead"])
        if min(r.gen_s, r.train_s) > 0.2 * max(r.gen_s, r.train_s):
            assert r.async_s < r.sync_s, r
    best_sync, best_async = recommend(rows)
    # generation 10 s/GPU and training 70 s/rank: the balance is about 1 serving GPU in 8 ... here 1-2
    assert best_async.vllm_gpus in (1, 2) and best_sync.vllm_gpus in (1, 2, 3), (best_sync, best_async)
    colocate = next(r for r in rows if r.layout == "TRL colocate")
    assert colocate.async_s is None and colocate.trainer_gpus == 8  # time-shares every GPU, no overlap
    far = next(r for r in rows if r.layout.startswith("separate"))
    assert far.push_s > best_async.push_s * 10  # its push crosses the network (twice), ours stays on NVLink
    # TP 2: only multiples of TP serve
    assert [r.vllm_gpus for r in split_rows(8, 2, 1, 1.0, 100, 100, 70.0, f) if r.layout.startswith("per-node")] == [2, 4, 6]


REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs" / "gpu_7b_4nodes.yaml")  # 8 GPUs a node, TP 1 x DP 1: 7 trainer ranks; 16 x 1024 tokens
# a model folder of the test's own (the config's /shared/models path may or may not exist on this machine)
SHAPE = {"hidden_size": 1024, "num_hidden_layers": 4, "intermediate_size": 2816, "vocab_size": 32000, "num_attention_heads": 16}
FIGURES = {
    "tokens_per_s_server": 1000.0,
    "tps_anchor_params_b": 1.0,
    "bytes_per_param": 4.0,
    "intra_bw_gbs": 2.0,
    "inter_bw_gbs": 0.5,
    "train_s": 3.0,
}


def simulate(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """The command as a user runs it, from another folder than the checkout."""
    return subprocess.run(
        [sys.executable, "-m", "launcher", "simulate", *args], capture_output=True, text=True, timeout=300, cwd=cwd
    )


def test_the_command_takes_the_config_and_the_calibration_and_writes_rows_and_a_png(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(SHAPE))
    params_b = ModelShape.read(str(model)).params / 1e9  # type: ignore[union-attr]
    assert 0.05 < params_b < 1.0  # under the anchor: the server runs at the calibrated tokens/s
    cal, rows_json, png = tmp_path / "results.json", tmp_path / "rows.json", tmp_path / "scaling.png"
    cal.write_text(json.dumps({"calibration": FIGURES, "other": "bench's other results are ignored"}))
    r = simulate(CONFIG, "--nodes", "1,2,4", "--set", f"vllm.model={model}", "--calibration", str(cal),
                 "--plot", str(png), "--json", str(rows_json), cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "tokens_per_s_server=1000," in r.stdout and f"plot: {png}" in r.stdout, r.stdout
    rows = json.loads(rows_json.read_text())
    assert [set(x) for x in rows] == [{f.name for f in fields(Row)}] * 3 and [x["nodes"] for x in rows] == [1, 2, 4]
    gen = 7 * 16 * 1024 / 1000.0  # 7 ranks x 16 completions x 1024 tokens at the calibrated 1000 tokens/s
    push = 4.0 * params_b * 1e9 / 2e9  # 4 bytes a parameter over the calibrated 2 GB/s
    for x in rows:
        assert x["ours_gen_s"] == pytest.approx(gen) and x["ours_push_s"] == pytest.approx(push), x
        assert x["ours_step_s"] == pytest.approx(gen + push + 3.0) and x["stock_gen_s"] == pytest.approx(x["nodes"] * gen), x
    assert rows[0]["speedup"] == 1.0 and rows[1]["stock_push_s"] == pytest.approx(2 * 4.0 * params_b * 1e9 / 0.5e9)
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", data[:16]
    assert struct.unpack(">II", data[16:24]) == (540, 360)  # 6 x 4 inches at 90 dpi
    # without --calibration: the public default figures, so the rows differ
    r = simulate(CONFIG, "--nodes", "1", "--set", f"vllm.model={model}", "--json", str(rows_json), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(rows_json.read_text())[0]["ours_gen_s"] == pytest.approx(7 * 16 * 1024 / DEFAULTS["tokens_per_s_server"])


@pytest.mark.parametrize(
    "calibration, args, needle",
    [
        (None, ["--calibration", "missing.json"], "--calibration missing.json: cannot read it (No such file or directory)"),
        ("{not json", ["--calibration", "c.json"], "--calibration c.json is not JSON"),
        ({"tokens_per_s_server": 5.0}, ["--calibration", "c.json"], "--calibration c.json has no 'calibration' object"),
        ({"calibration": {"tokens_per_sec": 5.0}}, ["--calibration", "c.json"], "unknown figure(s) tokens_per_sec; known: "),
        ({"calibration": {"intra_bw_gbs": 0}}, ["--calibration", "c.json"], "intra_bw_gbs=0: every figure must be above 0"),
        (None, ["--nodes", "1,x"], "--nodes 1,x: give comma-separated node counts of 1 or more"),
        (None, ["--plot", "no/such/folder/p.png"], "--plot no/such/folder/p.png: its folder does not exist"),
        (None, ["--json", "no/such/folder/x.json"], "--json no/such/folder/x.json: its folder does not exist"),
        (None, ["--json", "."], "--json . is a folder; give the path of a file to write"),
    ],
)
def test_bad_inputs_are_one_line_naming_the_option(tmp_path, calibration, args, needle):
    if calibration is not None:
        (tmp_path / "c.json").write_text(calibration if isinstance(calibration, str) else json.dumps(calibration))
    r = simulate(CONFIG, "--params-b", "1", *args, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("slurm-grpo simulate: error: "), r.stderr
    assert r.stdout == "", r.stdout  # refused before the work, not after its tables
    assert needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "Traceback" not in r.stderr and not list(tmp_path.glob("*.png"))


def test_a_model_size_assumed_for_want_of_its_config_is_said_so_as_dry_run_says_it(tmp_path):
    """A hub id not downloaded here: simulate's tables are of a 7 B model, and its assumptions line says that this is a
    fallback in dry-run's words (layout_verdict), not the model's own size; a size given or read says nothing of it."""
    from launcher.core.config import load
    from launcher.simulate import layout_verdict

    assumed = "a 7 B model assumed, its config.json is not readable here"
    hub = "example-org/not-downloaded-7b"
    r = simulate(CONFIG, "--nodes", "1", "--set", f"vllm.model={hub}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    first = r.stdout.splitlines()[0]
    assert first.startswith(f"assumptions: model 7B params ({assumed}; --params-b N gives the size)"), first
    verdict = layout_verdict(load(CONFIG, [f"vllm.model={hub}"]))
    assert verdict is not None and f"`slurm-grpo simulate`; {assumed})" in verdict, verdict
    r = simulate(CONFIG, "--nodes", "1", "--params-b", "7", "--set", f"vllm.model={hub}", cwd=tmp_path)
    assert r.returncode == 0 and "assumed" not in r.stdout.splitlines()[0], r.stdout
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(SHAPE))
    r = simulate(CONFIG, "--nodes", "1", "--set", f"vllm.model={model}", cwd=tmp_path)
    assert r.returncode == 0 and "assumed" not in r.stdout.splitlines()[0], r.stdout
