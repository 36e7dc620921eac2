"""The side-by-side benchmark harness (minirt/bench.py) on tiny synthetic models.

No timing is asserted: the tests check that every test runs and lands in the report, that a
missing llama.cpp is reported as missing (never as numbers), the weight-bytes arithmetic against
gguf-py's own quant size table, and the llama-bench and llama-cpp-python peers where present.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import stat
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from minirt import bench
from minirt.errors import InvalidRequestError
from tests.tiny_models import TinySpec, write_tiny


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bench") / "tiny-f32.gguf"
    write_tiny(path, TinySpec(seed=7))
    return path


def _tiny_config(path: Path, **kw) -> bench.BenchConfig:
    base = dict(model=str(path), path=str(path), n_prompt=[16, 32], n_gen=4, tg_prompt=16, repetitions=2,
                threads=2, cold_repetitions=1, cold_prompt=4, rss_gen=8, busy_repetitions=1, bandwidth_mb=8)
    base.update(kw)
    return bench.BenchConfig(**base)


def _missing_peer() -> bench.Peer:
    return bench.find_peer(True, env={}, try_current=False)


# ----------------------------------------------------------------------------------------------
def _quant_bytes(shape: tuple[int, int], qtype: QT) -> int:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return shape[0] * (shape[1] // block) * size


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("qtype", [QT.F32, QT.Q8_0])
def test_weight_bytes_per_token_counts_every_matrix_once_and_one_embedding_row(tmp_path, tied, qtype):
    spec = write_tiny(tmp_path / "m.gguf", TinySpec(qtype=qtype, tied=tied, n_embd=64, n_ff=128))
    expected = 0
    for name, w in spec.weights.items():
        if w.ndim != 2:
            continue
        full = _quant_bytes(w.shape, qtype)
        if name == "token_embd.weight":
            expected += full // w.shape[0] + (full if tied else 0)
        else:
            expected += full
    got = bench.weight_bytes_per_token(tmp_path / "m.gguf")
    assert got["bytes_per_token"] == expected
    assert got["tied_output"] is tied


def test_prompt_bank_draws_ordinary_ids_with_fresh_first_tokens(tiny_path):
    facts = bench.model_facts(str(tiny_path))
    allowed = facts["_prompt_ids"]
    md = gguf.GGUFReader(str(tiny_path))
    types = md.fields["tokenizer.ggml.token_type"]
    type_of = [int(types.parts[i][0]) for i in types.data]
    assert len(allowed) > 0 and all(type_of[i] == 1 for i in allowed)  # NORMAL tokens only
    a, b = bench.PromptBank(allowed, 3), bench.PromptBank(allowed, 3)
    prompts = [a.draw(12) for _ in range(20)]
    assert prompts == [b.draw(12) for _ in range(20)]  # seeded
    assert len({p[0] for p in prompts}) == 20  # no two prompts share a first token: no prefix reuse
    assert all(len(p) == 12 and set(p) <= set(allowed.tolist()) for p in prompts)


def test_find_peer_reports_why_llama_cpp_is_missing(tmp_path):
    p = bench.find_peer(False)
    assert not p.available and "--no-peer" in p.reason
    p = _missing_peer()
    assert not p.available and bench.ENV_LLAMA_PYTHON in p.reason and bench.ENV_LLAMA_BENCH in p.reason
    not_exe = tmp_path / "llama-bench"
    not_exe.write_text("")
    p = bench.find_peer(True, env={bench.ENV_LLAMA_PYTHON: str(tmp_path / "nope" / "python"),
                                   bench.ENV_LLAMA_BENCH: str(not_exe)}, try_current=False)
    assert not p.available
    assert "does not exist" in p.reason and "not an executable" in p.reason


def test_find_peer_rejects_a_python_without_llama_cpp():
    try:
        import llama_cpp  # noqa: F401
        pytest.skip("this interpreter has llama_cpp, so it cannot stand in for one without it")
    except ImportError:
        pass
    p = bench.find_peer(True, env={bench.ENV_LLAMA_PYTHON: sys.executable}, try_current=False)
    assert not p.available and "cannot import llama_cpp" in p.reason


def test_full_harness_on_tiny_model_without_peer(tiny_path):
    cfg = _tiny_config(tiny_path)
    lines: list[str] = []
    report = bench.run_benchmark(cfg, progress=lines.append, peer=_missing_peer())
    tests = [r.test for r in report.rows]
    assert tests == ["load→1st token", "peak RSS gen8", "pp16", "pp32", "tg4", "tg4 / floor",
                     "tg4 busy default", "tg4 busy t=2"]
    for r in report.rows:
        assert r.llama is None and r.ratio is None, r.test  # nothing invented for the missing peer
        assert r.minirt is not None and all(math.isfinite(v) and v > 0 for v in r.minirt.samples), r.test
    assert len(report.row("pp16").minirt.samples) == 2 and len(report.row("tg4").minirt.samples) == 2
    assert len(report.row("load→1st token").minirt.samples) == 1
    # the floor share is tok/s over (bandwidth / bytes per token), sample by sample
    floor = report.bandwidth["gbs"] * 1e9 / report.model["bytes_per_token"]
    assert report.bandwidth["floor_tok_s"] == pytest.approx(floor)
    assert report.bandwidth["method"].startswith("native streaming read"), report.bandwidth["method"]
    assert report.row("tg4 / floor").minirt.samples == pytest.approx(
        [v / floor for v in report.row("tg4").minirt.samples])
    busy = report.row("tg4 busy t=2").minirt
    assert busy.info["vs_idle"] == pytest.approx(busy.median / report.row("tg4").minirt.median)
    # cold start: its parts add up to the whole; RSS at least covers the weights it mapped and read
    parts = report.row("load→1st token").extra["parts"]["minirt"][0]
    assert sum(parts.values()) == pytest.approx(report.row("load→1st token").minirt.samples[0])
    assert report.row("peak RSS gen8").minirt.samples[0] * 2**20 > os.path.getsize(tiny_path)
    assert report.runtimes["minirt"]["runtime"] == "minirt"

    doc = json.loads(json.dumps(report.to_json(), default=str))
    assert doc["schema"] == bench.SCHEMA and doc["peer"]["available"] is False and doc["peer"]["reason"]
    assert all(r["llama_cpp"] is None and r["ratio_minirt_over_llama_cpp"] is None for r in doc["results"])
    text = bench.format_summary(report)
    assert "llama.cpp: NOT MEASURED" in text and "n/a" in text
    md = bench.format_markdown(report)
    assert "llama.cpp not measured" in md and "| model" in md
    assert any("pp16" in line for line in lines)


def test_main_writes_json_and_markdown_without_peer(tiny_path, tmp_path, capsys):
    out = tmp_path / "r.json"
    args = argparse.Namespace(model=str(tiny_path), ctx=None, threads=2, device=None, backend=None,
                              n_prompt=[8], n_gen=3, repetitions=1, no_peer=True, json=str(out),
                              quick=True, markdown=True, skip="cold,busy", bandwidth_gbs=10.0)
    assert bench.main(args) == 0
    printed = capsys.readouterr().out
    assert "disabled (--no-peer)" in printed and "### " in printed and "- command:" in printed
    doc = json.loads(out.read_text())
    assert [r["test"] for r in doc["results"]] == ["pp8", "tg3", "tg3 / floor"]
    assert doc["bandwidth"]["method"] == "given on the command line"
    assert doc["config"]["cold"] is False and doc["config"]["busy"] is False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM is read from /proc (Linux)")
def test_cold_run_rss_is_the_childs_own_not_the_parents(tiny_path):
    """A child's ru_maxrss on Linux inherits the parent's high-water mark across exec; the
    harness reports the child's own VmHWM, so a big buffer held here must not show up there."""
    ballast = np.ones(384 << 17)  # 384 MiB, touched
    cfg = _tiny_config(tiny_path)
    r = bench.cold_run("minirt", sys.executable, cfg, [5, 6, 7, 8], 4, 2)
    assert r["rss_source"] == "VmHWM"
    assert 0 < r["peak_rss_bytes"] < ballast.nbytes
    assert r["first_token_s"] > 0 and r["load_s"] > 0
    del ballast


