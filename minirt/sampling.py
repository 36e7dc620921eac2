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
from collections.abc import Callable, Mapping
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
    # llama.cpp's further samplers (names and defaults of llama.cpp's common_params_sampling)
    dry_multiplier: float = 0.0  # DRY ("don't repeat yourself"): 0 = off
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1  # -1: the whole context
    dry_sequence_breakers: tuple[str, ...] = ("\n", ":", "\"", "*")
    xtc_probability: float = 0.0  # XTC (exclude top choices): 0 = off
    xtc_threshold: float = 0.1
    top_n_sigma: float = -1.0  # keep logits within n standard deviations of the max; < 0 = off
    mirostat: int = 0  # 0 off, 1 Mirostat, 2 Mirostat 2.0 (replace top-k / top-p / min-p / typical)
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    n_probs: int = 0  # report the top n probabilities of the final sampling distribution

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
        num("dry_multiplier", self.dry_multiplier, 0.0, 1e4)
        num("dry_base", self.dry_base, 1.0, 1e4)
        integer("dry_allowed_length", self.dry_allowed_length, 0)
        integer("dry_penalty_last_n", self.dry_penalty_last_n, -1)
        if isinstance(self.dry_sequence_breakers, str) or not all(
                isinstance(b, str) for b in self.dry_sequence_breakers):
            raise InvalidRequestError("dry_sequence_breakers must be a list of strings")
        num("xtc_probability", self.xtc_probability, 0.0, 1.0)
        num("xtc_threshold", self.xtc_threshold, 0.0, 1.0)
        num("top_n_sigma", self.top_n_sigma, -1e4, 1e4)
        integer("mirostat", self.mirostat, 0, 2)
        num("mirostat_tau", self.mirostat_tau, 0.0, 1e4)
        num("mirostat_eta", self.mirostat_eta, 0.0, 1e4)
        integer("n_probs", self.n_probs, 0, MAX_TOP_LOGPROBS)
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
        return replace(self, logit_bias=bias, dry_sequence_breakers=tuple(self.dry_sequence_breakers))

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
    probs: list[tuple[int, float]] = field(default_factory=list)  # n_probs: (id, p) of the final distribution


