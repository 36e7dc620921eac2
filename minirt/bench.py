"""Side-by-side benchmark of minirt against llama.cpp on the same GGUF file.

``minirt bench`` and ``bench/compare.py`` call :func:`main`. What is measured (same file, same
prompt token ids, same thread count; the two runtimes take turns run by run, never together):

========================  =====================================================================
``pp128``, ``pp512``      prompt processing, tok/s, a fresh context every repetition
``tg64``                  decode after a 128-token prompt: tok/s over the generated tokens
                          (greedy, end-of-generation ignored)
``load→1st token``        wall time from spawning a fresh process to its first generated token
``peak RSS``              ``ru_maxrss`` of a fresh process that generates 256 tokens
``tg64 busy``             decode while another process keeps one core busy, with each runtime's
                          default thread count and with the benchmark's thread count, as a
                          share of the same runtime's idle decode
``tg64 / floor``          decode as a share of the bandwidth floor: memory bandwidth / weight
                          bytes streamed per token
========================  =====================================================================

Steady-state tests talk to one persistent worker process per runtime (the model loads once),
driven by JSON lines over stdin/stdout; cold start and peak RSS use fresh processes. The
llama.cpp side runs the ``llama_cpp`` Python package (llama-cpp-python) in whichever
interpreter has it: this one, ``$MINIRT_LLAMA_PYTHON``, or a ``llama-bench`` binary named by
``$MINIRT_LLAMA_BENCH`` (prefill and decode only). When none is found the report says so and
the llama.cpp columns stay empty: no figure is ever made up.

This module is also the worker: ``python -m minirt.bench --worker minirt|llama ...`` runs under
either interpreter (the package's parent on ``PYTHONPATH``), so it imports nothing beyond the
standard library at module level (importing the package itself needs only numpy).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import logging
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("minirt.bench")

SCHEMA = "minirt-bench/1"
REFERENCE_BANDWIDTH_GBS = 90.9  # DESIGN.md: 2-thread streaming read (AVX-512) of the reference machine
COLD_PROMPT_TOKENS = 16
TG_PROMPT_TOKENS = 128
ENV_LLAMA_PYTHON = "MINIRT_LLAMA_PYTHON"
ENV_LLAMA_BENCH = "MINIRT_LLAMA_BENCH"
REQUEST_TIMEOUT_S = 900.0

if __name__ == "__main__":  # a worker under the peer's interpreter, where minirt may not import
    class BenchError(RuntimeError):
        """A benchmark step failed."""
else:
    from .errors import MinirtError

    class BenchError(MinirtError, RuntimeError):  # type: ignore[no-redef]
        """A benchmark step failed (a worker died, timed out, or returned something unusable)."""


# ==============================================================================================
# configuration and results
# ==============================================================================================
@dataclass
class BenchConfig:
    """Everything one benchmark run needs; :func:`config_from_args` builds it from CLI flags."""

    model: str = ""                       # registry name or path, as given
    path: str = ""                        # resolved GGUF path
    n_prompt: list[int] = field(default_factory=lambda: [128, 512])
    n_gen: int = 64
    tg_prompt: int = TG_PROMPT_TOKENS
    repetitions: int = 3
    threads: int = 2
    n_ctx: int = 0                        # 0: large enough for every test
    device: str = "cpu"
    backend: str | None = None
    peer: bool = True
    cold: bool = True                     # load → first token and peak RSS (fresh processes)
    cold_repetitions: int = 3
    cold_prompt: int = COLD_PROMPT_TOKENS
    rss_gen: int = 256
    busy: bool = True
    busy_repetitions: int = 2
    batch: int = 0                        # sequences decoded together in the batched test (0: not run)
    bandwidth: bool = True
    bandwidth_mb: int = 512
    bandwidth_gbs: float | None = None    # given by the user instead of measured
    seed: int = 1234
    quick: bool = False
    llama_python: str | None = None       # overrides $MINIRT_LLAMA_PYTHON
    llama_bench: str | None = None        # overrides $MINIRT_LLAMA_BENCH

    def needed_n_ctx(self) -> int:
        """Positions the longest test uses, plus a little room."""
        return max(max(self.n_prompt, default=0), self.tg_prompt + self.n_gen, self.cold_prompt + self.rss_gen) + 8

    def resolved_n_ctx(self) -> int:
        """``n_ctx`` when given, else the smallest power of two (≥ 256) that fits every test."""
        if self.n_ctx:
            return self.n_ctx
        need = self.needed_n_ctx()
        n = 256
        while n < need:
            n *= 2
        return n


@dataclass
class Peer:
    """How the llama.cpp side is reached (``kind`` None: not available, ``reason`` says why)."""

    kind: str | None                      # "python" | "llama-bench" | None
    python: str | None = None
    llama_bench: str | None = None
    version: str | None = None
    reason: str = ""

    @property
    def available(self) -> bool:
        return self.kind is not None


@dataclass
class Cell:
    """Samples of one runtime on one test; ``median`` is what tables and ratios use."""

    samples: list[float]
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def median(self) -> float:
        return float(statistics.median(self.samples))

    @property
    def stdev(self) -> float:
        return float(statistics.stdev(self.samples)) if len(self.samples) > 1 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"median": self.median, "stdev": self.stdev, "samples": list(self.samples), **self.info}


@dataclass
class Row:
    """One line of the table: a test, its unit, both runtimes and minirt / llama.cpp."""

    test: str
    unit: str
    better: str                           # "higher" | "lower"
    minirt: Cell | None
    llama: Cell | None
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ratio(self) -> float | None:
        if self.minirt is None or self.llama is None or not self.llama.median:
            return None
        return self.minirt.median / self.llama.median

    def to_json(self) -> dict[str, Any]:
        return {"test": self.test, "unit": self.unit, "better": self.better,
                "minirt": self.minirt.to_json() if self.minirt else None,
                "llama_cpp": self.llama.to_json() if self.llama else None,
                "ratio_minirt_over_llama_cpp": self.ratio, "note": self.note, **self.extra}


@dataclass
class BenchReport:
    """The outcome of :func:`run_benchmark`: rows plus everything needed to reproduce them."""

    config: BenchConfig
    peer: Peer
    model: dict[str, Any]
    machine: dict[str, Any]
    rows: list[Row] = field(default_factory=list)
    bandwidth: dict[str, Any] = field(default_factory=dict)
    runtimes: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    command: str = ""
    date: str = ""
    duration_s: float = 0.0
    section_s: dict[str, float] = field(default_factory=dict)  # wall time of each part of the run

    def row(self, test: str) -> Row | None:
        return next((r for r in self.rows if r.test == test), None)

    def to_json(self) -> dict[str, Any]:
        cfg = asdict(self.config)
        return {
            "schema": SCHEMA, "date": self.date, "command": self.command, "duration_s": self.duration_s,
            "section_s": self.section_s,
            "machine": self.machine, "model": self.model, "config": cfg,
            "peer": {"available": self.peer.available, **asdict(self.peer)},
            "runtimes": self.runtimes, "bandwidth": self.bandwidth,
            "results": [r.to_json() for r in self.rows], "notes": self.notes,
        }


# ==============================================================================================
# model facts, prompts, machine, bandwidth
# ==============================================================================================
def weight_bytes_per_token(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Bytes of weights one decoded token streams: every 2-D weight tensor read whole, except the
    token embedding, of which the lookup reads one row; a tied output (no ``output.weight``)
    reads the whole embedding matrix once more. 1-D tensors (norms, biases) are left out."""
    from minirt import gguf

    with gguf.open(path) as f:
        tensors = f.tensors
        tied = "output.weight" not in tensors
        total, matrices = 0, 0
        for name, t in tensors.items():
            if len(t.shape) < 2:
                continue
            if name == "token_embd.weight":
                total += t.nbytes // int(t.shape[0])  # one row per token
                if tied:
                    total += t.nbytes
            else:
                total += t.nbytes
            matrices += 1
        return {"bytes_per_token": int(total), "matrices": matrices, "tied_output": tied}


