"""Embeddings and reranking: texts (or token ids) → pooled vectors, query + documents → scores.

The forward pass is :meth:`minirt.forward.Transformer.encode` (final hidden states, no logits);
this module batches inputs into it, pools what the description's :class:`~minirt.blocks.Pooling`
says (mean / first token / last token / none / the reranker's classifier head), applies the dense
projections after pooling and normalizes.

Batching: sequences are packed into forward calls of at most ``n_batch`` tokens (a longer
sequence goes alone, whole: bidirectional attention needs every position in one pass), the
sequences of concurrent calls together (:class:`EmbedQueue`). Each call takes the model's step
lock on its own, so generation steps of the scheduler run between them and a large embedding
request never holds generation up for longer than one batch. Each sequence gets
a KV cache of exactly its own length for the duration of its call, nothing sized by ``n_ctx``.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .blocks import Pooling
from .errors import ContextOverflowError, EmbeddingError, InvalidRequestError
from .forward import Segment, kv_cache_for

if TYPE_CHECKING:  # pragma: no cover
    from .runtime import Model

log = logging.getLogger(__name__)

MAX_INPUTS = 1 << 16  # inputs per request: bounds the work one call can ask for before any is done


def pooling_of(model: Model) -> Pooling:
    """The model's pooling, or :class:`EmbeddingError` when it is generative only."""
    p = model.model.desc.pooling
    if p is None:
        raise EmbeddingError(f"{model.name}: the model has no pooling (no '{model.arch}.pooling_type' in the file); "
                             "it is not an embedding model")
    return p


def set_pooling(model: Model, kind: str) -> None:
    """Use pooling ``kind`` instead of the file's (the ``pooling=`` load option)."""
    from .archs.base import read_hparams
    from .archs.pooling import pooling_from_meta
    from .blocks import POOLING_TYPES

    if kind not in POOLING_TYPES:
        raise InvalidRequestError(f"pooling must be one of {', '.join(POOLING_TYPES)}, got {kind!r}")
    desc = model.model.desc
    old = desc.pooling
    desc.pooling = pooling_from_meta(model.file, read_hparams(model.file), override=kind,
                                     cls_act=old.cls_act if old is not None else "tanh",
                                     softmax=old.softmax if old is not None else False, causal=desc.causal)


def max_tokens(model: Model) -> int:
    """The longest input one sequence may have: the context, and the position table of encoders."""
    n = model.n_ctx
    pe = model.model.desc.pos_embd
    return min(n, pe.shape[0]) if pe is not None else n


def _ids_list(model: Model, inputs: Any) -> tuple[list[list[int]], bool]:
    """Normalize ``inputs`` to token-id lists; also whether they came from text."""
    if isinstance(inputs, str):
        return [model.tokenize(inputs)], True
    if isinstance(inputs, (bytes, bytearray)):
        raise InvalidRequestError("embedding input must be str, a list of str, or token ids, not bytes")
    try:
        items = list(inputs)
    except TypeError:
        raise InvalidRequestError("embedding input must be a string, a list of strings, a list of token ids "
                                  "or a list of token-id lists") from None
    if not items:
        raise InvalidRequestError("embedding input is empty")
    if len(items) > MAX_INPUTS:
        raise InvalidRequestError(f"{len(items)} inputs in one request; at most {MAX_INPUTS}")
    if all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in items):
        return [[int(i) for i in items]], False
    if all(isinstance(i, str) for i in items):
        return [model.tokenize(t) for t in items], True
    out = []
    for k, it in enumerate(items):
        if isinstance(it, str) or not isinstance(it, (list, tuple, np.ndarray)):
            raise InvalidRequestError(f"input {k}: mix of strings and token ids, or not a token-id list")
        if not all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in it):
            raise InvalidRequestError(f"input {k}: token ids must be integers")
        out.append([int(i) for i in it])
    return out, False


def _check(model: Model, seqs: list[list[int]], truncate: bool, from_text: bool) -> list[list[int]]:
    n_max = max_tokens(model)
    out = []
    for k, ids in enumerate(seqs):
        if not ids:
            raise InvalidRequestError(f"input {k} has no tokens")
        bad = [i for i in ids if not 0 <= i < model.n_vocab]
        if bad:
            raise InvalidRequestError(f"input {k}: token id {bad[0]} is outside the vocabulary of {model.n_vocab}")
        if len(ids) > n_max:
            if not truncate:
                raise ContextOverflowError(f"input {k} has {len(ids)} tokens; the model takes at most {n_max} "
                                           "(pass truncate=True to cut it)")
            tk = model.tokenizer
            end = ids[-1] if from_text and ids[-1] in (tk.sep_id, tk.eos_id) else None
            ids = ids[:n_max - 1] + [end] if end is not None else ids[:n_max]  # keep the closing SEP / EOS
        out.append(ids)
    return out