class Sampler:
    """Stateful sampler of one sequence (its RNG advances with every draw)."""

    def __init__(self, params: SamplingParams, n_vocab: int, *, logits_processor: Any = None,
                 piece: Callable[[int], str] | None = None) -> None:
        """``logits_processor``: a callable or a list of them, ``(input_ids, scores) -> scores``
        (llama-cpp-python's shape), applied first; ``piece(id)``: a token's text (DRY's breakers)."""
        self.params = params.validated(n_vocab)
        self.n_vocab = n_vocab
        procs = logits_processor if isinstance(logits_processor, (list, tuple)) else \
            ([logits_processor] if logits_processor is not None else [])
        if not all(callable(f) for f in procs):
            raise InvalidRequestError("logits_processor must be a callable (input_ids, scores) -> scores "
                                      "or a list of them")
        self.processors = list(procs)
        self.piece = piece
        self._breaker: dict[int, bool] = {}
        self.mu = 2.0 * self.params.mirostat_tau  # Mirostat's running surprise target
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
        if self.processors:
            logits = self._process(logits, history)
        if self._bias_ids is None and not penalize and not p.dry_multiplier:
            return np.ascontiguousarray(logits, dtype=np.float32)  # 600 KB copy per token saved
        x = np.array(logits, dtype=np.float32, copy=True)
        if p.dry_multiplier and len(history):
            self._dry(x, history)
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

    def _process(self, logits: np.ndarray, history: np.ndarray) -> np.ndarray:
        ids = np.asarray(history, dtype=np.int64)
        scores = np.array(logits, dtype=np.float32, copy=True)
        for f in self.processors:
            out = f(ids, scores)
            scores = np.asarray(out if out is not None else scores, dtype=np.float32)
            if scores.shape != (self.n_vocab,):
                raise InvalidRequestError(
                    f"a logits_processor returned shape {scores.shape}, expected ({self.n_vocab},)")
        return scores

    def _is_breaker(self, tid: int) -> bool:
        b = self._breaker.get(tid)
        if b is None:
            text = self.piece(tid) if self.piece is not None else ""
            b = self._breaker[tid] = any(s in text for s in self.params.dry_sequence_breakers)
        return b

    def _dry(self, x: np.ndarray, history: np.ndarray) -> None:
        """DRY: penalize the token that would extend a sequence already seen in the context,
        ``multiplier * base ** (length - allowed_length)`` for a repeat of ``length`` tokens
        (sequences never cross a breaker token)."""
        p = self.params
        ctx = [int(t) for t in (history if p.dry_penalty_last_n < 0 else history[-p.dry_penalty_last_n:])] \
            if p.dry_penalty_last_n else []
        n = len(ctx)
        if n < 2 or self._is_breaker(ctx[-1]):
            return
        longest: dict[int, int] = {}
        for i in range(n - 1):  # ctx[i] == last token: ctx[i+1] continued the same text once
            if ctx[i] != ctx[-1]:
                continue
            k = 1
            while k <= i and ctx[i - k] == ctx[n - 1 - k] and not self._is_breaker(ctx[i - k]):
                k += 1
            nxt = ctx[i + 1]
            if k > longest.get(nxt, 0):
                longest[nxt] = k
        for tid, k in longest.items():
            if k >= p.dry_allowed_length and tid < self.n_vocab:
                x[tid] -= np.float32(p.dry_multiplier * p.dry_base ** (k - p.dry_allowed_length))

    def sample(self, logits: np.ndarray, history: np.ndarray | None = None,
               allowed: np.ndarray | None = None) -> Sampled:
        """Choose the next token from ``logits`` (V,) given the ids seen so far; ``allowed``: a
        boolean mask (V,) of the tokens a grammar permits (the others are never drawn)."""
        p = self.params
        x = self.adjust(logits, history if history is not None else np.zeros(0, np.int64))
        if allowed is not None:
            x = np.where(allowed, x, np.float32(-np.inf)).astype(np.float32, copy=False)
        # the candidates top-k keeps (when few enough to rank in one pass) and the reported alternatives
        rank_top_k = p.temperature > 0.0 and 0 < p.top_k <= TOPK_MAX
        m, lse, ids, vals = logit_stats(x, max(1, p.top_logprobs, p.top_k if rank_top_k else 0))
        if not math.isfinite(m):
            # every token banned (or the model produced non-finite values): nothing sane to draw
            raise InvalidRequestError("no token can be sampled: all logits are -inf or not finite"
                                      + (" (or banned by the grammar)" if allowed is not None else ""))
        dist: tuple[np.ndarray, np.ndarray] | None = None
        if p.temperature <= 0.0:
            tok = int(ids[0])  # argmax, the lowest id among equal logits
            dist = (np.array([tok]), np.array([1.0]))
        elif p.mirostat:
            tok, dist = self._mirostat(x)
        else:
            tok, dist = self._draw(x, ids[: p.top_k] if rank_top_k and p.top_n_sigma < 0 else None)
        top = [(int(i), float(v) - lse) for i, v in zip(ids[: p.top_logprobs], vals[: p.top_logprobs])]
        probs = []
        if p.n_probs:
            order = np.argsort(-dist[1], kind="stable")[: p.n_probs]
            probs = [(int(dist[0][j]), float(dist[1][j])) for j in order]
        return Sampled(tok, float(x[tok]) - lse, top, probs)

    def _mirostat(self, x: np.ndarray) -> tuple[int, tuple[np.ndarray, np.ndarray]]:
        """Mirostat 1 / 2 (llama.cpp's samplers): truncate to the tokens whose surprise fits the
        running target ``mu``, draw, move ``mu`` toward ``tau``."""
        p = self.params
        idx = np.flatnonzero(np.isfinite(x))
        idx = idx[np.argsort(-x[idx], kind="stable")]
        probs = _softmax(x[idx].astype(np.float64) / max(p.temperature, 1e-6))
        if p.mirostat == 1:
            m = min(100, probs.size - 1)
            if m >= 1:
                t = np.log(np.arange(2, m + 2) / np.arange(1, m + 1))
                b = np.log(np.maximum(probs[:m], 1e-300) / np.maximum(probs[1:m + 1], 1e-300))
                s_hat = float(np.sum(t * b) / np.sum(t * t))
                eps = s_hat - 1.0
                k = int(((eps * 2.0 ** self.mu) / (1.0 - self.n_vocab ** -eps)) ** (1.0 / s_hat)) if eps > 0 else 1
                k = max(1, min(k, probs.size))
                idx, probs = idx[:k], _softmax(np.log(np.maximum(probs[:k], 1e-300)))
        else:
            keep = max(1, int(np.sum(-np.log2(np.maximum(probs, 1e-300)) <= self.mu)))
            idx, probs = idx[:keep], _softmax(np.log(np.maximum(probs[:keep], 1e-300)))
        j = int(self.rng.choice(idx.size, p=probs))
        self.mu -= p.mirostat_eta * (-math.log2(probs[j]) - p.mirostat_tau)
        return int(idx[j]), (idx, probs)

    def _draw(self, x: np.ndarray, ranked: np.ndarray | None) -> tuple[int, tuple[np.ndarray, np.ndarray]]:
        """Draw from ``x`` through the chain; ``ranked``: the top-k ids, best first, when known.
        Returns the token and the final distribution ``(ids, probabilities)``."""
        p = self.params
        if p.top_n_sigma >= 0:  # before top-k, as in llama.cpp's default order
            fin = x[np.isfinite(x)]
            if fin.size:
                x = np.where(x >= fin.max() - p.top_n_sigma * float(np.std(fin)), x, np.float32(-np.inf))
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
        if p.xtc_probability > 0.0 and idx.size > 1 and self.rng.random() < p.xtc_probability:
            # XTC: drop every token above the threshold except the least likely of them
            above = int(np.sum(_softmax(lg) >= p.xtc_threshold))
            if above >= 2:
                idx, lg = idx[above - 1:], lg[above - 1:]
        probs = _softmax(lg / max(p.temperature, 1e-6))
        return int(idx[self.rng.choice(idx.size, p=probs)]), (idx, probs)


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
