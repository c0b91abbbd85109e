"""Private Redis and PostgreSQL servers for the tests that stop and restart them.

The machine's shared servers (127.0.0.1:6379 and :5432) serve other work too
and are never stopped by a test: a test that takes a server away starts its
own, on a free port, from the same binaries. Redis keeps nothing on disk, so
a restart loses its data (which is the point). PostgreSQL refuses to run as
root: its data directory is owned by, and the server run as, the `postgres`
system user when the tests run as root.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from conftest import free_port


def _wait_port(port: int, up: bool, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                if up:
                    return
        except OSError:
            if not up:
                return
        time.sleep(0.05)
    raise RuntimeError(f"port {port} did not go {'up' if up else 'down'}")


class RedisServer:
    def __init__(self) -> None:
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="kiln-redis-"))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.dir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_port(self.port, up=True)

    def stop(self) -> None:
        """Stop it; what it held is gone (nothing is saved)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None
            _wait_port(self.port, up=False)


def _pg_bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    if not found:
        raise RuntimeError(f"PostgreSQL's {name} not found under /usr/lib/postgresql")
    return found[-1]


class PostgresServer:
    """initdb + pg_ctl in a temp dir, on a free port, trust auth for `postgres` on 127.0.0.1."""

    def __init__(self) -> None:
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="kiln-pg-"))
        self.data = self.dir / "data"
        self.as_postgres = os.geteuid() == 0
        if self.as_postgres:
            shutil.chown(self.dir, "postgres", "postgres")
        self._run(_pg_bin("initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8")

    @property
    def dsn(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *cmd: str) -> None:
        prefix = ["runuser", "-u", "postgres", "--"] if self.as_postgres else []
        subprocess.run([*prefix, *cmd], check=True, capture_output=True, timeout=120)

    def start(self) -> None:
        self._run(_pg_bin("pg_ctl"), "-D", str(self.data), "-l", str(self.dir / "log"), "-w", "-o",
                  f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off", "start")
        _wait_port(self.port, up=True)

    def stop(self) -> None:
        self._run(_pg_bin("pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop")

    def destroy(self) -> None:
        try:
            self.stop()
        except subprocess.CalledProcessError:
            pass
        shutil.rmtree(self.dir, ignore_errors=True)
