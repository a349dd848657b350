"""A private ``redis-server`` for tests: started on a free port, stopped (or killed) on demand.

Tests run against a real Redis, never a fake: ``tests/conftest.py`` starts one
per session (``redis_url``), and tests that kill Redis on purpose start their
own (``redis_server`` fixture) so the others keep theirs::

    server = RedisServer(tmp_path).start()
    ...                          # server.url
    server.kill(); server.start()   # the same port and settings again
    server.stop()
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis

__all__ = ["REDIS_SERVER", "RedisServer", "delete_prefix", "free_port", "make_tls_certs",
           "wait_for_ping"]

# The binary; tests that need one fail with this name in the message when it is missing.
REDIS_SERVER = os.environ.get("JITSERVE_TEST_REDIS_SERVER") or shutil.which("redis-server") \
    or "/usr/bin/redis-server"


def free_port() -> int:
    """A TCP port that was free a moment ago (the OS's pick for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def delete_prefix(redis_url: str, prefix: str) -> None:
    """Delete the keys of the deployment ``prefix``, if that Redis is up."""
    client = redis.Redis.from_url(redis_url, socket_connect_timeout=1, socket_timeout=5)
    try:
        keys = list(client.scan_iter(match=f"jitserve:*:{prefix}:*", count=500))
        if keys:
            client.delete(*keys)
    except redis.RedisError:
        pass  # a test that stopped this Redis has nothing left to clean
    finally:
        client.close()


def wait_for_ping(url: str, timeout_s: float = 10.0) -> None:
    """Block until the Redis at ``url`` answers PING; ``TimeoutError`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    client = redis.Redis.from_url(url, socket_connect_timeout=0.2, socket_timeout=0.5)
    try:
        while True:
            try:
                if client.ping():
                    return
            except redis.RedisError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no Redis at {url} after {timeout_s} s") from None
                time.sleep(0.05)
    finally:
        client.close()


def make_tls_certs(directory: Path) -> Path:
    """A throwaway CA and a server certificate for 127.0.0.1 in ``directory`` (needs openssl)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1\n")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key",
            "-out", "ca.crt", "-days", "1", "-subj", "/CN=jitserve-test-ca")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key",
            "-out", "server.csr", "-subj", "/CN=127.0.0.1")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", "server.crt", "-days", "1", "-extfile", "ext.cnf")
    return directory


class RedisServer:
    """One ``redis-server`` process in ``workdir``: no persistence, LRU-bounded memory.

    It runs with the settings docs/redis.md recommends (``maxmemory`` with
    ``allkeys-lru``, no RDB or AOF), so the tests exercise them.
    """

    def __init__(self, workdir: Path, port: int | None = None, maxmemory: str = "512mb",
                 *, password: str | None = None, tls_dir: Path | None = None) -> None:
        """``password`` sets ``requirepass``; ``tls_dir`` (with ``ca.crt``, ``server.crt``,
        ``server.key``) makes the server speak TLS only."""
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.maxmemory = maxmemory
        self.password, self.tls_dir = password, tls_dir
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        if self.tls_dir is None:
            return f"redis://{auth}127.0.0.1:{self.port}/0"
        return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={self.tls_dir / 'ca.crt'}"

    def _args(self) -> list[str]:
        args = ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.workdir), "--maxmemory", self.maxmemory,
                "--maxmemory-policy", "allkeys-lru"]
        if self.password:
            args += ["--requirepass", self.password]
        if self.tls_dir is None:
            return ["--port", str(self.port), *args]
        return ["--port", "0", "--tls-port", str(self.port), "--tls-auth-clients", "no",
                "--tls-cert-file", str(self.tls_dir / "server.crt"),
                "--tls-key-file", str(self.tls_dir / "server.key"),
                "--tls-ca-cert-file", str(self.tls_dir / "ca.crt"), *args]

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        """Start (or restart) the server on its port and wait until it answers."""
        if self.process is not None and self.process.poll() is None:
            return self
        log = open(self.workdir / "redis.log", "ab")  # noqa: SIM115 - handed to the child
        self.process = subprocess.Popen(
            [REDIS_SERVER, *self._args()], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        try:
            wait_for_ping(self.url, timeout_s)
        except TimeoutError:
            self.stop()
            raise
        return self

    def kill(self) -> None:
        """SIGKILL the server (a crash: nothing is saved) and reap it."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def stop(self) -> None:
        """Stop the server politely, or kill it after a few seconds."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(Exception):
            self.stop()
