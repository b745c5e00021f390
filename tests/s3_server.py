"""Test helper: a real S3-API server (moto's server mode) on 127.0.0.1, on a free port,
started and stopped, plus a TCP proxy that adds latency to each request.

Used by tests/test_storage.py and ``benchmarks/object_store.py``. ``restart()`` stops the
server and starts it again on the same port (moto keeps its objects in memory: the caller
uploads them again). The client side finds the server through the standard AWS
environment (:meth:`S3Server.env`: ``AWS_ENDPOINT_URL`` and test credentials).
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

try:
    from ports import port_candidate, stop_server
except ImportError:  # tests/ imported as a package (benchmarks)
    from tests.ports import port_candidate, stop_server

__all__ = ["S3Server", "LatencyProxy", "s3_server", "moto_available"]

SECRET = "s3cr3t-test-key-do-not-log"


def moto_available() -> bool:
    """Whether ``moto[server]`` and s3fs are installed."""
    try:
        import moto.server  # noqa: F401
        import s3fs  # noqa: F401
    except ImportError:
        return False
    return True


class S3Server:
    """``python -m moto.server`` on ``127.0.0.1:<port>``; ``extra_env`` goes to the server
    (e.g. ``INITIAL_NO_AUTH_ACTION_COUNT`` to check credentials after N requests)."""

    def __init__(self, extra_env: dict | None = None) -> None:
        self.port, self.proc, self.extra_env = port_candidate(), None, dict(extra_env or {})

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self, endpoint: str | None = None) -> dict[str, str]:
        """The AWS environment of a client of this server (or of ``endpoint``)."""
        return {"AWS_ENDPOINT_URL": endpoint or self.url, "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_DEFAULT_REGION": "us-east-1"}

    def start(self, timeout: float = 60.0, keep_port: bool = False) -> S3Server:
        """Start and wait until it answers (a new port candidate if the bind failed)."""
        for _ in range(10):
            env = dict(os.environ, **self.extra_env)
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                start_new_session=True)  # a signal to the test run's group is not for it
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and self.proc.poll() is None:
                with contextlib.suppress(OSError):
                    urllib.request.urlopen(self.url + "/moto-api/", timeout=1).close()
                    if self._listening():  # not another test run's server on this port
                        return self
                time.sleep(0.1)
            if self.proc.poll() is None:
                self.stop()
                raise RuntimeError(f"moto server did not answer on {self.url}")
            self.proc = None
            if not keep_port:
                self.port = port_candidate()
            time.sleep(0.2)
        raise RuntimeError("moto server could not bind a port")

    def _listening(self) -> bool:
        import psutil

        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(self.proc.pid)
            conns = getattr(proc, "net_connections", proc.connections)("tcp")
            return any(c.laddr.port == self.port and c.status == psutil.CONN_LISTEN
                       for c in conns)
        return False

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL) and wait for it."""
        stop_server(self.proc)
        self.proc = None

    def restart(self) -> None:
        """Stop and start again on the same port (every object is gone)."""
        self.stop()
        self.start(keep_port=True)

    def cpu_seconds(self) -> float:
        """User + system CPU time the server process has used."""
        import psutil
        t = psutil.Process(self.proc.pid).cpu_times()
        return t.user + t.system

    def client(self):
        """A boto3 S3 client of this server."""
        import boto3
        env = self.env()
        return boto3.client("s3", endpoint_url=self.url, region_name="us-east-1",
                            aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=SECRET)

    def upload(self, bucket: str, files: dict[str, bytes]) -> None:
        """Create ``bucket`` (if needed) and put ``{key: bytes}`` into it."""
        c = self.client()
        with contextlib.suppress(c.exceptions.BucketAlreadyOwnedByYou):
            c.create_bucket(Bucket=bucket)
        for key, data in files.items():
            c.put_object(Bucket=bucket, Key=key, Body=data)


class LatencyProxy:
    """A TCP proxy on 127.0.0.1 that holds each chunk the client sends (a request) for
    ``delay`` seconds before passing it on; counts the requests (``GET``/``HEAD`` lines).
    With ``cut``, a connection is closed after that many bytes of response (a transfer
    cut short)."""

    def __init__(self, target_port: int, delay: float = 0.0, cut: int | None = None) -> None:
        self.target, self.delay, self.cut = target_port, delay, cut
        self.counts: dict[str, int] = {}
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self._stop = False
        self.open = threading.Event()  # cleared: new requests wait
        self.open.set()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._pipe, args=(conn,), daemon=True).start()

    def _pipe(self, conn: socket.socket) -> None:
        self.open.wait()
        try:
            up = socket.create_connection(("127.0.0.1", self.target))
        except OSError:
            conn.close()
            return
        sent = 0
        with conn, up:
            while not self._stop:
                ready, _, _ = select.select([conn, up], [], [], 0.5)
                for s in ready:
                    data = s.recv(1 << 16)
                    if not data:
                        return
                    if s is conn:
                        self.open.wait()
                        verb = data.split(b" ", 1)[0].decode(errors="replace")
                        if verb.isupper():
                            self.counts[verb] = self.counts.get(verb, 0) + 1
                        if self.delay:
                            time.sleep(self.delay)
                    elif self.cut is not None:
                        data, sent = data[:max(0, self.cut - sent)], sent + len(data)
                        if sent > self.cut:
                            conn.sendall(data)
                            return
                    (up if s is conn else conn).sendall(data)

    def close(self) -> None:
        self._stop = True
        self.sock.close()


@pytest.fixture(scope="module")
def s3_server():
    """One moto S3 server per test module; skips without ``moto[server]``/s3fs."""
    if not moto_available():
        pytest.skip("needs moto[server] and s3fs (pip install -e '.[dev]')")
    server = S3Server().start()
    try:
        yield server
    finally:
        server.stop()
