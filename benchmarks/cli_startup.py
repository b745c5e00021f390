"""Benchmark: how fast the commands that need neither torch nor Lightning start.

Times, each in a fresh process and interleaved round by round (so a busy machine slows
all of them alike):

* the baselines ``python -c "import torch"`` and ``python -c "import pytorch_lightning"``;
* ``lit-roidata --help``, ``lit-roidata cache ls`` and ``cache verify`` (on ``--cache-dir``,
  default an empty temporary folder) and ``lit-roidata convert-proposals`` of a small
  generated proposal pickle (run as ``python -m lit_roidata.cli``, what the console
  script runs).

Prints per command the median, min and max wall time of ``--repeat`` runs and the ratio of
the median to ``import torch``'s. Issue 20's target: under 1 s where ``import torch``
takes about 3 s. Usage::

    python benchmarks/cli_startup.py
    python benchmarks/cli_startup.py --repeat 10 --cache-dir ~/.cache/lit_roidata
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _commands(cache_dir: str, tmp: str) -> dict[str, list[str]]:
    cli = [sys.executable, "-m", "lit_roidata.cli"]
    pkl, npz = os.path.join(tmp, "props.pkl"), os.path.join(tmp, "props.npz")
    return {
        "python -c 'import torch'": [sys.executable, "-c", "import torch"],
        "python -c 'import pytorch_lightning'": [sys.executable, "-c",
                                                 "import pytorch_lightning"],
        "lit-roidata --help": [*cli, "--help"],
        "lit-roidata cache ls": [*cli, "cache", "--cache-dir", cache_dir, "ls"],
        "lit-roidata cache verify": [*cli, "cache", "--cache-dir", cache_dir, "verify"],
        "lit-roidata convert-proposals": [*cli, "convert-proposals", pkl, npz, "--force"],
    }


def _write_proposals(tmp: str, images: int = 100) -> None:
    import numpy as np

    rng = np.random.default_rng(0)
    boxes = [np.sort(rng.uniform(0, 500, (300, 4)).astype(np.float32), axis=1)
             for _ in range(images)]
    scores = [rng.uniform(0, 1, 300).astype(np.float32) for _ in range(images)]
    with open(os.path.join(tmp, "props.pkl"), "wb") as fh:
        pickle.dump({"boxes": boxes, "scores": scores, "ids": list(range(images))}, fh)


def _time(cmd: list[str], env: dict[str, str]) -> float:
    t = time.perf_counter()
    res = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         text=True)
    elapsed = time.perf_counter() - t
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stderr[-2000:]}")
    return elapsed


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print one row per command."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5, help="runs per command (default 5)")
    parser.add_argument("--cache-dir", default=None,
                        help="roidb cache root for `cache ls/verify` (default: an empty folder)")
    args = parser.parse_args(argv)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    with tempfile.TemporaryDirectory() as tmp:
        _write_proposals(tmp)
        cache_dir = args.cache_dir or os.path.join(tmp, "cache")
        commands = _commands(cache_dir, tmp)
        times: dict[str, list[float]] = {name: [] for name in commands}
        for name, cmd in commands.items():  # warm-up: page cache, .pyc files
            _time(cmd, env)
        for _ in range(args.repeat):
            for name, cmd in commands.items():
                times[name].append(_time(cmd, env))
    base = statistics.median(times["python -c 'import torch'"])
    print(f"{'command':<40} {'median s':>9} {'min s':>7} {'max s':>7} {'/ torch':>8}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<40} {med:>9.3f} {min(ts):>7.3f} {max(ts):>7.3f} {med / base:>8.2f}")
    print(f"({args.repeat} runs each after one warm-up; python {sys.version.split()[0]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
