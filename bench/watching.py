"""Watcher: write → verified latency, a waiting consumer's wake-up, hashing next to b3sum.

The write → verified runs and the 1 GiB hash are the watcher's own benchmarks
(``bench.watcher_latency``, ``bench.hash_throughput``), run as they are from the
command line and read back; the wake-up and the many-small-files hash are here.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import blake3

from baton_relay.client import Client, next_lease
from baton_relay.kernel.v1 import baton_pb2 as pb

from .harness import BenchError, Stack, check_interrupted, etcd_binary, load_average, ms
from .pool import Pool, Ready
from .profiles import Profile
from .report import Section, Table, line_plot

#: a rate is sustained when the producers offered at least this share of it ...
SUSTAIN_OFFERED = 0.9
#: ... and the slowest 1 % of files were verified within this many ms
SUSTAIN_P99_MS = 500.0
FILE_KIB = 64

METHOD = f"""
**Write → verified**: `python -m bench.watcher_latency` (etcd, registry and watcher
processes; producer threads publish {FILE_KIB} KiB files the way `client.producer`
does and commit them; a Watch stream notes when each entry turns `verified`),
measured from the rename that publishes a file. First at 100 files/s, then at
doubling rates until one is not sustained (the producers fall below
{SUSTAIN_OFFERED:.0%} of the rate, or p99 exceeds {SUSTAIN_P99_MS:.0f} ms), and then once
halfway between the last rate sustained and the first that was not.

**Wake-up**: a consumer process waits in `client.consumer.next_lease`; this process
claims and commits an entry, waits until the consumer is blocked again, and sends the
report that verifies the entry (as the watcher would). Measured from that report
call's return to `next_lease` returning in the consumer (one machine-wide
monotonic clock).