def model_facts(path: str) -> dict[str, Any]:
    """Name, architecture, size, quant mix and the ids safe to use in random prompts."""
    import numpy as np

    from minirt import gguf

    with gguf.open(path) as f:
        md = f.metadata
        tokens = md.get("tokenizer.ggml.tokens") or []
        types = md.get("tokenizer.ggml.token_type")
        n_tok = len(tokens)
        if types is not None and len(types) == n_tok:
            normal = np.flatnonzero(np.asarray(types) == 1)  # 1 = NORMAL: no control/byte/unused ids
        else:
            normal = np.arange(n_tok)
        special = {md.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "eot", "eom", "unknown", "padding")}
        normal = np.array([i for i in normal.tolist() if i not in special], dtype=np.int64)
        ftype_by_bytes: dict[str, int] = {}
        for t in f.tensors.values():
            ftype_by_bytes[t.qtype] = ftype_by_bytes.get(t.qtype, 0) + t.nbytes
        facts = {
            "path": str(path), "file": Path(path).name, "file_size_bytes": os.path.getsize(path),
            "name": md.get("general.name") or Path(path).stem, "architecture": f.architecture,
            "n_tokens_vocab": n_tok, "quant_bytes": dict(sorted(ftype_by_bytes.items())),
            "parameters": int(sum(t.n_elements for t in f.tensors.values())),
        }
    if len(normal) == 0:
        raise BenchError(f"{path}: no ordinary (non-special) tokens in the vocabulary to build prompts from")
    facts["_prompt_ids"] = normal
    facts.update(weight_bytes_per_token(path))
    return facts


class PromptBank:
    """Seeded random prompts from the ordinary vocabulary; every prompt starts with a token no
    earlier prompt started with, so no runtime can reuse a cached prefix (fresh context)."""

    def __init__(self, allowed_ids: Any, seed: int) -> None:
        import numpy as np

        self.ids = np.asarray(allowed_ids, dtype=np.int64)
        self.rng = np.random.default_rng(seed)
        self.used_first: set[int] = set()

    def draw(self, n: int) -> list[int]:
        out = self.rng.choice(self.ids, size=n).tolist()
        while out[0] in self.used_first and len(self.used_first) < len(self.ids):
            out[0] = int(self.rng.choice(self.ids))
        self.used_first.add(out[0])
        return [int(i) for i in out]


def machine_info() -> dict[str, Any]:
    """CPU model and flags, CPU count, memory, OS, Python, load average (from /proc when present)."""
    info: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version(),
                            "cpus": os.cpu_count()}
    try:
        info["cpus_usable"] = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        pass
    try:
        text = Path("/proc/cpuinfo").read_text()
        for line in text.splitlines():
            if line.startswith("model name") and "cpu" not in info:
                info["cpu"] = line.split(":", 1)[1].strip()
            if line.startswith("flags") and "flags" not in info:
                flags = set(line.split(":", 1)[1].split())
                info["flags"] = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni",
                                             "avx_vnni", "amx_int8", "neon", "asimddp") if f in flags]
    except OSError:
        info.setdefault("cpu", platform.processor() or platform.machine())
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                info["memory_bytes"] = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    info["loadavg_start"] = load_average()
    return info


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def measure_bandwidth(threads: int, megabytes: int = 512, repeats: int = 5) -> dict[str, Any]:
    """Streaming-read bandwidth (GB/s) over a buffer much larger than the caches, best of
    ``repeats`` passes.

    The native probe (:func:`minirt.kernels.native.read_bandwidth`: the ISA's widest integer adds on
    ``threads`` pool threads) is limited by memory alone. Without the native kernels, ``threads``
    Python threads each sum a slice of a float64 array in numpy; its dependent float adds are partly
    compute-bound, so that figure is only a lower bound, and the report says so."""
    import numpy as np

    n = max(1, megabytes) * (1 << 20) // 8
    buf = np.ones(n, dtype=np.float64)  # written once so every page is resident
    try:
        from minirt.kernels import native

        seconds, _ = native.read_bandwidth(buf, threads=threads, reps=repeats)
        isa = native.info()["isa"]
        return {"gbs": n * 8 / seconds / 1e9,
                "method": f"native streaming read ({isa}) over {megabytes} MiB in {threads} thread(s), "
                          f"best of {repeats}",
                "megabytes": megabytes, "threads": threads}
    except Exception as e:  # noqa: BLE001 - any native failure falls back to the numpy lower bound
        why = f"{type(e).__name__}: {e}"
    parts = np.array_split(buf, max(1, threads))
    best = 0.0
    for _ in range(repeats):
        ths = [threading.Thread(target=np.add.reduce, args=(p,)) for p in parts]
        t0 = time.perf_counter()
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        dt = time.perf_counter() - t0
        best = max(best, buf.nbytes / dt / 1e9)
    del buf, parts
    log.warning("native bandwidth probe unavailable (%s); numpy float64 sum used (a lower bound)", why)
    return {"gbs": best, "megabytes": megabytes, "threads": threads,
            "method": f"numpy float64 sum over {megabytes} MiB in {threads} thread(s), best of {repeats} "
                      f"(native probe unavailable: {why}; compute-bound, a lower bound of the bandwidth)"}


def _warm_page_cache(path: str) -> None:
    """Read the file once so every cold-start process finds it in the page cache (the condition
    the cold-start figures describe: a fresh process, a warm file)."""
    with open(path, "rb", buffering=0) as f:
        while f.read(8 << 20):
            pass


