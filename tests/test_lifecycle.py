"""Model lifecycle: ``close()`` and ``with minirt.load(...)`` release the file mapping, the KV caches
and the backend's references; every call after close raises ``minirt.ModelClosedError``; loading
and closing a real model repeatedly does not grow the process.

The mapping is checked in ``/proc/self/maps`` (Linux): the GGUF path is listed while any view of
its bytes is alive, so its absence after close proves that nothing (model, caches, kernels,
threads) still references the weights.
"""

from __future__ import annotations

import asyncio
import gc
import os
import re
import sys
import threading
import time
from pathlib import Path

import pytest

import minirt

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_models import TinySpec, write_tiny  # noqa: E402

pytestmark = pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc/self/maps and status")

MSG = [{"role": "user", "content": "the capital of France?"}]


def mapped(path: os.PathLike[str] | str) -> int:
    """How many mappings of ``path`` this process holds."""
    p = os.path.realpath(path)
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if line.rstrip().endswith(p))


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("life") / "tiny.gguf"
    write_tiny(p, TinySpec(seed=3))
    return p


def _use(llm: minirt.Model) -> None:
    """Exercise every path that allocates: prefill, decode, prefix cache, stream, chat, submit."""
    llm.generate("the capital of France is", max_tokens=4)
    list(llm.stream("the capital", max_tokens=3))
    llm.chat(MSG, max_tokens=3)
    llm.submit("the", max_tokens=3).result(30)


def test_close_unmaps_the_file_and_frees_caches(tiny):
    llm = minirt.load(str(tiny), n_ctx=128)
    _use(llm)
    assert mapped(tiny) >= 1
    assert llm.cache_pool.tokens() > 0  # the prefix cache kept finished requests' caches
    sched_thread = llm.scheduler._thread
    llm.close()
    assert llm.closed
    assert llm.cache_pool.tokens() == 0
    assert sched_thread is None or not sched_thread.is_alive()
    gc.collect()
    assert mapped(tiny) == 0, "the GGUF is still mapped after close(): something still views the weights"
    llm.close()  # idempotent


def test_with_block_closes_even_on_error(tiny):
    with minirt.load(str(tiny), n_ctx=128) as llm:
        _use(llm)
        assert mapped(tiny) >= 1
    assert llm.closed
    gc.collect()
    assert mapped(tiny) == 0

    with pytest.raises(RuntimeError, match="inside the block"):
        with minirt.load(str(tiny), n_ctx=128) as llm2:
            llm2.generate("the", max_tokens=2)
            raise RuntimeError("inside the block")
    assert llm2.closed
    gc.collect()
    assert mapped(tiny) == 0


def _astream(llm):
    async def go():
        return [ev async for ev in llm.astream("the", max_tokens=2)]

    return asyncio.run(go())


AFTER_CLOSE = {
    "generate": lambda m: m.generate("the", max_tokens=2),
    "stream": lambda m: list(m.stream("the", max_tokens=2)),
    "chat": lambda m: m.chat(MSG, max_tokens=2),
    "chat_stream": lambda m: list(m.chat_stream(MSG, max_tokens=2)),
    "submit": lambda m: m.submit("the", max_tokens=2).result(10),
    "submit_messages": lambda m: m.submit(messages=MSG, max_tokens=2).result(10),
    "astream": _astream,
    "create_completion": lambda m: m.create_completion("the", max_tokens=2),
    "create_completion_stream": lambda m: list(m.create_completion("the", max_tokens=2, stream=True)),
    "create_chat_completion": lambda m: m.create_chat_completion(MSG, max_tokens=2),
    "create_chat_completion_stream": lambda m: list(m.create_chat_completion(MSG, max_tokens=2, stream=True)),
    "logits": lambda m: m.logits([1, 5, 6]),
}


@pytest.fixture(scope="module")
def closed_model(tiny):
    llm = minirt.load(str(tiny), n_ctx=64)
    llm.generate("the", max_tokens=2)
    llm.close()
    return llm


@pytest.mark.parametrize("call", sorted(AFTER_CLOSE))
def test_calls_after_close_raise_model_closed(closed_model, call):
    with pytest.raises(minirt.ModelClosedError, match="closed"):
        AFTER_CLOSE[call](closed_model)


