"""Command line: ``minirt run | chat | serve | bench | info | pull | models``.

The CLI is the one place that prints; everything it calls reports through return values,
callbacks and ``logging``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from . import loading, registry
from .errors import MinirtError

log = logging.getLogger("minirt.cli")


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------
class ProgressBar:
    """A one-line progress bar on stderr (only when stderr is a terminal, else a few log lines)."""

    def __init__(self, label: str, stream: Any = None) -> None:
        self.label = label
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.last = 0.0
        self.last_pct = -10

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        pct = int(100 * done / total) if total else 100
        if self.tty:
            if now - self.last < 0.1 and done < total:
                return
            self.last = now
            width = 30
            fill = int(width * done / total) if total else width
            self.stream.write(f"\r{self.label} [{'#' * fill}{'.' * (width - fill)}] {pct:3d}% "
                              f"{done / 1e6:8.1f}/{total / 1e6:.1f} MB")
            if done >= total:
                self.stream.write("\n")
            self.stream.flush()
        elif pct >= self.last_pct + 10 or done >= total:
            self.last_pct = pct
            self.stream.write(f"{self.label}: {pct}% ({done / 1e6:.1f}/{total / 1e6:.1f} MB)\n")
            self.stream.flush()


def _load(args: argparse.Namespace, **kw: Any) -> Any:
    name = loading.model_name(args)
    return loading.load_from_args(args, progress=ProgressBar(f"pulling {name}"), **kw)


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    kw = {
        "temperature": args.temp, "top_k": args.top_k, "top_p": args.top_p, "min_p": args.min_p,
        "repeat_penalty": args.repeat_penalty, "seed": args.seed,
    }
    return {k: v for k, v in kw.items() if v is not None}


def _add_model_args(p: argparse.ArgumentParser, several: bool = False) -> None:
    if several:
        p.add_argument("-m", "--model", action="append",
                       help=f"registry name or GGUF path (default {registry.DEFAULT_MODEL}); repeat as NAME=PATH "
                            "to serve several models")
    else:
        p.add_argument("-m", "--model", help=f"registry name or GGUF path (default {registry.DEFAULT_MODEL})")
    p.add_argument("-c", "--ctx", type=int,
                   help="context size in tokens (default: from the model, capped to fit memory)")
    p.add_argument("-t", "--threads", type=int, help="CPU threads (default: physical cores)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], help="compute device (default auto)")
    p.add_argument("--backend", choices=["auto", "native", "numba", "reference"], help="CPU kernels (default auto)")
    _add_lora_args(p)
    from .kv_types import CACHE_TYPES, DEFAULT_CACHE_TYPE

    for half in ("k", "v"):
        p.add_argument(f"-ct{half}", f"--cache-type-{half}", choices=CACHE_TYPES, type=str.lower,
                       help=f"KV cache type for {'keys' if half == 'k' else 'values'} (default {DEFAULT_CACHE_TYPE})")


def _add_lora_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lora", action="append", metavar="FILE", help="LoRA adapter GGUF (repeatable; llama.cpp's --lora)")
    p.add_argument("--lora-scaled", action="append", nargs=2, metavar=("FILE", "SCALE"),
                   help="LoRA adapter GGUF with a user scale (repeatable)")


def _add_sampling_args(p: argparse.ArgumentParser, temp: float) -> None:
    p.add_argument("-n", "--max-tokens", type=int, default=256, help="tokens to generate at most (default 256)")
    p.add_argument("--temp", type=float, default=temp, help=f"temperature; 0 = greedy (default {temp})")
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--min-p", type=float)
    p.add_argument("--repeat-penalty", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-generation tokens")
    p.add_argument("--system", help="system prompt (chat mode)")


# ----------------------------------------------------------------------------------------------
# commands
# ----------------------------------------------------------------------------------------------
def cmd_run(args: argparse.Namespace) -> int:
    llm = _load(args)
    with llm:
        use_chat = not args.raw  # every model has a template: its own or a built-in one
        cancel = threading.Event()
        out = sys.stdout

        def on_token(ev: Any) -> None:
            out.write(ev.text)
            out.flush()

        kw = dict(max_tokens=args.max_tokens, stop=args.stop, on_token=on_token, cancel=cancel,
                  trace=args.explain, ignore_eos=args.ignore_eos, **_sampling(args))
        prev = signal.getsignal(signal.SIGINT)
        signal.signal(signal.SIGINT, lambda *_: cancel.set())
        try:
            if use_chat:
                msgs = ([{"role": "system", "content": args.system}] if args.system else [])
                msgs.append({"role": "user", "content": args.prompt})
                c = llm.chat(msgs, **kw)
            else:
                c = llm.generate(args.prompt, **kw)
        finally:
            signal.signal(signal.SIGINT, prev)
        out.write("\n")
        if args.explain and c.trace is not None:
            from .explain import format_trace

            sys.stderr.write(format_trace(llm, c))
        elif args.verbose:
            t = c.timings
            sys.stderr.write(f"[{c.usage['prompt_tokens']} prompt tokens at {t['prompt_tokens_per_s']:.1f} tok/s, "
                             f"{c.usage['completion_tokens']} generated at {t['generated_tokens_per_s']:.1f} tok/s, "
                             f"first token after {t['time_to_first_token_s']:.3f} s; finish: {c.finish_reason}]\n")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    llm = _load(args)
    with llm:
        history: list[dict[str, str]] = []
        if args.system:
            history.append({"role": "system", "content": args.system})
        sys.stderr.write(f"minirt chat — {llm.name} ({llm.arch}). Ctrl-C stops an answer; Ctrl-D or /exit quits; "
                         f"/reset clears history.\n")
        while True:
            try:
                user = input("> ")
            except (EOFError, KeyboardInterrupt):
                sys.stderr.write("\n")
                return 0
            if user.strip() in ("/exit", "/quit"):
                return 0
            if user.strip() == "/reset":
                history = history[:1] if args.system else []
                continue
            if not user.strip():
                continue
            history.append({"role": "user", "content": user})

            def on_token(ev: Any) -> None:
                sys.stdout.write(ev.text)
                sys.stdout.flush()

            h = llm.submit(messages=history, on_token=on_token, max_tokens=args.max_tokens, stop=args.stop,
                           ignore_eos=args.ignore_eos, **_sampling(args))
            while True:
                try:
                    c = h.result(timeout=0.1)
                    break
                except TimeoutError:
                    continue
                except KeyboardInterrupt:  # cancel this answer, keep the program
                    h.cancel()
            sys.stdout.write("\n")
            if c.finish_reason == "cancelled":
                sys.stderr.write("[stopped]\n")
            history.append({"role": "assistant", "content": c.text})


def model_summary(path_or_name: str) -> dict[str, Any]:
    """What ``minirt info`` shows, as a dict."""
    from . import gguf
    from .archs.base import read_config

    path = registry.model_path(path_or_name, pull_missing=False)
    with gguf.open(path) as f:
        md = f.metadata
        n_params = sum(t.n_elements for t in f.tensors.values())
        by_type: Counter[str] = Counter()
        bytes_by_type: Counter[str] = Counter()
        for t in f.tensors.values():
            by_type[t.qtype] += 1
            bytes_by_type[t.qtype] += t.nbytes
        info: dict[str, Any] = {
            "path": str(path),
            "file_size_bytes": os.path.getsize(path),
            "gguf_version": f.version,
            "name": md.get("general.name"),
            "architecture": f.architecture,
            "parameters": n_params,
            "tensors": len(f.tensors),
            "quant_mix": {k: {"tensors": by_type[k], "bytes": bytes_by_type[k]} for k in sorted(by_type)},
            "file_type": md.get("general.file_type"),
            "tokenizer": md.get("tokenizer.ggml.model"),
            "tokenizer_pre": md.get("tokenizer.ggml.pre"),
            "vocab_size": len(md.get("tokenizer.ggml.tokens", [])),
            "chat_template": "tokenizer.chat_template" in md,
        }
        try:
            cfg = read_config(f)
            info.update(context_length=cfg.n_ctx_train, layers=cfg.n_layer, embedding=cfg.n_embd,
                        heads=cfg.n_head, kv_heads=cfg.n_head_kv, head_dim=cfg.head_dim_k, ffn=cfg.n_ff,
                        supported=True)
            if cfg.kv_layers is not None:  # head sizes per layer; layers reading another's KV; conv layers
                own = [s for s in cfg.kv_layers if s is not None]
                attn = [s for s in own if s[2]]  # no values: a convolution layer's rows (LFM2)
                info.update(head_dims=sorted({s[1] for s in attn}), kv_layers=len(attn),
                            conv_layers=len(own) - len(attn))
        except MinirtError as e:
            info["config_error"] = str(e)
            info["supported"] = False
    return info


def backend_summary() -> dict[str, Any]:
    from .kernels import get_backend

    try:
        b = get_backend(None)
        return b.info()
    except MinirtError as e:
        return {"backend": "unavailable", "error": str(e)}


def cmd_info(args: argparse.Namespace) -> int:
    target = args.file or registry.DEFAULT_MODEL
    if target in registry.MODELS and registry.status(target) == "missing":
        registry.pull(target, progress=ProgressBar(f"pulling {target}"))
    info = model_summary(target)
    info["backend"] = backend_summary()
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    print(f"file          {info['path']} ({info['file_size_bytes'] / 1e6:.1f} MB, GGUF v{info['gguf_version']})")
    print(f"name          {info.get('name')}")
    status = "supported" if info["supported"] else "not supported: " + info["config_error"]
    print(f"architecture  {info['architecture']} ({status})")
    print(f"parameters    {info['parameters'] / 1e6:.1f} M in {info['tensors']} tensors")
    if "layers" in info:
        dims = "/".join(map(str, info.get("head_dims", [info["head_dim"]])))
        own = ""
        if info.get("conv_layers"):
            own = f" ({info['conv_layers']} short-convolution, {info['kv_layers']} attention)"
        elif "kv_layers" in info and info["kv_layers"] < info["layers"]:
            own = f", {info['kv_layers']} with a KV cache of their own"
        print(f"shape         {info['layers']} layers{own}, n_embd {info['embedding']}, {info['heads']} heads "
              f"({info['kv_heads']} KV) of {dims}, ffn {info['ffn']}")
        print(f"context       {info['context_length']} tokens (trained)")
    mix = ", ".join(f"{k} ×{v['tensors']} ({v['bytes'] / 1e6:.1f} MB)" for k, v in info["quant_mix"].items())
    print(f"quant mix     {mix}")
    print(f"tokenizer     {info['tokenizer']} (pre: {info['tokenizer_pre']}), {info['vocab_size']} tokens")
    print(f"chat template {'present' if info['chat_template'] else 'absent (built-in fallback used)'}")
    b = info["backend"]
    extra = ", ".join(f"{k}={v}" for k, v in b.items() if k != "backend")
    print(f"backend       {b.get('backend')}" + (f" ({extra})" if extra else ""))
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    names = args.names or [registry.DEFAULT_MODEL]
    for name in names:
        registry.entry(name)
        p = registry.pull(name, progress=ProgressBar(f"pulling {name}"), force=args.force)
        print(f"{name}: {p}")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    print(f"{'name':34s} {'status':11s} {'size':>9s}  description")
    for name, e in sorted(registry.MODELS.items()):
        mark = "*" if name == registry.DEFAULT_MODEL else " "
        print(f"{name + mark:34s} {registry.status(name):11s} {e.size / 1e6:7.1f}MB  {e.description}")
    print(f"\n* default model; cache: {registry.home()}")
    return 0


def _bytes(text: str) -> int:
    """``4G``, ``512M``, ``1.5GiB``, ``1000000``: a byte count."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(t[-1:], 1)
    try:
        n = float(t[:-1] if mult > 1 else t) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte count: {text!r} (e.g. 8G, 512M)") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return int(n)


