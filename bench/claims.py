"""First reading of claim throughput: N agent processes claim → commit through a registry.

    python -m bench.claims --agents 16 --entries 4000

Starts a private etcd (``client.etcdproc``) and one registry process, creates a
task, then runs N agent processes, each with its own client and session, looping
claim → commit until nothing is left. Prints cycles per second and the claim
latency percentiles. The full benchmark suite (references, plots) is separate.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from client import Client, errors
from client.etcdproc import EtcdProcess


def agent(address: str, task: str, n: int, start: float, out: mp.Queue) -> None:  # type: ignore[type-arg]
    latencies: list[float] = []
    with Client(address) as c, c.open_session(f"bench-{n}", ttl=30) as s:
        while time.time() < start:
            time.sleep(0.001)
        while True:
            t0 = time.perf_counter()
            try:
                claim = c.claim(task, session=s)
            except errors.NothingToClaim:
                break
            latencies.append(time.perf_counter() - t0)
            c.commit(task, claim.file_id, claim.token, 0)
    out.put(latencies)


def raw_etcd(endpoint: str, n: int, ops: int, start: float, out: mp.Queue) -> None:  # type: ignore[type-arg]
    """The limit: one create-only etcd transaction per op, same client library."""
    import asyncio

    from registry._etcd import Etcd, Put, absent

    async def go() -> None:
        etcd = Etcd(endpoint)
        await etcd.connect()
        await asyncio.sleep(max(0.0, start - time.time()))
        for i in range(ops):
            key = f"/bench-raw/{n}/{i}".encode()
            await etcd.txn([absent(key)], [Put(key, b"x")])
        await etcd.close()

    asyncio.run(go())
    out.put(ops)


def raw_rate(endpoint: str, agents: int, total: int) -> float:
    out: mp.Queue = mp.Queue()  # type: ignore[type-arg]
    start = time.time() + 2.0
    per = max(total // agents, 1)
    procs = [mp.Process(target=raw_etcd, args=(endpoint, n, per, start, out))
             for n in range(agents)]
    for p in procs:
        p.start()
    done = sum(out.get(timeout=600) for _ in procs)
    elapsed = time.time() - start
    for p in procs:
        p.join()
    return done / elapsed


def run(agents: int, entries: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        etcd = EtcdProcess(root / "etcd", log_path=root / "etcd.log")
        etcd.start()
        reg = subprocess.Popen(
            [sys.executable, "-m", "registry", "--etcd", etcd.endpoint, "--listen",
             "127.0.0.1:0", "--staging", str(root / "staging"), "--log-level", "WARNING"],
            stdout=subprocess.PIPE, text=True,
        )
        try:
            address = reg.stdout.readline().split()[-1]  # type: ignore[union-attr]
            with Client(address) as c:
                c.create_task({"task_id": "bench", "entries": [
                    {"file_id": f"e{i:06d}", "path": f"e{i:06d}"} for i in range(entries)]})
            out: mp.Queue = mp.Queue()  # type: ignore[type-arg]
            start = time.time() + 2.0
            procs = [mp.Process(target=agent, args=(address, "bench", n, start, out))
                     for n in range(agents)]
            for p in procs:
                p.start()
            lat: list[float] = []
            for _ in procs:
                lat.extend(out.get(timeout=600))
            elapsed = time.time() - start
            for p in procs:
                p.join()
            raw = raw_rate(etcd.endpoint, agents, entries)
        finally:
            reg.terminate()
            reg.wait()
            etcd.stop()
    lat.sort()
    return {
        "agents": agents,
        "cycles": len(lat),
        "cycles_per_s": len(lat) / elapsed,
        "claim_p50_ms": 1000 * statistics.median(lat),
        "claim_p99_ms": 1000 * lat[int(0.99 * (len(lat) - 1))],
        "raw_txn_per_s": raw,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, nargs="+", default=[16])
    parser.add_argument("--entries", type=int, default=4000)
    args = parser.parse_args()
    for n in args.agents:
        r = run(n, args.entries)
        print(f"agents={r['agents']:3d} cycles={r['cycles']} "
              f"claim+commit/s={r['cycles_per_s']:.0f} "
              f"claim p50={r['claim_p50_ms']:.1f}ms p99={r['claim_p99_ms']:.1f}ms "
              f"raw-etcd-txn/s={r['raw_txn_per_s']:.0f} "
              f"ratio={r['cycles_per_s'] / r['raw_txn_per_s']:.2f}", flush=True)


if __name__ == "__main__":
    main()
