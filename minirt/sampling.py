"""Step 5 of the pipeline: logits → next token id.

A sampler chain in llama.cpp's order: logit bias → repetition penalties over the recent window →
top-k → typical-p → top-p → min-p → temperature → draw. ``temperature == 0`` is greedy (argmax
after bias and penalties). Every sampler owns its ``numpy.random.Generator`` seeded from
``seed`` (or fresh entropy when None), so runs with a seed are reproducible and independent of
any global RNG.

Reported log-probabilities are those of the model's distribution after bias and penalties at
temperature 1 — what OpenAI-style ``logprobs`` describe — not of the truncated sampling
distribution.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np

from .errors import InvalidRequestError

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one request (defaults follow llama-cpp-python)."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    typical_p: float = 1.0
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64
    logit_bias: Mapping[int, float] | None = None
    seed: int | None = None
    top_logprobs: int = 0  # alternatives to report per token (0..20)

    def validated(self, n_vocab: int) -> SamplingParams:
        """Check every field; raise InvalidRequestError naming the first bad one."""

        def num(name: str, v: Any, lo: float | None = None, hi: float | None = None) -> float:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or math.isinf(v):
                raise InvalidRequestError(f"{name} must be a finite number, got {v!r}")
            if (lo is not None and v < lo) or (hi is not None and v > hi):
                raise InvalidRequestError(f"{name} must be in [{lo}, {hi}], got {v!r}")
            return float(v)

        def integer(name: str, v: Any, lo: int, hi: int | None = None) -> int:
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo or (hi is not None and v > hi):
                raise InvalidRequestError(
                    f"{name} must be an integer in [{lo}, {hi if hi is not None else '∞'}], got {v!r}")
            return int(v)

        num("temperature", self.temperature, 0.0, 1e4)
        integer("top_k", self.top_k, 0)
        num("top_p", self.top_p, 0.0, 1.0)
        num("min_p", self.min_p, 0.0, 1.0)
        num("typical_p", self.typical_p, 0.0, 1.0)
        num("repeat_penalty", self.repeat_penalty, 0.0, 1e4)
        num("presence_penalty", self.presence_penalty, -1e4, 1e4)
        num("frequency_penalty", self.frequency_penalty, -1e4, 1e4)
        integer("penalty_last_n", self.penalty_last_n, -1)
        integer("top_logprobs", self.top_logprobs, 0, MAX_TOP_LOGPROBS)
        if self.seed is not None:
            integer("seed", self.seed, -(2**63), 2**64 - 1)
        bias = None
        if self.logit_bias:
            if not isinstance(self.logit_bias, Mapping):
                raise InvalidRequestError("logit_bias must be a mapping of token id to bias, "
                                          f"got {type(self.logit_bias).__name__}")
            bias = {}
            for k, v in self.logit_bias.items():
                try:
                    tid = int(k)  # OpenAI sends ids as JSON object keys (strings)
                except (TypeError, ValueError):
                    raise InvalidRequestError(f"logit_bias key {k!r} is not a token id") from None
                if not 0 <= tid < n_vocab:
                    raise InvalidRequestError(f"logit_bias token id {tid} is out of range [0, {n_vocab})")
                if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or v == math.inf:
                    raise InvalidRequestError(f"logit_bias[{tid}] must be a finite number or -inf (ban), got {v!r}")
                # a huge finite bias acts like forcing / banning; clamp so sums stay finite
                bias[tid] = max(float(v), -1e9) if v != -math.inf else -math.inf
                bias[tid] = min(bias[tid], 1e9)
        return replace(self, logit_bias=bias)

    @classmethod
    def from_kwargs(cls, **kw: Any) -> SamplingParams:
        """Build from keyword arguments, ignoring None values; unknown names are an error."""
        names = {f.name for f in fields(cls)}
        bad = [k for k in kw if k not in names]
        if bad:
            raise InvalidRequestError(f"unknown sampling option(s): {', '.join(sorted(bad))}")
        return cls(**{k: v for k, v in kw.items() if v is not None})


@dataclass
class Sampled:
    """One chosen token with its log-probability and optional top alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (id, logprob), best first


