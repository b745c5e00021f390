"""The embedded store's position records (``head``/``ack``): two CRC-checked slots updated
in place under the directory lock. Torn and half-written slots are produced on disk for
real (bytes written into the file, a writer process running concurrently, a SIGKILL in
the middle of a write loop), never mocked."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lit_roidata.exchange.embedded import _RECORD_SIZE, _SLOT_SIZE, EmbeddedStore

REPO = Path(__file__).resolve().parents[1]
KEY = "run/0/c/head"


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def test_record_roundtrip_versions_and_slots(tmp_path):
    store = EmbeddedStore(tmp_path)
    assert store.add(KEY, b"0 0")
    assert not store.add(KEY, b"9 9")  # add never overwrites
    path = tmp_path / KEY
    assert path.stat().st_size == _RECORD_SIZE
    for i in range(1, 6):
        done, cur = store.fence(KEY, b"%d 5" % i, 5)
        assert done and cur == (b"%d 5" % (i - 1) if i > 1 else b"0 0")
        other = EmbeddedStore(tmp_path)  # a fresh handle (another process) reads the same
        assert other.get(KEY) == b"%d 5" % i
        other.close()
    assert store.fence(KEY, b"6 4", 4) == (False, b"5 5")  # an older generation is refused
    assert store.get(KEY) == b"5 5"
    assert store.cas(KEY, b"5 5", b"6 5") and not store.cas(KEY, b"5 5", b"7 5")
    store.set(KEY, b"1")  # set writes in place as well
    assert store.get(KEY) == b"1"
    assert path.stat().st_size == _RECORD_SIZE  # never grows: updated in place
    store.close()


def test_a_torn_slot_leaves_the_previous_value_in_force(tmp_path):
    """What a writer killed in the middle of its pwrite would leave: the slot of the next
    version half-written. Readers see the previous value; the next write succeeds."""
    store = EmbeddedStore(tmp_path)
    store.add(KEY, b"0 1")
    store.fence(KEY, b"1 1", 1)  # version 1 in slot 1
    store.fence(KEY, b"2 1", 1)  # version 2 in slot 0
    path = tmp_path / KEY
    raw = bytearray(path.read_bytes())
    with open(path, "r+b") as f:  # version 3 would go to slot 1: tear it
        f.seek(_SLOT_SIZE + 12)
        f.write(b"\xff" * 20)
    assert bytes(raw[:_SLOT_SIZE]) == path.read_bytes()[:_SLOT_SIZE]
    reader = EmbeddedStore(tmp_path)
    assert reader.get(KEY) == b"2 1"
    assert store.fence(KEY, b"3 1", 1) == (True, b"2 1")
    assert reader.get(KEY) == b"3 1"
    # Both slots damaged (not a crash: the file was overwritten): a clear error.
    with open(path, "r+b") as f:
        f.seek(12)
        f.write(b"\x00" * 20)
        f.seek(_SLOT_SIZE + 12)
        f.write(b"\x00" * 20)
    with pytest.raises(Exception, match="damaged"):
        EmbeddedStore(tmp_path).get(KEY)
    store.close()
    reader.close()


def test_a_deleted_and_recreated_channel_is_not_read_through_an_old_handle(tmp_path):
    store, other = EmbeddedStore(tmp_path), EmbeddedStore(tmp_path)
    store.add(KEY, b"5 1")
    assert other.get(KEY) == b"5 1"  # other now holds the file (and the lock file) open
    other.fence(KEY, b"6 1", 1)
    store.delete_namespace("run/0/c")  # the channel is finished and removed
    assert other.get(KEY) is None  # not the removed file's last value
    store.add(KEY, b"0 0")  # a new channel with the same name
    assert other.get(KEY) == b"0 0"
    assert other.fence(KEY, b"1 2", 2) == (True, b"0 0")  # writes the new file
    assert store.get(KEY) == b"1 2"
    store.close()
    other.close()


WRITER = r"""
import sys
from lit_roidata.exchange.embedded import EmbeddedStore
store = EmbeddedStore(sys.argv[1])
print("ready", flush=True)
i = 0
while True:  # until killed (or the count is reached)
    i += 1
    done, cur = store.fence("run/0/c/head", b"%d 1" % i, 1)
    assert done and cur == b"%d 1" % (i - 1), (i, cur)
    if i == int(sys.argv[2]):
        break
"""


def test_concurrent_readers_never_see_a_torn_or_backward_value(tmp_path):
    """A writer process rewrites head as fast as it can; lock-free reads here must always
    parse and never go backwards. Then a writer is SIGKILLed mid-loop: the value it leaves
    is complete and the next writer continues from it."""
    store = EmbeddedStore(tmp_path)
    store.add(KEY, b"0 1")
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), "20000"],
                            env=_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        last, reads = 0, 0
        while proc.poll() is None or reads == 0:
            seq, gen = store.get(KEY).split(b" ")
            assert gen == b"1" and int(seq) >= last
            last, reads = int(seq), reads + 1
        assert proc.wait(timeout=60) == 0
        assert store.get(KEY) == b"20000 1" and reads > 10
    finally:
        if proc.poll() is None:
            proc.kill()
    store.set(KEY, b"0 1")
    for delay in (0.05, 0.13, 0.31):
        proc = subprocess.Popen([sys.executable, "-c", WRITER.replace(
            "i = 0", "i = int(store.get('run/0/c/head').split()[0])"), str(tmp_path), "-1"],
            env=_env(), stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(delay)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        seq, gen = store.get(KEY).split(b" ")  # complete, and the next write goes on
        assert gen == b"1"
        assert store.fence(KEY, b"%d 1" % (int(seq) + 1), 1) == (True, b"%s 1" % seq)
    store.close()
