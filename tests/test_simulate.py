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
