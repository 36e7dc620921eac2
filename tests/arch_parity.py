"""minirt's logits on the architecture fixtures (``tests/data/archs/<arch>/``) against the references
stored beside them: transformers' float32 forward of the same tiny model (``hf``) and llama.cpp's
logits on the same GGUF (``llamacpp_<quant>``). Shared by ``tests/test_archs.py`` and
``bench/arch_parity.py`` (which prints the table)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

ARCH_DIR = Path(__file__).resolve().parent / "data" / "archs"
QUANTS = ("f16", "q8_0", "q4_k_m")


def fixtures() -> list[str]:
    """Architectures with a complete fixture folder."""
    if not ARCH_DIR.is_dir():
        return []
    return sorted(p.name for p in ARCH_DIR.iterdir() if (p / "ref.npz").is_file() and (p / "meta.json").is_file())


def rel_rms(a: np.ndarray, b: np.ndarray) -> float:
    """sqrt(mean((a-b)²)) / sqrt(mean(b²)) over everything."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    return float(np.sqrt(np.mean((a64 - b64) ** 2)) / np.sqrt(np.mean(b64 ** 2)))


def argmax_agreement(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean(a.argmax(-1) == b.argmax(-1)))


DECISIVE_MARGIN = 2.0


def decisive_positions(hf: np.ndarray, other: np.ndarray) -> np.ndarray:
    """Mask of positions whose top-two transformers logits differ by more than DECISIVE_MARGIN times
    ``other``'s RMS error against transformers (a runtime at that error level can tell them apart;
    at a narrower gap its argmax is a coin flip)."""
    err = float(np.sqrt(np.mean((other.astype(np.float64) - hf.astype(np.float64)) ** 2)))
    top2 = np.sort(hf, axis=-1)[..., -2:]
    return (top2[..., 1] - top2[..., 0]) > DECISIVE_MARGIN * err


FLIP_FACTOR = 4.0


def same_routing_positions(ours: np.ndarray, other: np.ndarray) -> np.ndarray:
    """Mask of positions where two runtimes' logits (n_seq, T, V) differ by at most FLIP_FACTOR
    times their median per-position RMS difference.

    In a mixture of experts a near tie in some layer's top-k sends a token to other experts at the
    smallest perturbation, which moves its logits by far more than rounding does; over a few hundred
    positions one or two such flips decide a whole-file RMS comparison. Outside the returned mask one
    of the two runtimes (not which) routed differently."""
    d = np.sqrt(np.mean((ours.astype(np.float64) - other.astype(np.float64)) ** 2, axis=-1))
    return d <= FLIP_FACTOR * np.median(d)


def minirt_logits(path: Path, tokens: np.ndarray, backend: str = "native", device: str = "cpu") -> np.ndarray:
    """Logits (n_seq, T, V) of every position of each sequence, each from a fresh context."""
    import minirt

    with minirt.load(str(path), n_ctx=max(64, tokens.shape[1] + 8), backend=backend, device=device) as llm:
        return np.stack([llm.logits([int(t) for t in seq]) for seq in tokens])


def decode_logits(path: Path, tokens: np.ndarray, n_prefill: int, backend: str = "native") -> np.ndarray:
    """Logits (n_seq, T - n_prefill, V) after positions n_prefill-1 .. T-2: prefill the first n_prefill
    ids, then decode the rest one at a time (the fused decode step where the backend has it)."""
    import minirt
    from minirt.forward import Segment, kv_cache_for

    with minirt.load(str(path), n_ctx=max(64, tokens.shape[1] + 8), backend=backend, device="cpu") as llm:
        m, c = llm.model, llm.model.cfg
        out = []
        for seq in tokens:
            cache = kv_cache_for(c, tokens.shape[1] + 8)
            rows = [m.forward(np.array(seq[:n_prefill]), [Segment(cache, n_prefill, "last")])[0].copy()]
            for t in seq[n_prefill:-1]:
                rows.append(m.forward(np.array([t]), [Segment(cache, 1, "last")])[0].copy())
            out.append(np.stack(rows))
        return np.stack(out)


