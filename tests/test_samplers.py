"""Sampler hooks and llama.cpp's further samplers: logits_processor and stopping_criteria
(llama-cpp-python's shapes), DRY, XTC, top-n-sigma, Mirostat 1 and 2, n_probs — each checked
against its definition on hand-made logits, and the hooks through generate on a tiny model."""

from __future__ import annotations

import math

import numpy as np
import pytest

import minirt
from minirt.sampling import Sampler, SamplingParams
from tests.tiny_models import TinySpec, write_tiny

V = 16


def sampler(**kw) -> Sampler:
    return Sampler(SamplingParams(**{"top_k": 0, "top_p": 1.0, "min_p": 0.0, "temperature": 1.0, "seed": 0, **kw}), V,
                   piece=lambda i: "\n" if i == 9 else f"t{i}")


def test_dry_penalizes_the_token_that_repeats_a_sequence():
    s = sampler(dry_multiplier=0.8, dry_base=1.75, dry_allowed_length=2)
    x = np.zeros(V, np.float32)
    out = s.adjust(x, np.array([1, 2, 3, 4, 7, 1, 2, 3]))  # "1 2 3" seen before, followed by 4
    want = np.zeros(V, np.float32)
    want[4] = -0.8 * 1.75 ** (3 - 2)
    np.testing.assert_allclose(out, want, rtol=1e-6)
    # a breaker (token 9 is a newline) cuts the match: "9 3" repeats only one token
    assert not sampler(dry_multiplier=0.8).adjust(x, np.array([9, 3, 4, 7, 9, 3])).any()
    assert sampler(dry_multiplier=0.8).adjust(x, np.array([8, 3, 4, 7, 8, 3]))[4] == np.float32(-0.8)
    assert not sampler(dry_multiplier=0.8, dry_allowed_length=4).adjust(x, np.array([1, 2, 3, 4, 1, 2, 3])).any()


def test_xtc_drops_the_top_choices():
    x = np.log(np.array([0.5, 0.3, 0.15, 0.05] + [1e-9] * (V - 4), np.float32))
    s = sampler(xtc_probability=1.0, xtc_threshold=0.1)
    seen = {s.sample(x).token_id for _ in range(200)}
    assert seen <= {2, 3} | set(range(4, V)) and 2 in seen and not seen & {0, 1}


def test_top_n_sigma_keeps_logits_near_the_max():
    x = np.array([10.0, 9.5, 9.0, 5.0] + [0.0] * (V - 4), np.float32)
    cut = x.max() - 1.0 * x.std()
    s = sampler(top_n_sigma=1.0, temperature=3.0)
    seen = {s.sample(x).token_id for _ in range(300)}
    assert seen == set(np.flatnonzero(x >= cut))


def test_mirostat_2_truncates_by_surprise_and_tracks_tau():
    rng = np.random.default_rng(1)
    x = rng.normal(0, 3, V).astype(np.float32)
    s = sampler(mirostat=2, mirostat_tau=2.0, mirostat_eta=0.5)
    p_full = np.exp(x - x.max()) / np.exp(x - x.max()).sum()
    order = np.argsort(-x, kind="stable")
    for _ in range(50):
        mu = s.mu
        r = s.sample(x, np.zeros(0, np.int64))
        keep = order[-np.log2(p_full[order]) <= mu] if (-np.log2(p_full[order]) <= mu).any() else order[:1]
        assert r.token_id in keep
        observed = -math.log2(p_full[r.token_id] / p_full[keep].sum())
        assert s.mu == pytest.approx(mu - 0.5 * (observed - 2.0))


def test_mirostat_1_runs_seeded_and_low_tau_is_greedy():
    x = np.linspace(0, 8, V).astype(np.float32)
    a = [sampler(mirostat=1, seed=3).sample(x).token_id for _ in range(5)]
    b = [sampler(mirostat=1, seed=3).sample(x).token_id for _ in range(5)]
    assert a == b
    s = sampler(mirostat=1, mirostat_tau=0.01, mirostat_eta=0.0)
    s.mu = 0.02
    assert {s.sample(x).token_id for _ in range(20)} == {V - 1}


def test_n_probs_reports_the_final_distribution():
    x = np.log(np.array([0.6, 0.3, 0.1] + [1e-12] * (V - 3), np.float32))
    r = sampler(n_probs=3, top_k=2).sample(x)
    assert [i for i, _ in r.probs] == [0, 1] and abs(sum(p for _, p in r.probs) - 1) < 1e-9
    assert sampler(n_probs=2, temperature=0.0).sample(x).probs == [(0, 1.0)]


@pytest.mark.parametrize("kw", [{"mirostat": 3}, {"dry_base": 0.5}, {"xtc_probability": 2.0}, {"n_probs": 50},
                                {"dry_sequence_breakers": "ab"}])
def test_bad_sampler_values(kw):
    with pytest.raises(minirt.InvalidRequestError):
        SamplingParams(**kw).validated(V)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    p = tmp_path_factory.mktemp("samplers") / "tiny.gguf"
    write_tiny(p, TinySpec(n_layer=1, seed=2))
    m = minirt.load(p, n_ctx=128)
    yield m
    m.close()


def test_logits_processor_and_stopping_criteria_through_generate(llm):
    seen = []

    def only_paris(input_ids, scores):
        seen.append(len(input_ids))
        out = np.full_like(scores, -np.inf)
        out[llm.tokenize("▁Paris".replace("▁", " "), add_special=False)[-1]] = 0.0
        return out

    c = llm.generate("the capital", max_tokens=4, temperature=0.0, logits_processor=[only_paris])
    prompt = len(llm.tokenize("the capital"))
    assert seen == [prompt, prompt + 1, prompt + 2, prompt + 3]
    assert len(set(c.token_ids)) == 1
    c = llm.generate("the capital", max_tokens=20, temperature=1.0, seed=1, ignore_eos=True,
                     stopping_criteria=lambda ids, logits: len(ids) >= prompt + 3)
    assert c.finish_reason == "stop" and len(c.token_ids) == 3
    ev = [e for e in llm.stream("the", max_tokens=3, temperature=1.0, seed=1, n_probs=2) if e.token_id is not None]
    assert all(e.probs and len(e.probs) <= 2 for e in ev)
    with pytest.raises(minirt.InvalidRequestError, match="logits_processor"):
        llm.generate("the", max_tokens=2, logits_processor=5)


def test_server_takes_llama_cpp_sampler_fields(llm):
    httpx = pytest.importorskip("httpx")
    from minirt.server import BackgroundServer, build_app

    body = {"prompt": "the", "max_tokens": 4, "temperature": 1.0, "seed": 3, "dry_multiplier": 0.8,
            "dry_sequence_breakers": ["\n"], "xtc_probability": 0.5, "top_n_sigma": 2.0, "mirostat": 2,
            "mirostat_tau": 4.0}
    with BackgroundServer(build_app(llm)) as srv:
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        want = llm.generate("the", max_tokens=4, temperature=1.0, seed=3, dry_multiplier=0.8,
                            dry_sequence_breakers=("\n",), xtc_probability=0.5, top_n_sigma=2.0, mirostat=2,
                            mirostat_tau=4.0)
        assert r.json()["choices"][0]["text"] == want.text
        assert httpx.post(srv.url + "/v1/completions", json={**body, "mirostat": 5}).status_code == 400