def _add_guard_arguments(p: argparse.ArgumentParser) -> None:
    """``minirt serve``'s connection limits and cross-origin policy (minirt.http_guard)."""
    from . import http_guard as g

    p.add_argument("--limit-concurrency", type=int, default=g.LIMIT_CONCURRENCY,
                   help=f"requests in flight before 503; /health, /metrics exempt (default {g.LIMIT_CONCURRENCY})")
    p.add_argument("--max-connections", type=int, default=g.MAX_CONNECTIONS,
                   help=f"open connections at most; idle ones are closed first (default {g.MAX_CONNECTIONS})")
    p.add_argument("--header-timeout", type=float, default=g.HEADER_TIMEOUT_S,
                   help=f"seconds for a request's line and headers to arrive, else 408 "
                        f"(default {g.HEADER_TIMEOUT_S:g})")
    p.add_argument("--body-timeout", type=float, default=g.BODY_TIMEOUT_S,
                   help=f"seconds for a request's body to arrive, else 408 (default {g.BODY_TIMEOUT_S:g})")
    p.add_argument("--keep-alive-timeout", type=float, default=g.KEEP_ALIVE_TIMEOUT_S,
                   help=f"seconds an idle keep-alive connection stays open (default {g.KEEP_ALIVE_TIMEOUT_S:g})")
    p.add_argument("--allow-origin", action="append", metavar="ORIGIN",
                   help="browser origin allowed to call the server, with CORS headers, e.g. "
                        "http://localhost:3000 (repeatable or comma-separated; '*' for any)")
    p.add_argument("--allow-host", action="append", metavar="NAME",
                   help="extra Host name accepted on loopback binds besides localhost, 127.0.0.1, [::1] (repeatable)")


