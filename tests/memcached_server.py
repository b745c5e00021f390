"""Test helper: a real memcached server on 127.0.0.1, on a free port, started and stopped.

Used by the BlobExchange tests and ``benchmarks/exchange.py``. The ``memcached_server``
fixture starts one server per test module (``-I`` sets the item size limit, so payloads
above it are chunked by the exchange) and stops it afterwards; ``restart()`` simulates a
server restart (all state lost) on the same port.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

import pytest

__all__ = ["MemcachedServer", "memcached_server", "memcached_path"]


def memcached_path() -> str | None:
    """Path of the memcached binary, or ``None`` if it is not installed."""
    return shutil.which("memcached") or ("/usr/bin/memcached"
                                         if os.path.exists("/usr/bin/memcached") else None)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _BindError(RuntimeError):
    pass


class MemcachedServer:
    """A memcached process on ``127.0.0.1:<port>``.

    Args:
        item_size: ``-I`` value (item size limit), e.g. ``"1m"``.
        memory_mb: ``-m`` value (cache memory in MB).
        port: a fixed port; default: a free one.
    """

    def __init__(self, item_size: str = "1m", memory_mb: int = 256,
                 port: int | None = None) -> None:
        binary = memcached_path()
        if binary is None:
            raise FileNotFoundError("memcached is not installed (apt-get install memcached)")
        self.binary, self.item_size, self.memory_mb = binary, item_size, memory_mb
        self._fixed_port = port is not None
        self.port = port or _free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        """``"127.0.0.1:<port>"``."""
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 10.0) -> MemcachedServer:
        """Start the server and wait until it answers ``version``.

        The free port is probed by binding and closing a socket, so another process can
        take it before memcached binds it: if memcached fails to bind, a new free port is
        tried (a fixed or restarted port is retried for a few seconds instead).
        """
        for attempt in range(20):
            try:
                return self._start_once(timeout)
            except _BindError:
                if not self._fixed_port and self.proc is None and attempt < 5:
                    self.port = _free_port()
                time.sleep(0.1 * (attempt + 1) if self._fixed_port else 0)
        raise RuntimeError(f"memcached could not bind a port (last tried {self.port})")

    def _start_once(self, timeout: float) -> MemcachedServer:
        cmd = [self.binary, "-l", "127.0.0.1", "-p", str(self.port), "-U", "0",
               "-I", self.item_size, "-m", str(self.memory_mb), "-t", "2"]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            cmd += ["-u", "root"]  # memcached refuses to run as root without -u
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                code = self.proc.returncode
                self.proc = None
                if "bind" in err.lower() or "in use" in err.lower():
                    raise _BindError(err)
                raise RuntimeError(f"memcached exited with {code}: {err}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"version\r\n")
                    if s.recv(64).startswith(b"VERSION"):
                        return self
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"memcached did not answer on port {self.port} within {timeout}s")

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL) and wait for it."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stderr:
            self.proc.stderr.close()
        self.proc = None

    def restart(self) -> None:
        """Stop and start again on the same port: every item is gone."""
        self.stop()
        fixed, self._fixed_port = self._fixed_port, True  # keep the address
        try:
            self.start()
        finally:
            self._fixed_port = fixed

    def __enter__(self) -> MemcachedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@pytest.fixture(scope="module")
def memcached_server():
    """One memcached (``-I 1m``) per test module; skips if memcached is not installed."""
    if memcached_path() is None:
        pytest.skip("memcached is not installed (.ci/run installs it with apt-get)")
    server = MemcachedServer(item_size="1m").start()
    try:
        yield server
    finally:
        server.stop()
