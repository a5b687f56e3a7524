"""bench.cases: case generation, routing, flop and byte counts (CPU only)."""

import zlib

import pytest
import torch

from bench import cases
from bench.cases import Case, Model

TINY = Model("tiny", experts=4, hidden=8, inter=16, top_k=2)


def test_model_shapes_and_gemm_dims():
    mix = cases.MODELS["mixtral-8x7b"]
    assert (mix.experts, mix.hidden, mix.inter, mix.top_k) == (8, 4096, 14336, 2)
    qwen = cases.MODELS["qwen3-30b-a3b"]
    assert (qwen.experts, qwen.hidden, qwen.inter, qwen.top_k) == (128, 2048, 768, 8)
    ds = cases.MODELS["deepseek-v3"]
    assert (ds.experts, ds.hidden, ds.inter, ds.top_k) == (256, 7168, 2048, 8)

    up = cases.make_case(qwen, "gate_up", 16, "uniform")
    assert (up.M, up.N, up.K, up.E) == (16 * 8, 2 * 768, 2048, 128)
    down = cases.make_case(qwen, "down", 16, "uniform")
    assert (down.M, down.N, down.K) == (16 * 8, 2048, 768)


@pytest.mark.parametrize("routing", cases.ROUTINGS)
@pytest.mark.parametrize("model", ["mixtral-8x7b", "deepseek-v3"])
def test_counts_sum_to_m(model, routing):
    m = cases.MODELS[model]
    for T in (1, 16, 1024):
        case = cases.make_case(m, "down", T, routing)
        assert case.M == T * m.top_k
        assert len(case.counts) == m.experts
        assert sum(case.counts) == case.M
        assert min(case.counts) >= 0
        # top-k experts of a token are distinct: no expert gets more rows than tokens
        assert max(case.counts) <= T


def test_route_distinct_experts_per_token():
    ids = cases.route(500, 8, 32, "skewed", seed=3)
    assert ids.shape == (500, 8)
    assert all(len(set(row)) == 8 for row in ids.tolist())


def test_routing_reproducible_by_seed():
    m = cases.MODELS["qwen3-30b-a3b"]
    a = cases.make_case(m, "gate_up", 1024, "skewed", base_seed=7)
    b = cases.make_case(m, "gate_up", 1024, "skewed", base_seed=7)
    c = cases.make_case(m, "gate_up", 1024, "skewed", base_seed=8)
    assert a.counts == b.counts and a.seed == b.seed
    assert a.counts != c.counts
    # gate_up and down of one batch share the routing
    assert cases.make_case(m, "down", 1024, "skewed", base_seed=7).counts == a.counts
    # and the seed is stable across processes (crc32, not the salted str hash())
    assert a.seed == zlib.crc32(b"7:qwen3-30b-a3b:1024:skewed")


def test_skewed_routing_is_skewed():
    m = cases.MODELS["qwen3-30b-a3b"]
    uniform = cases.make_case(m, "down", 1024, "uniform").counts
    skewed = cases.make_case(m, "down", 1024, "skewed").counts
    assert cases.skew(uniform) < 2.0
    assert cases.skew(skewed) > 5.0
    # the few hottest experts take a large share of the rows
    top8 = sorted(skewed, reverse=True)[:8]
    assert sum(top8) > 0.3 * sum(skewed)


def test_unknown_routing_rejected():
    with pytest.raises(ValueError, match="routing"):
        cases.route(4, 2, 8, "zipf", seed=0)


def test_suite_case_lists():
    gemm = cases.gemm_cases(["qwen3-30b-a3b"], [1024, 16], cases.GEMMS, ["uniform"])
    assert [(c.gemm, c.T) for c in gemm] == [("gate_up", 16), ("gate_up", 1024),
                                             ("down", 16), ("down", 1024)]
    layer = cases.layer_cases(["mixtral-8x7b"], cases.LAYER_T, ["uniform"])
    assert [c.T for c in layer] == [1, 16, 128, 1024, 4096, 16384]
    assert {c.gemm for c in layer} == {"layer"}
    assert cases.gemm_cases(["qwen3-30b-a3b"], [16], ["down"], ["uniform"],
                            weight_layout="kmajor")[0].weight_layout == "kmajor"


def _tiny(gemm):
    return Case(TINY, gemm, T=3, routing="uniform", seed=0, counts=(3, 0, 2, 1))


def test_flops_and_bytes_by_hand():
    up = _tiny("gate_up")  # M=6, N=32, K=8, 3 experts touched
    assert up.touched_experts == 3
    assert cases.flops(up) == 2 * 6 * 32 * 8 == 3072
    assert cases.traffic(up) == {"weights": 3 * 8 * 32 * 2, "act_in": 6 * 8 * 2, "out": 6 * 32 * 2}
    assert cases.bytes_moved(up) == 1536 + 96 + 384

    down = _tiny("down")  # N=8, K=16
    assert cases.flops(down) == 2 * 6 * 8 * 16
    assert cases.bytes_moved(down) == 3 * 16 * 8 * 2 + 6 * 16 * 2 + 6 * 8 * 2

    layer = _tiny("layer")  # gate_up 32x8 and down 8x16 per row; x in and out are T rows
    assert cases.flops(layer) == 2 * 6 * (32 * 8 + 8 * 16) == 4608
    assert cases.bytes_moved(layer) == 3 * (3 * 16 * 8 * 2) + 3 * 8 * 2 + 3 * 8 * 2


def test_bytes_real_model():
    m = cases.MODELS["mixtral-8x7b"]
    case = Case(m, "gate_up", 16, "uniform", 0, counts=(4,) * 8)
    assert cases.traffic(case)["weights"] == 8 * 4096 * 28672 * 2
    assert cases.flops(case) == 2 * 32 * 28672 * 4096


def test_describe_has_shape():
    text = _tiny("down").describe()
    assert "M=6" in text and "N=8" in text and "K=16" in text and "E=4" in text


def test_skew_of_even_counts_is_one():
    assert cases.skew((2, 2, 2)) == 1.0
    assert cases.expert_counts(torch.tensor([[0, 1], [1, 2]]), 4) == (1, 2, 1, 0)
