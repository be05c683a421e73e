"""The watcher's hash throughput next to ``b3sum`` on the same file, as a ratio.

    python -m bench.hash_throughput [--size-mib 1024] [--rounds 5] [--dir DIR]

Writes one file of random bytes, reads it once so both start from the page
cache, then alternates ``b3sum --no-names FILE`` (a process per run, as a user
would) and the watcher's ``Hasher.hash`` (memory mapped in its helper process,
blake3 AUTO threads; the helper is started before timing). Each round times
both; the ratio is taken per round, so a noisy machine slows both alike.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import blake3

from baton_relay.watcher.hashing import Hasher


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", type=Path, default=None)
    args = p.parse_args(argv)
    b3sum = shutil.which("b3sum")
    if b3sum is None:
        raise SystemExit("b3sum not found (Debian: apt-get install b3sum)")
    size = args.size_mib << 20
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        (Path(tmp) / "t").mkdir()
        path = Path(tmp) / "t" / "big"
        chunk = os.urandom(16 << 20)
        with path.open("wb") as f:
            for _ in range(size // len(chunk)):
                f.write(chunk)
            f.write(chunk[: size % len(chunk)])
        hasher = Hasher(tmp)
        expected = hasher.hash("t", "big").digest  # warms the cache and starts the helper
        version = subprocess.run([b3sum, "--version"], capture_output=True, text=True)
        print(f"{version.stdout.strip()}, blake3-py {blake3.__version__}, "
              f"{os.cpu_count()} cpus, file {args.size_mib} MiB")
        ours, theirs, ratios = [], [], []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            out = subprocess.run([b3sum, "--no-names", str(path)], capture_output=True,
                                 text=True, check=True).stdout.strip()
            t1 = time.perf_counter()
            got = hasher.hash("t", "big").digest
            t2 = time.perf_counter()
            assert out == got == expected, (out, got, expected)
            theirs.append(size / (t1 - t0) / 1e6)
            ours.append(size / (t2 - t1) / 1e6)
            ratios.append(ours[-1] / theirs[-1])
            print(f"  b3sum {theirs[-1]:7.0f} MB/s   watcher {ours[-1]:7.0f} MB/s   "
                  f"ratio {ratios[-1]:.2f}")
        hasher.close()
        print(f"median: b3sum {statistics.median(theirs):.0f} MB/s, watcher "
              f"{statistics.median(ours):.0f} MB/s, watcher/b3sum "
              f"{statistics.median(ratios):.2f} (min {min(ratios):.2f}, max {max(ratios):.2f})")


if __name__ == "__main__":
    main()