def test_batched_decode_row_on_tiny_model(tiny_path):
    """--batch N: N sequences decoded together; aggregate tok/s and the scaling over the same
    runtime's single-sequence decode of the same run."""
    cfg = _tiny_config(tiny_path, cold=False, busy=False, bandwidth=False, batch=3)
    report = bench.run_benchmark(cfg, peer=_missing_peer())
    assert [r.test for r in report.rows] == ["pp16", "pp32", "tg4", "tg4 x3 seqs"]
    row = report.row("tg4 x3 seqs")
    assert row.llama is None and len(row.minirt.samples) == 2 and all(v > 0 for v in row.minirt.samples)
    assert row.extra["scaling_over_single"]["minirt"] == pytest.approx(
        row.minirt.median / report.row("tg4").minirt.median)
    assert any("3 sequences decoded together vs one: minirt" in n for n in report.notes)


def test_config_rejects_bad_flags(tiny_path):
    ns = lambda **kw: argparse.Namespace(model=str(tiny_path), **kw)  # noqa: E731
    with pytest.raises(InvalidRequestError, match="unknown test"):
        bench.config_from_args(ns(skip="cold,warp"))
    with pytest.raises(InvalidRequestError, match="at least 2"):
        bench.config_from_args(ns(n_gen=1))
    with pytest.raises(InvalidRequestError, match="too small"):
        bench.config_from_args(ns(ctx=64, n_prompt=[128]))
    with pytest.raises(InvalidRequestError, match="--batch"):
        bench.config_from_args(ns(batch=65))
    q = bench.config_from_args(ns(quick=True))
    assert q.repetitions == 1 and q.n_prompt == [128] and q.resolved_n_ctx() >= q.needed_n_ctx()