# ==============================================================================================
# finding llama.cpp
# ==============================================================================================
def _probe_python(python: str) -> tuple[str | None, str]:
    """(llama_cpp version, "") when ``python`` can import llama_cpp, else (None, why not)."""
    if not (shutil.which(python) or os.path.isfile(python)):
        return None, f"{python} does not exist"
    try:
        r = subprocess.run([python, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                           capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"{python}: {e}"
    if r.returncode != 0:
        return None, f"{python} cannot import llama_cpp ({(r.stderr.strip().splitlines() or ['?'])[-1]})"
    return r.stdout.strip() or "unknown", ""


def find_peer(enabled: bool = True, llama_python: str | None = None, llama_bench: str | None = None,
              env: dict[str, str] | None = None, try_current: bool = True) -> Peer:
    """Locate llama.cpp: ``import llama_cpp`` here, else the interpreter named by
    ``$MINIRT_LLAMA_PYTHON`` (or ``llama_python``), else the ``llama-bench`` binary named by
    ``$MINIRT_LLAMA_BENCH`` (or ``llama_bench``). The returned :class:`Peer` says why not when
    none is usable."""
    if not enabled:
        return Peer(None, reason="disabled (--no-peer)")
    env = os.environ if env is None else env
    tried: list[str] = []
    if try_current:
        try:
            import llama_cpp  # noqa: F401

            return Peer("python", python=sys.executable,
                        version=f"llama-cpp-python {getattr(llama_cpp, '__version__', 'unknown')}")
        except Exception as e:  # ImportError, or a broken native library
            tried.append(f"this interpreter cannot import llama_cpp ({type(e).__name__})")
    py = llama_python or env.get(ENV_LLAMA_PYTHON)
    if py:
        version, why = _probe_python(py)
        if version:
            return Peer("python", python=py, version=f"llama-cpp-python {version}")
        tried.append(why)
    else:
        tried.append(f"${ENV_LLAMA_PYTHON} not set")
    lb = llama_bench or env.get(ENV_LLAMA_BENCH)
    if lb:
        exe = shutil.which(lb) or (lb if os.access(lb, os.X_OK) else None)
        if exe:
            return Peer("llama-bench", llama_bench=exe, version="llama-bench")
        tried.append(f"{lb} is not an executable")
    else:
        tried.append(f"${ENV_LLAMA_BENCH} not set")
    return Peer(None, reason="llama.cpp not found: " + "; ".join(tried) +
                f". Point {ENV_LLAMA_PYTHON} at a Python with llama-cpp-python installed "
                f"(e.g. /path/to/venv/bin/python) or {ENV_LLAMA_BENCH} at a llama-bench binary.")


# ==============================================================================================
# runners: one persistent worker process per runtime, or llama-bench
# ==============================================================================================
def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    pkg_parent = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = pkg_parent + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _worker_cmd(runtime: str, python: str, cfg: BenchConfig, threads: int | None, once: bool = False) -> list[str]:
    # run as a module (PYTHONPATH names the package's parent): a script path would put minirt/ itself
    # first on sys.path, where minirt/gguf.py shadows the gguf package
    cmd = [python, "-m", "minirt.bench", "--worker", runtime, "--model", cfg.path, "--n-ctx", str(cfg.resolved_n_ctx()),
           "--threads", str(threads or 0)]
    if runtime == "minirt":
        cmd += ["--device", cfg.device]
        if cfg.backend:
            cmd += ["--backend", cfg.backend]
    if once:
        cmd.append("--once")
    return cmd


def _tail(path: str, n: int = 2000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - n))
            return f.read().decode("utf-8", "replace").strip()
    except OSError:
        return ""


class WorkerRunner:
    """A persistent worker process (model loaded once) answering JSON-line requests."""

    def __init__(self, runtime: str, python: str, cfg: BenchConfig, threads: int | None, label: str) -> None:
        self.runtime, self.label = runtime, label
        self._err = tempfile.NamedTemporaryFile(prefix=f"minirt-bench-{runtime}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(_worker_cmd(runtime, python, cfg, threads), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._err, env=_worker_env(), text=True,
                                     bufsize=1)
        try:
            self.info = self._read(timeout=REQUEST_TIMEOUT_S)
        except BaseException:
            self.close()
            raise

    def _read(self, timeout: float) -> dict[str, Any]:
        timer = threading.Timer(timeout, self.proc.kill)
        timer.start()
        try:
            line = self.proc.stdout.readline() if self.proc.stdout else ""
        finally:
            timer.cancel()
        if not line:
            self.proc.wait(timeout=30)
            raise BenchError(f"{self.label} worker exited (status {self.proc.returncode}): {_tail(self._err.name)}")
        try:
            msg = json.loads(line)
        except json.JSONDecodeError:
            raise BenchError(f"{self.label} worker sent a malformed reply: {line[:200]!r}") from None
        if not msg.get("ok"):
            raise BenchError(f"{self.label} worker: {msg.get('error')}")
        return msg

    def request(self, op: str, timeout: float = REQUEST_TIMEOUT_S, **kw: Any) -> dict[str, Any]:
        if self.proc.poll() is not None or not self.proc.stdin:
            raise BenchError(f"{self.label} worker is not running: {_tail(self._err.name)}")
        try:
            self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            raise BenchError(f"{self.label} worker: {e}: {_tail(self._err.name)}") from e
        return self._read(timeout)

    def pp(self, ids: list[int]) -> float:
        """Prompt tok/s for ``ids`` in a fresh context."""
        r = self.request("pp", ids=ids)
        if r.get("cached"):
            raise BenchError(f"{self.label}: {r['cached']} prompt tokens came from a cache; "
                             "the test needs a fresh context")
        return len(ids) / r["prompt_s"]

    def tg(self, ids: list[int], n_gen: int) -> dict[str, Any]:
        """Decode tok/s over ``n_gen`` greedy tokens after prompt ``ids``, and the tokens."""
        r = self.request("tg", ids=ids, n_gen=n_gen)
        if r["n_gen"] != n_gen:
            raise BenchError(f"{self.label}: generated {r['n_gen']} tokens instead of {n_gen}")
        return r

    def tgb(self, prompts: list[list[int]], n_gen: int) -> float:
        """Aggregate decode tok/s of ``len(prompts)`` sequences decoded together (one forward pass
        per step for all of them), ``n_gen`` greedy tokens each, after their prompts."""
        r = self.request("tgb", prompts=prompts, n_gen=n_gen)
        if r["n_gen"] != len(prompts) * n_gen:
            raise BenchError(f"{self.label}: generated {r['n_gen']} tokens instead of {len(prompts) * n_gen}")
        return r["decode_tok_s"]

    def close(self) -> None:
        try:
            if self.proc.poll() is None and self.proc.stdin:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired, ValueError):
            pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for s in (self.proc.stdin, self.proc.stdout):
            try:
                if s:
                    s.close()
            except OSError:
                pass
        self._err.close()
        try:
            os.unlink(self._err.name)
        except OSError:
            pass


class LlamaBenchRunner:
    """llama.cpp through its ``llama-bench`` tool (one invocation per measurement). It draws its
    own prompt tokens, so only the lengths match minirt's prompts; no cold-start or RSS test."""

    def __init__(self, exe: str, cfg: BenchConfig, threads: int | None, label: str) -> None:
        self.exe, self.cfg, self.threads, self.label = exe, cfg, threads, label
        self.depth_ok = True
        self.info = {"runtime": "llama.cpp (llama-bench)", "threads": threads or "default", "binary": exe}

    def _run(self, extra: list[str]) -> list[dict[str, Any]]:
        cmd = [self.exe, "-m", self.cfg.path, "-r", "1", "-o", "jsonl", *extra]
        if self.threads:
            cmd += ["-t", str(self.threads)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=REQUEST_TIMEOUT_S)
        if r.returncode != 0:
            raise BenchError(f"{' '.join(cmd)} failed (exit {r.returncode}): {r.stderr.strip()[-1000:]}")
        return parse_llama_bench_jsonl(r.stdout)

    def pp(self, ids: list[int]) -> float:
        rows = self._run(["-p", str(len(ids)), "-n", "0"])
        return _llama_bench_ts(rows, n_prompt=len(ids), n_gen=0)

    def tgb(self, prompts: list[list[int]], n_gen: int) -> float:
        raise BenchError("llama-bench has no batched decode of separate sequences here; use llama-cpp-python")

    def tg(self, ids: list[int], n_gen: int) -> dict[str, Any]:
        if self.depth_ok:
            try:  # decode at depth len(ids), as the worker measures it
                rows = self._run(["-p", "0", "-n", str(n_gen), "-d", str(len(ids))])
                return {"gen_tok_s": _llama_bench_ts(rows, n_prompt=0, n_gen=n_gen), "ids": None}
            except BenchError:
                self.depth_ok = False  # an older llama-bench without -d: decode from an empty context
                log.warning("llama-bench does not accept -d; decode is measured from an empty context")
        rows = self._run(["-p", "0", "-n", str(n_gen)])
        return {"gen_tok_s": _llama_bench_ts(rows, n_prompt=0, n_gen=n_gen), "ids": None}

    def close(self) -> None:
        pass


def parse_llama_bench_jsonl(text: str) -> list[dict[str, Any]]:
    """Rows of ``llama-bench -o jsonl`` output (other lines ignored)."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def _llama_bench_ts(rows: list[dict[str, Any]], n_prompt: int, n_gen: int) -> float:
    for r in rows:
        if int(r.get("n_prompt", -1)) == n_prompt and int(r.get("n_gen", -1)) == n_gen:
            samples = r.get("samples_ts") or [r.get("avg_ts")]
            return float(statistics.median(float(s) for s in samples))
    raise BenchError(f"llama-bench output has no row for n_prompt={n_prompt} n_gen={n_gen}")


def cold_run(runtime: str, python: str, cfg: BenchConfig, ids: list[int], n_gen: int,
             threads: int | None) -> dict[str, Any]:
    """Spawn a fresh worker that loads the model and generates ``n_gen`` tokens after ``ids``.
    Returns seconds from spawn to the first token (and its parts) and the child's peak RSS."""
    err = tempfile.NamedTemporaryFile(prefix=f"minirt-bench-cold-{runtime}-", suffix=".log", delete=False)
    try:
        t0 = time.time()
        p = subprocess.Popen(_worker_cmd(runtime, python, cfg, threads, once=True), stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=err, env=_worker_env(), text=True)
        timer = threading.Timer(REQUEST_TIMEOUT_S, p.kill)
        timer.start()
        try:
            assert p.stdin and p.stdout
            p.stdin.write(json.dumps({"ids": ids, "n_gen": n_gen}) + "\n")
            p.stdin.close()
            out = p.stdout.read()
            p.stdout.close()
            # wait4 instead of Popen.wait: the child's own rusage carries its ru_maxrss
            _, status, ru = os.wait4(p.pid, 0)
            p.returncode = os.waitstatus_to_exitcode(status)
        finally:
            timer.cancel()
        msgs = [json.loads(x) for x in out.splitlines() if x.strip().startswith("{")]
        if p.returncode != 0 or not msgs or not msgs[-1].get("ok"):
            why = msgs[-1].get("error") if msgs else _tail(err.name)
            raise BenchError(f"{runtime} cold run failed (status {p.returncode}): {why}")
        m = msgs[-1]
        if m["n_gen"] != n_gen:
            raise BenchError(f"{runtime} cold run generated {m['n_gen']} tokens instead of {n_gen}")
        # ru_maxrss is KiB on Linux, bytes on macOS. On Linux it also carries the high-water mark
        # of the parent's memory at fork time (exec keeps the larger of the two), so the child's
        # own VmHWM, read just before it exits, is preferred.
        ru_rss = ru.ru_maxrss * (1 if sys.platform == "darwin" else 1024)
        rss = m.get("vm_hwm_bytes") or ru_rss
        return {"first_token_s": m["t_first"] - t0, "startup_s": m["t_entry"] - t0,
                "load_s": m["t_loaded"] - m["t_entry"], "prefill_first_s": m["t_first"] - m["t_loaded"],
                "peak_rss_bytes": int(rss), "ru_maxrss_bytes": int(ru_rss),
                "rss_source": "VmHWM" if m.get("vm_hwm_bytes") else "ru_maxrss"}
    finally:
        err.close()
        try:
            os.unlink(err.name)
        except OSError:
            pass