def test_close_while_a_generation_runs(tiny):
    """close() from another thread ends an in-flight request (cancelled or ModelClosedError), never hangs."""
    llm = minirt.load(str(tiny), n_ctx=256)
    seen = threading.Event()
    count = [0]

    def slow(ev):
        count[0] += 1
        if count[0] == 3:
            seen.set()
        time.sleep(0.005)  # keep the request running while close() happens

    h = llm.submit("the capital", max_tokens=200, ignore_eos=True, on_token=slow)
    assert seen.wait(30)
    t0 = time.perf_counter()
    llm.close()
    assert time.perf_counter() - t0 < 10
    try:
        c = h.result(10)
    except minirt.ModelClosedError:
        pass
    else:
        assert c.finish_reason == "cancelled" and len(c.token_ids) < 200
    assert h.done()
    gc.collect()
    assert mapped(tiny) == 0


def test_stream_iterator_survives_close(tiny):
    llm = minirt.load(str(tiny), n_ctx=256)
    it = llm.stream("the capital", max_tokens=200, ignore_eos=True)
    first = next(it)
    assert first.token_id is not None
    llm.close()
    # the iterator ends (final event "cancelled") or raises ModelClosedError: never hangs, never crashes
    try:
        rest = list(it)
    except minirt.ModelClosedError:
        rest = []
    assert not rest or rest[-1].finish_reason in ("cancelled", "length")
    del it, rest
    gc.collect()
    assert mapped(tiny) == 0


def test_close_drops_native_keepalive_references(tiny):
    """What the native pool does when a descheduled worker is overtaken, reproduced deterministically."""
    llm = minirt.load(str(tiny), n_ctx=64)
    if llm.backend_info().get("backend") != "native":
        pytest.skip(f"the {llm.backend_info().get('backend')} backend keeps no kernel references")
    from minirt.kernels import native

    if not hasattr(native, "_keepalive"):
        pytest.skip("the native kernels no longer keep arrays alive after a call")
    llm.generate("the", max_tokens=2)
    lib = native._mod.lib
    w = llm.model.output.w  # (n_vocab, row_bytes) view of the mapping
    with native._keepalive_lock:
        native._keepalive.append((lib.mr_pool_generation(), w, w))
    del w
    llm.close()
    gc.collect()
    try:
        assert mapped(tiny) == 0, "after close() the mapping is still referenced by native._keepalive"
    finally:
        native._keepalive[:] = [e for e in native._keepalive if not lib.mr_pool_quiescent(e[0])]


def _pymalloc_arenas() -> int:
    """pymalloc arenas currently allocated (from sys._debugmallocstats, which writes to fd 2)."""
    r, w = os.pipe()
    saved = os.dup(2)
    try:
        os.dup2(w, 2)
        sys._debugmallocstats()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(w)
    chunks = []
    while True:
        b = os.read(r, 1 << 16)
        if not b:
            break
        chunks.append(b)
    os.close(r)
    m = re.search(r"# arenas allocated current\s*=\s*([\d,]+)", b"".join(chunks).decode())
    if m is None:
        pytest.skip("sys._debugmallocstats() does not report arenas on this interpreter")
    return int(m.group(1).replace(",", ""))


@pytest.mark.slow
def test_reloading_does_not_pin_python_arenas(qwen_path):
    if not hasattr(sys, "_debugmallocstats"):
        pytest.skip("needs CPython's sys._debugmallocstats")

    def cycle():
        llm = minirt.load(str(qwen_path), n_ctx=256)
        llm.close()
        del llm
        gc.collect()

    cycle()
    cycle()
    a0 = _pymalloc_arenas()
    for _ in range(6):
        cycle()
    grown = _pymalloc_arenas() - a0
    assert grown <= 2, f"{grown} pymalloc arenas (MiB) more after 6 load/close cycles"


@pytest.mark.slow
def test_twenty_loads_of_a_real_model_do_not_grow_rss(qwen_path):
    def cycle():
        llm = minirt.load(str(qwen_path), n_ctx=256)
        llm.generate("def f():", max_tokens=2, temperature=0.0)  # KV caches, kernel buffers, scheduler
        llm.close()
        del llm
        gc.collect()

    cycle()  # first use: imports, kernel build, numba caches
    base = rss_mb()
    trail = []
    for _ in range(20):
        cycle()
        trail.append(round(rss_mb()))
    growth = rss_mb() - base
    assert mapped(qwen_path) == 0, f"the model is still mapped after 20 closes (RSS trail {trail})"
    assert growth <= 50, f"RSS grew {growth:.0f} MB over 20 load/close cycles (from {base:.0f} MB: {trail})"
