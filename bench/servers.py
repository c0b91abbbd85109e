"""The processes a benchmark run starts: the simulator, Kiln, the bare proxy and LiteLLM.

Each is started pinned (taskset) and stopped when the run's ExitStack closes, also on Ctrl-C,
SIGTERM or a failed check. A `Server` reads its CPU time and memory from /proc, summed over
its process tree (Granian serves from a worker process under a supervisor).
"""

from __future__ import annotations

import json
import os
import resource
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import litellm_env
from workloads import MODEL

PY = sys.executable
HERE = Path(__file__).resolve().parent
ADMIN_KEY = "sk-kiln-admin-bench-" + "b" * 32
LITELLM_KEY = "sk-litellm-bench-" + "c" * 32
SIM_MAX_MODEL_LEN = 131072  # room for a 32k-token reply after an agent-sized prompt
# The open-file limit this process was started with: what a gateway gets from its shell.
START_NOFILE = resource.getrlimit(resource.RLIMIT_NOFILE)


class BenchError(RuntimeError):
    """A failed check: the benchmark's numbers cannot be trusted."""


@dataclass
class Server:
    name: str
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def pids(self) -> list[int]:
        """The process and its descendants (Granian: supervisor and worker)."""
        children: dict[int, list[int]] = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                children.setdefault(ppid, []).append(int(entry.name))
        out, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            out.append(pid)
            todo += children.get(pid, [])
        return out

    def cpu_seconds(self) -> float:
        """User + system CPU time the process tree has used so far."""
        total = 0
        for pid in self.pids():
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += int(fields[11]) + int(fields[12])
        return total / os.sysconf("SC_CLK_TCK")

    def _status_kb(self, field: str) -> int:
        total = 0
        for pid in self.pids():
            try:
                lines = Path(f"/proc/{pid}/status").read_text().splitlines()
            except OSError:
                continue
            total += next((int(ln.split()[1]) for ln in lines if ln.startswith(field)), 0)
        return total

    def rss_mb(self) -> float:
        """Resident set size now (VmRSS, summed over the tree), MiB."""
        return self._status_kb("VmRSS:") / 1024

    def peak_rss_mb(self) -> float:
        """Peak resident set size (VmHWM, summed over the tree), MiB."""
        return self._status_kb("VmHWM:") / 1024

    def open_files(self) -> int:
        """The most file descriptors one process of the tree has open now (each process has its
        own open-file limit: with several workers, the fullest worker is the one near it)."""
        most = 0
        for pid in self.pids():
            try:
                most = max(most, len(os.listdir(f"/proc/{pid}/fd")))
            except OSError:
                continue
        return most

    def nofile_limit(self) -> int:
        """The open-file limit the process actually has (soft)."""
        for line in Path(f"/proc/{self.proc.pid}/limits").read_text().splitlines():
            if line.startswith("Max open files"):
                return int(line.split()[3])
        return 0

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:]


def pinned(cmd: list[str], cpu: int | str | None) -> list[str]:
    """Prefix `cmd` with `taskset -c CPU` when pinning (`cpu` may be a list: "0,1")."""
    return cmd if cpu is None else ["taskset", "-c", str(cpu), *cmd]