class BusyCore:
    """A process spinning on one core for the duration of a ``with`` block."""

    def __enter__(self) -> BusyCore:
        self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        time.sleep(0.5)  # let it get scheduled before measuring
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.kill()
        self.proc.wait()


# ==============================================================================================
# the benchmark
# ==============================================================================================
Progress = Callable[[str], None]


def _alternate(rep: int, pair: Sequence[Any]) -> list[Any]:
    """Run order for repetition ``rep``: minirt first on even reps, llama.cpp first on odd ones."""
    return list(pair) if rep % 2 == 0 else list(pair)[::-1]


def _default_llama_threads() -> int:
    # llama-cpp-python's own default for n_threads (decode): half the logical CPUs
    return max((os.cpu_count() or 2) // 2, 1)


def run_benchmark(cfg: BenchConfig, progress: Progress | None = None, peer: Peer | None = None) -> BenchReport:
    """Run every enabled test and return the :class:`BenchReport` (nothing is printed)."""
    say = progress or (lambda msg: log.info("%s", msg))
    t_start = time.perf_counter()
    if peer is None:
        peer = find_peer(cfg.peer, cfg.llama_python, cfg.llama_bench)
    facts = model_facts(cfg.path)
    bank = PromptBank(facts.pop("_prompt_ids"), cfg.seed)
    report = BenchReport(config=cfg, peer=peer, model=facts, machine=machine_info(),
                         date=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    if not peer.available:
        report.notes.append(peer.reason)
    load0 = report.machine.get("loadavg_start")
    if load0 and load0[0] > 0.5:
        report.notes.append(f"the machine was not idle (1-minute load average {load0[0]} at start): figures are noisy")
    n_ctx = cfg.resolved_n_ctx()
    say(f"model {facts['name']} ({facts['file']}), {cfg.threads} threads, n_ctx {n_ctx}; "
        f"llama.cpp: {peer.version if peer.available else 'not available'}")

    # -- bandwidth floor first, while nothing of ours runs ----------------------------------------
    if cfg.bandwidth:
        if cfg.bandwidth_gbs:
            report.bandwidth = {"gbs": cfg.bandwidth_gbs, "method": "given on the command line"}
        else:
            say(f"measuring memory bandwidth ({cfg.bandwidth_mb} MiB, {cfg.threads} threads)")
            report.bandwidth = measure_bandwidth(cfg.threads, cfg.bandwidth_mb)
        report.bandwidth["reference_gbs"] = REFERENCE_BANDWIDTH_GBS
        bpt = facts["bytes_per_token"]
        report.bandwidth["bytes_per_token"] = bpt
        report.bandwidth["floor_tok_s"] = report.bandwidth["gbs"] * 1e9 / bpt
        report.bandwidth["reference_floor_tok_s"] = REFERENCE_BANDWIDTH_GBS * 1e9 / bpt

    _warm_page_cache(cfg.path)
    python_for = {"minirt": sys.executable}
    if peer.kind == "python":
        python_for["llama"] = peer.python  # type: ignore[assignment]

    def section(name: str, fn: Callable[[], Any]) -> bool:
        # one failing section (a worker that cannot load, a timeout) is reported, not fatal
        t0 = time.perf_counter()
        try:
            fn()
            return True
        except BenchError as e:
            report.notes.append(f"{name} failed: {e}")
            say(f"{name} failed: {e}")
            return False
        finally:
            report.section_s[name] = round(time.perf_counter() - t0, 1)

    # -- cold start and peak RSS: fresh processes, alternating ------------------------------------
    if cfg.cold:
        section("cold start / peak RSS", lambda: _cold_tests(cfg, report, bank, python_for, say))

    # -- steady state: persistent workers ----------------------------------------------------------
    runners: dict[str, Any] = {}
    try:
        def start_minirt() -> None:
            say("starting minirt worker")
            runners["minirt"] = WorkerRunner("minirt", sys.executable, cfg, cfg.threads, "minirt")
            report.runtimes["minirt"] = runners["minirt"].info

        if section("minirt worker start", start_minirt):
            peer_ok = _start_peer(cfg, peer, report, runners, "llama", cfg.threads, say)
            section("prefill / decode", lambda: _steady_tests(cfg, report, bank, runners, peer_ok, say))
            if cfg.busy:
                section("busy-core decode", lambda: _busy_tests(cfg, report, bank, runners, peer, say))
    finally:
        for r in runners.values():
            r.close()
    report.machine["loadavg_end"] = load_average()
    report.duration_s = time.perf_counter() - t_start
    return report


def _start_peer(cfg: BenchConfig, peer: Peer, report: BenchReport, runners: dict[str, Any], key: str,
                threads: int | None, say: Progress) -> bool:
    if not peer.available:
        return False
    try:
        say(f"starting llama.cpp worker ({'default' if not threads else threads} threads)")
        if peer.kind == "python":
            runners[key] = WorkerRunner("llama", peer.python or sys.executable, cfg, threads, "llama.cpp")
        else:
            runners[key] = LlamaBenchRunner(peer.llama_bench or "llama-bench", cfg, threads, "llama.cpp")
        report.runtimes[key.replace("llama", "llama_cpp")] = runners[key].info
        return True
    except BenchError as e:
        report.notes.append(f"llama.cpp worker failed to start: {e}")
        say(f"llama.cpp worker failed to start: {e}")
        return False


def _sample_pair(rep: int, funcs: dict[str, Callable[[], Any]], report: BenchReport, test: str) -> dict[str, Any]:
    """Run minirt and llama.cpp once each in this rep's order; a peer failure is noted, not fatal."""
    out: dict[str, Any] = {}
    for side in _alternate(rep, [k for k in ("minirt", "llama") if k in funcs]):
        try:
            out[side] = funcs[side]()
        except BenchError as e:
            if side == "minirt":
                raise
            report.notes.append(f"llama.cpp failed on {test}: {e}")
            out[side] = None
    return out


def _steady_tests(cfg: BenchConfig, report: BenchReport, bank: PromptBank, runners: dict[str, Any],
                  peer_ok: bool, say: Progress) -> None:
    sides = ["minirt"] + (["llama"] if peer_ok else [])
    # warm-up (JIT compilation, first-touch of buffers, the threadpool): not measured
    for side in list(sides):
        try:
            runners[side].pp(bank.draw(min(cfg.n_prompt + [cfg.tg_prompt])))
            runners[side].tg(bank.draw(8), 4)
        except BenchError as e:
            if side == "minirt":
                raise
            report.notes.append(f"llama.cpp failed its warm-up: {e}")
            sides.remove(side)
    for n in cfg.n_prompt:
        samples: dict[str, list[float]] = {s: [] for s in sides}
        for rep in range(cfg.repetitions):
            say(f"pp{n} rep {rep + 1}/{cfg.repetitions}")
            ids = bank.draw(n)
            got = _sample_pair(rep, {s: (lambda s=s, ids=ids: runners[s].pp(ids)) for s in sides}, report, f"pp{n}")
            for s, v in got.items():
                if v is not None:
                    samples[s].append(v)
        report.rows.append(_row(f"pp{n}", "tok/s", "higher", samples))
    samples = {s: [] for s in sides}
    agree: list[int] = []
    for rep in range(cfg.repetitions):
        say(f"tg{cfg.n_gen} rep {rep + 1}/{cfg.repetitions}")
        ids = bank.draw(cfg.tg_prompt)
        got = _sample_pair(rep, {s: (lambda s=s, ids=ids: runners[s].tg(ids, cfg.n_gen)) for s in sides}, report, "tg")
        for s, v in got.items():
            if v is not None:
                samples[s].append(v["gen_tok_s"])
        if got.get("minirt") and got.get("llama") and got["llama"].get("ids") is not None:
            a, b = got["minirt"]["ids"], got["llama"]["ids"]
            agree.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
    row = _row(f"tg{cfg.n_gen}", "tok/s", "higher", samples, note=f"after a {cfg.tg_prompt}-token prompt")
    if agree:
        row.extra["greedy_agreement_tokens"] = agree  # leading generated tokens identical on both sides
    report.rows.append(row)
    if cfg.batch:
        _batch_tests(cfg, report, bank, runners, sides, samples, say)
    if cfg.bandwidth and report.bandwidth:
        floor = report.bandwidth["floor_tok_s"]
        share = {s: [v / floor for v in vals] for s, vals in samples.items() if vals}
        report.rows.append(_row(f"tg{cfg.n_gen} / floor", "share", "higher", share,
                                note=f"floor {floor:.1f} tok/s = {report.bandwidth['gbs']:.1f} GB/s / "
                                     f"{_fmt_bytes(report.bandwidth['bytes_per_token'])} per token"))


def _batch_tests(cfg: BenchConfig, report: BenchReport, bank: PromptBank, runners: dict[str, Any], sides: list[str],
                  single: dict[str, list[float]], say: Progress) -> None:
    """Batched decode: cfg.batch sequences with their own prompts decoded together, aggregate tok/s,
    and each runtime's scaling over its own single-sequence decode (the tg row, same minutes)."""
    agg: dict[str, list[float]] = {s: [] for s in sides}
    for rep in range(cfg.repetitions):
        say(f"tg{cfg.n_gen} x{cfg.batch} sequences rep {rep + 1}/{cfg.repetitions}")
        prompts = [bank.draw(cfg.tg_prompt) for _ in range(cfg.batch)]
        funcs = {s: (lambda s=s, prompts=prompts: runners[s].tgb(prompts, cfg.n_gen)) for s in sides}
        got = _sample_pair(rep, funcs, report, f"tg x{cfg.batch}")
        for s, v in got.items():
            if v is not None:
                agg[s].append(v)
    row = _row(f"tg{cfg.n_gen} x{cfg.batch} seqs", "tok/s", "higher", agg,
               note=f"aggregate decode of {cfg.batch} sequences sharing each forward pass")
    row.extra["scaling_over_single"] = {s.replace("llama", "llama_cpp"):
                                        statistics.median(agg[s]) / statistics.median(single[s])
                                        for s in sides if agg[s] and single.get(s)}
    report.rows.append(row)
    sc = row.extra["scaling_over_single"]
    if sc:
        report.notes.append(f"{cfg.batch} sequences decoded together vs one: "
                            + ", ".join(f"{k} {v:.2f}×" for k, v in sc.items()))


def _row(test: str, unit: str, better: str, samples: dict[str, list[float]], note: str = "") -> Row:
    m, lc = samples.get("minirt"), samples.get("llama")
    return Row(test, unit, better, Cell(m) if m else None, Cell(lc) if lc else None, note)


def _cold_tests(cfg: BenchConfig, report: BenchReport, bank: PromptBank, python_for: dict[str, str],
                say: Progress) -> None:
    sides = [s for s in ("minirt", "llama") if s in python_for]
    ids = bank.draw(cfg.cold_prompt)
    ttft: dict[str, list[float]] = {s: [] for s in sides}
    rss: dict[str, list[float]] = {s: [] for s in sides}
    parts: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
    rss_src: dict[str, list[str]] = {s: [] for s in sides}
    for rep in range(cfg.cold_repetitions):
        say(f"cold start + peak RSS rep {rep + 1}/{cfg.cold_repetitions}")
        funcs = {s: (lambda s=s: cold_run(s, python_for[s], cfg, ids, cfg.rss_gen, cfg.threads)) for s in sides}
        for s, r in _sample_pair(rep, funcs, report, "cold start").items():
            if r is None:
                continue
            ttft[s].append(r["first_token_s"])
            rss[s].append(r["peak_rss_bytes"] / 2**20)
            parts[s].append({k: r[k] for k in ("startup_s", "load_s", "prefill_first_s")})
            rss_src[s].append(r["rss_source"])
    row = _row("load→1st token", "s", "lower", ttft,
               note=f"fresh process, {cfg.cold_prompt}-token prompt, warm page cache")
    row.extra["parts"] = {k.replace("llama", "llama_cpp"): v for k, v in parts.items()}
    report.rows.append(row)
    row = _row(f"peak RSS gen{cfg.rss_gen}", "MiB", "lower", rss,
               note=f"peak resident set of a fresh process generating {cfg.rss_gen} tokens")
    row.extra["rss_source"] = {k.replace("llama", "llama_cpp"): sorted(set(v)) for k, v in rss_src.items()}
    report.rows.append(row)
    if "llama" not in sides and report.peer.kind == "llama-bench":
        report.notes.append("cold start and peak RSS are not measured through llama-bench")


def _busy_tests(cfg: BenchConfig, report: BenchReport, bank: PromptBank, runners: dict[str, Any],
                peer: Peer, say: Progress) -> None:
    """Decode with one core kept busy: each runtime's default threads and cfg.threads, each
    compared with the same configuration's idle decode."""
    idle_row = report.row(f"tg{cfg.n_gen}")
    say("starting default-thread workers for the busy-core test")
    try:
        runners["minirt_default"] = WorkerRunner("minirt", sys.executable, cfg, None, "minirt (default threads)")
        report.runtimes["minirt_default_threads"] = runners["minirt_default"].info
    except BenchError as e:
        report.notes.append(f"minirt with default threads failed to start: {e}")
    have_peer = "llama" in runners
    if have_peer:
        have_peer = _start_peer(cfg, peer, report, runners, "llama_default", None, say)
    configs = [("default", {"minirt": "minirt_default", "llama": "llama_default"}),
               (f"t={cfg.threads}", {"minirt": "minirt", "llama": "llama"})]
    idle: dict[str, dict[str, list[float]]] = {}
    # the default-thread workers' idle decode (the explicit-thread idle decode is the tg row)
    keys = {s: k for s, k in configs[0][1].items() if k in runners}
    for k in keys.values():
        runners[k].tg(bank.draw(8), 4)  # warm-up
    idle["default"] = {s: [] for s in keys}
    for rep in range(cfg.busy_repetitions):
        say(f"idle decode, default threads, rep {rep + 1}/{cfg.busy_repetitions}")
        ids = bank.draw(cfg.tg_prompt)
        got = _sample_pair(rep, {s: (lambda k=k, ids=ids: runners[k].tg(ids, cfg.n_gen)) for s, k in keys.items()},
                           report, "idle decode (default threads)")
        for s, v in got.items():
            if v is not None:
                idle["default"][s].append(v["gen_tok_s"])
    if idle_row is not None:
        idle[f"t={cfg.threads}"] = {"minirt": idle_row.minirt.samples if idle_row.minirt else [],
                                    "llama": idle_row.llama.samples if idle_row.llama else []}
    busy: dict[str, dict[str, list[float]]] = {name: {s: [] for s in m if m[s] in runners} for name, m in configs}
    with BusyCore():
        for rep in range(cfg.busy_repetitions):
            for name, m in configs:
                say(f"decode with one core busy, {name}, rep {rep + 1}/{cfg.busy_repetitions}")
                ids = bank.draw(cfg.tg_prompt)
                funcs = {s: (lambda k=m[s], ids=ids: runners[k].tg(ids, cfg.n_gen)) for s in m if m[s] in runners}
                for s, v in _sample_pair(rep, funcs, report, f"busy decode {name}").items():
                    if v is not None:
                        busy[name][s].append(v["gen_tok_s"])
    for name, m in configs:
        row = _row(f"tg{cfg.n_gen} busy {name}", "tok/s", "higher", busy[name])
        threads = {}
        for s, k in m.items():
            if k in runners:
                threads[s.replace("llama", "llama_cpp")] = _threads_of(runners[k].info, s)
        row.extra["threads"] = threads
        row.note = "one other core busy; " + ", ".join(f"{s} {t} threads" for s, t in threads.items())
        for s, cell in (("minirt", row.minirt), ("llama", row.llama)):
            base = idle.get(name, {}).get(s) or []
            if cell is not None and base:
                cell.info["idle_median"] = float(statistics.median(base))
                cell.info["vs_idle"] = cell.median / cell.info["idle_median"]
        report.rows.append(row)


def _threads_of(info: dict[str, Any], side: str) -> Any:
    t = info.get("threads")
    if t:
        return t
    return _default_llama_threads() if side == "llama" else "default"


# ==============================================================================================
# output
# ==============================================================================================
def _fmt_num(v: float, unit: str) -> str:
    if unit == "share":
        return f"{100 * v:.0f}%"
    if unit == "s":
        return f"{v:.2f}"
    if unit == "MiB":
        return f"{v:.0f}"
    return f"{v:.1f}" if abs(v) >= 100 else f"{v:.2f}"


def _fmt_bytes(n: float) -> str:
    return f"{n / 1e6:.0f} MB" if n >= 10e6 else f"{n / 1e3:.1f} kB"


def _fmt_cell(c: Cell | None, unit: str) -> str:
    if c is None:
        return "n/a"
    s = _fmt_num(c.median, unit)
    if len(c.samples) > 1 and unit != "share":
        s += f" ± {_fmt_num(c.stdev, unit)}"
    if "vs_idle" in c.info:
        s += f" ({c.info['vs_idle']:.2f}× idle)"
    return s


def _model_label(report: BenchReport) -> str:
    name = report.config.model or report.model.get("name", "")
    if name.endswith(".gguf") or os.sep in name:
        name = Path(name).name
    return name if len(name) <= 32 else name[:31] + "…"


def table_rows(report: BenchReport) -> list[list[str]]:
    """Cells of the result table: model, test, unit, minirt, llama.cpp, minirt / llama.cpp."""
    out = []
    for r in report.rows:
        ratio = r.ratio
        out.append([_model_label(report), r.test, r.unit + (" ↓" if r.better == "lower" else ""),
                    _fmt_cell(r.minirt, r.unit), _fmt_cell(r.llama, r.unit),
                    f"{ratio:.2f}×" if ratio is not None else "—"])
    return out


HEADER = ["model", "test", "unit", "minirt", "llama.cpp", "minirt / llama.cpp"]


def format_table(report: BenchReport) -> str:
    """The llama-bench-like table (Markdown pipe syntax, aligned for a terminal)."""
    rows = table_rows(report)
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(HEADER)]
    right = {3, 4, 5}

    def line(cells: list[str]) -> str:
        padded = (c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
        return "| " + " | ".join(padded) + " |"

    sep = "| " + " | ".join(("-" * (w - 1) + ":") if i in right else "-" * w for i, w in enumerate(widths)) + " |"
    return "\n".join([line(HEADER), sep, *(line(r) for r in rows)])


def format_summary(report: BenchReport) -> str:
    """Header lines (what ran where) + the table + the notes."""
    c, m = report.config, report.model
    lines = [f"model: {m['name']} ({m['file']}, {_fmt_bytes(m['file_size_bytes'])}, {m['architecture']}); "
             f"{_fmt_bytes(m['bytes_per_token'])} of weights streamed per decoded token"]
    rt = report.runtimes.get("minirt", {})
    backend = rt.get("backend", "?")
    if isinstance(backend, dict):
        backend = backend.get("backend", "?")
    lines.append(f"minirt {rt.get('version', '?')}: device {rt.get('device', c.device)}, backend {backend}, "
                 f"{c.threads} threads, n_ctx {c.resolved_n_ctx()}")
    if report.peer.available:
        lines.append(f"llama.cpp: {report.peer.version} ({report.peer.python or report.peer.llama_bench}), "
                     f"{c.threads} threads")
    else:
        lines.append(f"llama.cpp: NOT MEASURED — {report.peer.reason}")
    lines.append(f"medians of {_reps_text(c)}, runtimes alternating; ratio = minirt / llama.cpp (↓: lower is better)")
    out = "\n".join(lines) + "\n\n" + format_table(report) + "\n"
    bw = report.bandwidth
    if bw:
        out += (f"\nbandwidth floor: {bw['gbs']:.1f} GB/s measured ({bw.get('method', '')}) / "
                f"{_fmt_bytes(bw['bytes_per_token'])} per token = {bw['floor_tok_s']:.1f} tok/s; "
                f"at the reference {bw['reference_gbs']} GB/s: {bw['reference_floor_tok_s']:.1f} tok/s\n")
    tg = report.row(f"tg{c.n_gen}")
    if tg is not None and "greedy_agreement_tokens" in tg.extra:
        out += f"greedy tokens identical before the first difference (per rep): {tg.extra['greedy_agreement_tokens']}\n"
    for n in report.notes:
        out += f"note: {n}\n"
    out += f"({report.duration_s:.0f} s)\n"
    return out


def _reps_text(c: BenchConfig) -> str:
    extra = ([f"{c.cold_repetitions} for cold start/RSS"] if c.cold else []) + \
            ([f"{c.busy_repetitions} busy-core"] if c.busy else [])
    return f"{c.repetitions} runs" + (f" ({', '.join(extra)})" if extra else "")


def format_markdown(report: BenchReport) -> str:
    """A block ready to paste into bench/RESULTS.md: machine, command, date, table, notes."""
    mc, c = report.machine, report.config
    mem = f"{mc['memory_bytes'] / 2**30:.1f} GiB RAM" if mc.get("memory_bytes") else "RAM unknown"
    flags = ", ".join(mc.get("flags", [])) or "no SIMD flags read"
    cpus = mc.get("cpus_usable", mc.get("cpus"))
    lines = [f"### {report.model['name']} — {report.date}", "",
             f"- machine: {mc.get('cpu', '?')}, {cpus} CPUs ({flags}), {mem}, {mc.get('platform')}, "
             f"Python {mc.get('python')}",
             f"- load average at start / end: {mc.get('loadavg_start')} / {mc.get('loadavg_end')}",
             f"- command: `{report.command}`",
             f"- model file: `{report.model['file']}` ({_fmt_bytes(report.model['file_size_bytes'])}), "
             f"{_fmt_bytes(report.model['bytes_per_token'])} of weights per decoded token",
             f"- minirt {report.runtimes.get('minirt', {}).get('version', '?')} "
             f"({_backend_name(report.runtimes.get('minirt', {}))}, {c.threads} threads); "
             + (f"llama.cpp via {report.peer.version}" if report.peer.available
                else f"llama.cpp not measured: {report.peer.reason}"),
             f"- medians of {_reps_text(c)}, minirt and llama.cpp alternating; ratio = minirt / llama.cpp; "
             f"↓ lower is better",
             "", format_table(report), ""]
    bw = report.bandwidth
    if bw:
        lines.append(f"Bandwidth floor: {bw['gbs']:.1f} GB/s ({bw.get('method', '')}) → {bw['floor_tok_s']:.1f} tok/s; "
                     f"at {bw['reference_gbs']} GB/s → {bw['reference_floor_tok_s']:.1f} tok/s.")
    for n in report.notes:
        lines.append(f"Note: {n}")
    return "\n".join(lines) + "\n"


def _backend_name(rt: dict[str, Any]) -> str:
    b = rt.get("backend")
    if isinstance(b, dict):
        return f"{rt.get('device', 'cpu')}/{b.get('backend', '?')}"
    return str(b or "?")


# ==============================================================================================
# CLI entry points
# ==============================================================================================
def add_arguments(p: argparse.ArgumentParser, model_args: bool = True) -> None:
    """Flags of the benchmark. ``minirt bench`` defines a subset; :func:`main` defaults the rest."""
    if model_args:
        p.add_argument("-m", "--model", help="registry name or GGUF path (default: the registry default)")
        p.add_argument("-c", "--ctx", type=int, help="context size (default: large enough for every test)")
        p.add_argument("-t", "--threads", type=int, help="threads for both runtimes (default: usable CPUs)")
        p.add_argument("--device", choices=["auto", "cpu", "cuda"], help="minirt device (default cpu, like the peer)")
        p.add_argument("--backend", choices=["auto", "native", "numba", "reference"], help="minirt CPU kernels")
        p.add_argument("-p", "--n-prompt", type=int, action="append", help="prompt lengths (default 128 512)")
        p.add_argument("-g", "--n-gen", type=int, help="tokens to decode (default 64)")
        p.add_argument("-r", "--repetitions", type=int, help="repetitions per test (default 3)")
        p.add_argument("--no-peer", action="store_true", help="do not run llama.cpp")
        p.add_argument("--json", help="also write results to this file")
    p.add_argument("--quick", action="store_true", help="one repetition, pp128 only, shorter decode (a smoke run)")
    p.add_argument("--markdown", action="store_true", help="also print a block for bench/RESULTS.md")
    p.add_argument("--skip", default="", help="comma list of tests to skip: cold, busy, bandwidth")
    p.add_argument("--batch", type=int, default=0,
                   help="also decode this many sequences together (aggregate tok/s and scaling; 0: not run)")
    p.add_argument("--bandwidth-gbs", type=float, help="use this memory bandwidth instead of measuring it")
    p.add_argument("--llama-python", help=f"Python with llama-cpp-python (default ${ENV_LLAMA_PYTHON})")
    p.add_argument("--llama-bench", help=f"llama-bench binary (default ${ENV_LLAMA_BENCH})")
    p.add_argument("--seed", type=int, default=1234, help="seed of the random prompts")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="compare.py", description="minirt vs llama.cpp, side by side")
    ap.add_argument("-v", "--verbose", action="store_true")
    add_arguments(ap)
    return ap


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """A :class:`BenchConfig` from CLI flags (attributes ``minirt bench`` lacks take defaults)."""
    from minirt import registry
    from minirt.errors import InvalidRequestError

    g = lambda name, default=None: getattr(args, name, default)  # noqa: E731
    quick = bool(g("quick", False))
    model = g("model") or registry.DEFAULT_MODEL
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count() or 2
    cfg = BenchConfig(model=model, quick=quick, seed=g("seed", 1234) or 1234)
    cfg.threads = g("threads") or usable
    cfg.n_prompt = list(g("n_prompt") or ([128] if quick else [128, 512]))
    cfg.n_gen = g("n_gen") or (32 if quick else 64)
    reps = g("repetitions")
    cfg.repetitions = reps or (1 if quick else 3)
    cfg.cold_repetitions = 1 if quick else min(cfg.repetitions, 3)
    cfg.busy_repetitions = 1 if quick else min(cfg.repetitions, 2)
    cfg.rss_gen = 64 if quick else 256
    cfg.bandwidth_mb = 256 if quick else 512
    cfg.n_ctx = g("ctx") or 0
    cfg.device = g("device") or "cpu"
    b = g("backend")
    cfg.backend = None if b in (None, "auto") else b
    cfg.peer = not g("no_peer", False)
    skip = {s.strip() for s in (g("skip") or "").split(",") if s.strip()}
    unknown = skip - {"cold", "busy", "bandwidth"}
    if unknown:
        raise InvalidRequestError(f"--skip: unknown test(s) {', '.join(sorted(unknown))}; "
                                  "choose from cold, busy, bandwidth")
    cfg.cold, cfg.busy, cfg.bandwidth = "cold" not in skip, "busy" not in skip, "bandwidth" not in skip
    cfg.bandwidth_gbs = g("bandwidth_gbs")
    cfg.batch = g("batch", 0) or 0
    if not isinstance(cfg.batch, int) or not 0 <= cfg.batch <= 64:
        raise InvalidRequestError(f"--batch must be an integer in [0, 64], got {cfg.batch!r}")
    cfg.llama_python, cfg.llama_bench = g("llama_python"), g("llama_bench")
    for name, v in (("threads", cfg.threads), ("n_gen", cfg.n_gen), ("repetitions", cfg.repetitions)):
        if not isinstance(v, int) or v <= 0:
            raise InvalidRequestError(f"{name} must be a positive integer, got {v!r}")
    if cfg.n_gen < 2:
        raise InvalidRequestError("n_gen must be at least 2 (decode speed is measured between tokens)")
    if any(n <= 0 for n in cfg.n_prompt):
        raise InvalidRequestError(f"prompt lengths must be positive, got {cfg.n_prompt}")
    if cfg.n_ctx and cfg.n_ctx < cfg.needed_n_ctx():
        raise InvalidRequestError(f"--ctx {cfg.n_ctx} is too small for the tests (prompts up to {max(cfg.n_prompt)}, "
                                  f"{cfg.tg_prompt}+{cfg.n_gen}, {cfg.cold_prompt}+{cfg.rss_gen})")
    cfg.path = str(registry.model_path(model))
    return cfg


def main(args: argparse.Namespace) -> int:
    """``minirt bench`` / ``bench/compare.py``: run, print the table, optionally write JSON/Markdown."""
    cfg = config_from_args(args)

    def say(msg: str) -> None:
        sys.stderr.write(f"[bench] {msg}\n")
        sys.stderr.flush()

    report = run_benchmark(cfg, progress=say)
    report.command = getattr(args, "command_line", None) or shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]])
    print(format_summary(report))
    if getattr(args, "markdown", False):
        print(format_markdown(report))
    path = getattr(args, "json", None)
    if path:
        Path(path).write_text(json.dumps(report.to_json(), indent=2, default=str) + "\n", encoding="utf-8")
        say(f"wrote {path}")
    return 0


