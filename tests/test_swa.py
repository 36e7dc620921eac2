"""Sliding-window layers keep only their window resident (KVCache.release_stale): results do not
change, the given-back rows are really gone, and prefix reuse, state files and context shift never
read a given-back row.

The Gemma 3 fixture (tests/data/archs/gemma3: 7 layers, sliding window 16, every sixth layer full)
with the slack and step shrunk to 8 positions so a few hundred tokens cross them many times."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import minirt
from minirt.archs.base import Segment
from minirt.kv_cache import KVCache

G3 = Path(__file__).parent / "data" / "archs" / "gemma3" / "model-q8_0.gguf"
N_CTX = 4096  # large enough for the cache to be page-mapped (what makes giving rows back possible)


@pytest.fixture
def small_slack(monkeypatch):
    monkeypatch.setattr(KVCache, "STALE_SLACK", 8)
    monkeypatch.setattr(KVCache, "STALE_STEP", 8)


def _run(ids: list[int], n0: int, backend: str = "reference") -> tuple[np.ndarray, KVCache]:
    """Logits of a prefill of ids[:n0] then decode steps over the rest, and the cache."""
    with minirt.load(str(G3), n_ctx=N_CTX, backend=backend) as m:
        cache = m._new_cache(N_CTX)
        rows = [m.model.forward(np.array(ids[:n0]), [Segment(cache, n0, "last")])[0]]
        rows += [m.model.forward(np.array([t]), [Segment(cache, 1, "last")])[0] for t in ids[n0:]]
        return np.stack(rows), cache


@pytest.mark.parametrize("backend", ["reference", "native"])
def test_release_changes_nothing_and_gives_rows_back(small_slack, monkeypatch, backend):
    if backend == "native":
        from minirt.kernels import native

        if not native.available():
            pytest.skip("native kernels unavailable")
    ids = np.random.default_rng(1).integers(3, 200, 300).tolist()
    got, cache = _run(ids, 120, backend)
    w = cache.windows
    assert w == [16, 16, 16, 16, 16, 0, 16]
    for i in range(7):
        k, v = cache.layer(i)
        if w[i]:  # everything older than window + slack (to whole pages) reads as zeros again
            lo, hi = cache._stale[i]
            assert lo == 0 and hi >= 300 - 16 - 8 - 8
            assert not k[:, : hi // 32 * 32].any() and not v[:, : hi // 32 * 32].any()
            assert k[:, 300 - 16:300].any()
        else:
            assert k[:, :300].all(axis=-1).mean() > 0.9  # the full layer keeps every row
    monkeypatch.setattr(KVCache, "STALE_SLACK", 1 << 30)  # nothing given back
    want, c2 = _run(ids, 120, backend)
    assert not any(hi > lo for lo, hi in c2._stale)
    np.testing.assert_array_equal(got, want)


def test_prefix_reuse_never_reads_given_back_rows(small_slack):
    """A request sharing a prefix that ends inside the given-back range of a cached conversation reuses
    only what is intact (here: nothing) and gives the tokens of a fresh model; one continuing the whole
    conversation reuses it all."""
    rng = np.random.default_rng(2)
    prompt = rng.integers(3, 200, 200).tolist()
    with minirt.load(str(G3), n_ctx=512) as fresh:
        want_short = fresh.generate(prompt[:100] + [7, 8, 9], max_tokens=8, temperature=0.0, ignore_eos=True)
    with minirt.load(str(G3), n_ctx=N_CTX) as m:
        first = m.generate(prompt, max_tokens=40, temperature=0.0, ignore_eos=True)
        c = m.cache_pool.most_recent()
        assert any(hi > lo for lo, hi in c._stale)
        assert c.valid_prefix(100) == 0 and c.valid_prefix(c.n_past) == c.n_past
        follow = prompt + first.token_ids + [5]
        again = m.generate(follow, max_tokens=8, temperature=0.0, ignore_eos=True)
        assert again.usage["cached_tokens"] == len(prompt) + len(first.token_ids) - 1
        short = m.generate(prompt[:100] + [7, 8, 9], max_tokens=8, temperature=0.0, ignore_eos=True)
        assert short.token_ids == want_short.token_ids and short.usage["cached_tokens"] == 0
    with minirt.load(str(G3), n_ctx=512) as fresh:
        assert fresh.generate(follow, max_tokens=8, temperature=0.0, ignore_eos=True).token_ids == again.token_ids


def test_state_file_and_context_shift(small_slack, tmp_path):
    """A state saved after rows were given back loads as reusable at its full length only; a context
    shift keeps n_keep rows intact (they are never given back) and moves the window's rows."""
    rng = np.random.default_rng(3)
    prompt = rng.integers(3, 200, 150).tolist()
    st = tmp_path / "g3.state"
    with minirt.load(str(G3), n_ctx=N_CTX) as m:
        m.generate(prompt, max_tokens=20, temperature=0.0, ignore_eos=True)
        saved = m.save_state(st)
        want = m.generate(saved + [11], max_tokens=6, temperature=0.0, ignore_eos=True).token_ids
    with minirt.load(str(G3), n_ctx=N_CTX) as m2:
        assert m2.load_state(st) == saved
        c = m2.cache_pool.most_recent()
        assert c.valid_prefix(50) == 0 and c.valid_prefix(len(saved)) == len(saved)
        got = m2.generate(saved + [11], max_tokens=6, temperature=0.0, ignore_eos=True)
        assert got.usage["cached_tokens"] == len(saved) and got.token_ids == want
    # context shift: a 160-token context overflowing with n_keep 136, so each shift discards 12
    # positions and the window reaches back into the kept rows; against a cache giving nothing back
    out = {}
    for slack in (8, 1 << 30):
        KVCache.STALE_SLACK = slack
        with minirt.load(str(G3), n_ctx=160) as m:
            r = m.generate(prompt[:150], max_tokens=40, temperature=0.0, ignore_eos=True,
                           context_overflow="shift", n_keep=136)
            out[slack] = (r.token_ids, r.logprobs)
    assert len(out[8][0]) == 40 and out[8][0] == out[1 << 30][0]
    np.testing.assert_array_equal(out[8][1], out[1 << 30][1])