def test_table_ratio_and_idle_share():
    cfg = bench.BenchConfig(model="m")
    rep = bench.BenchReport(cfg, bench.Peer("python", python="py", version="x"), {"name": "m"}, {})
    rep.rows = [bench.Row("pp128", "tok/s", "higher", bench.Cell([10.0, 30.0, 20.0]), bench.Cell([40.0, 40.0])),
                bench.Row("peak RSS gen256", "MiB", "lower", bench.Cell([300.0]), None)]
    assert rep.rows[0].ratio == pytest.approx(0.5)  # medians 20 / 40
    cells = bench.table_rows(rep)
    assert cells[0][5] == "0.50×" and cells[0][3].startswith("20.00 ± 10.00")
    assert cells[1][4] == "n/a" and cells[1][5] == "—" and "↓" in cells[1][2]


# ----------------------------------------------------------------------------------------------
FAKE_LLAMA_BENCH = r'''#!{python}
import json, sys
args = sys.argv[1:]
open({log!r}, "a").write(" ".join(args) + "\n")
if "-d" in args:
    sys.stderr.write("error: invalid parameter for argument: -d\n")
    sys.exit(1)
val = lambda f: int(args[args.index(f) + 1])
p, n = val("-p"), val("-n")
print("main: some log line")
print(json.dumps({{"n_prompt": p, "n_gen": n, "n_threads": val("-t"), "avg_ts": 0.0,
                  "samples_ts": [1000.0 / (p + n), 3000.0 / (p + n), 2000.0 / (p + n)]}}))
'''


def test_llama_bench_runner_parses_jsonl_and_falls_back_without_depth(tiny_path, tmp_path):
    log = tmp_path / "calls.txt"
    exe = tmp_path / "llama-bench"
    exe.write_text(FAKE_LLAMA_BENCH.format(python=sys.executable, log=str(log)))
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    peer = bench.find_peer(True, env={bench.ENV_LLAMA_BENCH: str(exe)}, try_current=False)
    assert peer.kind == "llama-bench"
    r = bench.LlamaBenchRunner(peer.llama_bench, _tiny_config(tiny_path), 2, "llama.cpp")
    assert r.pp([1] * 100) == pytest.approx(20.0)  # median of 10, 30, 20
    assert r.tg([1] * 16, 50)["gen_tok_s"] == pytest.approx(40.0)
    calls = log.read_text().splitlines()
    assert calls[0].split()[:2] == ["-m", str(tiny_path)] and "-p 100 -n 0" in calls[0] and "-t 2" in calls[0]
    assert "-d 16" in calls[1] and "-d" not in calls[2]  # refused depth → decode from an empty context
    with pytest.raises(bench.BenchError, match="no row"):
        bench._llama_bench_ts(bench.parse_llama_bench_jsonl('{"n_prompt": 1, "n_gen": 0}'), 2, 0)


def test_harness_with_llama_cpp_peer_on_tiny_model(tiny_path):
    """With llama-cpp-python reachable (this interpreter or $MINIRT_LLAMA_PYTHON), both runtimes
    run the same ids and greedy decoding on a float32 model agrees token for token."""
    peer = bench.find_peer(True)
    if peer.kind != "python":
        pytest.skip(f"llama-cpp-python not reachable: {peer.reason}")
    cfg = _tiny_config(tiny_path, busy=False, bandwidth=False, n_gen=8, batch=2)
    report = bench.run_benchmark(cfg, peer=peer)
    assert set(report.row("tg8 x2 seqs").extra["scaling_over_single"]) == {"minirt", "llama_cpp"}
    assert not [n for n in report.notes if "failed" in n], report.notes
    for r in report.rows:
        assert r.minirt is not None and r.llama is not None, r.test
        assert r.ratio == pytest.approx(r.minirt.median / r.llama.median)
    assert report.runtimes["llama_cpp"]["threads"] == 2
    agree = report.row("tg8").extra["greedy_agreement_tokens"]
    assert agree == [8] * cfg.repetitions, agree
    assert np.isfinite(report.row("peak RSS gen8").llama.median)


def test_bandwidth_falls_back_to_numpy_and_says_so(monkeypatch):
    from minirt.kernels import native

    def broken(*a, **k):
        raise native.BackendError("no native kernels here")

    monkeypatch.setattr(native, "read_bandwidth", broken)
    bw = bench.measure_bandwidth(threads=2, megabytes=8, repeats=1)
    assert bw["gbs"] > 0 and bw["threads"] == 2
    assert bw["method"].startswith("numpy float64 sum") and "no native kernels here" in bw["method"]
    assert "lower bound" in bw["method"]


def test_native_bandwidth_figure_is_a_real_read():
    bw = bench.measure_bandwidth(threads=1, megabytes=8, repeats=1)
    assert bw["method"].startswith("native streaming read") and bw["gbs"] > 0