# ==============================================================================================
# worker side (runs under the minirt interpreter or the llama.cpp one)
# ==============================================================================================
class _MinirtSide:
    def __init__(self, a: argparse.Namespace) -> None:
        import minirt

        kw: dict[str, Any] = {"n_ctx": a.n_ctx, "device": a.device or "cpu", "pull": False}
        if a.threads:
            kw["threads"] = a.threads
        if a.backend:
            kw["backend"] = a.backend
        self.llm = minirt.load(a.model, **kw)
        self.version = minirt.__version__

    def info(self) -> dict[str, Any]:
        b = self.llm.backend_info()
        return {"runtime": "minirt", "version": self.version, "device": self.llm.device, "backend": b,
                "threads": b.get("threads") or getattr(self.llm.backend, "threads", None),
                "n_ctx": self.llm.n_ctx, "n_vocab": self.llm.n_vocab}

    def pp(self, ids: list[int]) -> dict[str, Any]:
        c = self.llm.generate(ids, max_tokens=1, temperature=0.0, ignore_eos=True)
        return {"prompt_s": c.timings["prompt_s"], "cached": c.usage.get("cached_tokens", 0)}

    def tg(self, ids: list[int], n_gen: int) -> dict[str, Any]:
        c = self.llm.generate(ids, max_tokens=n_gen, temperature=0.0, ignore_eos=True)
        return {"prompt_s": c.timings["prompt_s"], "gen_tok_s": c.timings["generated_tokens_per_s"],
                "n_gen": len(c.token_ids), "ids": list(c.token_ids), "cached": c.usage.get("cached_tokens", 0)}

    def tgb(self, prompts: list[list[int]], n_gen: int) -> dict[str, Any]:
        # public API only: every prompt is submitted at once and the scheduler runs them as one
        # batch (prompt chunks first, then one token per sequence per step). Decode throughput
        # counts the tokens that arrive after every sequence has its first token (which comes from
        # its prompt's logits), up to the last one.
        stamps: list[list[float]] = [[] for _ in prompts]

        def recorder(i: int) -> Callable[[Any], None]:
            def on_token(ev: Any) -> None:
                if ev.token_id is not None:
                    stamps[i].append(time.perf_counter())
            return on_token

        handles = [self.llm.submit(ids, max_tokens=n_gen, temperature=0.0, ignore_eos=True, on_token=recorder(i))
                   for i, ids in enumerate(prompts)]
        for h in handles:
            h.result()
        t0 = max(s[0] for s in stamps)
        t1 = max(s[-1] for s in stamps)
        n = sum(1 for s in stamps for t in s if t > t0)
        return {"decode_tok_s": n / (t1 - t0) if t1 > t0 else float("nan"), "n_gen": sum(map(len, stamps))}

    def once(self, ids: list[int], n_gen: int) -> dict[str, Any]:
        first: list[float] = []

        def on_token(ev: Any) -> None:
            if not first:
                first.append(time.time())

        c = self.llm.generate(ids, max_tokens=n_gen, temperature=0.0, ignore_eos=True, on_token=on_token)
        return {"t_first": first[0], "n_gen": len(c.token_ids)}