def is_moe(meta: dict, quant: str) -> bool:
    """Whether the fixture's file routes tokens to experts (a dense Granite 4.0-H writes expert_count 0)."""
    return any(k.endswith(".expert_count") and int(v) > 0 for k, v in meta["files"][quant]["metadata"].items())


def compare(arch: str, quant: str, backend: str = "native") -> dict[str, Any]:
    """minirt vs transformers and llama.cpp vs transformers on one fixture file."""
    d = ARCH_DIR / arch
    ref = np.load(d / "ref.npz")
    meta = json.loads((d / "meta.json").read_text())
    tokens, hf, lc = ref["tokens"], ref["hf"], ref[f"llamacpp_{quant}"]
    ours = minirt_logits(d / meta["files"][quant]["file"], tokens, backend)
    m = decisive_positions(hf, lc)
    same = same_routing_positions(ours, lc)
    moe = is_moe(meta, quant)
    extra = {}
    if moe:
        ms = m & same
        extra = {"same_routing_fraction": float(same.mean()),
                 "minirt_rel_rms_same_routing": rel_rms(ours[same], hf[same]),
                 "llamacpp_rel_rms_same_routing": rel_rms(lc[same], hf[same]),
                 "minirt_decisive_argmax_same_routing": argmax_agreement(ours[ms], hf[ms]) if ms.any() else 1.0,
                 "llamacpp_decisive_argmax_same_routing": argmax_agreement(lc[ms], hf[ms]) if ms.any() else 1.0}
    return {"arch": arch, "quant": quant, "moe": moe, **extra,
            "minirt_rel_rms": rel_rms(ours, hf), "llamacpp_rel_rms": rel_rms(lc, hf),
            "minirt_argmax": argmax_agreement(ours, hf), "llamacpp_argmax": argmax_agreement(lc, hf),
            "minirt_decisive_argmax": argmax_agreement(ours[m], hf[m]) if m.any() else 1.0,
            "llamacpp_decisive_argmax": argmax_agreement(lc[m], hf[m]) if m.any() else 1.0,
            "decisive_fraction": float(m.mean()), "minirt_vs_llamacpp_rel_rms": rel_rms(ours, lc)}


def check_recurrent_passes(m: Any, a: np.ndarray, b: np.ndarray, tol: float) -> None:
    """For a model whose layers keep a per-sequence recurrent state: two sequences a and b (at least 11 and 6
    tokens) in one pass, a token by token, a's prefill split in two, and one decode step of both after
    separate prefills give, within ``tol`` (relative RMS), what each sequence gets alone in one pass: each
    segment continues from its own state."""
    from minirt.forward import Segment, kv_cache_for

    def logits(ids: list[np.ndarray]) -> list[np.ndarray]:
        caches = [kv_cache_for(m.cfg, 64) for _ in ids]
        return m.forward(np.concatenate(ids), [Segment(c, len(x), "all") for c, x in zip(caches, ids, strict=True)])

    alone = [logits([x])[0] for x in (a, b)]
    for got, want in zip(logits([a, b]), alone, strict=True):
        assert rel_rms(got, want) < tol
    cache = kv_cache_for(m.cfg, 64)
    steps = [m.forward(np.array([t]), [Segment(cache, 1, "last")])[0].copy() for t in a]
    assert rel_rms(np.stack(steps), alone[0]) < tol
    cache = kv_cache_for(m.cfg, 64)
    m.forward(a[:7], [Segment(cache, 7, "none")])
    rest = m.forward(a[7:], [Segment(cache, len(a) - 7, "all")])[0]
    assert rel_rms(rest, alone[0][7:]) < tol
    c1, c2 = kv_cache_for(m.cfg, 64), kv_cache_for(m.cfg, 64)
    m.forward(a[:10], [Segment(c1, 10, "none")])
    m.forward(b[:5], [Segment(c2, 5, "none")])
    both = m.forward(np.array([a[10], b[5]]), [Segment(c1, 1, "last"), Segment(c2, 1, "last")])
    assert rel_rms(both[0], alone[0][10]) < tol and rel_rms(both[1], alone[1][5]) < tol


