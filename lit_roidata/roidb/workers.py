"""Forked worker processes for the cold build: one function over many tasks, results in order."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import signal
from collections import deque
from typing import Any, Callable, Iterator, Sequence

import numpy as np

__all__ = ["OrderedWorkers", "WorkerDied", "WorkerFailed", "build_workers", "map_ordered"]

_MAX_WORKERS = 8


class WorkerFailed(Exception):
    """A task raised in its worker (``__cause__`` is its exception when it could be sent
    back), or a worker died (:class:`WorkerDied`)."""


class WorkerDied(WorkerFailed):
    """A worker process ended (killed, out of memory): the workers are unusable."""


def build_workers() -> int:
    """The number of build worker processes to use (``0``: build in this process)."""
    env = os.environ.get("LIT_ROIDATA_BUILD_WORKERS", "").strip()
    if env:
        try:
            n = int(env)
        except ValueError:
            raise ValueError(f"LIT_ROIDATA_BUILD_WORKERS={env!r}: expected a number of "
                             f"processes (0 or 1: build in one process)") from None
    else:  # os.sched_getaffinity: Linux only
        n = min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                else os.cpu_count() or 1, _MAX_WORKERS)
    return n if n > 1 and "fork" in multiprocessing.get_all_start_methods() else 0


def _serve(fn: Callable[[Any, dict], Any], conn: Any) -> None:
    """A worker's loop: ``("set", dict)`` updates its state, ``("task", x)`` answers
    ``fn(x, state)``, ``None`` ends it."""
    # Ctrl-C is the caller's: it stops the build and ends the workers (no traceback here)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    state: dict = {}
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        kind, payload = msg
        if kind == "set":
            state.update(payload)
            continue
        try:
            out: tuple = ("ok", fn(payload, state))
        except BaseException as exc:  # noqa: BLE001 - the caller decides what it means
            out = ("err", exc)
        try:
            bufs: list = []  # arrays' data out of band: sent from their memory, no copies
            head = pickle.dumps(out, protocol=5, buffer_callback=bufs.append)
        except Exception:  # noqa: BLE001 - an exception that does not pickle
            bufs, head = [], pickle.dumps(("err", RuntimeError(f"{type(out[1]).__name__}: "
                                                               f"{out[1]}")))
        raws = [b.raw() for b in bufs]
        conn.send((head, [r.nbytes for r in raws]))
        for r in raws:  # raw bytes on the pipe (their sizes went ahead)
            while r:
                r = r[os.write(conn.fileno(), r):]


class OrderedWorkers:
    """``n`` forked processes running ``fn(task, state)`` (they see everything the caller
    had at construction); results in submission order. ``daemon`` processes cannot fork
    workers of their own."""

    def __init__(self, fn: Callable[[Any, dict], Any], n: int, *, daemon: bool = True) -> None:
        ctx = multiprocessing.get_context("fork")
        self.n = max(1, int(n))
        # pipes, processes, the worker index of each task not yet read back, next worker
        self._conns, self._procs, self._owner, self._next = [], [], deque(), 0
        try:
            for _ in range(self.n):
                mine, theirs = ctx.Pipe()
                p = ctx.Process(target=_serve, args=(fn, theirs), daemon=daemon,
                                name="lit-roidata-build")
                p.start()
                theirs.close()
                self._conns.append(mine)
                self._procs.append(p)
        except BaseException:
            self.close()
            raise

    @property
    def alive(self) -> bool:
        """Whether the processes still run (not closed)."""
        return bool(self._conns)

    @property
    def pending(self) -> int:
        """Tasks submitted whose result has not been read."""
        return len(self._owner)

    def submit(self, task: Any) -> None:
        """Send ``task`` to the next worker (round-robin)."""
        k, self._next = self._next, (self._next + 1) % self.n
        self._send(k, ("task", task))
        self._owner.append(k)

    def broadcast(self, state: dict) -> None:
        """Update every worker's ``state`` with ``state`` (after the tasks already sent)."""
        for k in range(self.n):
            self._send(k, ("set", state))

    def result(self) -> Any:
        """The result of the oldest unread task; :class:`WorkerFailed` if the task raised
        (its exception is the ``__cause__``) or its worker died."""
        k = self._owner.popleft()
        try:
            head, sizes = self._conns[k].recv()
            bufs = [np.empty(n, np.uint8) for n in sizes]  # read in place, no copy
            for b in map(memoryview, bufs):
                while b:
                    got = os.readv(self._conns[k].fileno(), [b])
                    if not got:
                        raise EOFError
                    b = b[got:]
            kind, value = pickle.loads(head, buffers=bufs)
        except (EOFError, OSError) as exc:
            raise self._died(k, "; is the machine out of memory?") from exc
        if kind == "err":
            raise WorkerFailed(f"{type(value).__name__}: {value}") from value
        return value

    def stream(self, tasks: Iterator[Any], depth: int) -> Iterator[tuple[Any, Any]]:
        """``(task, result)`` for each of ``tasks`` in order, at most ``depth`` in flight
        (tasks are drawn as results come back); raises as :meth:`result`."""
        sent: deque = deque()
        for task in tasks:
            self.submit(task)
            sent.append(task)
            if len(sent) >= depth:
                yield sent.popleft(), self.result()
        while sent:
            yield sent.popleft(), self.result()

    def discard(self) -> bool:
        """Read and drop every pending result; ``False`` (and closed) if a worker died
        or the workers were closed."""
        while self._owner:
            try:
                self.result()
            except WorkerDied:
                self.close()
            except WorkerFailed:
                pass
        return self.alive

    def _send(self, k: int, msg: Any) -> None:
        if not self._conns:
            raise WorkerDied("the build workers were closed")
        try:
            self._conns[k].send(msg)
        except OSError as exc:  # BrokenPipeError included
            raise self._died(k) from exc

    def _died(self, k: int, hint: str = "") -> WorkerDied:
        return WorkerDied(f"a build worker process ended (exit code "
                          f"{self._procs[k].exitcode}){hint}")

    def close(self) -> None:
        """End the processes (those busy with a task are terminated)."""
        busy = set(self._owner)
        for k, conn in enumerate(self._conns):
            if k not in busy:
                with contextlib.suppress(OSError):  # BrokenPipeError included
                    conn.send(None)
        for k, p in enumerate(self._procs):
            if k in busy:
                p.terminate()
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        for conn in self._conns:
            conn.close()
        self._conns, self._procs, self._owner = [], [], deque()

    def __enter__(self) -> "OrderedWorkers":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def map_ordered(fn: Callable[[Any, dict], Any], tasks: Sequence[Any], n: int) -> Iterator[Any]:
    """Yield ``fn(task, {})`` for each of ``tasks`` in order, computed by ``n`` forked
    workers (``n <= 1`` or after a worker's death: here); a task's error is raised."""
    done = 0
    if n > 1:
        with OrderedWorkers(fn, n) as w:
            try:
                for _, out in w.stream(iter(tasks), 2 * n):
                    yield out
                    done += 1
            except WorkerDied:
                pass
            except WorkerFailed as exc:
                raise exc.__cause__ from None
    for t in tasks[done:]:
        yield fn(t, {})
