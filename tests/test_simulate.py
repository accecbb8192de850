"""The scaling model's arithmetic (launcher.simulate.predict): what its docstring states, checked."""

from launcher.simulate import DEFAULTS, predict


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
