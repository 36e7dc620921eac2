"""Generation API on a tiny random model: streaming, callbacks, cancel, stop strings, background
and async use, thread safety, batching, KV budget, prefix reuse, hostile input."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

import minirt
from minirt import CapacityError, ContextOverflowError, InvalidRequestError
from tests.tiny_models import TinySpec, write_tiny

PROMPT = "the capital of France is"


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    p = tmp_path_factory.mktemp("gen") / "tiny.gguf"
    write_tiny(p, TinySpec(n_layer=2, seed=11))
    return str(p)


@pytest.fixture()
def llm(tiny_path):
    m = minirt.load(tiny_path, n_ctx=128)
    yield m
    m.close()


def greedy(llm, prompt=PROMPT, n=12, **kw):
    return llm.generate(prompt, max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def test_stream_equals_generate(llm):
    c = greedy(llm)
    evs = list(llm.stream(PROMPT, max_tokens=12, temperature=0.0, ignore_eos=True))
    assert evs[-1].finish_reason == "length" and evs[-1].token_id is None
    assert all(e.finish_reason is None for e in evs[:-1])
    assert [e.token_id for e in evs[:-1]] == c.token_ids
    assert "".join(e.text for e in evs) == c.text
    assert c.usage == {"prompt_tokens": len(c.prompt_ids), "completion_tokens": 12,
                       "total_tokens": len(c.prompt_ids) + 12, "cached_tokens": c.usage["cached_tokens"]}
    for k in ("time_to_first_token_s", "prompt_tokens_per_s", "generated_tokens_per_s"):
        assert c.timings[k] > 0


def test_prompt_as_ids_used_as_given(llm):
    ids = llm.tokenize(PROMPT)
    assert greedy(llm, ids).token_ids == greedy(llm).token_ids
    assert greedy(llm, ids[1:]).prompt_ids == ids[1:]


def test_callback_false_stops(llm):
    seen = []

    def cb(ev):
        seen.append(ev)
        return len(seen) < 3

    c = llm.generate(PROMPT, max_tokens=20, temperature=0.0, ignore_eos=True, on_token=cb)
    assert c.finish_reason == "cancelled"
    assert len(c.token_ids) == 3 and [e.token_id for e in seen] == c.token_ids
    assert c.text == "".join(e.text for e in seen)
    assert threading.current_thread() is threading.main_thread()


def test_callback_runs_on_caller_thread(llm):
    threads = set()
    llm.generate(PROMPT, max_tokens=3, temperature=0.0, on_token=lambda ev: threads.add(threading.get_ident()))
    assert threads == {threading.get_ident()}


def test_cancel_event_from_another_thread(llm):
    """Set from another thread, the event ends the generation at the next step boundary."""
    class Marked(threading.Event):
        step_at_set = -1

        def set(self):
            self.step_at_set = llm.scheduler.steps
            super().set()

    cancel = Marked()
    n = []

    def cb(ev):
        n.append(ev)
        if len(n) == 2:
            t = threading.Thread(target=cancel.set)
            t.start()
            t.join()

    c = llm.generate(PROMPT, max_tokens=100, temperature=0.0, ignore_eos=True, on_token=cb, cancel=cancel)
    assert c.finish_reason == "cancelled" and len(c.token_ids) < 100
    assert llm.scheduler.steps - cancel.step_at_set <= 1  # at most the forward pass already under way


def test_stop_strings_held_back_and_never_emitted(llm):
    full = greedy(llm, n=16).text
    assert len(full) > 6
    stop = full[len(full) // 2: len(full) // 2 + 3]
    before = full[: full.index(stop)]
    evs = list(llm.stream(PROMPT, max_tokens=16, temperature=0.0, ignore_eos=True, stop=[stop, "\x00never"]))
    text = "".join(e.text for e in evs)
    assert text == before and evs[-1].finish_reason == "stop"
    c = llm.generate(PROMPT, max_tokens=16, temperature=0.0, ignore_eos=True, stop=stop)
    assert c.text == before and c.finish_reason == "stop"
    # a stop string that never completes: the held-back prefix is released at the end
    tail = full[-2:] + "\x01"
    c = llm.generate(PROMPT, max_tokens=16, temperature=0.0, ignore_eos=True, stop=tail)
    assert c.text == full and c.finish_reason == "length"


def test_callback_exception_is_reraised_and_model_keeps_working(llm):
    class Boom(Exception):
        pass

    def cb(ev):
        raise Boom("from callback")

    with pytest.raises(Boom):
        llm.generate(PROMPT, max_tokens=5, on_token=cb)
    assert greedy(llm, n=4).finish_reason == "length"


def test_submit_handle_result_and_cancel(llm, tmp_path):
    h = llm.submit(PROMPT, max_tokens=6, temperature=0.0, ignore_eos=True)
    c = h.result(timeout=60)
    assert h.done() and c.finish_reason == "length" and len(c.token_ids) == 6
    # a long generation (3000 tokens: about a second on this tiny model, on a fast machine), so the
    # cancel after two callbacks lands while it runs (100 tokens were all decoded before the callbacks,
    # which run on the worker thread, had seen two of them)
    p = tmp_path / "long.gguf"
    write_tiny(p, TinySpec(n_layer=2, seed=11, n_ctx=4096))
    with minirt.load(str(p), n_ctx=4096) as long_llm:
        got = []
        h = long_llm.submit(PROMPT, max_tokens=3000, temperature=0.0, ignore_eos=True,
                            on_token=lambda ev: (got.append(ev), time.sleep(0.01)))
        while len(got) < 2:
            time.sleep(0.005)
        h.cancel()
        c = h.result(timeout=60)
    assert c.finish_reason == "cancelled" and len(c.token_ids) < 3000
    assert c.text.startswith("".join(e.text for e in got[:2]))


def test_astream_does_not_block_the_loop(llm):
    # The generation holds at its prefill until the loop has ticked a few times: if astream ran it on
    # the loop, the ticker could not run and the wait would time out with ticks still low. (Timing
    # the ticker against a free-running generation of a tiny model failed when 8 tokens took < 3 ms.)
    ticked = threading.Event()

    def hold(done, total):
        ticked.wait(timeout=5)

    async def main():
        ticks = 0
        stop = asyncio.Event()

        async def ticker():
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                if ticks > 3:
                    ticked.set()
                await asyncio.sleep(0.001)

        t = asyncio.create_task(ticker())
        evs = [ev async for ev in llm.astream(PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True, progress=hold)]
        stop.set()
        await t
        return evs, ticks

    evs, ticks = asyncio.run(main())
    assert evs[-1].finish_reason == "length" and len([e for e in evs if e.token_id is not None]) == 8
    assert ticks > 3


def test_inline_delivery_events_errors_and_early_cancel(llm):
    """Model._submit_inline (the server's streaming path and astream): events arrive on the
    scheduler thread in order and equal a plain generation; a request cancelled before it starts
    still completes its handle; a failing callback ends its own request with that error."""
    want = greedy(llm, n=6)
    got, threads = [], set()

    def on_token(ev):
        got.append(ev)
        threads.add(threading.current_thread().name)

    h = llm.submit(PROMPT, max_tokens=6, temperature=0.0, ignore_eos=True, on_token=on_token, _inline=True)
    c = h.result(timeout=60)
    assert c.token_ids == want.token_ids and c.text == want.text and h.thread is None
    assert [e.token_id for e in got if e.token_id is not None] == want.token_ids
    assert got[-1].finish_reason == "length" and threads == {"minirt-scheduler"}
    for _ in range(20):  # cancelled before admission: the scheduler may finish it before submit() returns
        ev = threading.Event()
        ev.set()
        c = llm.submit(PROMPT, max_tokens=6, on_token=lambda e: None, cancel=ev, _inline=True).result(timeout=10)
        assert c.finish_reason == "cancelled" and c.token_ids == []

    def boom(ev):
        raise RuntimeError("callback failed")

    h = llm.submit(PROMPT, max_tokens=6, temperature=0.0, on_token=boom, _inline=True)
    with pytest.raises(RuntimeError, match="callback failed"):
        h.result(timeout=60)
    assert greedy(llm, n=6).token_ids == want.token_ids  # the model serves the next request


def test_threads_get_sequential_results(llm):
    prompts = [f"{PROMPT} {w}" for w in ("a", "the", "Paris", "of", "e", "th", "t", "?")]
    expected = {p: greedy(llm, p, n=6).token_ids for p in prompts}
    results: dict[tuple[str, int], list[int]] = {}
    errors = []

    def worker(p):
        try:
            for j in range(5):
                results[(p, j)] = greedy(llm, p, n=6).token_ids
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(p,)) for p in prompts]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert not errors
    for (p, _), ids in results.items():
        assert ids == expected[p]
    assert len(results) == 40


def test_concurrent_requests_share_forward_passes(tiny_path):
    with minirt.load(tiny_path, n_ctx=128) as m:
        handles = [m.submit(PROMPT, max_tokens=20, temperature=0.0, ignore_eos=True) for _ in range(6)]
        outs = [h.result(60) for h in handles]
        assert all(len(o.token_ids) == 20 for o in outs)
        # 6 × 20 tokens were decoded in far fewer than 120 forward passes
        assert m.scheduler.steps < 80


def test_a_burst_of_prompts_is_prefilled_together(tiny_path):
    """Prompts that outnumber the decoding streams get the whole batch in one pass (a burst of requests starts
    together); a prompt arriving beside as many decoding streams is cut into prefill chunks."""
    prompts = [f"{PROMPT} {' '.join(f'w{i}{j}' for j in range(12))}" for i in range(4)]
    with minirt.load(tiny_path, n_ctx=128) as m:
        m.configure_scheduler(prefill_chunk=8)
        calls: dict[int, list[tuple[int, int]]] = {i: [] for i in range(-1, 4)}
        prefilled, gate = threading.Event(), threading.Event()

        def hold(done, total):  # the first request decodes; the scheduler waits here until the burst is queued
            calls[-1].append((done, total))
            if done == total:
                prefilled.set()
                gate.wait(10)

        def rec(i):
            return lambda done, total: calls[i].append((done, total))

        h0 = m.submit("w1", max_tokens=40, temperature=0.0, ignore_eos=True, progress=hold)
        assert prefilled.wait(10)
        hs = [m.submit(p, max_tokens=2, temperature=0.0, ignore_eos=True, progress=rec(i))
              for i, p in enumerate(prompts)]
        gate.set()
        outs = [h.result(60) for h in hs]
        h0.result(60)
        for i, o in enumerate(outs):  # 4 prompts of 16+ tokens beside 1 decoding stream: one pass each
            n = len(o.prompt_ids)
            assert n > 8 and calls[i] == [(n, n)], (i, calls[i])
        # one prompt beside one decoding stream: chunks of 8
        calls[0].clear()
        prefilled.clear()
        gate.clear()
        m.cache_pool.clear()  # nothing of the prompt cached: all of it computed
        h0 = m.submit("w2", max_tokens=40, temperature=0.0, ignore_eos=True, progress=hold)
        assert prefilled.wait(10)
        h1 = m.submit(prompts[0] + " again", max_tokens=2, temperature=0.0, ignore_eos=True, progress=rec(0))
        gate.set()
        n = len(h1.result(60).prompt_ids)
        h0.result(60)
        assert [d for d, _ in calls[0]] == list(range(8, n, 8)) + [n], calls[0]


def test_every_request_of_a_burst_reuses_a_cached_prefix(tiny_path):
    """A finished conversation's prefix (a shared system prompt) serves every request that starts with it, also
    when they run at once: each gets a copy, and the cached conversation stays whole for the next one."""
    with minirt.load(tiny_path, n_ctx=128) as m:
        base = m.tokenize(PROMPT + " w1 w2 w3 w4 w5 w6")
        shared = base[:-2]
        branches = [shared + m.tokenize(f" b{i} c{i}", add_special=False) for i in range(3)]
        refs = []
        for b in branches:  # each alone, nothing cached
            m.cache_pool.clear()
            refs.append(m.generate(b, max_tokens=6, temperature=0.0, ignore_eos=True).token_ids)
        m.cache_pool.clear()
        first = m.generate(base, max_tokens=4, temperature=0.0, ignore_eos=True)
        hs = [m.submit(b, max_tokens=6, temperature=0.0, ignore_eos=True) for b in branches]
        outs = [h.result(60) for h in hs]
        assert [o.token_ids for o in outs] == refs
        assert [o.usage["cached_tokens"] for o in outs] == [len(shared)] * 3
        again = m.generate(base + first.token_ids, max_tokens=2, temperature=0.0, ignore_eos=True)
        assert again.usage["cached_tokens"] == len(base) + len(first.token_ids) - 1  # the conversation, whole


def test_kv_budget_queue_and_refusal(tiny_path):
    with minirt.load(tiny_path, n_ctx=128) as m:
        m.configure_scheduler(kv_budget_tokens=100, max_queue=1, n_parallel=4)
        n_prompt = len(m.tokenize(PROMPT))
        assert n_prompt + 40 <= 100 < 2 * (n_prompt + 40)  # one request fits, two do not
        with pytest.raises(CapacityError):  # can never fit
            m.generate(PROMPT, max_tokens=100)
        gate, started = threading.Event(), threading.Event()

        def hold(done, total):  # keeps h1 in prefill, holding its reservation, until the gate opens
            started.set()
            gate.wait(10)

        h1 = m.submit(PROMPT, max_tokens=40, temperature=0.0, ignore_eos=True, progress=hold)
        assert started.wait(10)
        h2 = m.submit(PROMPT, max_tokens=40, temperature=0.0, ignore_eos=True)  # waits in the queue
        time.sleep(0.1)
        with pytest.raises(CapacityError):
            m.submit(PROMPT, max_tokens=40, temperature=0.0, ignore_eos=True)  # queue full
        gate.set()
        assert h1.result(60).finish_reason == "length"
        assert h2.result(60).finish_reason == "length"


def test_prefix_cache_reuses_shared_prefix(llm):
    a = greedy(llm, PROMPT + " w1 w2 w3", n=4)
    b = greedy(llm, PROMPT + " w1 w2 w3", n=4)
    assert b.usage["cached_tokens"] >= len(b.prompt_ids) - 1
    assert a.token_ids == b.token_ids
    c = greedy(llm, PROMPT + " w1 w2 w4", n=4)
    assert 0 < c.usage["cached_tokens"] < len(c.prompt_ids)


def test_trace_collects_every_step(llm):
    c = llm.generate(PROMPT, max_tokens=3, temperature=0.0, trace=True)
    steps = {s["step"] for s in c.trace.steps}
    assert {"tokenize", "prefill", "sample", "detokenize"} <= steps
    assert len(c.trace.tokens) == len(c.token_ids) and all(t["top"] for t in c.trace.tokens)
    assert c.trace.prompt_ids == c.prompt_ids


def test_openai_shaped_dicts(llm):
    d = llm.create_completion(PROMPT, max_tokens=4, temperature=0.0, logprobs=2)
    assert d["object"] == "text_completion" and d["choices"][0]["finish_reason"] in ("length", "stop")
    lp = d["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == d["usage"]["completion_tokens"] and len(lp["top_logprobs"][0]) == 2
    chunks = list(llm.create_completion(PROMPT, max_tokens=4, temperature=0.0, stream=True))
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == d["choices"][0]["text"]
    msgs = [{"role": "user", "content": "hi"}]
    cd = llm.create_chat_completion(msgs, max_tokens=4, temperature=0.0)
    assert cd["object"] == "chat.completion" and cd["choices"][0]["message"]["role"] == "assistant"
    cs = list(llm.create_chat_completion(msgs, max_tokens=4, temperature=0.0, stream=True))
    assert cs[0]["choices"][0]["delta"]["role"] == "assistant" and cs[-1]["choices"][0]["finish_reason"]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in cs) == cd["choices"][0]["message"]["content"]


@pytest.mark.parametrize("kw", [
    {"max_tokens": 0}, {"max_tokens": -5}, {"max_tokens": 2.5}, {"temperature": float("nan")},
    {"temperature": -0.5}, {"stop": 5}, {"stop": ["ok", 3]}, {"logit_bias": {10**9: 1.0}},
    {"context_overflow": "wrap"}, {"cancel": "yes"}, {"on_token": 3}, {"bogus_option": 1},
])
def test_bad_arguments_raise_typed_errors(llm, kw):
    with pytest.raises(InvalidRequestError):
        llm.generate(PROMPT, **{"max_tokens": 3, **kw})


@pytest.mark.parametrize("prompt", [b"bytes prompt", [], [1, 10**6], [1, -1], ["a", "b"], [1.5]])
def test_bad_prompts_raise_typed_errors(llm, prompt):
    with pytest.raises(InvalidRequestError):
        llm.generate(prompt, max_tokens=2)


def test_prompt_longer_than_context(llm):
    with pytest.raises(ContextOverflowError):
        llm.generate("e " * 400, max_tokens=2)


def test_closed_model_raises(tiny_path):
    m = minirt.load(tiny_path, n_ctx=64)
    m.close()
    m.close()
    with pytest.raises(minirt.ModelClosedError):
        m.generate(PROMPT, max_tokens=2)
