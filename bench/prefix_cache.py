"""Prefix cache: time to first token of a chat's second turn on a ~1,000-token history.

Turn 1 sends a long conversation (system prompt + history, ~1,000 tokens) and gets an answer;
turn 2 appends the answer and a new user message. With the prefix cache, turn 2 computes only the
new tokens; without it (a fresh model each time), it recomputes the whole history. Prints both
times to first token and their ratio (target ≥ 5×), medians of several repetitions.

    python bench/prefix_cache.py -m qwen2.5-coder-0.5b-instruct -r 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import minirt  # noqa: E402

TOPICS = ["rivers", "volcanoes", "compilers", "bridges", "tea", "chess", "glaciers", "satellites", "bees", "maps"]


def history(llm: minirt.Model, target_tokens: int) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": "You are a concise assistant who answers in one sentence."}]
    i = 0
    while len(llm.tokenizer.encode(llm.apply_chat_template(msgs), parse_special=True)) < target_tokens:
        t = TOPICS[i % len(TOPICS)]
        msgs.append({"role": "user", "content": f"Tell me one surprising fact about {t} (question {i})."})
        msgs.append({"role": "assistant",
                     "content": f"Here is a fact about {t}: " + ("it is remarkable " * 6).strip() + "."})
        i += 1
    return msgs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--history-tokens", type=int, default=1000)
    ap.add_argument("-r", "--repetitions", type=int, default=3)
    args = ap.parse_args()

    cold, warm, n_hist = [], [], 0
    for rep in range(args.repetitions):
        with minirt.load(args.model, n_ctx=4096) as llm:
            msgs = history(llm, args.history_tokens)
            msgs[-1]["content"] += f" (run {rep})"  # nothing cached from an earlier repetition
            msgs.append({"role": "user", "content": "And one about clouds?"})
            first = llm.chat(msgs, max_tokens=16, temperature=0.0)
            n_hist = first.usage["prompt_tokens"]
            msgs += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And one about rain?"}]
            second = llm.chat(msgs, max_tokens=4, temperature=0.0)
            warm.append(second.timings["time_to_first_token_s"])
            cached = second.usage["cached_tokens"]
        with minirt.load(args.model, n_ctx=4096) as fresh:  # the same second turn, nothing cached
            c = fresh.chat(msgs, max_tokens=4, temperature=0.0)
            assert c.usage["cached_tokens"] == 0
            cold.append(c.timings["time_to_first_token_s"])
            assert c.token_ids == second.token_ids, "prefix reuse changed the answer"
    mc, mw = statistics.median(cold), statistics.median(warm)
    print(f"model {args.model}: first turn {n_hist} prompt tokens; second turn {len(c.prompt_ids)} tokens, "
          f"{cached} reused from the prefix cache")
    print(f"second-turn time to first token: without prefix cache {mc:.3f} s, with {mw:.3f} s "
          f"-> {mc / mw:.1f}x faster (median of {args.repetitions})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
