#!/usr/bin/env python3
"""One-shot check of the CUDA backend on a machine with an NVIDIA GPU (no network needed).

1. every kernel against its numpy reference on random data, at the real models' sizes;
2. greedy parity on the real models: the first 16 greedy tokens of each reference prompt from the
   device forward pass against llama.cpp's (``<ref>/<name>.greedy.jsonl``) and against minirt's CPU
   backend (``--cpu-prompts`` prompts);
3. a table: prefill tok/s (pp512), decode tok/s (batch 1, CUDA graphs), time to first token, and
   VRAM held (weights, activations, KV caches) against the GGUF size + KV cache.

Targets (Qwen2.5-Coder-0.5B Q4_K_M on an H200): decode >= 500 tok/s, pp512 >= 10,000 tok/s,
VRAM <= GGUF size + KV cache + 10%. Exit status 1 when a kernel check or a parity check fails;
missed speed targets are reported, not fatal.

    python bench/gpu_check.py \\
        --qwen models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf --gemma models/gemma-3-270m-q4_k_m.gguf
    python bench/gpu_check.py --synthetic          # no model files: time random models with the
                                                   # real models' tensor tables (no parity) and a
                                                   # random Qwen3-MoE (greedy parity with the CPU)
    python bench/gpu_check.py --simulate           # dry run on the CPU under numba's CUDA simulator

See bench/GPU.md for the wheels to carry and the exact command used on the GPU machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TARGETS = {"decode_tok_s": 500.0, "prefill_tok_s": 10_000.0, "vram_ratio": 1.10}
REF_NAMES = {"qwen": "qwen2.5-coder-0.5b", "gemma": "gemma3-270m"}

# per-layer weight types of the two real Q4_K_M files (4 = Q4_K, 5 = Q5_0, 6 = Q6_K, 8 = Q8_0), used
# to build same-shaped random models with --synthetic
_T = {"4": "Q4_K", "5": "Q5_0", "6": "Q6_K", "8": "Q8_0"}
SYNTH = {
    "qwen": dict(arch="qwen2", d=896, H=14, Hkv=2, hd=64, F=4864, V=151936, n_layer=24, emb="Q5_0", out="Q8_0",
                 bias=True, layers={"attn_q": "5" * 24, "attn_k": "5" * 24, "attn_v": "885855888885585585585855",
                                    "attn_output": "5" * 24, "ffn_gate": "5" * 24, "ffn_up": "5" * 24,
                                    "ffn_down": "664644666664464464464644"}),
    "gemma": dict(arch="gemma3", d=640, H=4, Hkv=1, hd=256, F=2048, V=262144, n_layer=18, emb="Q8_0", out=None,
                  bias=False, layers={"attn_q": "5" * 18, "attn_k": "5" * 18, "attn_v": "885585585585585888",
                                      "attn_output": "4" * 18, "ffn_gate": "5" * 18, "ffn_up": "5" * 18,
                                      "ffn_down": "664464464464464666"}),
    # a Qwen3-MoE of 1.5 B parameters (32 experts of width 768, top 4; about 0.9 GB at Q4_K): no real file
    # of this size is carried to the GPU machine, so it is always random (timing and the CPU parity run)
    "moe": dict(arch="qwen3moe", d=1024, H=16, Hkv=4, hd=64, F=768, E=32, k=4, V=32000, n_layer=16, emb="Q4_K",
                out="Q6_K", bias=False, layers={n: "4" * 16 for n in ("attn_q", "attn_k", "attn_v", "attn_output",
                                                                      "ffn_gate_exps", "ffn_up_exps")}
                | {"ffn_down_exps": "6" * 16}),
}
# tiny shapes for --simulate (legacy types only: K-quants need 256-wide rows)
SIM = {
    "qwen": dict(arch="qwen2", d=32, H=4, Hkv=2, hd=8, F=64, V=96, n_layer=2, emb="Q5_0", out="Q8_0", bias=True,
                 layers={"attn_q": "55", "attn_k": "55", "attn_v": "85", "attn_output": "55", "ffn_gate": "55",
                         "ffn_up": "55", "ffn_down": "88"}),
    "gemma": dict(arch="gemma3", d=32, H=2, Hkv=1, hd=16, F=64, V=96, n_layer=2, emb="Q8_0", out=None, bias=False,
                  layers={"attn_q": "55", "attn_k": "55", "attn_v": "85", "attn_output": "88", "ffn_gate": "55",
                          "ffn_up": "55", "ffn_down": "88"}),
    "moe": dict(arch="qwen3moe", d=32, H=2, Hkv=1, hd=16, F=32, E=6, k=2, V=96, n_layer=2, emb="Q8_0", out="Q8_0",
                bias=False, layers={n: "85" for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_exps",
                                                      "ffn_up_exps", "ffn_down_exps")}),
}


def log(msg: str = "") -> None:
    print(msg, flush=True)


def write_synthetic(path: Path, s: dict, seed: int = 0) -> None:
    """A random GGUF with the given architecture, shapes and per-layer types (no tokenizer)."""
    import gguf
    import numpy as np

    from minirt.kernels.cuda.selfcheck import random_raw

    rng = np.random.default_rng(seed)
    a = s["arch"]
    w = gguf.GGUFWriter(str(path), a)
    w.add_block_count(s["n_layer"])
    w.add_context_length(32768)
    w.add_embedding_length(s["d"])
    w.add_feed_forward_length(s["F"])
    w.add_head_count(s["H"])
    w.add_head_count_kv(s["Hkv"])
    w.add_key_length(s["hd"])
    w.add_value_length(s["hd"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    if a == "gemma3":
        w.add_sliding_window(512 if s["d"] > 64 else 3)
    if "E" in s:  # experts of width F, s["k"] per token, renormalised (Qwen3-MoE)
        w.add_expert_count(s["E"])
        w.add_expert_used_count(s["k"])
        w.add_expert_feed_forward_length(s["F"])
        w.add_expert_weights_norm(True)
    d, H, Hkv, hd, F = s["d"], s["H"], s["Hkv"], s["hd"], s["F"]

    def q(name: str, qt: str, rows: int, cols: int, n_expert: int = 0) -> None:
        raw = random_raw(qt, rows * max(1, n_expert), cols, rng, 0.05 if "embd" not in name else 1.0)
        if n_expert:  # a 3-D tensor: (n_expert, rows, cols) in GGUF's order
            raw = raw.reshape(n_expert, rows, -1)
        w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[qt])

    def vec(name: str, n: int, base: float) -> None:
        w.add_tensor(name, (base + 0.1 * rng.standard_normal(n)).astype(np.float32))

    q("token_embd.weight", s["emb"], s["V"], d)
    if s["out"]:
        q("output.weight", s["out"], s["V"], d)
    vec("output_norm.weight", d, 1.0 if a != "gemma3" else 0.0)
    shapes = {"attn_q": (H * hd, d), "attn_k": (Hkv * hd, d), "attn_v": (Hkv * hd, d), "attn_output": (d, H * hd),
              "ffn_gate": (F, d), "ffn_up": (F, d), "ffn_down": (d, F),
              "ffn_gate_exps": (F, d), "ffn_up_exps": (F, d), "ffn_down_exps": (d, F)}
    for i in range(s["n_layer"]):
        p = f"blk.{i}."
        for n, types in s["layers"].items():
            q(p + n + ".weight", _T[types[i]], *shapes[n], n_expert=s["E"] if n.endswith("_exps") else 0)
        if "E" in s:
            w.add_tensor(p + "ffn_gate_inp.weight", (0.5 * rng.standard_normal((s["E"], d))).astype(np.float32))
        norms = ["attn_norm", "ffn_norm"] + (["post_attention_norm", "post_ffw_norm"] if a == "gemma3" else [])
        for n in norms:
            vec(p + n + ".weight", d, 1.0 if a != "gemma3" else 0.0)
        if a in ("gemma3", "qwen3moe"):
            vec(p + "attn_q_norm.weight", hd, 0.0 if a == "gemma3" else 1.0)
            vec(p + "attn_k_norm.weight", hd, 0.0 if a == "gemma3" else 1.0)
        if s["bias"]:
            for n, rows in (("attn_q", H * hd), ("attn_k", Hkv * hd), ("attn_v", Hkv * hd)):
                w.add_tensor(p + n + ".bias", (0.1 * rng.standard_normal(rows)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


class Runner:
    """One model on the device (and optionally on the CPU) driven through forward passes."""

    def __init__(self, path: Path, simulate: bool, cpu: bool) -> None:
        import minirt
        from minirt.archs.base import build
        from minirt.kernels.cuda.backend import CudaBackend

        self.path = path
        self.f = minirt.gguf.open(path)
        launch = None
        if simulate:
            from minirt.kernels.cuda.kernels import LaunchConfig

            launch = LaunchConfig.simulator_fast()
        t = time.perf_counter()
        self.be = CudaBackend(self.f, launch=launch, allow_simulator=simulate)
        self.upload_s = time.perf_counter() - t
        self.dev = build(self.f, self.be)
        self.cpu = None
        if cpu:
            from minirt.kernels import get_backend

            self.cpu = build(self.f, get_backend())
        self.cfg = self.dev.cfg

    def cache(self, n: int):
        from minirt.forward import kv_cache_for

        return kv_cache_for(self.cfg, n)  # per-layer shapes and recurrent state of hybrid models too

    def fwd(self, on_cpu: bool):
        if on_cpu:
            return self.cpu.forward
        return lambda t, s: self.be.forward(self.dev, t, s)

    def greedy(self, prompt: list[int], n: int, on_cpu: bool = False) -> list[int]:
        import numpy as np

        from minirt.archs.base import Segment

        fwd = self.fwd(on_cpu)
        c = self.cache(len(prompt) + n + 1)
        lg = fwd(np.asarray(prompt), [Segment(c, len(prompt), "last")])[0]
        out = []
        for _ in range(n):
            t = int(np.argmax(lg))
            out.append(t)
            if len(out) < n:
                lg = fwd(np.array([t]), [Segment(c, 1, "last")])[0]
        return out

    def time_prefill(self, n: int, reps: int) -> tuple[float, float]:
        """(median seconds of an n-token prefill with last-row logits, first-call seconds)."""
        import numpy as np

        from minirt.archs.base import Segment

        ids = (np.arange(n) * 7919 % (self.cfg.n_vocab - 10) + 5).astype(np.int64)
        times = []
        for _ in range(reps + 1):
            c = self.cache(n + 1)
            t = time.perf_counter()
            lg = self.be.forward(self.dev, ids, [Segment(c, n, "last")])[0]
            int(np.argmax(lg))
            times.append(time.perf_counter() - t)
        return statistics.median(times[1:]), times[0]

    def time_decode(self, n_prompt: int, n_tokens: int, warm: int = 4) -> float:
        """Decode tok/s at batch 1 (greedy, host argmax on the copied logits), after ``warm`` steps."""
        import numpy as np

        from minirt.archs.base import Segment

        c = self.cache(n_prompt + n_tokens + warm + 1)
        ids = (np.arange(n_prompt) * 104729 % (self.cfg.n_vocab - 10) + 5).astype(np.int64)
        lg = self.be.forward(self.dev, ids, [Segment(c, n_prompt, "last")])[0]
        t0 = 0.0
        for i in range(warm + n_tokens):
            if i == warm:
                t0 = time.perf_counter()
            tok = int(np.argmax(lg))
            lg = self.be.forward(self.dev, np.array([tok]), [Segment(c, 1, "last")])[0]
        return n_tokens / (time.perf_counter() - t0)

    def close(self) -> None:
        self.be.close()
        self.f.close()


def parity(r: Runner, key: str, refs: list[dict] | None, cpu_prompts: int, n: int = 16,
           dry_run: bool = False) -> dict:
    """Greedy agreement of the device path with llama.cpp's references and with the CPU backend."""
    import numpy as np

    res: dict = {}
    if refs is None:  # no references: random prompts, compared with the CPU backend
        rng = np.random.default_rng(0)
        refs = [{"prompt_ids": [1] + rng.integers(3, r.cfg.n_vocab, 5).tolist()} for _ in range(cpu_prompts)]
        if dry_run and r.cpu is not None:  # the CPU's greedy ids stand in for llama.cpp's

            for rec in refs:
                rec["greedy_ids"] = r.greedy(rec["prompt_ids"], n, on_cpu=True)
    t = time.perf_counter()
    got = [r.greedy(rec["prompt_ids"], n) for rec in refs]
    res["gpu_greedy_s"] = time.perf_counter() - t
    with_ref = [(g, rec["greedy_ids"][:n]) for g, rec in zip(got, refs) if "greedy_ids" in rec]
    if with_ref:
        same = sum(g[:len(w)] == w for g, w in with_ref)
        res["llama_cpp"] = (same, len(with_ref))
    if r.cpu is not None and cpu_prompts:
        t = time.perf_counter()
        k = min(cpu_prompts, len(refs))
        cpu = [r.greedy(rec["prompt_ids"], n, on_cpu=True) for rec in refs[:k]]
        res["cpu"] = (sum(a == b for a, b in zip(got[:k], cpu)), k)
        res["cpu_greedy_s"] = time.perf_counter() - t
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reference-dir", type=Path,
                    default=Path(__file__).resolve().parents[1] / "tests" / "data" / "reference",
                    help="directory holding <name>.greedy.jsonl (default: the repository's tests/data/reference)")
    ap.add_argument("--qwen", type=Path, help="Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF")
    ap.add_argument("--gemma", type=Path, help="Gemma 3 270M Q4_K_M GGUF")
    ap.add_argument("--synthetic", action="store_true", help="time random models with the real tensor tables "
                    "for the models not given")
    ap.add_argument("--moe", action="store_true", help="also time a random Qwen3-MoE (1.5 B parameters, 32 "
                    "experts, top 4; always with --synthetic) and compare its greedy tokens with the CPU backend's")
    ap.add_argument("--simulate", action="store_true", help="dry run under numba's CUDA simulator (tiny sizes)")
    ap.add_argument("--cpu-prompts", type=int, default=8, help="prompts also decoded on the CPU backend")
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--skip-kernels", action="store_true")
    ap.add_argument("--gguf", type=Path, action="append", default=[],
                    help="any other GGUF (repeatable; e.g. the hybrid fixtures tests/data/archs/{lfm2,qwen35,"
                         "granitehybrid}/model-q8_0.gguf): greedy parity with the CPU backend, then the same timings")
    ap.add_argument("--json", type=Path, help="write the results here too")
    args = ap.parse_args(argv)

    if args.simulate:
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
        sys.setswitchinterval(1e-4)  # the simulator's barriers poll between Python threads
        args.prefill_tokens = min(args.prefill_tokens, 6)
        args.decode_tokens = min(args.decode_tokens, 3)
        args.cpu_prompts = min(args.cpu_prompts, 2)
    sys.path.insert(0, str(ROOT))
    import numpy as np

    from minirt.kernels import cuda as cuda_pkg

    t_start = time.perf_counter()
    out: dict = {"python": platform.python_version(), "numpy": np.__version__}
    for mod in ("numba", "numba_cuda", "cupy"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001 - report what is missing
            out[mod] = f"missing ({type(e).__name__})"
    if not args.simulate and not cuda_pkg.available():
        log(f"no usable GPU: {cuda_pkg.unavailable_reason()}")
        return 2
    from numba import cuda

    if not args.simulate:
        dev = cuda.get_current_device()
        out["device"] = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
        out["compute_capability"] = list(dev.compute_capability)
        try:
            out["driver"] = cuda.cudadrv.driver.driver.get_version()
        except Exception:  # noqa: BLE001
            pass
    log("== environment: " + json.dumps(out))
    failures: list[str] = []

    # 1. kernels ---------------------------------------------------------------------------------
    if not args.skip_kernels:
        from minirt.kernels.cuda import selfcheck
        from minirt.kernels.cuda.backend import CudaBackend

        log("== kernels vs numpy (random data" + (", real sizes)" if not args.simulate else ", tiny sizes)"))
        t = time.perf_counter()
        be = CudaBackend(None, allow_simulator=args.simulate)
        checks = selfcheck.run_all(be, np.random.default_rng(0), real=not args.simulate, log=log)
        be.close()
        if not args.simulate:
            be = CudaBackend(None, use_cupy=False)
            for qt in ("Q4_K", "Q5_0", "Q6_K", "Q8_0"):
                c = selfcheck.check_matmul(be, qt, 896, 1024 if qt.endswith("_K") else 896, 77,
                                           np.random.default_rng(1), "numba-gemm")
                log(str(c))
                checks.append(c)
            be.close()
        bad = [c.name for c in checks if not c.ok]
        failures += [f"kernel: {b}" for b in bad]
        out["kernels"] = {"checks": len(checks), "failed": bad, "seconds": round(time.perf_counter() - t, 1)}
        log(f"-- {len(checks) - len(bad)}/{len(checks)} kernel checks passed in {out['kernels']['seconds']} s")

    # 2./3. models ------------------------------------------------------------------------------------
    tmp = Path(tempfile.mkdtemp(prefix="minirt-gpu-check-"))
    models: list[tuple[str, Path, bool]] = []
    for key in ("qwen", "gemma", "moe"):
        p = getattr(args, key, None)
        if args.simulate:
            path = tmp / f"sim-{key}.gguf"
            write_synthetic(path, SIM[key])
            models.append((key, path, True))
        elif p is not None:
            if not p.is_file():
                log(f"!! {key}: no such file {p}")
                failures.append(f"{key}: model file missing")
                continue
            models.append((key, p, False))
        elif args.synthetic or (key == "moe" and args.moe):
            path = tmp / f"synthetic-{key}.gguf"
            t = time.perf_counter()
            write_synthetic(path, SYNTH[key])
            log(f"== {key}: wrote a random model with the real tensor table ({path.stat().st_size / 1e6:.0f} MB) "
                f"in {time.perf_counter() - t:.1f} s")
            models.append((key, path, True))
    for p in args.gguf:
        if p.is_file():
            models.append((p.parent.name if p.stem.startswith("model") else p.stem, p, False))
        else:
            log(f"!! no such file {p}")
            failures.append(f"{p}: model file missing")
    rows = []
    for key, path, synthetic in models:
        log(f"== {key}: {path.name}" + (" (synthetic)" if synthetic else ""))
        # the MoE is random but small enough for the CPU: its greedy tokens are compared there
        with_cpu = not synthetic or args.simulate or key == "moe"
        r = Runner(path, args.simulate, cpu=(args.cpu_prompts > 0 and with_cpu))
        rec: dict = {"model": key, "synthetic": synthetic, "gguf_bytes": path.stat().st_size,
                     "upload_s": round(r.upload_s, 3)}
        try:
            refs = None
            if not synthetic and args.reference_dir is not None and key in REF_NAMES:
                rp = args.reference_dir / f"{REF_NAMES[key]}.greedy.jsonl"
                if rp.is_file():
                    refs = [json.loads(x) for x in rp.read_text().splitlines() if x.strip()]
                else:
                    log(f"!! {rp} missing: parity against llama.cpp skipped")
            if with_cpu:
                n_cpu = args.cpu_prompts if key != "moe" else min(args.cpu_prompts, 3)
                par = parity(r, key, refs, n_cpu, n=16 if not args.simulate else 3, dry_run=args.simulate)
                rec["parity"] = par
                for what in ("llama_cpp", "cpu"):
                    if what in par:
                        same, n = par[what]
                        ok = same >= 0.9 * n
                        log(f"-- greedy parity vs {what}: {same}/{n} prompts identical over the first 16 tokens "
                            f"{'ok' if ok else 'FAIL'}")
                        if not ok:
                            failures.append(f"{key}: parity vs {what} {same}/{n}")
            pf_s, first_s = r.time_prefill(args.prefill_tokens, 3)
            rec["first_call_s"] = round(first_s, 3)
            rec["prefill_tok_s"] = args.prefill_tokens / pf_s
            rec["ttft_pp_s"] = pf_s
            short, _ = r.time_prefill(min(32, args.prefill_tokens), 3)
            rec["ttft_32_s"] = short
            rec["decode_tok_s"] = r.time_decode(min(32, args.prefill_tokens), args.decode_tokens)
            v = r.be.vram_bytes()
            rec["vram"] = v
            info = r.be.info()
            rec["device_memory_used_bytes"] = info.get("device_memory_used_bytes")
            rec["graphs"] = r.be.use_graphs
            rec["prefill_gemm"] = info["prefill_gemm"]
            budget = rec["gguf_bytes"] + v["kv"]
            rec["vram_ratio"] = v["total"] / budget
            rows.append(rec)
            log(f"-- upload {rec['upload_s']:.2f} s; first forward (incl. compile) {rec['first_call_s']:.2f} s; "
                f"prefill {rec['prefill_tok_s']:.0f} tok/s; decode {rec['decode_tok_s']:.0f} tok/s; "
                f"VRAM {v['total'] / 2**20:.1f} MiB (weights {v['weights'] / 2**20:.1f}, scratch "
                f"{v['scratch'] / 2**20:.1f}, kv {v['kv'] / 2**20:.1f})")
        except Exception as e:  # noqa: BLE001 - report and go on with the next model
            import traceback

            traceback.print_exc()
            failures.append(f"{key}: {type(e).__name__}: {e}")
            rec["error"] = repr(e)
        finally:
            r.close()
        out.setdefault("models", []).append(rec)

    # table ------------------------------------------------------------------------------------------
    if rows:
        log("")
        log(f"| model | pp{args.prefill_tokens} tok/s | decode tok/s | TTFT {args.prefill_tokens} | "
            f"TTFT {min(32, args.prefill_tokens)} | "
            "VRAM (MiB) | GGUF + KV (MiB) | ratio | parity llama.cpp | parity CPU |")
        log("|---|---:|---:|---:|---:|---:|---:|---:|---|---|")
        for rec in rows:
            par = rec.get("parity", {})
            fmt = lambda k, par=par: f"{par[k][0]}/{par[k][1]}" if k in par else "-"  # noqa: E731
            name = rec["model"] + (" (synthetic)" if rec["synthetic"] else "")
            log(f"| {name} | {rec['prefill_tok_s']:.0f} | {rec['decode_tok_s']:.0f} | "
                f"{rec['ttft_pp_s'] * 1e3:.1f} ms | "
                f"{rec['ttft_32_s'] * 1e3:.1f} ms | {rec['vram']['total'] / 2**20:.1f} | "
                f"{(rec['gguf_bytes'] + rec['vram']['kv']) / 2**20:.1f} | {rec['vram_ratio']:.3f} | "
                f"{fmt('llama_cpp')} | {fmt('cpu')} |")
        q = next((x for x in rows if x["model"] == "qwen"), None)
        if q is not None and not args.simulate:
            log("")
            for k, want in TARGETS.items():
                got = q[k]
                ok = got <= want if k == "vram_ratio" else got >= want
                log(f"target qwen {k}: {got:.3f} vs {'<=' if k == 'vram_ratio' else '>='} {want:g}: "
                    f"{'met' if ok else 'MISSED'}")
                out.setdefault("targets", {})[k] = {"value": got, "target": want, "met": ok}
    out["failures"] = failures
    out["seconds"] = round(time.perf_counter() - t_start, 1)
    log(f"\n== done in {out['seconds']} s; " + ("all checks passed" if not failures else f"FAILED: {failures}"))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2, default=str))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
