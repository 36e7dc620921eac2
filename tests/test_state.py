"""Saving and restoring a conversation's KV cache across model instances."""

from __future__ import annotations

import json

import numpy as np
import pytest

import minirt
from minirt import StateError
from tests.tiny_models import TinySpec, write_tiny

PROMPT = "the capital of France is"


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("state")
    a, b = d / "a.gguf", d / "b.gguf"
    write_tiny(a, TinySpec(seed=21))
    write_tiny(b, TinySpec(seed=22))
    return str(a), str(b)


def test_save_then_resume_in_a_new_instance(paths, tmp_path):
    a, _ = paths
    st = tmp_path / "conv.state"
    with minirt.load(a, n_ctx=128) as m:
        with pytest.raises(StateError):
            m.save_state(st)  # nothing yet
        first = m.generate(PROMPT, max_tokens=6, temperature=0.0, ignore_eos=True)
        saved = m.save_state(st)
        assert saved == first.prompt_ids + first.token_ids[:-1]
        follow = saved + first.token_ids[-1:] + m.tokenize(" w1 w2", add_special=False)
        want = m.generate(follow, max_tokens=5, temperature=0.0, ignore_eos=True).token_ids
    with minirt.load(a, n_ctx=128) as m2:
        assert m2.load_state(st) == saved
        c = m2.generate(follow, max_tokens=5, temperature=0.0, ignore_eos=True)
        assert c.usage["cached_tokens"] == len(saved)
        assert c.token_ids == want


def test_state_from_another_model_is_refused(paths, tmp_path):
    a, b = paths
    st = tmp_path / "a.state"
    with minirt.load(a, n_ctx=64) as m:
        m.generate(PROMPT, max_tokens=3, temperature=0.0)
        m.save_state(st)
    with minirt.load(b, n_ctx=64) as m:
        with pytest.raises(StateError, match="another model"):
            m.load_state(st)


def test_corrupt_or_foreign_files_are_refused(paths, tmp_path):
    a, _ = paths
    bad = tmp_path / "bad.state"
    bad.write_bytes(b"not a state file")
    with minirt.load(a, n_ctx=64) as m:
        with pytest.raises(StateError):
            m.load_state(bad)
        with pytest.raises(StateError):
            m.load_state(tmp_path / "missing.state")
        m.generate(PROMPT, max_tokens=3, temperature=0.0)
        good = tmp_path / "good.state"
        m.save_state(good)
        with np.load(good) as z:
            parts = {k: z[k] for k in z.files}
        h = json.loads(str(parts["header"]))
        for field, value in (("minirt", "0.0.0"), ("format", "other")):
            forged = tmp_path / f"{field}.state"
            np.savez(forged, **{**parts, "header": np.array(json.dumps({**h, field: value}))})
            with pytest.raises(StateError):
                m.load_state(forged)
        forged = tmp_path / "shape.state"
        np.savez(forged, **{**parts, "k": parts["k"][:, :1]})
        with pytest.raises(StateError):
            m.load_state(forged)