class _LlamaSide:
    def __init__(self, a: argparse.Namespace) -> None:
        import llama_cpp
        import numpy as np

        self.np, self.lc = np, llama_cpp
        kw: dict[str, Any] = {"model_path": a.model, "n_ctx": a.n_ctx, "n_batch": 512, "verbose": False}
        if a.threads:
            kw.update(n_threads=a.threads, n_threads_batch=a.threads)
        self.llm = llama_cpp.Llama(**kw)
        self.n_vocab = self.llm.n_vocab()

    def info(self) -> dict[str, Any]:
        sysinfo = self.lc.llama_print_system_info()
        return {"runtime": "llama.cpp", "version": f"llama-cpp-python {self.lc.__version__}",
                "threads": self.llm.n_threads, "threads_batch": self.llm.n_threads_batch,
                "n_ctx": self.llm.n_ctx(), "n_vocab": self.n_vocab,
                "system_info": sysinfo.decode("utf-8", "replace") if isinstance(sysinfo, bytes) else str(sysinfo)}

    def _greedy(self) -> int:
        # logits of the last evaluated token: (n_vocab,) float32 owned by the llama context
        ptr = self.lc.llama_get_logits_ith(self.llm.ctx, -1)
        return int(self.np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).argmax())

    def _eval(self, ids: list[int]) -> float:
        t0 = time.perf_counter()
        self.llm.eval(ids)
        return time.perf_counter() - t0

    def pp(self, ids: list[int]) -> dict[str, Any]:
        self.llm.reset()  # fresh context: eval drops KV entries from position 0 on
        return {"prompt_s": self._eval(ids), "cached": 0}

    def tg(self, ids: list[int], n_gen: int) -> dict[str, Any]:
        self.llm.reset()
        prompt_s = self._eval(ids)
        out = [self._greedy()]
        gen_s = 0.0
        for _ in range(n_gen - 1):  # the first token came from the prompt's logits
            gen_s += self._eval([out[-1]])
            out.append(self._greedy())
        return {"prompt_s": prompt_s, "gen_tok_s": (n_gen - 1) / gen_s if gen_s > 0 else float("nan"),
                "n_gen": len(out), "ids": out, "cached": 0}

    def tgb(self, prompts: list[list[int]], n_gen: int) -> dict[str, Any]:
        # llama.cpp's own batching (what llama-server and batched-bench do): a context with one KV
        # sequence per prompt, a llama_batch holding one token of every sequence per decode call
        lc, np, B = self.lc, self.np, len(prompts)
        n_prompt = max(len(p) for p in prompts)
        cp = lc.llama_context_default_params()
        cp.n_ctx = B * (n_prompt + n_gen + 8)
        cp.n_batch = cp.n_ubatch = max(512, n_prompt)
        cp.n_seq_max = B
        cp.n_threads, cp.n_threads_batch = self.llm.n_threads, self.llm.n_threads_batch
        ctx = lc.llama_init_from_model(self.llm.model, cp)
        if not ctx:
            raise RuntimeError("llama.cpp could not create a context for the batched test")
        batch = lc.llama_batch_init(max(B, n_prompt), 0, B)

        def fill(items: list[tuple[int, int, int, bool]]) -> None:  # (token, pos, seq, want logits)
            batch.n_tokens = len(items)
            for j, (tok, pos, seq, want) in enumerate(items):
                batch.token[j], batch.pos[j], batch.n_seq_id[j] = tok, pos, 1
                batch.seq_id[j][0], batch.logits[j] = seq, want

        def greedy(j: int) -> int:
            return int(np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, j), shape=(self.n_vocab,)).argmax())

        try:
            last: list[int] = []
            for sq, ids in enumerate(prompts):  # prompts one sequence at a time, like minirt's chunks
                fill([(t, i, sq, i == len(ids) - 1) for i, t in enumerate(ids)])
                if lc.llama_decode(ctx, batch) != 0:
                    raise RuntimeError("llama_decode failed on a prompt")
                last.append(greedy(len(ids) - 1))
            n, t0 = B, time.perf_counter()
            for step in range(n_gen - 1):
                fill([(last[sq], len(prompts[sq]) + step, sq, True) for sq in range(B)])
                if lc.llama_decode(ctx, batch) != 0:
                    raise RuntimeError("llama_decode failed while decoding")
                last = [greedy(sq) for sq in range(B)]
                n += B
            dt = time.perf_counter() - t0
        finally:
            lc.llama_batch_free(batch)
            lc.llama_free(ctx)
        return {"decode_tok_s": (n - B) / dt if dt > 0 else float("nan"), "n_gen": n}

    def once(self, ids: list[int], n_gen: int) -> dict[str, Any]:
        self.llm.reset()
        self.llm.eval(ids)
        out = [self._greedy()]
        t_first = time.time()
        for _ in range(n_gen - 1):
            self.llm.eval([out[-1]])
            out.append(self._greedy())
        return {"t_first": t_first, "n_gen": len(out)}