def raise_nofile(wanted: int) -> int:
    """Raise this process's open-file limit to at least `wanted` (root may pass the hard limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= wanted:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, max(hard, wanted)))
    except (ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def _limit_nofile(limit: tuple[int, int]) -> Callable[[], None]:
    def apply() -> None:  # in the child, before exec
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, limit)
        except (ValueError, OSError):  # above the hard limit without CAP_SYS_RESOURCE: as high as allowed
            hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(limit[0], hard), hard))

    return apply


def spawn(stack: ExitStack, cmd: list[str], log: Path, env: dict[str, str] | None = None,
          nofile: tuple[int, int] | None = None) -> subprocess.Popen[bytes]:
    """Start a process whose output goes to `log`; it is stopped when `stack` closes.

    `nofile`: the child's open-file limit (default: this process's, which the bench raises).
    """
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                preexec_fn=_limit_nofile(nofile) if nofile else None)
    stack.callback(stop, proc)
    return proc


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after 10 s (a no-op for a process that already exited)."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def wait_until(check: Callable[[], Any], proc: subprocess.Popen[bytes], log: Path, what: str,
               timeout: float = 60) -> Any:
    """Poll `check()` until it returns something truthy; fail if `proc` dies or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BenchError(f"{what} exited with {proc.returncode}:\n{log.read_text(errors='replace')[-4000:]}")
        if found := check():
            return found
        time.sleep(0.1)
    raise BenchError(f"{what} did not start within {timeout:.0f} s:\n{log.read_text(errors='replace')[-4000:]}")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http(method: str, url: str, body: Any = None, headers: dict[str, str] | None = None,
         timeout: float = 60) -> tuple[int, dict[str, str], bytes]:
    """One blocking request; returns (status, lower-cased headers, body) for any status."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        resp = urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as exc:
        resp = exc
    with resp:
        return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()


def _answers(url: str) -> bool:
    try:
        return http("GET", url, timeout=5)[0] == 200
    except OSError:
        return False


def start_sim(stack: ExitStack, tmp: Path, cpu: int | None, *, name: str = "sim", reply_tokens: int = 20,
              extra: tuple[str, ...] = ()) -> Server:
    """`kiln sim` with zero delays and 20-token replies (`extra`: more of its flags); its URL is the
    base, without /v1."""
    log = tmp / f"{name}.log"
    cmd = [PY, "-m", "kiln.sim", "--port", "0", "--model", MODEL, "--reply-tokens", str(reply_tokens),
           "--max-model-len", str(SIM_MAX_MODEL_LEN), *extra]
    proc = spawn(stack, pinned(cmd, cpu), log)

    def listening() -> str | None:  # "kiln sim listening on http://127.0.0.1:PORT"
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if "listening on" in ln]
        return lines[0].rsplit(" ", 1)[-1] if lines else None

    return Server(name, wait_until(listening, proc, log, f"kiln sim ({name})"), proc, log)


def kiln_config(tmp: Path, backends: list[str], name: str = "kiln", extra: str = "") -> Path:
    """One model backed by the simulator(s), limits too high to trigger, room for 32k-token replies;
    `extra`: more TOML tables (e.g. `[routing]`)."""
    config = tmp / f"{name}.toml"
    # No per-backend cap on requests in flight (1,024 by default): the slow section holds thousands.
    urls = "".join(f'[[models.backends]]\nurl = "{url}/v1"\nmax_in_flight = 1000000\n' for url in backends)
    config.write_text(f"""
[limits]
rpm = 1000000000
concurrency = 1000000

[[models]]
id = "{MODEL}"
context_window = {SIM_MAX_MODEL_LEN}
max_output_tokens = 65536
prices = {{ input = "0.10", output = "0.30" }}
{urls}
{extra}""")
    return config


def start_kiln(stack: ExitStack, tmp: Path, backends: str | list[str], cpu: int | str | None,
               server: str = "uvicorn", nofile: tuple[int, int] = START_NOFILE, *, name: str = "kiln",
               workers: int = 1, env: dict[str, str] | None = None, extra_toml: str = "") -> Server:
    """`kiln serve` (uvicorn; `workers` > 1: `--workers N`), or the same app on Granian
    (bench/kiln_granian.py). `backends`: the simulator's URL, or several; `env`: more KILN_* settings."""
    urls = [backends] if isinstance(backends, str) else backends
    config, port, log = kiln_config(tmp, urls, name, extra_toml), free_port(), tmp / f"{name}.log"
    env = {**os.environ, "KILN_ADMIN_KEY": ADMIN_KEY, "KILN_CONFIG": str(config), "KILN_PORT": str(port),
           "KILN_DATA_DIR": str(tmp / f"{name}-data"), **(env or {})}
    if server == "granian":
        if workers > 1:
            raise BenchError("several Kiln workers are started by `kiln serve --workers N` (uvicorn) only")
        cmd = [PY, str(HERE / "kiln_granian.py")]
    else:
        cmd = [PY, "-m", "kiln", "serve", "--config", str(config), "--port", str(port)]
        cmd += ["--workers", str(workers)] if workers > 1 else []
    proc = spawn(stack, pinned(cmd, cpu), log, env=env, nofile=nofile)
    url = f"http://127.0.0.1:{port}"
    what = f"kiln ({server}" + (f", {workers} workers)" if workers > 1 else ")")
    # several workers: each binds the port itself; wait until all of them listen
    wait_until(lambda: (workers == 1 or listeners(port) >= workers) and _answers(url + "/health"), proc, log, what)
    return Server(name, url, proc, log)


def listeners(port: int) -> int:
    """Sockets listening on 127.0.0.1:`port` (one per worker: each binds it with SO_REUSEPORT)."""
    local = f"0100007F:{port:04X}"
    try:
        rows = Path("/proc/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return 1  # no /proc/net: trust /health alone
    return sum(1 for row in rows if (f := row.split())[1] == local and f[3] == "0A")


def start_bare(stack: ExitStack, tmp: Path, sim_url: str, cpu: int | None, server: str,
               nofile: tuple[int, int]) -> Server:
    port, log = free_port(), tmp / "bare.log"
    cmd = [PY, str(HERE / "bare_proxy.py"), "--upstream", sim_url, "--port", str(port), "--server", server]
    proc = spawn(stack, pinned(cmd, cpu), log, nofile=nofile)
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: _answers(url + "/health"), proc, log, f"bare proxy ({server})")
    return Server("bare", url, proc, log)


