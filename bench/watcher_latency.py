"""Write → verified latency through a real stack: etcd, registry and watcher processes.

    python -m bench.watcher_latency [--files 1000] [--rate 100] [--size-kib 64] [--drain]
    python -m bench.watcher_latency --helper [--files 6000] [--producers 4]

Producer threads publish ``--files`` files of ``--size-kib`` KiB at ``--rate`` files
per second, each exactly as the producer helper does (claim, temp file, fsync,
rename, fsync the directory, commit). A Watch stream on the task records when
each entry turns verified. Printed: percentiles of landed → verified (from the
rename that publishes the file) and of commit → verified (from the moment the
commit call returned; 0 when the watcher's report came first and the commit
itself verified the entry).

``--helper``: end to end as fast as it goes — ``--producers`` agent processes run the
producer helper (``produce_each``, working ahead) over the task until nothing is left,
while the watcher verifies; printed: files verified per second from the first claim
to the last verification, and each process's CPU per file.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import blake3

from baton_relay.client import Client, Session
from baton_relay.client.producer import temp_path
from baton_relay.kernel.v1 import baton_pb2 as pb
from baton_relay.local.etcdproc import EtcdProcess, etcd_version, free_port, wait_ready
from baton_relay.local.stack import grpc_health_probe


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_line(proc: subprocess.Popen[bytes], prefix: str) -> None:
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    if not line.startswith(prefix):
        raise SystemExit(f"watcher did not start: {line!r}")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (exits on an unknown option)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--files", type=int, default=1000)
    p.add_argument("--rate", type=float, default=100.0)
    p.add_argument("--size-kib", type=int, default=64)
    p.add_argument("--producers", type=int, default=4, help="threads sharing the rate")
    p.add_argument("--drain", action="store_true",
                   help="publish every file first, then start the watcher: how fast it "
                   "verifies the backlog")
    p.add_argument("--helper", action="store_true",
                   help="producer processes run produce_each as fast as they can: write → "
                   "verified end to end, sustained")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        staging = root / "staging"
        staging.mkdir()
        etcd = EtcdProcess(root / "etcd", log_path=root / "etcd.log").start()
        try:
            stack(root, etcd, args)
        finally:
            etcd.stop()


def stack(root: Path, etcd: EtcdProcess, args: argparse.Namespace) -> None:
    """Registry and watcher processes on ``etcd``; runs the measurement; stops them."""
    staging = root / "staging"
    address = f"127.0.0.1:{free_port()}"
    procs: list[subprocess.Popen[bytes]] = []
    with (root / "registry.log").open("wb") as rlog, (root / "watcher.log").open("wb") as wl:
        try:
            reg = subprocess.Popen([sys.executable, "-m", "baton_relay.registry", "--insecure",
                                    "--etcd", etcd.endpoint, "--listen", address,
                                    "--staging", str(staging), "--allow-etcd-version",
                                    etcd_version(etcd.binary)],
                                   stdout=rlog, stderr=subprocess.STDOUT)
            procs.append(reg)
            wait_ready(grpc_health_probe(address), reg, daemon="registry",
                       log_path=root / "registry.log", timeout=30)
            pids = {"watcher": 0, "registry": reg.pid, "etcd": etcd.pid or 0}

            def start_watcher() -> None:
                watcher = subprocess.Popen([sys.executable, "-u", "-m", "baton_relay.watcher",
                                            "--registry", address, "--staging", str(staging)],
                                           stdout=subprocess.PIPE, stderr=wl)
                procs.insert(0, watcher)
                wait_line(watcher, "baton-watcher watching")
                pids["watcher"] = watcher.pid

            if args.drain:
                drain(address, args, start_watcher)
                return
            start_watcher()
            if args.helper:
                helper(address, args, pids)
                return
            before = {k: cpu_seconds(v) for k, v in pids.items()}
            run(address, args)
            used = {k: cpu_seconds(v) - before[k] for k, v in pids.items()}
            print("  CPU ms per file: " + ", ".join(
                f"{k} {1000 * v / args.files:.2f}" for k, v in used.items()))
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait()


def publish(c: Client, session: Session, file_id: str, data: bytes,
            landed: dict[str, float]) -> None:
    """As the producer helper does: claim, temp file, fsync, rename, fsync the
    directory, commit; when the file landed goes into ``landed``."""
    claim = c.claim("lat", file_id, session=session)
    final = Path(claim.path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(final, claim.token)
    digest = blake3.blake3(data).hexdigest()  # hashed before it lands, not timed
    with open(tmp, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    os.rename(tmp, final)
    landed[file_id] = time.monotonic()
    dfd = os.open(final.parent, os.O_RDONLY | os.O_DIRECTORY)
    os.fsync(dfd)
    os.close(dfd)
    c.commit("lat", file_id, claim.token, len(data), digest)


def drain(address: str, args: argparse.Namespace, start_watcher: Callable[[], None]) -> None:
    """``--drain``: every file published and committed first, then the watcher started;
    how fast it verifies the backlog (its start included) — the verification path's
    throughput, apart from how fast this machine's producers can publish."""
    n = args.files
    ids = [f"f{i:05d}" for i in range(n)]
    payload = os.urandom(args.size_kib << 10)
    landed: dict[str, float] = {}
    with Client(address) as c, c.open_session("bench-producer", ttl=60) as session:
        c.operator.create_task({"task_id": "lat", "entries": [
            {"file_id": f, "path": f"d{i % 8}/{f}.bin"} for i, f in enumerate(ids)]})

        def produce(k: int) -> None:
            for i in range(k, n, args.producers):
                publish(c, session, ids[i], payload[:-8] + i.to_bytes(8, "big"), landed)

        producers = [threading.Thread(target=produce, args=(k,)) for k in range(args.producers)]
        for t in producers:
            t.start()
        for t in producers:
            t.join()
        verified: set[str] = set()
        all_seen = threading.Event()

        def follow() -> None:
            for ev in c.watch("lat", start_revision=-1, timeout=600):
                if (ev.kind == pb.TaskEvent.KIND_CHANGED
                        and ev.entry.state == pb.ENTRY_STATE_VERIFIED):
                    verified.add(ev.entry.file_id)
                    if len(verified) == n:
                        all_seen.set()
                        return

        threading.Thread(target=follow, daemon=True).start()
        time.sleep(0.5)  # let the stream reach the registry first
        start = time.monotonic()
        start_watcher()
        if not all_seen.wait(600):
            raise SystemExit(f"only {len(verified)} of {n} verified")
        took = time.monotonic() - start
    print(f"{n} files of {args.size_kib} KiB committed, then the watcher started: all "
          f"verified in {took:.2f} s, {n / took:.0f} files/s ({os.cpu_count()} cpus)")