class _Job:
    """One call's sequences waiting for their hidden states."""

    def __init__(self, seqs: list[list[int]]) -> None:
        self.seqs = seqs
        self.out: list[np.ndarray | None] = [None] * len(seqs)
        self.left = len(seqs)
        self.error: BaseException | None = None


class EmbedQueue:
    """Sequences of concurrent embedding calls packed into shared forward passes.

    Every call queues its sequences; the first caller that finds no pass being run becomes the
    leader and runs passes of at most ``n_batch`` tokens over the queue in arrival order, other
    calls' sequences included, until its own are done, then hands over to a waiting caller. So
    many small concurrent requests (a server's ``/v1/embeddings`` clients) share passes, and no
    caller waits on work queued after it for longer than its own last pass."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self._cv = threading.Condition()
        self._queue: collections.deque[tuple[_Job, int]] = collections.deque()
        self._leader = False
        self.passes = 0  # forward passes run (for tests and stats)

    def hidden_states(self, seqs: list[list[int]]) -> list[np.ndarray]:
        """Final hidden states (n_i, d) of each sequence."""
        if not seqs:
            return []
        job = _Job(seqs)
        with self._cv:
            self._queue.extend((job, i) for i in range(len(seqs)))
            while job.left and self._leader:
                self._cv.wait()
            if not job.left:
                return self._result(job)
            self._leader = True
        try:
            while job.left:
                with self._cv:
                    group = self._take()
                self._run(group)
                with self._cv:
                    self._cv.notify_all()
        finally:
            with self._cv:
                self._leader = False
                self._cv.notify_all()
        return self._result(job)

    @staticmethod
    def _result(job: _Job) -> list[np.ndarray]:
        if job.error is not None:
            raise job.error
        return job.out  # type: ignore[return-value]

    def _take(self) -> list[tuple[_Job, int]]:
        """The queue's head: sequences in order up to ``n_batch`` tokens (a longer one alone)."""
        budget, used, group = self.model.engine.n_batch, 0, []
        while self._queue:
            job, i = self._queue[0]
            n = len(job.seqs[i])
            if group and used + n > budget:
                break
            group.append(self._queue.popleft())
            used += n
        return group

    def _run(self, group: list[tuple[_Job, int]]) -> None:
        """One forward pass over ``group``; its results (or its error) go to each sequence's call."""
        model, tr = self.model, self.model.model
        seqs = [job.seqs[i] for job, i in group]
        caches = [kv_cache_for(tr.cfg, len(s)) for s in seqs]
        h: np.ndarray | None = None
        err: BaseException | None = None
        try:
            tokens = np.concatenate([np.asarray(s, dtype=np.int64) for s in seqs])
            segs = [Segment(cache, len(s), "none") for cache, s in zip(caches, seqs, strict=True)]
            with model._step_lock:
                model._check_open()
                h = tr.encode(tokens, segs)
            self.passes += 1
        except BaseException as e:  # a failed pass fails the calls it served, not the queue
            err = e
        finally:
            for cache in caches:
                cache.release()
        with self._cv:
            s0 = 0
            for (job, i), s in zip(group, seqs, strict=True):
                if err is not None:
                    job.error = job.error or err
                else:
                    job.out[i] = h[s0:s0 + len(s)]  # type: ignore[index]
                s0 += len(s)
                job.left -= 1


def hidden_states(model: Model, seqs: list[list[int]]) -> list[np.ndarray]:
    """Final hidden states (n_i, d) of each sequence, in forward passes of at most ``n_batch`` tokens
    shared with concurrent calls (:class:`EmbedQueue`)."""
    return model.embed_queue.hidden_states(seqs)


def _pool_one(kind: str, h: np.ndarray) -> np.ndarray:
    if kind == "mean":
        return h.mean(axis=0, dtype=np.float64).astype(np.float32)
    if kind == "cls":
        return h[0]
    if kind == "last":
        return h[-1]
    raise AssertionError(kind)


def _l2(x: np.ndarray) -> np.ndarray:
    n = np.linalg.norm(x.astype(np.float64), axis=-1, keepdims=True)
    return (x / np.maximum(n, 1e-12)).astype(np.float32)


def pool(model: Model, p: Pooling, hs: list[np.ndarray], kind: str | None = None) -> Any:
    """Pooled outputs of hidden states ``hs``: (n, dim) for mean / cls / last (after the dense
    projections), (n, n_cls_out) classifier outputs for rank, a list of (n_i, d) for none."""
    tr = model.model
    kind = kind or p.kind
    if kind == "none":
        return list(hs)
    if kind == "rank":
        x = np.stack([_pool_one(p.cls_pool, h) for h in hs])
        if p.cls is not None:
            from .blocks import activation

            x = activation(p.cls_act, tr.mm(p.cls, x))
            x = tr.norm(x, p.cls_norm)
        if p.cls_out is not None:
            x = tr.mm(p.cls_out, x)
        if p.softmax:
            x = np.exp(x - x.max(axis=-1, keepdims=True))
            x /= x.sum(axis=-1, keepdims=True)
        return x
    x = np.stack([_pool_one(kind, h) for h in hs])
    for lin in p.dense:
        x = tr.mm(lin, x)
    return x