def start_litellm(stack: ExitStack, tmp: Path, sim_url: str, cpu: int | None,
                  nofile: tuple[int, int]) -> Server:
    """LiteLLM's proxy from its own venv: the simulator as an OpenAI-compatible (vLLM) backend,
    no database, no callbacks, no retries or cooldowns; Responses bridged to chat completions."""
    record = litellm_env.ensure()
    config, port, log = tmp / "litellm.yaml", free_port(), tmp / "litellm.log"
    config.write_text(f"""model_list:
  - model_name: {MODEL}
    litellm_params:
      model: hosted_vllm/{MODEL}
      api_base: {sim_url}/v1
      api_key: none
      use_chat_completions_api: true
litellm_settings:
  callbacks: []
  success_callback: []
  failure_callback: []
  drop_params: true
  telemetry: false
router_settings:
  disable_cooldowns: true
  num_retries: 0
general_settings:
  master_key: {LITELLM_KEY}
  disable_spend_logs: true
""")
    exe = litellm_env.python_of().parent / "litellm"
    env = {**{k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "VIRTUAL_ENV")},
           "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR", "LITELLM_MODE": "PRODUCTION"}
    cmd = [str(exe), "--config", str(config), "--host", "127.0.0.1", "--port", str(port), "--num_workers", "1"]
    proc = spawn(stack, pinned(cmd, cpu), log, env=env, nofile=nofile)
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: _answers(url + "/health/liveliness"), proc, log, f"LiteLLM {record['version']}", 180)
    return Server("litellm", url, proc, log)


def admin(kiln: Server, method: str, path: str, body: Any = None) -> dict[str, Any]:
    status, _, raw = http(method, f"{kiln.url}/admin/v1{path}", body, {"Authorization": f"Bearer {ADMIN_KEY}"})
    if status not in (200, 201):
        raise BenchError(f"admin {method} {path}: HTTP {status}: {raw!r}")
    return dict(json.loads(raw))


def create_tenant(kiln: Server) -> tuple[str, str]:
    """An org with large credits, a project and a key; returns (org_id, key)."""
    org = admin(kiln, "POST", "/orgs", {"name": f"bench-{secrets.token_hex(4)}", "credits": "100000000"})
    project = admin(kiln, "POST", "/projects", {"org_id": org["id"], "name": "bench"})
    key = admin(kiln, "POST", "/keys", {"project_id": project["id"], "name": "bench"})
    return org["id"], key["key"]


def usage_events(kiln: Server, org_id: str) -> int:
    return int(admin(kiln, "GET", f"/orgs/{org_id}")["usage_events"])


def set_sim_rules(sim: Server, rules: list[dict[str, Any]]) -> None:
    unique = list({r["when"]: r for r in rules}.values())
    status, _, raw = http("POST", sim.url + "/sim/config", {"rules": unique})
    if status != 200:
        raise BenchError(f"simulator rules: HTTP {status}: {raw!r}")


def forget_requests(sim: Server) -> None:
    http("DELETE", sim.url + "/sim/requests")


def first_upstream_body(sim: Server) -> dict[str, Any]:
    """The body of the first request the simulator received since forget_requests()."""
    status, _, raw = http("GET", sim.url + "/sim/requests")
    entries = json.loads(raw) if status == 200 else []
    if not entries:
        raise BenchError("the simulator recorded no request")
    return dict(entries[0]["body"])


def settle(server: Server, timeout: float = 30.0) -> None:
    """Wait until the server is idle (under 5% CPU over 0.2 s): a slow gateway may still be working
    off requests its client gave up on, which would disturb the next cell."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        before = server.cpu_seconds()
        time.sleep(0.2)
        if server.cpu_seconds() - before < 0.01:
            return


def cpus_for(no_pin: bool) -> tuple[int | None, int | None, str]:
    """(gateway CPU, simulator+load CPU, description)."""
    import shutil

    cpus = sorted(os.sched_getaffinity(0))
    if no_pin or len(cpus) < 2 or shutil.which("taskset") is None:
        why = "--no-pin" if no_pin else "taskset missing" if len(cpus) >= 2 else "fewer than 2 CPUs"
        return None, None, f"no CPU pinning ({why}); all processes share {len(cpus)} CPU(s)"
    return cpus[0], cpus[1], f"gateway on CPU {cpus[0]}, simulator and load generator on CPU {cpus[1]} (taskset)"
