"""metrics.png's middle panel: where each step's seconds go per node (generation, push, parity, training), from the
typed step rows (trainer.metrics.step_phases), drawn as stacked bars (the plot is written for real, with matplotlib)."""

from __future__ import annotations

import pytest

from launcher.core.records import StepRow
from trainer.metrics import plot, step_phases


def test_a_steps_seconds_split_into_generation_push_parity_and_the_rest_as_training():
    r = StepRow(step=3, reward=0.5, step_s=2.0, gen_wait_s={"0": 0.8, "1": 1.1}, push_s={"0": 0.3}, parity_s={"0": 0.05})
    assert step_phases(r, "0") == pytest.approx({"generation": 0.8, "push": 0.3, "parity": 0.05, "training": 0.85})
    assert step_phases(r, "1") == pytest.approx({"generation": 1.1, "push": 0.0, "parity": 0.0, "training": 0.9})
    assert step_phases(StepRow(step=1, reward=0.0), "0") is None, "no step time: nothing to split"


def test_the_plot_draws_one_stacked_bar_per_step_and_node_in_place_of_the_kl_panel(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.axes

    bars: list[tuple[str | None, int]] = []
    real_bar = matplotlib.axes.Axes.bar
    monkeypatch.setattr(
        matplotlib.axes.Axes,
        "bar",
        lambda self, x, h, *a, **k: bars.append((k.get("label"), len(x))) or real_bar(self, x, h, *a, **k),
    )
    titles: list[str] = []
    real_title = matplotlib.axes.Axes.set_title
    monkeypatch.setattr(
        matplotlib.axes.Axes, "set_title", lambda self, t, *a, **k: titles.append(t) or real_title(self, t, *a, **k)
    )
    rows = [
        StepRow(
            step=i, reward=0.1 * i, step_s=2.0, gen_wait_s={"0": 1.0, "1": 1.2}, push_s={"0": 0.2, "1": 0.3}, parity_s={"0": 0.02}
        )
        for i in range(1, 5)
    ]
    out = tmp_path / "metrics.png"
    plot(rows, out)
    assert out.stat().st_size > 1000
    assert bars == [("generation", 4), ("push", 4), ("parity", 4), ("training", 4), *[(None, 4)] * 4], bars
    assert "step seconds by phase (nodes 0, 1 side by side)" in titles and not any("KL" in t for t in titles), titles
