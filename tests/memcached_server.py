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

try:
    from ports import port_candidate, stop_server
except ImportError:  # tests/ imported as a package (benchmarks)
    from tests.ports import port_candidate, stop_server

__all__ = ["MemcachedServer", "memcached_server", "memcached_path"]


def memcached_path() -> str | None:
    """Path of the memcached binary, or ``None`` if it is not installed."""
    return shutil.which("memcached") or ("/usr/bin/memcached"
                                         if os.path.exists("/usr/bin/memcached") else None)


class _BindError(RuntimeError):
    pass


def _server_pid(sock: socket.socket) -> int | None:
    """The pid a memcached server reports in ``stats`` (``None`` if it does not answer)."""
    sock.sendall(b"stats\r\n")
    data = b""
    while not data.endswith(b"END\r\n"):
        chunk = sock.recv(65536)
        if not chunk:
            return None
        data += chunk
    for line in data.split(b"\r\n"):
        if line.startswith(b"STAT pid "):
            return int(line.split()[2])
    return None


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
        self.port = port or port_candidate()
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        """``"127.0.0.1:<port>"``."""
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 10.0) -> MemcachedServer:
        """Start the server and wait until it answers ``version``.

        The port is only a candidate (``ports.port_candidate``): another process can take
        it before memcached binds it. memcached then exits with "address in use", which is
        detected here and a new candidate is tried (a fixed or restarted port is retried
        for a few seconds instead). The server that answers must report this process's pid
        (``stats``), so a foreign server that won the port is never taken for ours.
        """
        for attempt in range(20):
            try:
                return self._start_once(timeout)
            except _BindError:
                if not self._fixed_port and self.proc is None and attempt < 5:
                    self.port = port_candidate()
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
                    if _server_pid(s) == self.proc.pid:
                        return self
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"memcached did not answer on port {self.port} within {timeout}s")

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL) and wait for it."""
        if self.proc is None:
            return
        stop_server(self.proc)
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
