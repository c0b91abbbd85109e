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
    """`options`: more redis-server flags (a password, a socket file, TLS: see `tls_options`)."""

    def __init__(self, *options: str) -> None:
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="kiln-redis-"))
        self.proc: subprocess.Popen[bytes] | None = None
        self.options = options

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def socket(self) -> Path:
        """Where `--unixsocket` may put its socket file."""
        return self.dir / "redis.sock"

    def tls_options(self, port: int) -> tuple[str, ...]:
        """Flags for TLS on `port`, with a certificate for localhost and 127.0.0.1 signed by a CA
        made here (`self.dir / "ca.crt"`), by the openssl command."""
        d = self.dir

        def openssl(*args: str) -> None:
            subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

        openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(d / "ca.key"), "-out",
                str(d / "ca.crt"), "-days", "2", "-subj", "/CN=kiln-test-ca")
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(d / "server.key"), "-out",
                str(d / "server.csr"), "-subj", "/CN=localhost")
        (d / "ext.cnf").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
        openssl("x509", "-req", "-in", str(d / "server.csr"), "-CA", str(d / "ca.crt"), "-CAkey", str(d / "ca.key"),
                "-CAcreateserial", "-out", str(d / "server.crt"), "-days", "2", "-extfile", str(d / "ext.cnf"))
        return ("--tls-port", str(port), "--tls-cert-file", str(d / "server.crt"), "--tls-key-file",
                str(d / "server.key"), "--tls-ca-cert-file", str(d / "ca.crt"), "--tls-auth-clients", "no")

    def start(self) -> None:
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.dir), *self.options], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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