**Hashing**: `bench.hash_throughput` on one large file (`b3sum` and the watcher's
`Hasher`, memory-mapped on blake3's threads, alternating, from the page cache), and
here {{files:,}} files of {FILE_KIB} KiB: one `b3sum` process over all of them against
`Hasher.hash` file by file, on one thread and on two (the watcher's default
`--hash-workers`). Ratios are per round, medians of {{rounds}} rounds.
"""


def child_env() -> dict[str, str]:
    """The environment for the watcher engineer's scripts: our etcd first on PATH."""
    env = dict(os.environ)
    binary = etcd_binary()
    env["PATH"] = f"{os.path.dirname(binary)}{os.pathsep}{env.get('PATH', '')}"
    return env


def run_script(argv: list[str], timeout: float) -> str:
    """Run ``python -m ...`` to completion; its stdout. Ctrl-C reaches it as SIGINT."""
    proc = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=child_env())
    try:
        deadline = time.monotonic() + timeout
        while True:
            check_interrupted()
            try:
                out, err = proc.communicate(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() > deadline:
                    raise
    except BaseException:
        # SIGINT, not SIGTERM: the script's finally blocks stop its own daemons.
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        raise
    if proc.returncode != 0:
        raise BenchError(f"{' '.join(argv)} exited {proc.returncode}:\n{err[-3000:]}")
    return out


def number(pattern: str, text: str) -> float:
    found = re.search(pattern, text)
    return float(found.group(1)) if found else float("nan")


@dataclass
class Latency:
    rate: int
    files: int
    offered: float
    p50: float
    p99: float
    maximum: float
    cpu: str

    @property
    def sustained(self) -> bool:
        return self.offered >= SUSTAIN_OFFERED * self.rate and self.p99 <= SUSTAIN_P99_MS


def write_to_verified(rate: int, files: int) -> Latency:
    out = run_script(["-m", "bench.watcher_latency", "--files", str(files), "--rate", str(rate),
                      "--size-kib", str(FILE_KIB)], timeout=files / rate + 300)
    line = next((x for x in out.splitlines() if "landed -> verified" in x), "")
    if not line:
        raise BenchError(f"no 'landed -> verified' line in bench.watcher_latency's output:\n{out}")
    cpu = next((x.split(":", 1)[1].strip() for x in out.splitlines()
                if "CPU ms per file" in x), "")
    return Latency(rate, files, number(r"at (\d+(?:\.\d+)?) files/s", out),
                   number(r"p50 ([\d.]+) ms", line), number(r"p99 ([\d.]+) ms", line),
                   number(r"max ([\d.]+) ms", line), cpu)


# --- a waiting consumer woken -----------------------------------------------------------


@dataclass(frozen=True)
class WakeArgs:
    address: str
    task: str
    samples: int


@dataclass
class WakeResult:
    woken: dict[str, float] = field(default_factory=dict)


def consumer(args: WakeArgs, ready: Ready) -> WakeResult:
    """Wait for each verified entry in ``next_lease``; note when it returned; ack."""
    out = WakeResult()
    with Client(args.address, timeout=30) as c, c.open_session("bench-consumer", ttl=30) as s:
        ready()
        for _ in range(args.samples):
            lease = next_lease(c, s, args.task, timeout=60)
            out.woken[lease.file_id] = time.monotonic()
            c.ack(args.task, lease.file_id, lease.group, lease.token)
    return out


def wake_up(root: Path, samples: int) -> list[float]:
    """Seconds from the verifying report's return to the waiting consumer's wake-up."""
    task = "wake"
    ids = [f"w{i:05d}" for i in range(samples)]
    data = os.urandom(FILE_KIB << 10)
    digest = blake3.blake3(data).hexdigest()
    reported: dict[str, float] = {}
    with Stack(root) as stack, Pool(1) as pool:
        address = stack.registry(root / "staging").address
        with Client(address, timeout=30) as c, c.open_session("bench-producer", ttl=30) as s:
            c.operator.create_task({"task_id": task,
                                    "entries": [{"file_id": f, "path": f} for f in ids]})
            pool.start(consumer, [WakeArgs(address, task, samples)])
            previous = ""
            for f in ids:
                claim = c.claim(task, f, session=s)
                c.commit(task, f, claim.token, len(data), digest)
                deadline = time.monotonic() + 30
                while previous and c.operator.get_entry(task,
                                                        previous).state != pb.ENTRY_STATE_CONSUMED:
                    if time.monotonic() > deadline:
                        raise BenchError(f"the consumer did not take {previous}")
                    time.sleep(0.005)
                time.sleep(0.05 if previous else 0.3)  # back in next_lease, its watch open
                c.watcher.report(task, f, len(data), digest, reporter="bench")
                reported[f] = time.monotonic()
                previous = f
            woken: dict[str, float] = pool.collect(60)[0].woken
    return [woken[f] - reported[f] for f in ids]


# --- hashing ----------------------------------------------------------------------------


def many_small(root: Path, files: int, rounds: int, b3sum: str) -> dict[str, float]:
    """MB/s of b3sum and of the watcher's Hasher (1 and 2 threads) over small files."""
    from baton_relay.watcher.hashing import Hasher

    folder = root / "t" / "files"
    folder.mkdir(parents=True)
    names = [f"f{i:05d}" for i in range(files)]
    for name in names:
        (folder / name).write_bytes(os.urandom(FILE_KIB << 10))
    total = files * (FILE_KIB << 10)
    hasher = Hasher(str(root))
    expected = {n: hasher.hash("t", f"files/{n}").digest for n in names}  # warms the cache
    speeds: dict[str, list[float]] = {"b3sum": [], "1 thread": [], "2 threads": []}
    chunk = 2000  # names per b3sum call, well within the argument size limit
    with ThreadPoolExecutor(2) as two:
        for _ in range(rounds):
            t0 = time.perf_counter()
            got: list[str] = []
            for i in range(0, files, chunk):
                got += subprocess.run([b3sum, "--no-names", *names[i:i + chunk]], cwd=folder,
                                      capture_output=True, text=True, check=True).stdout.split()
            speeds["b3sum"].append(total / (time.perf_counter() - t0) / 1e6)
            t0 = time.perf_counter()
            ours = [hasher.hash("t", f"files/{n}").digest for n in names]
            speeds["1 thread"].append(total / (time.perf_counter() - t0) / 1e6)
            t0 = time.perf_counter()
            both = list(two.map(lambda n: hasher.hash("t", f"files/{n}").digest, names))
            speeds["2 threads"].append(total / (time.perf_counter() - t0) / 1e6)
            if got != ours or ours != both or ours != [expected[n] for n in names]:
                raise BenchError("b3sum and the watcher disagree about a digest")
    hasher.close()
    shutil.rmtree(folder)
    return {k: statistics.median(v) for k, v in speeds.items()}


def big_file(root: Path, mib: int, rounds: int) -> dict[str, float]:
    out = run_script(["-m", "bench.hash_throughput", "--size-mib", str(mib), "--rounds",
                      str(rounds), "--dir", str(root)], timeout=1200)
    line = next((x for x in out.splitlines() if x.startswith("median:")), "")
    if not line:
        raise BenchError(f"no 'median:' line in bench.hash_throughput's output:\n{out}")
    return {"b3sum": number(r"b3sum ([\d.]+) MB/s", line),
            "watcher": number(r"watcher ([\d.]+) MB/s", line),
            "ratio": number(r"watcher/b3sum ([\d.]+)", line)}


# --- the scenario -----------------------------------------------------------------------


def run(p: Profile, root: Path, plot_dir: Path) -> Section:
    t0 = time.monotonic()
    notes: list[str] = []
    headlines: list[str] = []
    runs = [write_to_verified(100, p.latency_files)]
    last_good = 100
    for rate in p.latency_rates if runs[0].sustained else ():
        runs.append(write_to_verified(rate, max(100, int(rate * p.latency_seconds))))
        if not runs[-1].sustained:
            middle = (last_good + rate) // 2
            if p.latency_refine and middle > last_good:
                runs.append(write_to_verified(middle, max(100, int(middle * p.latency_seconds))))
            break
        last_good = rate
    runs.sort(key=lambda r: r.rate)
    good = [r for r in runs if r.sustained]
    latency = Table(f"Write → verified, {FILE_KIB} KiB files",
                    ["target files/s", "files", "offered files/s", "p50 ms", "p99 ms", "max ms",
                     "sustained", "CPU ms per file"])
    for r in runs:
        latency.rows.append([r.rate, r.files, r.offered, r.p50, r.p99, r.maximum,
                             "yes" if r.sustained else "no", r.cpu])
    first = runs[0]
    top = good[-1] if good else None
    if top is not None:
        reach = (f"highest rate sustained {top.rate} files/s (p50 {top.p50:.1f} ms, "
                 f"p99 {top.p99:.1f} ms)")
    else:
        reach = f"not sustained even there (the producers offered {first.offered:.0f} files/s)"
    headlines.append(f"Watcher: write → verified p50 {first.p50:.1f} ms, p99 {first.p99:.1f} ms "
                     f"at 100 files/s of {FILE_KIB} KiB; {reach}.")
    failed = [r for r in runs if not r.sustained]
    if failed and failed[0].offered < SUSTAIN_OFFERED * failed[0].rate:
        notes.append(f"At {failed[0].rate} files/s the producers (claim, write + fsync, rename, "
                     f"commit; bench.watcher_latency's threads) reached only "
                     f"{failed[0].offered:.0f} files/s: the producing side set the limit, not "
                     "verification. The CPU column says where the time went.")
    elif failed:
        notes.append(f"At {failed[0].rate} files/s the producers kept up but p99 reached "
                     f"{failed[0].p99:.0f} ms: verification fell behind.")
    if top is not None and top is runs[-1] and len(runs) > 1:
        notes.append(f"Every rate tried up to {top.rate} files/s was sustained; the real "
                     "limit is higher.")
    plots = [line_plot(plot_dir / "watcher_latency.png", "Write → verified latency vs rate",
                       "target files/s (64 KiB files)", "ms",
                       {"p50": ([r.rate for r in runs], [r.p50 for r in runs]),
                        "p99": ([r.rate for r in runs], [r.p99 for r in runs])},
                       logx=True, logy=True)]

    woken = wake_up(root / "wake", p.wake_samples)
    wake = Table("Verified → waiting consumer woken (next_lease)",
                 ["samples", "p50 ms", "p90 ms", "p99 ms", "max ms"])
    wake.rows.append([len(woken), ms(woken, 0.5), ms(woken, 0.9), ms(woken, 0.99),
                      1000 * max(woken)])
    headlines.append(f"Watcher: a consumer waiting in next_lease wakes {ms(woken, 0.5):.1f} ms "
                     f"(p50) / {ms(woken, 0.99):.1f} ms (p99) after the verifying report.")

    hashing = Table("Hash throughput, MB/s (medians)",
                    ["input", "b3sum", "watcher Hasher", "watcher ÷ b3sum",
                     "watcher, 2 threads", "2 threads ÷ b3sum"])
    b3sum = shutil.which("b3sum")
    if b3sum is None:
        notes.append("b3sum is not installed and could not be installed here: the hash "
                     "rows are skipped (Debian: `apt-get install -y b3sum`).")
    else:
        big = big_file(root, p.hash_big_mib, p.hash_rounds)
        hashing.rows.append([f"1 file of {p.hash_big_mib:,} MiB", big["b3sum"], big["watcher"],
                             big["ratio"], None, None])
        small = many_small(root, p.hash_files, p.hash_rounds, b3sum)
        hashing.rows.append([f"{p.hash_files:,} files of {FILE_KIB} KiB", small["b3sum"],
                             small["1 thread"], small["1 thread"] / small["b3sum"],
                             small["2 threads"], small["2 threads"] / small["b3sum"]])
        headlines.append(
            f"Watcher: hashing at {big['ratio']:.2f}x b3sum's speed on {p.hash_big_mib:,} MiB "
            f"and {small['1 thread'] / small['b3sum']:.2f}x (one thread) on "
            f"{p.hash_files:,} files of {FILE_KIB} KiB.")
    intro = METHOD.format(files=p.hash_files, rounds=p.hash_rounds)
    facts = {"watcher.p50.100": first.p50, "watcher.p99.100": first.p99}
    if top is not None:
        facts["watcher.sustained"] = float(top.rate)
        facts["watcher.all_sustained"] = float(top is runs[-1])
    return Section("watcher", "Watcher", intro, [latency, wake, hashing], plots, notes=notes,
                   headlines=headlines, seconds=time.monotonic() - t0, load=load_average(),
                   facts=facts)