def _vm_hwm() -> int | None:
    """This process's peak resident set (``VmHWM``, Linux), in bytes."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def worker_main(argv: Sequence[str]) -> int:
    """Worker process: load one runtime, then answer JSON-line requests on stdin (``--once``:
    a single cold-start request). Replies go to the original stdout; fd 1 is pointed at stderr
    so nothing a native library prints can corrupt the protocol."""
    t_entry = time.time()
    ap = argparse.ArgumentParser(prog="minirt-bench-worker")
    ap.add_argument("--worker", choices=["minirt", "llama"], required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--n-ctx", type=int, required=True)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend")
    ap.add_argument("--once", action="store_true")
    a = ap.parse_args(list(argv))
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def reply(**kw: Any) -> None:
        proto.write(json.dumps({"ok": True, **kw}) + "\n")
        proto.flush()

    def fail(e: BaseException) -> None:
        proto.write(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"}) + "\n")
        proto.flush()

    try:
        side: Any = _MinirtSide(a) if a.worker == "minirt" else _LlamaSide(a)
    except Exception as e:
        fail(e)
        return 1
    t_loaded = time.time()
    if a.once:
        try:
            req = json.loads(sys.stdin.readline())
            r = side.once(req["ids"], int(req["n_gen"]))
            reply(t_entry=t_entry, t_loaded=t_loaded, vm_hwm_bytes=_vm_hwm(), **r)
            return 0
        except Exception as e:
            fail(e)
            return 1
    reply(**side.info(), load_s=t_loaded - t_entry)
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            op = req.get("op")
            if op == "quit":
                break
            if op == "pp":
                reply(**side.pp(req["ids"]))
            elif op == "tg":
                reply(**side.tg(req["ids"], int(req["n_gen"])))
            elif op == "tgb":
                reply(**side.tgb(req["prompts"], int(req["n_gen"])))
            elif op == "info":
                reply(**side.info())
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as e:
            fail(e)
    return 0


if __name__ == "__main__":
    if "--worker" in sys.argv[1:]:
        sys.exit(worker_main(sys.argv[1:]))
    sys.exit(main(build_parser().parse_args()))