#: one producer process of ``--helper``: produce_each until nothing is left to claim
HELPER_AGENT = """
import os, sys, time
from baton_relay.client import Client, produce_each
address, name, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
body = os.urandom(size - 16)
n = 0
with Client(address) as c, c.open_session(name, ttl=30) as s:
    sys.stdin.readline()  # the common start
    for out in produce_each(c, s, "lat"):
        out.write(body + out.claim.file_id.encode().ljust(16))
        n += 1
print(n, time.process_time(), flush=True)
"""


def helper(address: str, args: argparse.Namespace, pids: dict[str, int]) -> None:
    """``--helper``: producer processes on ``produce_each`` publish every file as fast
    as they can while the watcher verifies; files verified per second, end to end."""
    n = args.files
    ids = [f"f{i:05d}" for i in range(n)]
    verified: dict[str, float] = {}
    all_seen = threading.Event()
    with Client(address) as c:
        c.operator.create_task({"task_id": "lat", "entries": [
            {"file_id": f, "path": f"d{i % 8}/{f}.bin"} for i, f in enumerate(ids)]})

        def follow() -> None:
            for ev in c.watch("lat", start_revision=-1, timeout=600,
                              states=[pb.ENTRY_STATE_VERIFIED]):
                if (ev.kind == pb.TaskEvent.KIND_CHANGED
                        and ev.entry.state == pb.ENTRY_STATE_VERIFIED):
                    verified.setdefault(ev.entry.file_id, time.monotonic())
                    if len(verified) == n:
                        all_seen.set()
                        return

        threading.Thread(target=follow, daemon=True).start()
        agents = [subprocess.Popen([sys.executable, "-c", HELPER_AGENT, address, f"p{k}",
                                    str(args.size_kib << 10)], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True)
                  for k in range(args.producers)]
        time.sleep(2.0)  # connected, sessions open, the watch on its way
        before = {k: cpu_seconds(v) for k, v in pids.items()}
        start = time.monotonic()
        for a in agents:
            assert a.stdin is not None
            a.stdin.write("go\n")
            a.stdin.flush()
        made, agent_cpu = 0, 0.0
        for a in agents:
            out, _ = a.communicate(timeout=600)
            count, cpu = out.split()
            made, agent_cpu = made + int(count), agent_cpu + float(cpu)
        if not all_seen.wait(120):
            raise SystemExit(f"only {len(verified)} of {n} verified")
        took = max(verified.values()) - start
        used = {k: cpu_seconds(v) - before[k] for k, v in pids.items()}
    print(f"{n} files of {args.size_kib} KiB by {args.producers} produce_each processes "
          f"({made} produced): all verified in {took:.2f} s, {n / took:.0f} files/s "
          f"end to end ({os.cpu_count()} cpus)")
    print("  CPU ms per file: " + ", ".join(
        f"{k} {1000 * v / n:.2f}" for k, v in {**used, "producers": agent_cpu}.items()))