class Sampler:
    """Stateful sampler of one sequence (its RNG advances with every draw)."""

    def __init__(self, params: SamplingParams, n_vocab: int) -> None:
        self.params = params.validated(n_vocab)
        self.n_vocab = n_vocab
        self.rng = np.random.default_rng(None if params.seed is None else int(params.seed) % (2**64))
        b = self.params.logit_bias
        self._bias_ids = np.fromiter(b.keys(), dtype=np.int64) if b else None
        self._bias_vals = np.fromiter(b.values(), dtype=np.float32) if b else None

    def adjust(self, logits: np.ndarray, history: np.ndarray) -> np.ndarray:
        """Logit bias and repetition penalties → float32 (V,): a new array when either applies,
        else ``logits`` itself (never modified)."""
        p = self.params
        penalize = (p.repeat_penalty != 1.0 or p.presence_penalty or p.frequency_penalty) and len(history) \
            and p.penalty_last_n
        if self._bias_ids is None and not penalize:
            return np.ascontiguousarray(logits, dtype=np.float32)  # 600 KB copy per token saved
        x = np.array(logits, dtype=np.float32, copy=True)
        if self._bias_ids is not None:
            x[self._bias_ids] += self._bias_vals
        if penalize:
            recent = history if p.penalty_last_n < 0 else history[-p.penalty_last_n:]
            ids, counts = np.unique(np.asarray(recent, dtype=np.int64), return_counts=True)
            ids_ok = ids < self.n_vocab
            ids, counts = ids[ids_ok], counts[ids_ok]
            v = x[ids]
            if p.repeat_penalty != 1.0:  # llama.cpp: divide positive logits, multiply negative ones
                v = np.where(v > 0, v / p.repeat_penalty, v * p.repeat_penalty)
            v = v - counts * np.float32(p.frequency_penalty) - np.float32(p.presence_penalty)
            x[ids] = v
        return x

    def sample(self, logits: np.ndarray, history: np.ndarray | None = None) -> Sampled:
        """Choose the next token from ``logits`` (V,) given the ids seen so far."""
        p = self.params
        x = self.adjust(logits, history if history is not None else np.zeros(0, np.int64))
        # the candidates top-k keeps (when few enough to rank in one pass) and the reported alternatives
        rank_top_k = p.temperature > 0.0 and 0 < p.top_k <= TOPK_MAX
        m, lse, ids, vals = logit_stats(x, max(1, p.top_logprobs, p.top_k if rank_top_k else 0))
        if not math.isfinite(m):
            # every token banned (or the model produced non-finite values): nothing sane to draw
            raise InvalidRequestError("no token can be sampled: all logits are -inf or not finite")
        if p.temperature <= 0.0:
            tok = int(ids[0])  # argmax, the lowest id among equal logits
        else:
            tok = self._draw(x, ids[: p.top_k] if rank_top_k else None)
        top = [(int(i), float(v) - lse) for i, v in zip(ids[: p.top_logprobs], vals[: p.top_logprobs])]
        return Sampled(tok, float(x[tok]) - lse, top)

    def _draw(self, x: np.ndarray, ranked: np.ndarray | None) -> int:
        """Draw from ``x`` through the chain; ``ranked``: the top-k ids, best first, when known."""
        p = self.params
        if ranked is not None:
            idx = ranked
        else:  # candidates sorted by logit, descending
            if 0 < p.top_k < x.size:
                idx = np.argpartition(-x, p.top_k - 1)[: p.top_k]
            else:
                idx = np.arange(x.size)
            idx = idx[np.argsort(-x[idx], kind="stable")]
        lg = x[idx].astype(np.float64)
        lg = lg[np.isfinite(lg)] if not np.all(np.isfinite(lg)) else lg
        idx = idx[: lg.size]
        probs = _softmax(lg)
        if p.typical_p < 1.0 and lg.size > 1:
            ent = -np.sum(probs * np.log(np.maximum(probs, 1e-300)))
            shifted = np.abs(-np.log(np.maximum(probs, 1e-300)) - ent)
            order = np.argsort(shifted, kind="stable")
            cum = np.cumsum(probs[order])
            keep = max(1, int(np.searchsorted(cum, p.typical_p) + 1))
            sel = np.sort(order[:keep])
            idx, lg = idx[sel], lg[sel]
            probs = _softmax(lg)
        if p.top_p < 1.0:
            cum = np.cumsum(probs)
            keep = max(1, int(np.searchsorted(cum, p.top_p) + 1))
            idx, lg = idx[:keep], lg[:keep]
            probs = _softmax(lg)
        if p.min_p > 0.0:
            keep = probs >= p.min_p * probs[0]
            keep[0] = True
            idx, lg = idx[keep], lg[keep]
        probs = _softmax(lg / max(p.temperature, 1e-6))
        return int(idx[self.rng.choice(idx.size, p=probs)])


TOPK_MAX = 64  # most entries the native logit_stats ranks (minirt.kernels.native.TOPK_MAX)


def logit_stats(x: np.ndarray, k: int) -> tuple[float, float, np.ndarray, np.ndarray]:
    """``(max, logsumexp, top ids, top values)`` of float32 logits ``x`` (V,) in one pass.

    The top ``min(k, V)`` entries come value descending, lowest id first among equal values. With a
    NaN in ``x`` max and logsumexp are NaN, with an infinite maximum both are that infinity, and no
    entries are returned. Uses the native kernel when the native extension is already loaded (it
    is, under the native backend) and ``k <= TOPK_MAX``, else :func:`logit_stats_numpy`.
    """
    if k <= TOPK_MAX:
        from .kernels import native

        if native.loaded():
            return native.logit_stats(x, k)
    return logit_stats_numpy(x, k)


def logit_stats_numpy(x: np.ndarray, k: int) -> tuple[float, float, np.ndarray, np.ndarray]:
    """numpy specification of :func:`logit_stats` (any ``k``)."""
    none = (np.zeros(0, np.int64), np.zeros(0, np.float32))
    if np.isnan(x).any():
        return math.nan, math.nan, *none
    m = float(np.max(x))
    if not math.isfinite(m):
        return m, m, *none
    lse = m + math.log(float(np.sum(np.exp(x - m, dtype=np.float32), dtype=np.float64)))
    k = min(int(k), x.size)
    if k <= 0:
        return m, lse, *none
    kth = x[np.argpartition(-x, k - 1)[k - 1]]  # the k-th largest value
    cand = np.flatnonzero(x >= kth)  # every tie of it, in id order
    ids = cand[np.argsort(-x[cand], kind="stable")][:k].astype(np.int64)
    return m, lse, ids, x[ids].astype(np.float32)


def _softmax(lg: np.ndarray) -> np.ndarray:
    e = np.exp(lg - lg.max())
    return e / e.sum()
