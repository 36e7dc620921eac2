"""``minirt run --explain``: a request walked through the eight pipeline steps, with timings.

Formats a :class:`minirt.generate.Trace` (collected with ``trace=True``) as text an engineer can
read: what arrived, the rendered context, the token ids with their text, where the time went
(tokenize, template, prefill, each forward / sample / detokenize), and for every generated token
its top candidates with probabilities.
"""

from __future__ import annotations

from typing import Any

from .generate import Completion


def _ms(s: float) -> str:
    return f"{s * 1e3:8.2f} ms"


def format_trace(llm: Any, c: Completion, max_prompt_tokens: int = 64, top_n: int = 5) -> str:
    """Human-readable explanation of one finished request."""
    tr = c.trace
    if tr is None:
        return "(no trace: pass trace=True)\n"
    out: list[str] = []
    w = out.append
    steps = tr.steps

    def total(name: str) -> float:
        return sum(s["seconds"] for s in steps if s["step"] == name)

    w("\n=== 1. receive ===\n")
    if tr.messages is not None:
        for m in tr.messages:
            w(f"  {m.get('role')}: {m.get('content')!r}\n")
    else:
        w(f"  prompt: {tr.prompt!r}\n")
    w("\n=== 2. tokenize ===  " + _ms(total("tokenize")) + "\n")
    ids = tr.prompt_ids
    w(f"  {len(ids)} tokens (vocab of {llm.n_vocab}, {llm.tokenizer.__class__.__name__})\n")
    for i, (tid, piece) in enumerate(zip(ids[:max_prompt_tokens], tr.prompt_pieces)):
        w(f"  [{i:3d}] {tid:7d}  {piece!r}\n")
    if len(ids) > max_prompt_tokens:
        w(f"  ... {len(ids) - max_prompt_tokens} more\n")
    w("\n=== 3. assemble context ===  " + _ms(total("template")) + "\n")
    if tr.rendered is not None:
        w("  chat template rendered:\n")
        for line in tr.rendered.splitlines() or [""]:
            w(f"  | {line}\n")
    else:
        w("  raw completion: the prompt is the whole context (no chat template)\n")
    pre = [s for s in steps if s["step"] == "prefill"]
    fwd = [s for s in steps if s["step"] == "forward"]
    n_pre = sum(s["tokens"] for s in pre)
    t_pre = sum(s["seconds"] for s in pre)
    cfg = llm.model.cfg if llm.model is not None else None
    w("\n=== 4. forward pass ===\n")
    if cfg is not None:
        w(f"  {cfg.arch}: {cfg.n_layer} layers, n_embd {cfg.n_embd}, {cfg.n_head} heads / {cfg.n_head_kv} KV heads, "
          f"backend {llm.backend.name}\n")
    if c.usage.get("cached_tokens"):
        w(f"  {c.usage['cached_tokens']} prompt tokens reused from the KV cache (shared prefix)\n")
    w(f"  prefill: {n_pre} tokens in {len(pre)} chunk(s), {_ms(t_pre)}"
      f" ({n_pre / t_pre if t_pre else float('nan'):.1f} tok/s)\n")
    if fwd:
        t_f = sum(s["seconds"] for s in fwd)
        w(f"  decode: {len(fwd)} forward passes of 1 token, {_ms(t_f)} total, {_ms(t_f / len(fwd))} each\n")
    w("\n=== 5. sample ===  " + _ms(total("sample")) + " total\n")
    for j, t in enumerate(tr.tokens):
        cands = ", ".join(f"{llm.tokenizer.token_to_piece(i).decode('utf-8', 'replace')!r} {p:.3f}"
                          for i, p in t["top"][:top_n])
        w(f"  #{j:<3d} {t['id']:7d} {t['text']!r:18s} p={__import__('math').exp(t['logprob']):.3f}   top: {cands}\n")
    w("\n=== 6. append ===\n")
    w(f"  KV cache holds {c.usage['prompt_tokens'] + len(c.token_ids)} positions of {llm.n_ctx}; each step computed "
      f"only the new token\n")
    w("\n=== 7. stop ===\n")
    why = {"stop": "end-of-generation token or stop string", "length": "max_tokens or context full",
           "cancelled": "cancelled by the caller"}.get(c.finish_reason, c.finish_reason)
    w(f"  finish_reason: {c.finish_reason} ({why})\n")
    w("\n=== 8. detokenize + stream ===  " + _ms(total("detokenize")) + " total\n")
    w(f"  text: {c.text!r}\n")
    t = c.timings
    w(f"\n  time to first token {t['time_to_first_token_s'] * 1e3:.1f} ms, "
      f"prefill {t['prompt_tokens_per_s']:.1f} tok/s,"
      f" decode {t['generated_tokens_per_s']:.1f} tok/s\n")
    return "".join(out)
