"""Ctrl-C during `lit-roidata fit`: workers stop, no orphans, and the run resumes exactly."""

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


def _config(root: Path, tmp_path: Path, name: str, rec: Path, run: str,
            delay: float = 0.0) -> Path:
    # ``delay``: the interrupted run sleeps after each recorded step, so that the rest of
    # the run (13 steps) outlasts the signal's way to the process: the loader got fast
    # enough that an undelayed run could finish first, and the Ctrl-C land in teardown.
    return tiny_config(root, tmp_path / f"{name}.yaml", run=run,
                       trainer={"max_steps": 16, "limit_val_batches": 0},
                       callbacks=[{"class_path": REC,
                                   "init_args": {"path": str(rec), "delay": delay}}],
                       data={"num_workers": 2})


def _default_sigint() -> None:
    # What a terminal gives the command. A test run started as a background job of a
    # non-interactive shell (`bash .ci/run &`) ignores SIGINT, the child would inherit
    # that, and Python installs its KeyboardInterrupt handler only over the default.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_sigint_stops_workers_and_the_rerun_resumes_exactly(root: Path, tmp_path: Path) -> None:
    ref_rec = tmp_path / "ref"
    res = run_cli("fit", "--config", str(_config(root, tmp_path, "ref", ref_rec, "ref")))
    assert res.returncode == 0, res.stderr[-3000:]
    reference = [r["indices"] for r in read_records(ref_rec)]
    assert len(reference) == 16

    rec = tmp_path / "run"
    cfg = _config(root, tmp_path, "run", rec, "run", delay=0.25)
    # A new session, like a shell job: Ctrl-C reaches the whole process group.
    proc = subprocess.Popen([sys.executable, "-m", "lit_roidata.cli", "fit", "--config", str(cfg)],
                            cwd=REPO, env=cli_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=_default_sigint)
    try:
        deadline = time.time() + 240
        while len(read_records(rec)) < 3 and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, "training ended before the interrupt: " + proc.stdout.read()[-2000:]
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children, "expected DataLoader worker processes"
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, out[-3000:]
    assert "KeyboardInterrupt" in out or "graceful shutdown" in out, out[-2000:]
    gone, alive = psutil.wait_procs(children, timeout=10)
    alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"orphan processes after Ctrl-C: {alive}"
    assert (tmp_path / "run" / "interrupted" / "on_exception.ckpt").is_file(), out[-2000:]
    done = [r["indices"] for r in read_records(rec)]
    assert 3 <= len(done) < 16 and done == reference[:len(done)]

    # The same command again resumes from the interrupted checkpoint (OnExceptionCheckpoint).
    res = run_cli("fit", "--config", str(cfg))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resuming the interrupted run from" in res.stderr and "at global step" in res.stderr
    assert [r["indices"] for r in read_records(rec)] == reference
