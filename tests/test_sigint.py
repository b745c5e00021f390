"""Ctrl-C during `lit-roidata fit` (the whole process group, as from a terminal).

The first Ctrl-C stops at the next step boundary (GracefulStop): the workers survive it,
the run writes its checkpoint, exits with 128 + SIGINT and leaves no process behind; the
same command resumes exactly. Two Ctrl-C abort (Lightning's KeyboardInterrupt path:
OnExceptionCheckpoint); the same command still resumes the data stream exactly.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from datamodule_support import REPO, cli_env, read_records, run_cli, tiny_config

REC = "datamodule_support.IndexRecorder"
STEPS = 16

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")]


def _config(root: Path, tmp_path: Path, name: str, rec: Path, delay: float = 0.0) -> Path:
    # ``delay``: the interrupted run sleeps after each recorded step, so that its signals
    # land in training (the loader is fast enough to finish the run first otherwise).
    return tiny_config(root, tmp_path / f"{name}.yaml", run=name,
                       trainer={"max_steps": STEPS, "limit_val_batches": 0},
                       callbacks=[{"class_path": REC,
                                   "init_args": {"path": str(rec), "delay": delay}}],
                       data={"num_workers": 2})


def _reference(root: Path, tmp_path: Path) -> list[list[int]]:
    rec = tmp_path / "ref"
    res = run_cli("fit", "--config", str(_config(root, tmp_path, "ref", rec)))
    assert res.returncode == 0, res.stderr[-3000:]
    reference = [r["indices"] for r in read_records(rec)]
    assert len(reference) == STEPS
    return reference


def _default_sigint() -> None:
    # What a terminal gives the command. A test run started as a background job of a
    # non-interactive shell (`bash .ci/run &`) ignores SIGINT, the child would inherit
    # that, and Python installs its KeyboardInterrupt handler only over the default.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupt(cfg: Path, rec: Path, presses: int, sig: int = signal.SIGINT
               ) -> tuple[int, str, list]:
    """Run ``fit`` in a new session, send ``sig`` to the whole process group ``presses``
    times after 3 steps (Ctrl-C, or a scheduler's SIGTERM); return its exit status, its
    output and its worker processes."""
    proc = subprocess.Popen([sys.executable, "-m", "lit_roidata.cli", "fit", "--config",
                             str(cfg)], cwd=REPO, env=cli_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=_default_sigint)
    try:
        deadline = time.time() + 240
        while len(read_records(rec)) < 3 and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, "training ended before Ctrl-C: " + proc.stdout.read()[-2000:]
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children, "expected DataLoader worker processes"
        sent = time.time()
        for _ in range(presses):
            os.killpg(proc.pid, sig)  # the whole group: the workers too
            time.sleep(0.1)
        out, _ = proc.communicate(timeout=120)
        out += f"\n[exited {time.time() - sent:.1f} s after the signal]"
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, out, children


def _no_orphans(children: list) -> None:
    _, alive = psutil.wait_procs(children, timeout=10)
    alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"orphan processes after Ctrl-C: {alive}"


def test_first_ctrl_c_stops_gracefully_and_the_rerun_resumes_exactly(root: Path,
                                                                     tmp_path: Path) -> None:
    reference = _reference(root, tmp_path)
    rec = tmp_path / "run"
    cfg = _config(root, tmp_path, "run", rec, delay=0.25)
    status, out, children = _interrupt(cfg, rec, presses=1)
    assert "SIGINT: stopping after this step; Ctrl-C again to abort" in out, out[-3000:]
    assert "KeyboardInterrupt" not in out, out[-3000:]
    assert status == 128 + signal.SIGINT, (status, out[-3000:])
    _no_orphans(children)
    ckpt = tmp_path / "run" / "interrupted" / "interrupted.ckpt"
    assert ckpt.is_file() and f"checkpoint {ckpt}" in out, out[-2000:]
    done = [r["indices"] for r in read_records(rec)]
    assert 3 <= len(done) < STEPS and done == reference[:len(done)]

    res = run_cli("fit", "--config", str(cfg))  # the same command again
    assert res.returncode == 0, res.stderr[-3000:]
    assert [r["indices"] for r in read_records(rec)] == reference
    assert not ckpt.exists()  # the finished run leaves no stop checkpoint behind


def test_second_ctrl_c_aborts_and_the_rerun_resumes_the_stream(root: Path,
                                                              tmp_path: Path) -> None:
    reference = _reference(root, tmp_path)
    rec = tmp_path / "run"
    cfg = _config(root, tmp_path, "run", rec, delay=0.5)
    status, out, children = _interrupt(cfg, rec, presses=2)
    assert "Ctrl-C again to abort" in out and "KeyboardInterrupt" in out, out[-3000:]
    assert status == 1, (status, out[-3000:])  # Lightning's abort
    _no_orphans(children)
    assert (tmp_path / "run" / "interrupted" / "on_exception.ckpt").is_file(), out[-2000:]
    done = [r["indices"] for r in read_records(rec)]
    assert 3 <= len(done) < STEPS and done == reference[:len(done)]

    res = run_cli("fit", "--config", str(cfg))
    assert res.returncode == 0, res.stderr[-3000:]
    assert [r["indices"] for r in read_records(rec)] == reference  # exactly once


def test_sigterm_to_the_process_group_stops_gracefully(root: Path, tmp_path: Path) -> None:
    """What SLURM and Kubernetes do on preemption: SIGTERM to every process of the job. The
    workers ignore it, the run stops at the next step boundary with a checkpoint and exits
    with 128 + SIGTERM within seconds; the same command resumes exactly."""
    reference = _reference(root, tmp_path)
    rec = tmp_path / "run"
    cfg = _config(root, tmp_path, "run", rec, delay=0.25)
    status, out, children = _interrupt(cfg, rec, presses=1, sig=signal.SIGTERM)
    assert "SIGTERM: stopping after this step" in out, out[-3000:]
    assert "killed by signal" not in out and "Traceback" not in out, out[-3000:]
    assert status == 128 + signal.SIGTERM, (status, out[-3000:])
    waited = float(out.rsplit("[exited ", 1)[1].split(" s")[0])
    assert waited < 15, out[-500:]
    _no_orphans(children)
    ckpt = tmp_path / "run" / "interrupted" / "interrupted.ckpt"
    assert ckpt.is_file(), out[-2000:]
    done = [r["indices"] for r in read_records(rec)]
    assert 3 <= len(done) < STEPS and done == reference[:len(done)]
    res = run_cli("fit", "--config", str(cfg))
    assert res.returncode == 0, res.stderr[-3000:]
    assert [r["indices"] for r in read_records(rec)] == reference
