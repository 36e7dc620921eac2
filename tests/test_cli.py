"""The command line, run as a user would: ``python -m minirt ...`` in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiny_models import TinySpec, write_tiny

ROOT = Path(__file__).resolve().parents[1]


def minirt_cli(*args: str, timeout: float = 300, env: dict | None = None, input: str | None = None):
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    if env:
        e.update(env)
    return subprocess.run([sys.executable, "-m", "minirt", *args], capture_output=True, text=True,
                          timeout=timeout, env=e, input=input)


def test_worked_example(qwen_path):
    """README Quick start's main command: greedy answer of the default model, exactly llama.cpp's."""
    r = minirt_cli("run", "What is the capital of France?")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "The capital of France is Paris.\n"


def test_explain_walks_the_eight_steps(qwen_path):
    r = minirt_cli("run", "--explain", "What is the capital of France?")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "The capital of France is Paris.\n"
    for step in ("1. receive", "2. tokenize", "3. assemble context", "4. forward pass", "5. sample", "6. append",
                 "7. stop", "8. detokenize"):
        assert f"=== {step}" in r.stderr
    assert "<|im_start|>assistant" in r.stderr  # the rendered context
    assert "' Paris'" in r.stderr and "top:" in r.stderr  # candidates with probabilities
    assert "finish_reason: stop" in r.stderr


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    p = tmp_path_factory.mktemp("cli") / "tiny.gguf"
    write_tiny(p, TinySpec(seed=31))
    return str(p)


def test_run_raw_with_sampling_flags(tiny):
    a = minirt_cli("run", "-m", tiny, "--raw", "-n", "8", "--temp", "0.9", "--seed", "7", "the capital")
    b = minirt_cli("run", "-m", tiny, "--raw", "-n", "8", "--temp", "0.9", "--seed", "7", "the capital")
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout and a.stdout.endswith("\n")


def test_info_and_json(tiny):
    r = minirt_cli("info", tiny)
    assert r.returncode == 0, r.stderr
    for word in ("architecture  llama", "quant mix", "tokenizer     llama", "chat template", "backend"):
        assert word in r.stdout
    j = json.loads(minirt_cli("info", tiny, "--json").stdout)
    assert j["architecture"] == "llama" and j["layers"] == 2 and j["chat_template"] is False
    assert j["parameters"] > 0 and "F32" in j["quant_mix"]
    assert j["backend"]["backend"] in ("native", "numba")


def test_models_lists_registry():
    r = minirt_cli("models")
    assert r.returncode == 0
    assert "qwen2.5-coder-0.5b-instruct*" in r.stdout and "gemma3-270m" in r.stdout


def test_errors_are_reported_not_raised(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 64)
    r = minirt_cli("info", str(bad))
    assert r.returncode == 2 and "magic" in r.stderr and "Traceback" not in r.stderr
    r = minirt_cli("run", "-m", "no-such-model", "hi")
    assert r.returncode == 2 and "known models" in r.stderr and "Traceback" not in r.stderr
    r = minirt_cli("pull", "no-such-model")
    assert r.returncode == 2 and "unknown model" in r.stderr


def test_chat_repl_keeps_history(tiny):
    r = minirt_cli("chat", "-m", tiny, "-n", "4", "--temp", "0", input="hello\n/reset\nagain\n/exit\n")
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("minirt chat") == 1


def test_chat_ctrl_c_stops_the_answer_not_the_program(tiny):
    import select
    import signal
    import time

    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    p = subprocess.Popen([sys.executable, "-m", "minirt", "chat", "-m", tiny, "-c", "4096", "-n", "4000",
                          "--temp", "1.0", "--seed", "1", "--ignore-eos"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=e)
    try:
        p.stdin.write("tell me a long story\n")
        p.stdin.flush()
        got = b""
        deadline = time.time() + 120
        while len(got) < 40 and time.time() < deadline:  # past the "> " prompt: the answer is streaming
            ready, _, _ = select.select([p.stdout], [], [], 1)
            if ready:
                got += os.read(p.stdout.fileno(), 4096)
        assert len(got) >= 40
        p.send_signal(signal.SIGINT)
        time.sleep(0.5)
        assert p.poll() is None  # still running
        out, err = p.communicate("/exit\n", timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err
    assert "[stopped]" in err