def cmd_serve(args: argparse.Namespace) -> int:
    if args.ray:
        from .serve_ray import serve_from_args

        return serve_from_args(args)
    from .server import serve

    return serve(args, load=lambda: _load(args))


def cmd_embed(args: argparse.Namespace) -> int:
    """Embed texts (arguments, else one per line of stdin), or rerank them against ``--rerank``; print JSON."""
    import json

    from .embedding_server import embeddings_response, rerank_response

    texts = list(args.texts) or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not texts:
        sys.stderr.write("minirt: error: no text to embed (give TEXT arguments or lines on stdin)\n")
        return 2
    llm = _load(args, embedding=True, **({"pooling": args.pooling} if args.pooling else {}))
    with llm:
        if args.rerank is not None:
            out = rerank_response(llm, {"query": args.rerank, "documents": texts, "return_documents": True})
        else:
            body: dict[str, Any] = {"input": texts, "dimensions": args.dimensions}
            if args.no_normalize:
                vecs = llm.embed(texts, normalize=False)
                data = [{"object": "embedding", "index": i, "embedding": v.tolist()} for i, v in enumerate(vecs)]
                out = {"object": "list", "model": llm.name, "data": data}
            else:
                out = embeddings_response(llm, body)
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import main as bench_main

    return bench_main(args)