def run(address: str, args: argparse.Namespace) -> None:
    n = args.files
    ids = [f"f{i:05d}" for i in range(n)]
    verified: dict[str, float] = {}
    all_seen = threading.Event()
    with Client(address) as c, c.open_session("bench-producer", ttl=30) as session:
        c.operator.create_task({"task_id": "lat", "entries": [
            {"file_id": f, "path": f"d{i % 8}/{f}.bin"} for i, f in enumerate(ids)]})

        def follow() -> None:
            for ev in c.watch("lat", start_revision=-1, timeout=n / args.rate + 120):
                if (ev.kind == pb.TaskEvent.KIND_CHANGED and ev.entry.state
                    == pb.ENTRY_STATE_VERIFIED):
                    verified.setdefault(ev.entry.file_id, time.monotonic())
                    if len(verified) == n:
                        all_seen.set()
                        return

        follower = threading.Thread(target=follow, daemon=True)
        follower.start()
        time.sleep(0.5)  # let the stream reach the registry before the first commit
        landed: dict[str, float] = {}
        committed: dict[str, float] = {}
        payload = os.urandom(args.size_kib << 10)
        start = time.monotonic()

        def produce(k: int) -> None:
            for i in range(k, n, args.producers):
                f = ids[i]
                time.sleep(max(0.0, start + i / args.rate - time.monotonic()))
                publish(c, session, f, payload[:-8] + i.to_bytes(8, "big"), landed)
                committed[f] = time.monotonic()

        producers = [threading.Thread(target=produce, args=(k,)) for k in range(args.producers)]
        for t in producers:
            t.start()
        for t in producers:
            t.join()
        offered = n / (time.monotonic() - start)
        if not all_seen.wait(120):
            raise SystemExit(f"only {len(verified)} of {n} verified")
    from_landed = [1000 * (verified[f] - landed[f]) for f in ids]
    from_commit = [1000 * max(0.0, verified[f] - committed[f]) for f in ids]
    at_commit = sum(1 for f in ids if verified[f] <= committed[f])
    print(f"{n} files of {args.size_kib} KiB at {offered:.0f} files/s "
          f"({os.cpu_count()} cpus)")
    for name, values in (("landed -> verified", from_landed),
                         ("commit -> verified", from_commit)):
        print(f"  {name}: p50 {statistics.median(values):.1f} ms  "
              f"p90 {pct(values, 0.90):.1f} ms  p99 {pct(values, 0.99):.1f} ms  "
              f"max {max(values):.1f} ms")
    print(f"  verified by the commit itself (report came first): {at_commit} of {n}")


if __name__ == "__main__":
    main()
