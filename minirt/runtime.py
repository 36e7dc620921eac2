"""The :class:`Model` a caller holds: load a GGUF, then tokenize, generate, stream and chat.

Step 1 of the pipeline for Python callers. A request goes: prompt (text, ids or chat messages)
→ chat template (step 3) → tokenizer (step 2) → :class:`minirt.generate.Sequence` driven by the
:class:`minirt.generate.Engine` through the forward pass (4), sampling (5), the KV cache (6), the
stop rules (7) and the streaming detokenizer (8).

Concurrency: weights are read-only and every request has its own KV cache, so requests from
several threads are safe; the model's forward passes are serialized by a lock taken per step
(or merged into batched steps by the scheduler), never interleaved inside one cache.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any

import numpy as np

from . import gguf as gguf_mod
from . import kv_types, registry
from . import lora as lora_mod
from .archs import build, read_config
from .errors import ContextOverflowError, InvalidRequestError, ModelClosedError, TokenizerError
from .forward import Segment, kv_cache_for
from .generate import Completion, Engine, Sequence, TokenEvent, Trace, check_prompt, validate_stop
from .grammar import options as grammar_options
from .kv_cache import KVCache
from .sampling import Sampler, SamplingParams

if TYPE_CHECKING:  # pragma: no cover
    from .grammar import Constraint
    from .reasoning import ChatParser
    from .scheduler import EventStream, Scheduler

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256
KV_MEMORY_FRACTION = 0.25
MAX_N_CTX = 1 << 24  # positions of one context (16 Mi); a larger n_ctx is refused at load
STATE_FORMAT = "minirt-kv-state-1"  # default n_ctx: the KV cache of one full context fits in this share of RAM


def _total_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def state_positions(cache: KVCache) -> int:
    """A cache's recurrent state and snapshot (Qwen3.5's delta-net layers) as KV positions of the same
    bytes: what the KV budget, counted in positions, charges for them."""
    n = cache.state_nbytes()
    return -(-n // max(1, cache.bytes_per_token)) if n else 0


class CachePool:
    """Idle KV caches kept after requests end, reused by the next request sharing their prefix.

    Bounded by the bytes their used positions occupy (LRU eviction), so a chat's next turn
    recomputes only the new messages. A request continuing a whole cached conversation takes its
    cache; one sharing only part of it (a common system prompt) gets a copy of that part.
    """

    def __init__(self, make: Callable[[], KVCache], max_bytes: int) -> None:
        self._make = make
        self.max_bytes = max_bytes
        self._idle: list[KVCache] = []  # most recently released last
        self._lock = threading.Lock()
        self.hits = 0
        self.reused_tokens = 0

    def acquire(self, prompt_ids: np.ndarray, keep: int = 0) -> tuple[KVCache, int]:
        """A cache for ``prompt_ids`` and how many of its leading positions are already valid (``keep``:
        the request's context-shift n_keep, rows it needs intact)."""
        with self._lock:
            best, best_n = None, 0
            for c in self._idle:
                n = min(c.n_past, len(prompt_ids) - 1)  # the last prompt token is always recomputed
                if n <= best_n:
                    continue
                same = c.tokens[:n] == prompt_ids[:n]
                n = c.valid_prefix(int(n if same.all() else np.argmin(same)), keep)
                if n > best_n:
                    best, best_n = c, n
            if best is not None:
                self.hits += 1
                self.reused_tokens += best_n
                self._idle.remove(best)
                if best_n < best.n_past:
                    # a shared prefix (a system prompt): copied, so that the cache keeps the rest and
                    # every request of a burst starting with it reuses it, not only the first
                    self._idle.append(best)  # most recently used
                    fork = self._make()
                    fork.copy_prefix_from(best, best_n)
                    return fork, best_n
                best.truncate(best_n)
                return best, best_n
            if self._idle:  # recycle the least recently used cache rather than allocating
                c = self._idle.pop(0)
                c.clear()
                return c, 0
        return self._make(), 0

    def most_recent(self) -> KVCache | None:
        """The idle cache released last (the latest finished conversation), if any."""
        with self._lock:
            return self._idle[-1] if self._idle else None

    def tokens(self) -> int:
        """Positions held by idle caches, recurrent states counted as the positions of their bytes (they
        count against the KV budget)."""
        with self._lock:
            return sum(c.n_past + state_positions(c) for c in self._idle)

    def evict_tokens(self, n: int) -> bool:
        """Drop least recently used idle caches until ``n`` positions are freed; False if impossible."""
        with self._lock:
            freed = 0
            while self._idle and freed < n:
                c = self._idle.pop(0)
                freed += c.n_past + state_positions(c)
                c.release()
            return freed >= n

    def release(self, cache: KVCache) -> None:
        with self._lock:
            self._idle.append(cache)
            total = 0
            keep: list[KVCache] = []
            for c in reversed(self._idle):
                total += c.n_past * c.bytes_per_token
                if total <= self.max_bytes and len(keep) < 16:
                    keep.append(c)
                else:
                    c.release()
            self._idle = keep[::-1]

    def clear(self) -> None:
        with self._lock:
            for c in self._idle:
                c.release()
            self._idle.clear()


class GenerationHandle:
    """A request running in the background (``Model.submit``): cancel it, wait for it, poll it."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._cancel = threading.Event()
        self._result: Completion | None = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[GenerationHandle], Any]] = []
        self._cb_lock = threading.Lock()
        self.thread: threading.Thread | None = None

    def add_done_callback(self, fn: Callable[[GenerationHandle], Any]) -> None:
        """Call ``fn(handle)`` when the generation ends (at once if it already has)."""
        with self._cb_lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def _set_done(self) -> None:
        with self._cb_lock:
            self._event.set()
            cbs, self._callbacks = self._callbacks, []
        for fn in cbs:
            try:
                fn(self)
            except Exception:
                log.exception("done callback failed")

    def cancel(self) -> None:
        """Ask the generation to stop; it ends within one token or one prefill chunk."""
        self._cancel.set()

    def done(self) -> bool:
        return self._event.is_set()

    def cancelled(self) -> bool:
        return self._result is not None and self._result.finish_reason == "cancelled"

    def result(self, timeout: float | None = None) -> Completion:
        """The Completion (partial text kept when cancelled); re-raises the request's error."""
        if not self._event.wait(timeout):
            raise TimeoutError(f"generation not finished after {timeout} s")
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


class Model:
    """A loaded model. Create with :func:`minirt.load`; close with :meth:`close` or ``with``."""

    def __init__(self, model: str | os.PathLike[str], *, device: str = "auto", n_ctx: int | None = None,
                 threads: int | None = None, backend: str | None = None, n_batch: int = 512,
                 chat_template: str | None = None, pull: bool = True,
                 progress: Callable[[int, int], Any] | None = None, embedding: bool = False,
                 pooling: str | None = None,
                 cache_type_k: str | None = kv_types.DEFAULT_CACHE_TYPE,
                 cache_type_v: str | None = kv_types.DEFAULT_CACHE_TYPE,
                 lora: Any = None) -> None:
        """``cache_type_k`` / ``cache_type_v``: KV cache element types as llama.cpp names them
        (f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1; default f16); ``n_ctx`` defaults to what fits a
        quarter of RAM in bytes of these types. ``lora``: LoRA adapter GGUFs (llama.cpp's ``--lora``):
        a path, ``(path, scale)`` or a list of them (:mod:`minirt.lora`)."""
        from .chat import ChatTemplate
        from .tokenizer import Tokenizer

        self.path = registry.model_path(model, pull_missing=pull, progress=progress)
        self.name = str(model)
        self._closed = False
        # loaded for embeddings (llama-cpp-python's embedding=True): the context defaults to the trained
        # length; KV caches are made per embedding batch, sized to its texts
        self.embedding = bool(embedding)
        self.file = gguf_mod.open(self.path)
        try:
            self.metadata = self.file.metadata
            if self.metadata.get("general.type") == "adapter":
                from .errors import GGUFError

                raise GGUFError(f"{self.path} is a LoRA adapter, not a model: load its base model with "
                                f"lora={os.fspath(self.path)!r} (--lora on the command line)")
            self.tokenizer = Tokenizer.from_gguf(self.file)
            self.chat_template = ChatTemplate.from_gguf(self.file, self.tokenizer, override=chat_template)
            dflt = kv_types.DEFAULT_CACHE_TYPE
            self.cache_types = (kv_types.get(cache_type_k or dflt).name, kv_types.get(cache_type_v or dflt).name)
            self.device, self.backend = self._pick_backend(device, backend, threads)
            cfg = read_config(self.file)
            for _, dk, dv in {s for s in cfg.kv_layers or [(0, cfg.head_dim_k, cfg.head_dim_v)] if s is not None}:
                kv_types.get(self.cache_types[0]).check_dim(dk)
                if dv:  # 0: a layer without values
                    kv_types.get(self.cache_types[1]).check_dim(dv)
            self._check_cache_types_device()  # sizes the context before the weights are prepared
            if self.tokenizer.n_vocab > cfg.n_vocab:
                raise TokenizerError(f"the vocabulary has {self.tokenizer.n_vocab} tokens but the model only "
                                     f"{cfg.n_vocab} embeddings")
            self.n_vocab = cfg.n_vocab
            self.n_ctx = self._pick_n_ctx(n_ctx, cfg)
            self.model = build(self.file, self.backend, self.n_ctx)
            self.lora_adapters = lora_mod.load(lora, self.file)
            if self.lora_adapters:
                self.model.attach_lora(self.lora_adapters)
            if kv_types.get(self.cache_types[0]).quantized and not self.embedding:
                from . import kv_balance

                kv_balance.balance(self.model)  # keys and queries rebalanced for the block-quantized K cache
            self._cfg = self.model.cfg  # kept after close() for arch / repr
            if pooling is not None:  # llama.cpp's --pooling: instead of the file's
                from .embedding import set_pooling

                set_pooling(self, pooling)
            if threads is not None and (not isinstance(threads, int) or threads <= 0):
                raise InvalidRequestError(f"threads must be a positive integer, got {threads!r}")
            self.engine = Engine(self.model, n_batch)
            self._step_lock = threading.RLock()
            self.cache_pool = CachePool(self._new_cache, max_bytes=min(_total_memory() // 8, 2 << 30))
            self._workers: set[threading.Thread] = set()
            self._scheduler: Any = None
            self._sched_lock = threading.Lock()
            self._sched_opts: dict[str, Any] = {}
            self._fingerprint: str | None = None
            self._grammar_engine: Any = None
            self._embed_queue: Any = None
            # chat content's control-token texts stay text (see _chat_prompt); True: llama.cpp's way
            self.parse_special_content = False
        except BaseException:
            self.file.close()
            raise

    # -- setup -------------------------------------------------------------------------------------
    def _pick_backend(self, device: str, backend: str | None, threads: int | None) -> tuple[str, Any]:
        from .kernels import select_backend

        return select_backend(device, backend, threads, self.file)

    def _check_cache_types_device(self) -> None:
        """The CUDA backend keeps its caches in f16 on the device: other types are refused there."""
        if self.device == "cuda" and any(t not in ("f16", "f32") for t in self.cache_types):
            raise InvalidRequestError(f"cache types {self.cache_types[0]}/{self.cache_types[1]} are not supported on "
                                      "the CUDA device (its cache is f16); use f16 or device='cpu'")

    def _kv_bytes_per_token(self, cfg: Any) -> int:
        tk, tv = kv_types.get(self.cache_types[0]), kv_types.get(self.cache_types[1])
        if cfg.kv_layers is not None:  # layers of their own shapes, some without a cache
            # at least the position's token id (4 bytes): with no attention layer at all (pure Mamba-2, only
            # recurrent state) the sum is 0, and the context is then bounded by the training length
            return max(4, sum(h * (tk.row_bytes(dk) + (tv.row_bytes(dv) if dv else 0))  # dv 0: no values
                              for h, dk, dv in filter(None, cfg.kv_layers)))
        return cfg.n_layer * cfg.n_head_kv * (tk.row_bytes(cfg.head_dim_k) + tv.row_bytes(cfg.head_dim_v))

    def _pick_n_ctx(self, n_ctx: int | None, cfg: Any) -> int:
        per_tok = self._kv_bytes_per_token(cfg)
        if n_ctx is None and self.embedding:
            return cfg.n_ctx_train
        if n_ctx is None:
            fit = int(_total_memory() * KV_MEMORY_FRACTION // per_tok)
            return max(256, min(cfg.n_ctx_train, fit))
        if isinstance(n_ctx, bool) or not isinstance(n_ctx, int) or n_ctx <= 0:
            raise InvalidRequestError(f"n_ctx must be a positive integer, got {n_ctx!r}")
        if n_ctx > MAX_N_CTX:
            raise InvalidRequestError(f"n_ctx {n_ctx} is over the limit of {MAX_N_CTX} positions (MAX_N_CTX)")
        total = _total_memory()
        if n_ctx * per_tok > total:
            raise InvalidRequestError(f"n_ctx {n_ctx} needs a KV cache of {n_ctx * per_tok / 2**30:.1f} GiB for "
                                      f"one context, more than this machine's {total / 2**30:.1f} GiB of memory; "
                                      f"at most n_ctx={total // per_tok} fits")
        if n_ctx > cfg.n_ctx_train:
            log.warning("n_ctx %d exceeds the %d positions the model was trained for", n_ctx, cfg.n_ctx_train)
        return n_ctx

    def _new_cache(self, n_ctx: int | None = None) -> KVCache:
        self._check_open()
        return kv_cache_for(self._cfg, n_ctx or self.n_ctx, *self.cache_types)

    def _check_open(self) -> None:
        if self._closed:
            raise ModelClosedError("the model is closed")

    # -- information -------------------------------------------------------------------------------
    @property
    def arch(self) -> str:
        return self._cfg.arch

    @property
    def eog_ids(self) -> frozenset[int]:
        return self.tokenizer.eog_ids

    def backend_info(self) -> dict[str, Any]:
        return self.backend.info()

    def __repr__(self) -> str:
        cfg = self.__dict__.get("_cfg")  # a model whose load failed half-way has no config
        arch = cfg.arch if cfg is not None else "?"
        closed = " closed" if self.__dict__.get("_closed") else ""
        return (f"<minirt.Model {self.__dict__.get('name', '?')} arch={arch} n_ctx={self.__dict__.get('n_ctx', '?')} "
                f"device={self.__dict__.get('device', '?')}{closed}>")

    # -- steps 2, 3 and 8 --------------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Text → ids with the GGUF's own vocabulary (BOS as the vocab asks when add_special)."""
        return self.tokenizer.encode(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, ids: Seq[int]) -> str:
        return self.tokenizer.decode(ids)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, **kwargs: Any) -> str:
        """Render chat messages into the prompt text with the model's template (step 3)."""
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs)

    def _check_text_fits(self, text: str) -> None:
        """Refuse, before tokenizing it, a text that cannot fit the context whatever its tokens
        (the bound of :meth:`Tokenizer.min_tokens`): tokenizing megabytes only to refuse them
        would cost far more than the check."""
        low = self.tokenizer.min_tokens(text)
        if low >= self.n_ctx:
            raise ContextOverflowError(f"the prompt has at least {low} tokens ({len(text)} characters) but the "
                                       f"context holds {self.n_ctx}; raise n_ctx or shorten it")

    def _chat_ids(self, text: str, plain_spans: Seq[tuple[int, int]] | None = None) -> list[int]:
        """Tokenize a rendered chat prompt: special tokens parsed (except in ``plain_spans``, the
        caller's data), BOS added unless the template did."""
        tk = self.tokenizer
        self._check_text_fits(text)
        ids = tk.encode(text, add_special=False, parse_special=True, plain_spans=plain_spans)
        if tk.add_bos and tk.bos_id is not None and (not ids or ids[0] != tk.bos_id):
            ids = [tk.bos_id] + ids
        if tk.add_eos and tk.eos_id is not None:
            ids = ids + [tk.eos_id]
        return ids

    # -- step 4 ------------------------------------------------------------------------------------
    def logits(self, ids: Seq[int]) -> np.ndarray:
        """Logits (len(ids), n_vocab) float32 for every position, in a fresh context (no side effects)."""
        self._check_open()
        if isinstance(ids, str):
            raise InvalidRequestError("logits() takes token ids; tokenize the text first (llm.tokenize(text))")
        ids = np.asarray(self._prompt_ids(ids, None, None), dtype=np.int64)
        check_prompt(ids, self.n_vocab, self.n_ctx + 1)
        cache = self._new_cache(len(ids))
        out = np.empty((len(ids), self.n_vocab), dtype=np.float32)
        nb = self.engine.n_batch
        try:
            for s in range(0, len(ids), nb):
                chunk = ids[s:s + nb]
                with self._step_lock:
                    self._check_open()  # close() may have run on another thread since the last chunk
                    out[s:s + len(chunk)] = self.model.forward(chunk, [Segment(cache, len(chunk), "all")])[0]
        finally:
            cache.release()
        return out

    # -- embeddings and reranking (minirt.embedding) ---------------------------------------------------
    @property
    def embed_queue(self) -> Any:
        """Packs the sequences of concurrent embedding calls into shared passes (:mod:`minirt.embedding`)."""
        q = self._embed_queue
        if q is None:
            with self._sched_lock:
                if self._embed_queue is None:
                    from .embedding import EmbedQueue

                    self._embed_queue = EmbedQueue(self)
                q = self._embed_queue
        return q

    def embed(self, texts: str | Seq[str] | Seq[int] | Seq[Seq[int]], normalize: bool = True,
              truncate: bool = True, dimensions: int | None = None) -> Any:
        """Embeddings of ``texts`` (a string, strings, token ids or token-id lists), many per forward
        pass: (n, dim) float32, L2-normalized when ``normalize``; for a model with pooling "none" a
        list of (n_tokens, n_embd) arrays. Inputs longer than the model takes are cut when
        ``truncate`` (ContextOverflowError otherwise); ``dimensions`` keeps the first dims and
        renormalizes (Matryoshka models). EmbeddingError for models without pooling or rerankers."""
        from . import embedding

        return embedding.embed(self, texts, normalize=normalize, truncate=truncate, dimensions=dimensions)

    def rerank(self, query: str, documents: Seq[str], truncate: bool = True) -> np.ndarray:
        """Relevance scores (len(documents),) float32 of each document for ``query`` from a reranker
        (pooling "rank": the classifier's raw score, as llama.cpp's server returns it)."""
        from . import embedding

        return embedding.rerank(self, query, documents, truncate=truncate)

    def create_embedding(self, input: Any, model: str | None = None, **kw: Any) -> dict[str, Any]:
        """llama-cpp-python's / OpenAI's embedding response dict for ``input``."""
        from .embedding_server import embeddings_response

        return embeddings_response(self, {"input": input, "model": model or self.name, **kw})

    # -- requests ----------------------------------------------------------------------------------
    def _prompt_ids(self, prompt: str | Seq[int], add_special: bool | None, trace: Trace | None) -> list[int]:
        if isinstance(prompt, str):
            self._check_text_fits(prompt)
            t0 = time.perf_counter()
            ids = self.tokenizer.encode(prompt, add_special=True if add_special is None else add_special,
                                        parse_special=False)
            if trace is not None:
                trace.prompt = prompt
                trace.add("tokenize", time.perf_counter() - t0, tokens=len(ids))
            return ids
        if isinstance(prompt, (bytes, bytearray)):
            raise InvalidRequestError("prompt must be str or a list of token ids, not bytes (decode it first)")
        try:
            items = list(prompt)
        except TypeError:
            raise InvalidRequestError("prompt must be a string or a list of integer token ids") from None
        if not all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in items):
            raise InvalidRequestError("prompt must be a string or a list of integer token ids")
        ids = [int(i) for i in items]
        return ids

    def _sequence(self, prompt_ids: list[int], *, max_tokens: int | None, stop: Any, ignore_eos: bool,
                  on_token: Callable[[TokenEvent], Any] | None, cancel: threading.Event | None,
                  progress: Callable[[int, int], Any] | None, trace: Trace | None,
                  context_overflow: str, n_keep: int | None, sampling: dict[str, Any]) -> Sequence:
        self._check_open()
        if not self.model.desc.causal:
            from .errors import EmbeddingError

            raise EmbeddingError(f"{self.arch} attends bidirectionally: it embeds (embed / rerank), it cannot generate")
        check_prompt(prompt_ids, self.n_vocab, self.n_ctx)
        if max_tokens is None:
            max_tokens = DEFAULT_MAX_TOKENS
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        _check_cancel(cancel)
        if on_token is not None and not callable(on_token):
            raise InvalidRequestError("on_token must be callable")
        if progress is not None and not callable(progress):
            raise InvalidRequestError("progress must be callable (done, total)")
        sampling = dict(sampling)
        constraint = self._constraint(grammar_options(sampling))
        if trace is not None and not sampling.get("top_logprobs"):
            sampling["top_logprobs"] = 5  # the explanation shows the top candidates
        processors = sampling.pop("logits_processor", None)
        stopping = sampling.pop("stopping_criteria", None)
        stopping = list(stopping) if isinstance(stopping, (list, tuple)) else ([stopping] if stopping else [])
        if not all(callable(f) for f in stopping):
            raise InvalidRequestError("stopping_criteria must be a callable (input_ids, logits) -> bool "
                                      "or a list of them")
        params = SamplingParams.from_kwargs(**sampling)
        tk = self.tokenizer
        sampler = Sampler(params, self.n_vocab, logits_processor=processors,
                          piece=lambda i: tk.token_to_piece(i).decode("utf-8", "replace") if i < tk.n_vocab else "")
        stops = validate_stop(stop)
        if n_keep is None:
            n_keep = 1 if (self.tokenizer.add_bos and prompt_ids[0] == self.tokenizer.bos_id) else 0
        if not isinstance(n_keep, int) or n_keep < 0:
            raise InvalidRequestError(f"n_keep must be a non-negative integer, got {n_keep!r}")
        ids = np.asarray(prompt_ids, dtype=np.int32)
        if trace is not None:
            trace.prompt_ids = list(prompt_ids)
            trace.prompt_pieces = [self.tokenizer.token_to_piece(i).decode("utf-8", "replace") for i in prompt_ids]
        seq = Sequence(ids, None, sampler, self.tokenizer.stream_decoder(continuation=True), self.tokenizer.eog_ids,
                       max_tokens=max_tokens, stop=stops, ignore_eos=ignore_eos,
                       context_overflow=context_overflow, n_keep=n_keep, cancel=cancel, sink=None,
                       progress=progress, trace=trace,
                       matcher=constraint.matcher() if constraint is not None else None)
        seq.stopping = stopping
        seq.user_sink = on_token  # type: ignore[attr-defined]
        return seq

    def _constraint(self, opts: dict[str, Any]) -> Constraint | None:
        """The compiled grammar of a request's ``grammar`` / ``json_schema`` / ``response_format``."""
        if not opts or all(v is None for v in opts.values()):
            return None
        from .grammar import GrammarEngine, compile_constraint

        with self._sched_lock:
            if self._grammar_engine is None:
                self._grammar_engine = GrammarEngine(self.tokenizer, self.n_vocab)
        return compile_constraint(self._grammar_engine, **opts)

    # -- the scheduler ---------------------------------------------------------------------------
    @property
    def scheduler(self) -> Scheduler:
        """The batching scheduler (started on first use)."""
        from .scheduler import Scheduler

        with self._sched_lock:
            self._check_open()
            if self._scheduler is None:
                self._scheduler = Scheduler(self, **self._sched_opts)
            return self._scheduler

    def configure_scheduler(self, **opts: Any) -> None:
        """Set scheduler options (n_parallel, kv_budget_tokens, max_queue, prefill_chunk) before first use."""
        with self._sched_lock:
            if self._scheduler is not None:
                raise InvalidRequestError("the scheduler is already running; configure it before the first request")
            self._sched_opts.update(opts)

    def default_kv_budget(self) -> int:
        """KV positions shared by all requests by default: what fits in a quarter of RAM."""
        return max(self.n_ctx, int(_total_memory() * KV_MEMORY_FRACTION // self.kv_bytes_per_token))

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one position of the KV cache takes, in the cache types (all layers, keys and values)."""
        return self._kv_bytes_per_token(self.model.cfg)

    @property
    def state_positions(self) -> int:
        """One sequence's recurrent state and its snapshot (float32, Qwen3.5's delta-net layers) as KV
        positions of the same bytes; 0 for a model without recurrent layers. A request reserves them
        on top of its positions."""
        rec = self.model.cfg.recurrent
        if not rec:
            return 0
        n = 2 * 4 * sum(int(np.prod(sh)) for shapes in rec if shapes for sh in shapes)
        return -(-n // max(1, self.kv_bytes_per_token))

    def attach_cache(self, seq: Sequence) -> None:
        """Give a sequence a KV cache, reusing the longest cached prefix of its prompt."""
        cache, n_reused = self.cache_pool.acquire(seq.prompt_ids, seq.n_keep)
        seq.attach_cache(cache, n_reused)

    def release_cache(self, seq: Sequence) -> None:
        """Return a finished sequence's cache to the prefix cache (or free it once closed)."""
        cache, seq.cache = seq.cache, None
        if cache is None:
            return
        if self._closed:
            cache.release()
        else:
            self.cache_pool.release(cache)

    def _submit(self, seq: Sequence) -> EventStream:
        from .scheduler import EventStream

        stream = EventStream()
        seq.sink = stream.sink
        stream.req = self.scheduler.submit(seq, stream.sink)
        return stream

    def _run(self, seq: Sequence) -> Completion:
        """Run a sequence through the scheduler, delivering events to its callback on this thread."""
        return self._consume(seq, self._submit(seq))

    def _consume(self, seq: Sequence, stream: EventStream) -> Completion:
        """Deliver a submitted sequence's events to its callback on this thread; build the Completion."""
        on_token = getattr(seq, "user_sink", None)
        delivered: list[TokenEvent] = []
        stopped = False
        error: BaseException | None = None
        try:
            for ev in stream:
                if stopped:
                    continue  # produced after the caller said stop: never delivered
                delivered.append(ev)
                if on_token is None:
                    continue
                try:
                    keep = on_token(ev)
                except BaseException as e:  # a failing callback ends this request only
                    error, stopped = e, True
                    seq.request_stop()
                    continue
                if keep is False and ev.finish_reason is None:
                    stopped = True
                    seq.request_stop()
        except BaseException:
            seq.request_stop()
            raise
        if error is not None:
            raise error
        c = seq.completion()
        if stopped:  # report exactly what the caller saw
            n = sum(1 for e in delivered if e.token_id is not None)
            c.token_ids, c.logprobs = c.token_ids[:n], c.logprobs[:n]
            c.top_logprobs = c.top_logprobs[:n]
            c.text = "".join(e.text for e in delivered)
            c.finish_reason = "cancelled"
            c.usage.update(completion_tokens=n, total_tokens=c.usage["prompt_tokens"] + n)
            if seq.parser is not None:
                seq.parser.apply(c)
        return c

    def generate(self, prompt: str | Seq[int], max_tokens: int | None = DEFAULT_MAX_TOKENS, *,
                 stop: str | list[str] | None = None, ignore_eos: bool = False,
                 on_token: Callable[[TokenEvent], Any] | None = None, cancel: threading.Event | None = None,
                 progress: Callable[[int, int], Any] | None = None, trace: bool = False,
                 add_special: bool | None = None, context_overflow: str = "stop", n_keep: int | None = None,
                 **sampling: Any) -> Completion:
        """Complete ``prompt`` (text, or token ids used as given). Sampling keywords: temperature,
        top_k, top_p, min_p, typical_p, repeat_penalty, presence_penalty, frequency_penalty,
        penalty_last_n, logit_bias, seed, top_logprobs. Constrained output: ``grammar`` (llama.cpp
        GBNF or Lark), ``json_schema`` (dict, JSON string or pydantic model) or ``response_format``
        (OpenAI's ``{"type": "json_object"}`` / ``{"type": "json_schema", "json_schema": {...}}``,
        or ``{"type": "regex", "regex": ...}``). ``on_token(ev)`` runs on this thread for each
        :class:`TokenEvent`; returning False stops (finish_reason "cancelled")."""
        tr = Trace() if trace else None
        ids = self._prompt_ids(prompt, add_special, tr)
        seq = self._sequence(ids, max_tokens=max_tokens, stop=stop, ignore_eos=ignore_eos, on_token=on_token,
                             cancel=cancel, progress=progress, trace=tr, context_overflow=context_overflow,
                             n_keep=n_keep, sampling=sampling)
        return self._run(seq)

    def stream(self, prompt: str | Seq[int], max_tokens: int | None = DEFAULT_MAX_TOKENS,
               **kw: Any) -> Iterator[TokenEvent]:
        """Like :meth:`generate`, as an iterator of :class:`TokenEvent`; breaking out cancels."""
        if "on_token" in kw:
            raise InvalidRequestError("stream() yields events; use generate(on_token=...) for callbacks")
        add_special = kw.pop("add_special", None)
        trace = Trace() if kw.pop("trace", False) else None
        ids = self._prompt_ids(prompt, add_special, trace)
        return self._stream_ids(ids, max_tokens, trace, kw)

    def _stream_ids(self, ids: list[int], max_tokens: int | None, trace: Trace | None,
                    kw: dict[str, Any]) -> Iterator[TokenEvent]:
        return self._stream_seq(self._stream_sequence(ids, max_tokens, trace, kw))

    def _stream_sequence(self, ids: list[int], max_tokens: int | None, trace: Trace | None,
                         kw: dict[str, Any]) -> Sequence:
        opts = {k: kw.pop(k) for k in ("stop", "ignore_eos", "cancel", "progress", "context_overflow", "n_keep")
                if k in kw}
        return self._sequence(ids, max_tokens=max_tokens, stop=opts.get("stop"),
                              ignore_eos=opts.get("ignore_eos", False), on_token=None,
                              cancel=opts.get("cancel"), progress=opts.get("progress"), trace=trace,
                              context_overflow=opts.get("context_overflow", "stop"), n_keep=opts.get("n_keep"),
                              sampling=kw)

    def _stream_seq(self, seq: Sequence) -> Iterator[TokenEvent]:
        stream = self._submit(seq)
        try:
            yield from stream
        finally:
            if not seq.done:  # the consumer broke out: cancel at the next step
                seq.request_stop()

    def chat(self, messages: list[dict[str, Any]], max_tokens: int | None = DEFAULT_MAX_TOKENS, *,
             tools: list[dict[str, Any]] | None = None, trace: bool = False, **kw: Any) -> Completion:
        """Answer a conversation: the chat template renders ``messages``, then :meth:`generate`."""
        tr = Trace() if trace else None
        ids, plan = self._chat_request(messages, tools, tr, kw)
        seq_kw = {k: kw.pop(k) for k in ("stop", "ignore_eos", "on_token", "cancel", "progress",
                                         "context_overflow", "n_keep") if k in kw}
        seq = self._sequence(ids, max_tokens=max_tokens, stop=seq_kw.get("stop"),
                             ignore_eos=seq_kw.get("ignore_eos", False), on_token=seq_kw.get("on_token"),
                             cancel=seq_kw.get("cancel"), progress=seq_kw.get("progress"), trace=tr,
                             context_overflow=seq_kw.get("context_overflow", "stop"), n_keep=seq_kw.get("n_keep"),
                             sampling=kw)
        seq.parser = plan
        return self._run(seq)

    def _chat_request(self, messages: list[dict[str, Any]], tools: Any, trace: Trace | None,
                      kw: dict[str, Any]) -> tuple[list[int], ChatParser | None]:
        """Prompt ids and output parser of a chat; pops ``tool_choice``, ``parallel_tool_calls`` and
        ``chat_template_kwargs`` from ``kw`` and adds the grammar a forced tool call needs."""
        from . import reasoning
        from .grammar import lark_marker
        from .tools import ToolPlan

        src = self.chat_template.source
        plan = ToolPlan.build(tools, kw.pop("tool_choice", None), kw.pop("parallel_tool_calls", None), src)
        g = plan.grammar(lambda text: lark_marker(self.tokenizer, text)) if plan is not None else None
        if g is not None:
            if any(kw.get(k) is not None for k in ("grammar", "json_schema", "response_format")):
                raise InvalidRequestError("tool_choice 'required' or a named function cannot be combined with "
                                          "grammar, json_schema or response_format")
            kw["grammar"] = g
        ids, text = self._chat_prompt(messages, plan.render_tools if plan is not None else None, trace,
                                      kw.pop("chat_template_kwargs", None), with_text=True,
                                      parse_special_content=kw.pop("parse_special_content", None))
        rf = kw.pop("reasoning_format", None)
        if rf not in (None, "auto", "none"):
            raise InvalidRequestError(f"reasoning_format must be 'auto' or 'none', got {rf!r}")
        fmt = reasoning.detect_format(src) if rf != "none" else None  # "none": thinking stays in the content
        budget = kw.pop("thinking_budget", None)
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
            raise InvalidRequestError(f"thinking_budget must be a non-negative number of tokens, got {budget!r}")
        if fmt is None and plan is None:
            return ids, None
        parser = reasoning.ChatParser(fmt, reasoning.starts_inside(fmt, text), plan)
        opener = "<|channel|>" if fmt == reasoning.HARMONY else \
            reasoning.TAGS[fmt][0] if reasoning.may_open(fmt, text) else None
        if opener is not None:  # a grammar then holds for the answer (Sequence.advance_grammar)
            opening = self.tokenizer.encode(opener, add_special=False, parse_special=True)
            parser.open_id = opening[0] if len(opening) == 1 else None
        if fmt is not None and budget is not None:
            parser.budget = budget
            parser.end_ids = self.tokenizer.encode(reasoning.end_marker(fmt), add_special=False, parse_special=True)
        return ids, parser

    def _chat_prompt(self, messages: list[dict[str, Any]], tools: Any, trace: Trace | None,
                     template_kwargs: dict[str, Any] | None = None, with_text: bool = False,
                     parse_special_content: bool | None = None) -> Any:
        """Render and tokenize a conversation; ``template_kwargs`` (``chat_template_kwargs``, e.g.
        ``enable_thinking``, ``reasoning_effort``) are variables the template reads.

        Control tokens come only from the template's own text: a control-token text inside the
        messages, tools or template variables is tokenized as plain text (no role injection).
        ``parse_special_content=True`` (or ``Model.parse_special_content = True``) parses them
        in the content too, as llama.cpp and transformers do."""
        if parse_special_content is None:
            parse_special_content = self.parse_special_content
        if not isinstance(parse_special_content, bool):
            raise InvalidRequestError(f"parse_special_content must be a boolean, got {parse_special_content!r}")
        if template_kwargs is not None and not isinstance(template_kwargs, dict):
            raise InvalidRequestError("chat_template_kwargs must be a dict of template variables")
        reserved = {"messages", "tools", "add_generation_prompt"} & set(template_kwargs or ())
        if reserved:
            raise InvalidRequestError(f"chat_template_kwargs cannot set {', '.join(sorted(reserved))}")
        t0 = time.perf_counter()
        if parse_special_content:
            text = self.apply_chat_template(messages, add_generation_prompt=True, tools=tools,
                                            **(template_kwargs or {}))
            spans: list[tuple[int, int]] = []
        else:
            text, spans = self.chat_template.render_spans(messages, add_generation_prompt=True, tools=tools,
                                                          control_texts=self.tokenizer.control_texts_in,
                                                          **(template_kwargs or {}))
        t1 = time.perf_counter()
        ids = self._chat_ids(text, spans)
        if trace is not None:
            trace.messages = [dict(m) for m in messages]
            trace.rendered = text
            trace.add("template", t1 - t0, chars=len(text))
            trace.add("tokenize", time.perf_counter() - t1, tokens=len(ids))
        return (ids, text) if with_text else ids

    def chat_stream(self, messages: list[dict[str, Any]], max_tokens: int | None = DEFAULT_MAX_TOKENS, *,
                    tools: list[dict[str, Any]] | None = None, **kw: Any) -> Iterator[TokenEvent]:
        """:meth:`chat` as an iterator of :class:`TokenEvent`."""
        return self._stream_seq(self._chat_stream_seq(messages, max_tokens, tools, kw))

    def _chat_stream_seq(self, messages: list[dict[str, Any]], max_tokens: int | None, tools: Any,
                         kw: dict[str, Any]) -> Sequence:
        trace = Trace() if kw.pop("trace", False) else None
        ids, plan = self._chat_request(messages, tools, trace, kw)
        seq = self._stream_sequence(ids, max_tokens, trace, kw)
        seq.parser = plan
        return seq

    # -- background and async ----------------------------------------------------------------------
    def submit(self, prompt: str | Seq[int] | None = None, *, messages: list[dict[str, Any]] | None = None,
               on_token: Callable[[TokenEvent], Any] | None = None, **kw: Any) -> GenerationHandle:
        """Start a generation on a worker thread; returns a handle (cancel / result / done).

        ``on_token`` runs on the worker thread. Pass ``messages=`` instead of a prompt to chat.
        """
        self._check_open()
        if (prompt is None) == (messages is None):
            raise InvalidRequestError("submit() takes either a prompt or messages=")
        inline = kw.pop("_inline", False)  # private: see _submit_inline
        parser = kw.pop("_parser", None)  # private: the server's tool plan for a prompt it rendered
        h = GenerationHandle()
        user_cancel = kw.pop("cancel", None)
        _check_cancel(user_cancel)
        if user_cancel is not None:
            # either the handle or the caller's event can cancel
            h._cancel = _AnyEvent(h._cancel, user_cancel)  # type: ignore[assignment]

        # build the sequence now so bad arguments raise here, on the caller's thread
        if messages is not None:
            trace = Trace() if kw.pop("trace", False) else None
            ids, plan = self._chat_request(messages, kw.pop("tools", None), trace, kw)
        else:
            plan = parser
            trace = Trace() if kw.pop("trace", False) else None
            ids = self._prompt_ids(prompt, kw.pop("add_special", None), trace)  # type: ignore[arg-type]
        max_tokens = kw.pop("max_tokens", DEFAULT_MAX_TOKENS)
        opts = {k: kw.pop(k) for k in ("stop", "ignore_eos", "progress", "context_overflow", "n_keep") if k in kw}
        seq = self._sequence(ids, max_tokens=max_tokens, stop=opts.get("stop"),
                             ignore_eos=opts.get("ignore_eos", False), on_token=on_token, cancel=h._cancel,
                             progress=opts.get("progress"), trace=trace,
                             context_overflow=opts.get("context_overflow", "stop"), n_keep=opts.get("n_keep"),
                             sampling=kw)
        seq.parser = plan

        if inline:
            self._submit_inline(seq, h)
            return h
        stream = self._submit(seq)  # a full queue raises CapacityError here, on the caller's thread

        def work() -> None:
            try:
                h._result = self._consume(seq, stream)
            except BaseException as e:  # delivered by result()
                h._error = e
            finally:
                self._workers.discard(threading.current_thread())
                h._set_done()

        t = threading.Thread(target=work, name="minirt-generate", daemon=True)
        h.thread = t
        self._workers.add(t)
        t.start()
        return h

    def _submit_inline(self, seq: Sequence, h: GenerationHandle) -> None:
        """Submit with ``on_token`` called on the scheduler thread itself, with no worker thread
        between them. Only for callbacks that return at once and never block, such as posting to
        an event loop (the server and :meth:`astream`): with 16 streams the worker threads' wake-ups
        took ~5% of a 2-core machine's CPU from the forward passes. The callback's exceptions and
        ``False`` end the request as on the worker thread (``Sequence._emit``)."""

        submitted = threading.Event()
        box: list[Any] = []

        def done(_ev: TokenEvent) -> None:  # the scheduler's last call for this request
            # a request cancelled from the start can end before submit() below has returned
            submitted.wait()
            req = box[0] if box else None
            err = req.error if req is not None and req.error is not None else seq.error
            if err is not None:
                h._error = err
            else:
                h._result = seq.completion()
            h._set_done()

        seq.sink = getattr(seq, "user_sink", None)
        try:
            box.append(self.scheduler.submit(seq, done))  # a full queue raises CapacityError here
        finally:
            submitted.set()

    async def astream(self, prompt: str | Seq[int] | None = None, *, messages: list[dict[str, Any]] | None = None,
                      **kw: Any) -> AsyncIterator[TokenEvent]:
        """Async iterator of :class:`TokenEvent`; generation runs off the event loop, which never
        blocks. Leaving the loop early cancels the generation."""
        import asyncio

        loop = asyncio.get_running_loop()
        q: asyncio.Queue[TokenEvent | None] = asyncio.Queue()

        def post(item: TokenEvent | None) -> None:
            try:
                loop.call_soon_threadsafe(q.put_nowait, item)
            except RuntimeError:  # the loop is gone: nobody listens any more
                pass

        h = self.submit(prompt, messages=messages, on_token=post, _inline=True, **kw)
        h.add_done_callback(lambda _h: post(None))
        try:
            while True:
                item = await q.get()
                if item is None:
                    break
                yield item
            h.result(0)  # re-raise the request's error, if any
        finally:
            if not h.done():
                h.cancel()

    # -- OpenAI / llama-cpp-python shaped API ------------------------------------------------------
    def create_completion(self, prompt: str | Seq[int], max_tokens: int | None = 16, *, stream: bool = False,
                          logprobs: int | None = None, echo: bool = False, **kw: Any) -> Any:
        """llama-cpp-python's ``create_completion``: a ``text_completion`` dict, or chunks when ``stream``."""
        from . import openai_format as fmt

        if logprobs is not None:
            kw["top_logprobs"] = _count("logprobs", logprobs, 20)
        cid, created = f"cmpl-{uuid.uuid4()}", int(time.time())
        if stream:
            ids = self._prompt_ids(prompt, kw.pop("add_special", None), None)
            events = self._stream_ids(ids, max_tokens, None, kw)
            return fmt.completion_chunks(self, events, cid, created, prompt if echo and isinstance(prompt, str) else "",
                                         want_logprobs=logprobs is not None)
        c = self.generate(prompt, max_tokens, **kw)
        return fmt.completion_dict(self, c, cid, created, logprobs is not None,
                                   prompt if echo and isinstance(prompt, str) else "")

    def create_chat_completion(self, messages: list[dict[str, Any]], max_tokens: int | None = None, *,
                               stream: bool = False, logprobs: bool = False, top_logprobs: int | None = None,
                               tools: list[dict[str, Any]] | None = None, **kw: Any) -> Any:
        """llama-cpp-python's ``create_chat_completion``: a ``chat.completion`` dict, or chunk dicts
        when ``stream`` (first delta carries the role, the last the finish_reason)."""
        from . import openai_format as fmt

        if logprobs:
            kw["top_logprobs"] = _count("top_logprobs", top_logprobs or 0, 20) or 1
        cid, created = f"chatcmpl-{uuid.uuid4()}", int(time.time())
        if stream:
            seq = self._chat_stream_seq(messages, max_tokens, tools, kw)
            return fmt.chat_chunks(self, self._stream_seq(seq), cid, created, logprobs, seq.parser)
        c = self.chat(messages, max_tokens, tools=tools, **kw)
        return fmt.chat_dict(self, c, cid, created, logprobs)

    def set_lora_scales(self, scales: dict[int, float]) -> None:
        """Set the scale of each loaded LoRA adapter by index (llama-server's ``POST /lora-adapters``):
        adapters not named get 0, as there. Takes effect from the next forward pass, also for running
        requests; cached prefixes (computed with the old scales) are dropped."""
        if not isinstance(scales, dict):
            raise InvalidRequestError("LoRA scales must be a mapping of adapter index to scale")
        n = len(self.lora_adapters)
        for i, v in scales.items():
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n:
                raise InvalidRequestError(f"no LoRA adapter with id {i!r} (the model has {n})")
            lora_mod.check_scale(v, f"LoRA adapter {i}: the scale")
        with self._step_lock:
            for i, ad in enumerate(self.lora_adapters):
                ad.set_scale(float(scales.get(i, 0.0)))
            self.cache_pool.clear()
            self._fingerprint = None

    # -- state save / load -----------------------------------------------------------------------
    def fingerprint(self) -> str:
        """Identity of the model file: sha256 of its header (metadata + tensor table), its size and
        17 slices of the tensor data spread over the file (cheap, yet differs between fine-tunes);
        with LoRA adapters, also their factors and scales (a cache made with them is theirs)."""
        if self._fingerprint is None:
            import hashlib

            h = hashlib.sha256()
            size = os.path.getsize(self.path)
            h.update(str(size).encode())
            with open(self.path, "rb") as fh:
                h.update(fh.read(self.file.data_offset))
                span = max(size - self.file.data_offset, 1)
                for i in range(17):
                    fh.seek(self.file.data_offset + span * i // 17)
                    h.update(fh.read(1 << 16))
            for ad in self.lora_adapters:
                for name, pair in sorted(ad.pairs.items()):
                    h.update(f"{name}:{pair.scale!r}".encode())
                    h.update(pair.a.tobytes())
                    h.update(pair.b.tobytes())
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    def save_state(self, path: str | os.PathLike[str]) -> list[int]:
        """Save the KV cache of the most recent conversation so a later process can resume it
        without recomputing; returns the token ids it covers. Written atomically (temp + rename)."""
        from . import __version__
        from .errors import StateError

        self._check_open()
        cache = self.cache_pool.most_recent()
        if cache is None or cache.n_past == 0:
            raise StateError("nothing to save: no finished request has left a KV cache")
        n = cache.n_past
        header = {"format": STATE_FORMAT, "minirt": __version__, "model": self.fingerprint(),
                  "arch": self.arch, "n_tokens": n, "kv_dtype": str(cache.k.dtype),
                  "cache_type_k": cache.types[0], "cache_type_v": cache.types[1],
                  "kv_basis": int(cache.transformed)}
        from .state import SCALE_MEMBER, STATE_MEMBER, scale_exponents

        scales = scale_exponents(cache)
        extra = {} if scales is None else {SCALE_MEMBER: scales}
        header["kv_key_scales"] = scales is not None
        header["recurrent"] = cache.has_state
        if cache.has_state:  # Qwen3.5's delta-net layers: their state after the n saved positions
            try:
                extra[STATE_MEMBER] = cache.export_state()
            except ValueError as e:
                raise StateError(f"cannot save the most recent conversation: {e}") from None
        path = os.fspath(path)
        tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
        k, v = cache.export(n)
        try:
            with open(tmp, "wb") as fh:
                np.savez(fh, header=np.array(json.dumps(header)), tokens=cache.tokens[:n].copy(), k=k, v=v,
                         **extra)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return cache.tokens[:n].tolist()

    def load_state(self, path: str | os.PathLike[str]) -> list[int]:
        """Load a state saved by :meth:`save_state` into the prefix cache: the next request whose
        prompt starts with the saved tokens skips recomputing them. Returns those token ids.

        Everything in the file is checked against this model first (:mod:`minirt.state`): a bad,
        foreign or tampered file raises :class:`StateError` and leaves the prefix cache as it was."""
        from . import __version__
        from .errors import StateError
        from .state import read_state

        self._check_open()

        def check_header(header: dict[str, Any]) -> None:
            if header.get("format") != STATE_FORMAT:
                raise StateError(f"{path}: unsupported state format {str(header.get('format'))[:80]!r}")
            if header.get("model") != self.fingerprint():
                raise StateError(f"{path}: saved from another model (fingerprint {str(header.get('model'))[:12]}…, "
                                 f"this model {self.fingerprint()[:12]}…)")
            if header.get("minirt") != __version__:
                raise StateError(f"{path}: saved by minirt {str(header.get('minirt'))[:40]}, this is {__version__}")

        cache = self._new_cache()
        try:
            tokens = read_state(path, cache, self.n_vocab, check_header)
            self._check_open()  # closed meanwhile: the cache must not outlive the model in its pool
        except BaseException:
            cache.release()
            raise
        self.cache_pool.release(cache)
        return tokens

    # -- lifecycle ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Release the KV caches, backend buffers and the file mapping. Idempotent."""
        if self._closed:
            return
        sched = self._scheduler
        if sched is not None:
            sched.close()
        with self._step_lock:
            self._closed = True
            self.cache_pool.clear()
            close = getattr(self.backend, "close", None)
            if close is not None:
                close()
            self.model = None  # type: ignore[assignment]  # drops every view of the mapping
            self.engine.close()
            self.engine = None  # type: ignore[assignment]
            self.file.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort at interpreter shutdown
        try:
            if not self._closed:
                self.close()
        except Exception:
            pass


def _check_cancel(cancel: Any) -> None:
    if cancel is not None and not callable(getattr(cancel, "is_set", None)):
        raise InvalidRequestError(f"cancel must be a threading.Event (or have is_set()), got {type(cancel).__name__}")


def _count(name: str, v: Any, hi: int) -> int:
    """An integer option such as logprobs / top_logprobs, validated."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= v <= hi:
        raise InvalidRequestError(f"{name} must be an integer in [0, {hi}], got {v!r}")
    return int(v)


class _AnyEvent:
    """``is_set()`` true when either of two events is set; ``set()`` sets the first."""

    def __init__(self, a: threading.Event, b: threading.Event) -> None:
        self.a, self.b = a, b

    def is_set(self) -> bool:
        return self.a.is_set() or self.b.is_set()

    def set(self) -> None:
        self.a.set()
