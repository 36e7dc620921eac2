"""Sampler chain against numpy computations of what each stage must keep."""

from __future__ import annotations

import math

import numpy as np
import pytest

from minirt import InvalidRequestError, sampling
from minirt.kernels import native
from minirt.sampling import Sampler, SamplingParams

V = 50


@pytest.fixture(autouse=True, params=["numpy", "native"])
def stats_path(request, monkeypatch):
    """Every sampler test runs on both implementations of the logit statistics."""
    if request.param == "numpy":
        monkeypatch.setattr(sampling, "logit_stats", sampling.logit_stats_numpy)
    elif not native.available():
        pytest.skip("native kernels unavailable")
    else:
        monkeypatch.setattr(sampling, "logit_stats", native.logit_stats)
    return request.param


def logits(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 3, V).astype(np.float32)


def draws(params: SamplingParams, x: np.ndarray, n: int = 400) -> np.ndarray:
    s = Sampler(params, V)
    return np.array([s.sample(x).token_id for _ in range(n)])


def test_greedy_is_argmax_and_logprob_is_log_softmax():
    x = logits()
    r = Sampler(SamplingParams(temperature=0.0, top_logprobs=5), V).sample(x)
    assert r.token_id == int(np.argmax(x))
    ls = x - (x.max() + np.log(np.exp(x - x.max()).sum()))
    assert math.isclose(r.logprob, float(ls[r.token_id]), rel_tol=1e-5)
    want = np.argsort(-x)[:5]
    assert [i for i, _ in r.top] == want.tolist()
    assert np.allclose([lp for _, lp in r.top], ls[want], rtol=1e-5)


def test_top_k_only_draws_the_k_best():
    x = logits(1)
    got = set(draws(SamplingParams(temperature=5.0, top_k=3, top_p=1.0, min_p=0.0, seed=1), x).tolist())
    assert got <= set(np.argsort(-x)[:3].tolist()) and len(got) >= 2


def test_top_p_keeps_smallest_prefix_reaching_p():
    x = logits(2)
    p = np.exp(x - x.max())
    p /= p.sum()
    order = np.argsort(-p)
    keep = order[: int(np.searchsorted(np.cumsum(p[order]), 0.5) + 1)]
    got = set(draws(SamplingParams(temperature=1.0, top_k=0, top_p=0.5, min_p=0.0, seed=2), x).tolist())
    assert got <= set(keep.tolist())


def test_min_p_threshold_relative_to_best():
    x = logits(3)
    p = np.exp(x - x.max())
    p /= p.sum()
    allowed = set(np.nonzero(p >= 0.2 * p.max())[0].tolist())
    got = set(draws(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.2, seed=3), x).tolist())
    assert got <= allowed


def test_typical_p_restricts_candidates():
    x = logits(4)
    got = set(draws(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, typical_p=0.2, seed=4), x).tolist())
    full = set(draws(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=4), x).tolist())
    assert len(got) < len(full)


def test_temperature_sharpens_distribution():
    x = logits(5)
    hot = draws(SamplingParams(temperature=2.0, top_k=0, top_p=1.0, min_p=0.0, seed=5), x, 600)
    cold = draws(SamplingParams(temperature=0.3, top_k=0, top_p=1.0, min_p=0.0, seed=5), x, 600)
    best = int(np.argmax(x))
    assert (cold == best).mean() > (hot == best).mean()


def test_seed_reproducible_and_independent_of_global_rng():
    x = logits(6)
    p = SamplingParams(temperature=1.0, seed=1234)
    a = draws(p, x, 50)
    np.random.seed(999)
    b = draws(p, x, 50)
    assert a.tolist() == b.tolist()
    assert draws(SamplingParams(temperature=1.0, seed=4321), x, 50).tolist() != a.tolist()


def test_repeat_presence_frequency_penalties():
    x = np.zeros(V, np.float32)
    x[:4] = [2.0, -2.0, 1.0, 0.5]
    hist = np.array([0, 1, 2, 2, 2])
    s = Sampler(SamplingParams(repeat_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.1), V)
    y = s.adjust(x, hist)
    assert y[0] == pytest.approx(2.0 / 2 - 0.1 - 0.5)
    assert y[1] == pytest.approx(-2.0 * 2 - 0.1 - 0.5)
    assert y[2] == pytest.approx(1.0 / 2 - 0.3 - 0.5)
    assert y[3] == pytest.approx(0.5)
    window = Sampler(SamplingParams(repeat_penalty=2.0, penalty_last_n=1), V).adjust(x, hist)
    assert window[0] == 2.0 and window[2] == pytest.approx(0.5)


def test_logit_bias_forces_and_bans():
    x = logits(7)
    worst = int(np.argmin(x))
    assert Sampler(SamplingParams(temperature=0.0, logit_bias={worst: 100.0}), V).sample(x).token_id == worst
    best = int(np.argmax(x))
    r = Sampler(SamplingParams(temperature=0.0, logit_bias={str(best): -math.inf}), V).sample(x)
    assert r.token_id != best
    huge = Sampler(SamplingParams(temperature=1.0, logit_bias={3: 1e300}, seed=0), V).sample(x)
    assert huge.token_id == 3 and math.isfinite(huge.logprob)


