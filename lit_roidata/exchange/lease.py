"""Ownership leases: one producer and one consumer per channel, dead owners detected.

Each end holds a lease record (JSON) with a TTL refreshed by a heartbeat. A peer is
*absent* (no record), *dead* (its process is gone, seen at once on the same kernel) or
*alive* (a record on another machine is trusted until its TTL runs out).
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from dataclasses import asdict, dataclass
from functools import lru_cache

import orjson
import psutil

__all__ = ["LeaseRecord", "host_identity", "peer_liveness"]


@lru_cache(maxsize=1)
def host_identity() -> str:
    """An id equal for processes that can see each other's PIDs (same boot, same PID ns)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return f"host:{socket.gethostname()}"


@dataclass(frozen=True)
class LeaseRecord:
    """Who owns one end of a channel."""

    token: str
    role: str
    pid: int
    hostname: str
    host_id: str
    create_time: float  # process start time, to tell a reused PID from the owner
    opened_at: float
    gen: int = 0  # lease generation: the fencing token of every write by this owner

    @classmethod
    def mine(cls, role: str, gen: int = 0) -> LeaseRecord:
        """A fresh record for this process, holding lease generation ``gen``."""
        try:
            created = psutil.Process().create_time()
        except psutil.Error:
            created = 0.0
        return cls(token=uuid.uuid4().hex, role=role, pid=os.getpid(),
                   hostname=socket.gethostname(), host_id=host_identity(),
                   create_time=created, opened_at=time.time(), gen=gen)

    def dumps(self) -> bytes:
        """Serialise to the stored value."""
        return orjson.dumps(asdict(self))

    @classmethod
    def loads(cls, raw: bytes | None) -> LeaseRecord | None:
        """Parse a stored value; ``None`` if it is none or not a lease record."""
        try:
            return cls(**orjson.loads(raw))
        except (orjson.JSONDecodeError, TypeError):
            return None

    def describe(self) -> str:
        """``"producer pid 123 on host"`` for error messages."""
        return f"{self.role} pid {self.pid} on {self.hostname}"


def peer_liveness(record: LeaseRecord | None) -> str:
    """``"absent"``, ``"dead"`` or ``"alive"`` for a stored lease record (see module doc)."""
    if record is None:
        return "absent"
    if record.host_id != host_identity():
        return "alive"
    try:
        proc = psutil.Process(record.pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return "dead"
        reused = record.create_time and abs(proc.create_time() - record.create_time) > 1.0
    except psutil.NoSuchProcess:
        return "dead"
    except psutil.AccessDenied:
        return "alive"
    return "dead" if reused else "alive"  # (reused: the PID now names another process)
