"""Sampler chain against numpy computations of what each stage must keep."""

from __future__ import annotations

import math

import numpy as np
import pytest

from minirt import InvalidRequestError
from minirt.sampling import Sampler, SamplingParams

V = 50


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