# ----------------------------------------------------------------------------------------------
def _intermixed(p: argparse.ArgumentParser) -> None:
    """Parse ``p``'s arguments intermixed (options after positionals), also as a subparser."""
    plain = p.parse_known_args
    busy = [False]

    def parse_known_args(args: Any = None, namespace: Any = None) -> Any:
        if busy[0]:  # parse_known_intermixed_args itself calls parse_known_args
            return plain(args, namespace)
        busy[0] = True
        try:
            return p.parse_known_intermixed_args(args, namespace)
        finally:
            busy[0] = False

    p.parse_known_args = parse_known_args  # type: ignore[method-assign]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="minirt", description="Run quantized GGUF language models.")
    ap.add_argument("-v", "--verbose", action="store_true", help="log progress and timings to stderr")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("run", help="complete or answer one prompt, streaming to stdout")
    _add_model_args(p)
    _add_sampling_args(p, temp=0.0)
    p.add_argument("--raw", action="store_true", help="plain completion: no chat template")
    p.add_argument("--explain", action="store_true", help="walk the request through the eight pipeline steps")
    p.add_argument("prompt")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("chat", help="interactive chat with history")
    _add_model_args(p)
    _add_sampling_args(p, temp=0.8)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _add_model_args(p, several=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY'")
    p.add_argument("--ssl-certfile")
    p.add_argument("--ssl-keyfile")
    p.add_argument("--parallel", type=int, default=16, help="sequences decoded together at most")
    p.add_argument("--kv-budget-tokens", type=int, help="KV-cache positions shared by all requests")
    p.add_argument("--queue", type=int, default=64, help="requests waiting for room before 503")
    p.add_argument("--alias", help="the model's name in /v1/models (default: registry or file name)")
    p.add_argument("--strict-model", action="store_true",
                   help="refuse requests naming another model (default: any name is served, as llama-server)")
    p.add_argument("--slot-save-path", help="directory for /slots/{id}?action=save|restore KV files")
    g = p.add_argument_group("several models")
    g.add_argument("--models-dir", help="serve every GGUF in this directory (name: file name without .gguf)")
    g.add_argument("--models-memory", type=_bytes,
                   help="bytes the loaded models may take (weights + KV budget, e.g. 8G); the least recently "
                        "used idle model is unloaded to load another")
    g.add_argument("--models-max", type=int, help="models loaded at once at most")
    g.add_argument("--keep-alive", help="unload an idle model after this long (e.g. 5m, 30s; default: only "
                                        "when room is needed); requests may send keep_alive")
    g = p.add_argument_group("Ray Serve (pip install 'minirt[ray]')")
    g.add_argument("--ray", action="store_true", help="run replicas of the engine behind Ray Serve's HTTP proxy")
    g.add_argument("--ray-address", help="Ray cluster to join (default: start a local one)")
    g.add_argument("--replicas", type=int, default=1, help="replicas (fixed; default 1)")
    g.add_argument("--min-replicas", type=int, help="autoscaling: fewest replicas")
    g.add_argument("--max-replicas", type=int, help="autoscaling: most replicas")
    g.add_argument("--target-ongoing-requests", type=float, default=8,
                   help="autoscaling: requests per replica to aim for (default 8)")
    g.add_argument("--replica-cpus", type=float, default=1, help="CPUs Ray reserves per replica (default 1)")
    _add_guard_arguments(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("bench", help="prefill / decode speed, side by side with llama.cpp when present")
    _add_model_args(p)
    p.add_argument("-p", "--n-prompt", type=int, action="append", help="prompt lengths (default 128 512)")
    p.add_argument("-g", "--n-gen", type=int, default=64, help="tokens to decode (default 64)")
    p.add_argument("-r", "--repetitions", type=int, default=3)
    p.add_argument("--no-peer", action="store_true", help="do not run llama.cpp")
    p.add_argument("--json", help="also write results to this file")
    from .bench import add_arguments as _bench_args

    _bench_args(p, model_args=False)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("embed", help="embed texts (or rerank them against --rerank QUERY) and print JSON")
    p.add_argument("model", help="registry name or GGUF path of an embedding or reranking model")
    p.add_argument("texts", nargs="*", help="texts to embed (default: one per line of stdin)")
    p.add_argument("-c", "--ctx", type=int, help="longest input in tokens (default: the model's)")
    p.add_argument("-t", "--threads", type=int, help="CPU threads (default: physical cores)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], help="compute device (default auto)")
    p.add_argument("--backend", choices=["auto", "native", "numba", "reference"], help="CPU kernels (default auto)")
    p.add_argument("--pooling", choices=["none", "mean", "cls", "last", "rank"], help="instead of the file's")
    _add_lora_args(p)
    p.add_argument("--dimensions", type=int, help="keep the first N dimensions, renormalized (Matryoshka)")
    p.add_argument("--no-normalize", action="store_true", help="raw pooled vectors (no L2 normalization)")
    p.add_argument("--rerank", metavar="QUERY", help="score the texts as documents for QUERY (a reranker)")
    p.set_defaults(func=cmd_embed)
    # options may follow the texts (`minirt embed MODEL --rerank Q doc1 doc2`): this subcommand's
    # arguments are parsed intermixed (argparse's subparser action calls parse_known_args)
    _intermixed(p)

    p = sub.add_parser("info", help="describe a GGUF file or registry model")
    p.add_argument("file", nargs="?", help="path or registry name (default: the default model)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("pull", help="download registry models into $MINIRT_HOME")
    p.add_argument("names", nargs="*")
    p.add_argument("--force", action="store_true", help="pull even if a verified copy exists")
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("models", help="list registry models and their status")
    p.set_defaults(func=cmd_models)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except MinirtError as e:
        sys.stderr.write(f"minirt: error: {e}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("\ninterrupted\n")
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