def test_all_banned_is_a_typed_error():
    bias = {i: -math.inf for i in range(V)}
    with pytest.raises(InvalidRequestError):
        Sampler(SamplingParams(logit_bias=bias), V).sample(logits())


@pytest.mark.parametrize("kw", [
    {"temperature": float("nan")}, {"temperature": -1.0}, {"temperature": float("inf")},
    {"top_p": 1.5}, {"min_p": -0.1}, {"top_k": -1}, {"top_k": 2.5}, {"typical_p": 2},
    {"logit_bias": {V + 5: 1.0}}, {"logit_bias": {"abc": 1.0}}, {"logit_bias": {1: float("nan")}},
    {"logit_bias": {1: float("inf")}}, {"logit_bias": [1, 2]}, {"top_logprobs": 99}, {"seed": "x"},
    {"repeat_penalty": float("nan")},
])
def test_invalid_parameters_raise_typed_errors(kw):
    with pytest.raises(InvalidRequestError):
        Sampler(SamplingParams(**kw), V)


def test_unknown_option_rejected():
    with pytest.raises(InvalidRequestError, match="bogus"):
        SamplingParams.from_kwargs(bogus=1)


def test_greedy_picks_the_lowest_id_among_tied_best():
    x = np.zeros(V, np.float32)
    x[[7, 3, 30]] = 2.5
    assert Sampler(SamplingParams(temperature=0.0), V).sample(x).token_id == 3


def _reference_stats(x: np.ndarray, k: int):
    order = np.lexsort((np.arange(x.size), -x.astype(np.float64)))  # value descending, id ascending
    m = float(x.max())
    lse = m + math.log(float(np.sum(np.exp(x.astype(np.float64) - m))))
    return m, lse, order[:k]


@pytest.mark.parametrize("n", [1, 3, 15, 16, 17, 63, 64, 65, 255, 256, 257, 1000, 151936])
@pytest.mark.parametrize("kind", ["normal", "ties", "half_banned", "ascending", "one_finite"])
def test_logit_stats_against_a_full_sort(stats_path, n, kind):
    """max, logsumexp and the top k (value descending, lowest id first among equal values) of
    both implementations against a float64 computation and a full lexicographic sort."""
    rng = np.random.default_rng(n)
    x = rng.normal(0, 4, n).astype(np.float32)
    if kind == "ties":
        x = np.round(x).astype(np.float32)
    elif kind == "half_banned":
        x[rng.random(n) < 0.5] = -np.inf
        x[rng.integers(n)] = 1.0
    elif kind == "ascending":  # the scan's worst case: every element enters the top k
        x = np.sort(x)
    elif kind == "one_finite":
        x[:] = -np.inf
        x[rng.integers(n)] = -3.0
    for k in (0, 1, 5, 40, 64):
        m, lse, ids, vals = sampling.logit_stats(x, k)
        rm, rlse, rids = _reference_stats(x, k)
        assert m == rm and math.isclose(lse, rlse, rel_tol=1e-6, abs_tol=1e-6)
        assert ids.tolist() == rids.tolist() and np.array_equal(vals, x[rids])


@pytest.mark.parametrize("bad,want", [(np.nan, "nan"), (np.inf, "inf"), (None, "-inf")])
def test_logit_stats_non_finite(stats_path, bad, want):
    x = np.random.default_rng(0).normal(0, 1, 4000).astype(np.float32)
    if bad is None:
        x[:] = -np.inf
    else:
        x[1234] = bad
    m, lse, ids, vals = sampling.logit_stats(x, 10)
    assert str(m) == want and str(lse) == want and ids.size == 0 and vals.size == 0
    with pytest.raises(InvalidRequestError, match="no token can be sampled"):
        Sampler(SamplingParams(temperature=0.0), x.size).sample(x)


def test_native_logit_stats_every_isa_and_bad_arguments():
    if not native.available():
        pytest.skip("native kernels unavailable")
    x = np.random.default_rng(3).normal(0, 3, 5001).astype(np.float32)
    want = sampling.logit_stats_numpy(x, 40)
    for isa in native.supported_isas():
        m, lse, ids, vals = native.logit_stats(x, 40, isa=isa)
        assert m == want[0] and math.isclose(lse, want[1], rel_tol=1e-6), isa
        assert np.array_equal(ids, want[2]) and np.array_equal(vals, want[3]), isa
    for k in (-1, native.TOPK_MAX + 1, 2.0):
        with pytest.raises(InvalidRequestError, match="k must be"):
            native.logit_stats(x, k)
    with pytest.raises(InvalidRequestError):
        native.logit_stats(x.astype(np.float64), 4)
    with pytest.raises(InvalidRequestError):
        native.logit_stats(np.zeros(0, np.float32), 4)
    assert sampling.TOPK_MAX == native.TOPK_MAX


def test_large_top_k_and_top_logprobs_fall_back_to_numpy():
    x = np.random.default_rng(4).normal(0, 3, 300).astype(np.float32)
    r = Sampler(SamplingParams(temperature=0.0, top_logprobs=20), 300).sample(x)
    assert [i for i, _ in r.top] == np.argsort(-x, kind="stable")[:20].tolist()
    got = {Sampler(SamplingParams(temperature=3.0, top_k=100, top_p=1.0, min_p=0.0, seed=s), 300).sample(x).token_id
           for s in range(200)}
    assert got <= set(np.argsort(-x)[:100].tolist()) and len(got) > 20