def embed(model: Model, inputs: Any, normalize: bool = True, truncate: bool = True,
          dimensions: int | None = None) -> Any:
    """See :meth:`minirt.Model.embed`."""
    return embed_counted(model, inputs, normalize, truncate, dimensions)[0]


def embed_counted(model: Model, inputs: Any, normalize: bool = True, truncate: bool = True,
                  dimensions: int | None = None) -> tuple[Any, int]:
    """:func:`embed` and the number of tokens it ran (after truncation)."""
    model._check_open()
    p = pooling_of(model)
    if p.kind == "rank":
        raise EmbeddingError(f"{model.name} is a reranker (pooling 'rank'): use rerank(query, documents)")
    seqs, from_text = _ids_list(model, inputs)
    seqs = _check(model, seqs, truncate, from_text)
    n_tokens = sum(len(s) for s in seqs)
    if dimensions is not None and p.kind == "none":
        raise InvalidRequestError("dimensions needs a pooled model (this one returns one vector per token)")
    out = pool(model, p, hidden_states(model, seqs))
    if p.kind == "none":
        return [_l2(o) if normalize else o for o in out], n_tokens
    if dimensions is not None:
        if isinstance(dimensions, bool) or not isinstance(dimensions, (int, np.integer)) or \
                not 1 <= dimensions <= out.shape[1]:
            raise InvalidRequestError(f"dimensions must be an integer in [1, {out.shape[1]}], got {dimensions!r}")
        out = out[:, :int(dimensions)]  # Matryoshka truncation, then (re)normalized below
    return (_l2(out) if normalize or dimensions is not None else out), n_tokens


def rerank_ids(model: Model, query: str, doc: str) -> list[int]:
    """The token ids of one (query, document) pair, as llama.cpp's server forms them: the file's
    ``tokenizer.chat_template.rerank`` with ``{query}`` / ``{document}`` when it has one, else
    ``[BOS] query [EOS] [SEP] document [EOS]`` with each special token where the vocabulary adds it
    (XLM-RoBERTa: ``<s> q </s></s> d </s>``, the pair encoding of transformers)."""
    tk = model.tokenizer
    tmpl = model.metadata.get("tokenizer.chat_template.rerank")
    if isinstance(tmpl, str):
        text = tmpl.replace("{query}", query).replace("{document}", doc)
        return tk.encode(text, add_special=False, parse_special=True)
    eos = tk.eos_id if tk.eos_id is not None else tk.sep_id
    ids: list[int] = []
    if tk.add_bos and tk.bos_id is not None:
        ids.append(tk.bos_id)
    ids += tk.encode(query, add_special=False)
    if tk.add_eos and eos is not None:
        ids.append(eos)
    if tk.add_sep and tk.sep_id is not None:
        ids.append(tk.sep_id)
    ids += tk.encode(doc, add_special=False)
    if tk.add_eos and eos is not None:
        ids.append(eos)
    return ids


def rerank(model: Model, query: str, documents: Sequence[str], truncate: bool = True) -> np.ndarray:
    """See :meth:`minirt.Model.rerank`."""
    return rerank_counted(model, query, documents, truncate)[0]


def rerank_counted(model: Model, query: str, documents: Sequence[str], truncate: bool = True) -> tuple[np.ndarray, int]:
    """:func:`rerank` and the number of tokens it ran."""
    model._check_open()
    p = pooling_of(model)
    if p.kind != "rank":
        raise EmbeddingError(f"{model.name} is not a reranker (pooling {p.kind!r}, not 'rank')")
    if not isinstance(query, str):
        raise InvalidRequestError("query must be a string")
    if isinstance(documents, str) or not isinstance(documents, Sequence):
        raise InvalidRequestError("documents must be a list of strings")
    if not documents:
        return np.zeros(0, dtype=np.float32), 0
    if len(documents) > MAX_INPUTS or not all(isinstance(d, str) for d in documents):
        raise InvalidRequestError(f"documents must be a list of at most {MAX_INPUTS} strings")
    seqs = _check(model, [rerank_ids(model, query, d) for d in documents], truncate, True)
    scores = pool(model, p, hidden_states(model, seqs))
    return np.ascontiguousarray(scores[:, 0], dtype=np.float32), sum(len(s) for s in seqs)
