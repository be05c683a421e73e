"""Where multithreaded hashing starts to pay: single thread vs blake3 AUTO threads.

    python -m bench.hash_threshold [--dir DIR] [--seconds 0.3]

For each file size, hashes one file (in the page cache) with the watcher's
``Hasher`` both ways: read in 1 MiB chunks on the calling thread, and mapped
and hashed on blake3's AUTO threads in the helper process (what the watcher
does for large files, IPC included). References: 16 MiB chunked reads on AUTO
threads, and mappings made in-process (one thread, AUTO, blake3's
``update_mmap(path)``). The variants run interleaved, several rounds, and the
best round counts, so a noisy shared machine disturbs all of them alike.
Prints MB/s per variant and the smallest size from which the helper beats one
thread by 10 % at every larger size: the watcher's ``--large-file`` default.
"""

from __future__ import annotations

import argparse
import mmap
import os
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import blake3

from baton_relay.watcher.hashing import Hasher

SIZES = [16 << 10, 64 << 10, 256 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20, 16 << 20,
         64 << 20, 256 << 20]


def mmap_own_fd(path: Path, threads: int) -> str:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        h = blake3.blake3(max_threads=threads)
        h.update(m)
        return h.hexdigest()


def chunked_auto(path: Path, buf: memoryview) -> str:
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(buf[:n])
    return h.hexdigest()


def update_mmap(path: Path) -> str:
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    h.update_mmap(str(path))
    return h.hexdigest()


def rate(fn: Callable[[], object], size: int, seconds: float) -> float:
    """MB/s of ``fn`` repeated for about ``seconds``."""
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            return n * size / elapsed / 1e6


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=None, help="where to write the test files")
    p.add_argument("--seconds", type=float, default=0.3, help="per variant and round")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        (root / "t").mkdir()
        single = Hasher(str(root), large_file=1 << 62)
        multi = Hasher(str(root), large_file=0)
        big = memoryview(bytearray(16 << 20))
        auto = blake3.blake3.AUTO
        print(f"cpus {os.cpu_count()}  blake3 {blake3.__version__}   MB/s, best of {args.rounds}")
        print(f"{'size':>9} {'read 1thr':>10} {'helper':>10} {'helper/1':>8} "
              f"{'read AUTO':>10} {'mmap 1thr':>10} {'mmap AUTO':>10} {'upd_mmap':>10}")
        wins: list[tuple[int, bool]] = []
        for size in SIZES:
            name = f"f{size}"
            path = root / "t" / name
            path.write_bytes(os.urandom(size))
            variants: dict[str, Callable[[], object]] = {
                "single": partial(single.hash, "t", name),
                "helper": partial(multi.hash, "t", name),
                "read_auto": partial(chunked_auto, path, big),
                "mmap1": partial(mmap_own_fd, path, 1),
                "mmap_auto": partial(mmap_own_fd, path, auto),
                "update_mmap": partial(update_mmap, path),
            }
            best = dict.fromkeys(variants, 0.0)
            for _ in range(args.rounds):
                for key, fn in variants.items():
                    best[key] = max(best[key], rate(fn, size, args.seconds))
            ratio = best["helper"] / best["single"]
            wins.append((size, ratio >= 1.1))
            print(f"{size >> 10:>7}Ki {best['single']:>10.0f} {best['helper']:>10.0f} "
                  f"{ratio:>8.2f} {best['read_auto']:>10.0f} {best['mmap1']:>10.0f} "
                  f"{best['mmap_auto']:>10.0f} {best['update_mmap']:>10.0f}")
            path.unlink()
        multi.close()
        threshold = None
        for size, win in reversed(wins):
            if not win:
                break
            threshold = size
        print(f"threshold: {threshold} bytes" if threshold else "threshold: none found")


if __name__ == "__main__":
    main()