def check_fused_decode(fused: Any, per_op: Any, a: np.ndarray, b: np.ndarray, steps: int = 5) -> None:
    """The fused native decode step of ``fused`` against the per-op ``per_op`` (the same description): after
    separate prefills of a[:5] and b[:2], ``steps`` decode steps of both sequences together give the same
    logits (relative RMS < 5e-4) and leave the same recurrent state in the first layer that has one (if any)."""
    from minirt.forward import Segment, kv_cache_for

    assert fused.native_stack is not None and per_op.native_stack is None
    outs, states = [], []
    for m in (fused, per_op):
        c1, c2 = kv_cache_for(m.cfg, 64), kv_cache_for(m.cfg, 64)
        m.forward(a[:5], [Segment(c1, 5, "none")])
        m.forward(b[:2], [Segment(c2, 2, "none")])
        outs.append(np.stack([np.stack(m.forward(np.array([a[5 + t], b[2 + t]]),
                                                 [Segment(c1, 1, "last"), Segment(c2, 1, "last")]))
                              for t in range(steps)]))
        i = next((j for j, sh in enumerate(c1.recurrent) if sh is not None), None)
        states.append([] if i is None else [x.copy() for x in c1.state(i)])
    assert rel_rms(outs[0], outs[1]) < 5e-4
    for x, y in zip(*states, strict=True):
        np.testing.assert_allclose(x, y, rtol=0, atol=2e-3 * float(np.abs(y).max()))


def check_recurrent_prefix_cache(q8_path: str, st: Path) -> None:
    """The prefix cache, state files (written to ``st``) and scheduler batching of a model whose layers keep a
    recurrent state: a repeated prompt reuses the snapshot before its last token, a continued conversation the
    live state, a prompt sharing only part of a cached one nothing; a saved state continues as it would have;
    three requests batched get what each gets alone."""
    import minirt

    prompt = list(range(10, 60))
    with minirt.load(q8_path, n_ctx=128) as m:
        first = m.generate(prompt, max_tokens=6, temperature=0.0, ignore_eos=True)
        # the same prompt again (regenerate): the snapshot before its last token is reused
        again = m.generate(prompt, max_tokens=6, temperature=0.0, ignore_eos=True)
        assert again.usage["cached_tokens"] == len(prompt) - 1 and again.token_ids == first.token_ids
        # the conversation continued: the live state after every cached position
        cont = prompt + first.token_ids + [5, 6, 7]
        c = m.generate(cont, max_tokens=5, temperature=0.0, ignore_eos=True)
        assert c.usage["cached_tokens"] == len(prompt) + len(first.token_ids) - 1
        # a prompt sharing only part of a cached one: no state there, so nothing is reused
        part = prompt[:30] + [7, 8, 9]
        partial = m.generate(part, max_tokens=4, temperature=0.0, ignore_eos=True)
        assert partial.usage["cached_tokens"] == 0
        saved = m.save_state(st)
        follow = saved + [11]
        want = m.generate(follow, max_tokens=5, temperature=0.0, ignore_eos=True).token_ids
    with minirt.load(q8_path, n_ctx=128) as m2:
        assert m2.generate(cont, max_tokens=5, temperature=0.0, ignore_eos=True).token_ids == c.token_ids
        assert m2.generate(part, max_tokens=4, temperature=0.0, ignore_eos=True).token_ids == partial.token_ids
        assert m2.load_state(st) == saved
        got = m2.generate(follow, max_tokens=5, temperature=0.0, ignore_eos=True)
        assert got.usage["cached_tokens"] == len(saved) and got.token_ids == want
        # three requests batched by the scheduler get what each gets alone
        prompts = [prompt, part, cont]
        alone = [m2.generate(p, max_tokens=5, temperature=0.0, ignore_eos=True).token_ids for p in prompts]
        m2.cache_pool.clear()
        handles = [m2.submit(p, max_tokens=5, temperature=0.0, ignore_eos=True) for p in prompts]
        assert [h.result(timeout=120).token_ids for h in handles] == alone
