"""Test helper: ports for servers the tests start, without the bind-close-rebind race.

Picking a port by binding a socket to port 0, closing it and handing the number to another
process is a race: anything on the machine can take the port in between. The tests avoid
it in two ways:

- DDP rendezvous (:func:`ddp_rendezvous_env`): this process hosts the rendezvous store
  itself, on a port the kernel picks and that stays bound for the whole launch; every rank,
  rank 0 included, connects to it as a client (``TORCHELASTIC_USE_AGENT_STORE``, the way
  torchrun's agent serves the store), so no rank ever binds ``MASTER_PORT``.
- Servers that must bind their own port (memcached): :func:`port_candidate` only proposes
  a number; the caller starts the server, detects "address in use" from its exit, and
  retries with another candidate (see ``memcached_server.MemcachedServer.start``).
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
from typing import Iterator

__all__ = ["ddp_rendezvous_env", "port_candidate", "stop_server"]


def port_candidate(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago: a candidate only, not a reservation.

    The caller must detect that its server failed to bind it and retry with a new one.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def ddp_rendezvous_env(host: str = "127.0.0.1") -> Iterator[dict[str, str]]:
    """Environment for one DDP launch whose rendezvous store this process hosts.

    Yields ``MASTER_ADDR``/``MASTER_PORT``/``TORCHELASTIC_USE_AGENT_STORE`` to put into the
    environment of every rank (Lightning's launcher passes them on to the ranks it starts,
    and ``torch.distributed.init_process_group`` then makes every rank a client of this
    store). The store keeps its port bound until the block exits; use one block per launch
    (a store's keys from one process group would confuse the next one's rendezvous).
    """
    from torch.distributed import TCPStore

    store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
    try:
        yield {"MASTER_ADDR": host, "MASTER_PORT": str(store.port),
               "TORCHELASTIC_USE_AGENT_STORE": "True"}
    finally:
        del store


def stop_server(proc: subprocess.Popen | None) -> None:
    """Stop a server process the tests started (SIGTERM, then SIGKILL) and wait for it."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
