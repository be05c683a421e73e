"""``python -m bench``: run the scenarios and write the report with its plots.

    python -m bench [--quick]
                    [--only claims,loops,stack,batches,pools,scale,watcher,cli,etcd-tls,
                            lifetime,rest]
                    [--out docs/benchmarks.md] [--set FIELD=VALUE ...]

Without ``--only``, every scenario but the lifetime, which runs for hours at full size
(``--only lifetime``; ``--quick`` runs it too, briefly). Every scenario starts its own
private etcd and registry (and watcher) on 127.0.0.1 in a temporary directory and stops
them when it ends, also on Ctrl-C.
``$BATON_BENCH_ETCD`` picks the etcd binary. ``--quick`` runs each scenario for
seconds and writes to a temporary file unless ``--out`` is given.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from . import (
    batches,
    claims,
    cli_startup,
    etcd_tls,
    lifetime,
    loops,
    pools,
    rest,
    scale,
    stack,
    watching,
)
from .harness import INTERRUPTED, Machine, cpu_busy, ensure_b3sum, load_average
from .profiles import FULL, QUICK, Profile
from .report import Section, render

Scenario = Callable[[Profile, Path, Path], Section]
SCENARIOS: dict[str, tuple[str, Scenario]] = {
    "claims": ("Claims", claims.run),
    "loops": ("Producer loops", loops.run),
    "stack": ("The stack", stack.run),
    "batches": ("Batches", batches.run),
    "pools": ("Pools", pools.run),
    "scale": ("Scale", scale.run),
    "watcher": ("Watcher", watching.run),
    "cli": ("CLI startup", cli_startup.run),
    "etcd-tls": ("TLS: etcd over TLS, and mutual TLS to clients", etcd_tls.run),
    "lifetime": ("Lifetime", lifetime.run),
    "rest": ("At rest", rest.run),
}
#: scenarios that run only when named (or with --quick): hours at full size
LONG = ("lifetime",)
DEFAULT_OUT = Path("docs/benchmarks.md")


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0]
                                if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="a few seconds per scenario")
    p.add_argument("--only", default="",
                   help=f"comma-separated scenarios of {','.join(SCENARIOS)} (default: all "
                        f"but {','.join(LONG)}, which take hours; with --quick all)")
    p.add_argument("--out", type=Path, default=None,
                   help=f"report file; plots go to a 'benchmarks' folder beside it "
                        f"(default {DEFAULT_OUT}; with --quick a temporary file)")
    p.add_argument("--note", default="",
                   help="a line for the report's machine table, e.g. what else was running")
    p.add_argument("--no-install", action="store_true",
                   help="do not apt-get install b3sum when it is missing")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a field of the profile (bench/profiles.py), e.g. "
                        "--set claim_agents=1,16,64 --set claim_rounds=1")
    args = p.parse_args(argv)
    args.only = [s.strip() for s in args.only.split(",") if s.strip()] or [
        s for s in SCENARIOS if args.quick or s not in LONG]
    unknown = [s for s in args.only if s not in SCENARIOS]
    if unknown:
        p.error(f"unknown scenario(s) {', '.join(unknown)}; choose from {', '.join(SCENARIOS)}")
    return args


def _interrupt(signum: int, frame: FrameType | None) -> None:
    INTERRUPTED.set()
    raise KeyboardInterrupt(f"signal {signum}")


def failed_section(key: str, title: str, error: str, seconds: float) -> Section:
    return Section(key, title, "This scenario failed in this run; the error follows.",
                   notes=[f"```\n{error.strip()}\n```"],
                   headlines=[f"{title}: FAILED ({error.strip().splitlines()[-1]})"],
                   seconds=seconds, load=load_average())


def override(profile: Profile, settings: list[str]) -> Profile:
    """``profile`` with ``FIELD=VALUE`` settings applied (tuples: comma-separated)."""
    values = dict(profile.__dict__)
    for setting in settings:
        name, sep, raw = setting.partition("=")
        if not sep or name not in values:
            raise ValueError(f"--set {setting!r}: expected FIELD=VALUE with FIELD one of "
                             f"{', '.join(sorted(values))}")
        current = values[name]
        try:
            if isinstance(current, tuple):
                values[name] = tuple(type(current[0])(v) for v in raw.split(",") if v)
            elif isinstance(current, bool):
                values[name] = raw.lower() in ("1", "true", "yes")
            else:
                values[name] = type(current)(raw)
        except ValueError:
            raise ValueError(f"--set {setting!r}: {raw!r} is not a valid "
                             f"{type(current).__name__}") from None
    return Profile(**values)


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    # The benchmark's stacks say how to reach them; a shell's identity must not leak in.
    for name in ("BATON_CA", "BATON_CERT", "BATON_KEY", "BATON_REGISTRY"):
        os.environ.pop(name, None)
    profile = QUICK if args.quick else FULL
    if args.no_install:
        profile = Profile(**{**profile.__dict__, "install": False})
    try:
        profile = override(profile, args.set)
    except ValueError as e:
        print(f"python -m bench: {e}", file=sys.stderr)
        return 2
    out: Path = args.out or (Path(tempfile.mkdtemp(prefix="baton-bench-")) / "benchmarks.md"
                             if args.quick else DEFAULT_OUT)
    plot_dir = out.parent / "benchmarks"
    command = shlex.join(["python", "-m", "bench", *(sys.argv[1:] if argv is None else argv)])
    # SIGTERM ends the run like Ctrl-C: every scenario's finally stops its daemons.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    if "watcher" in args.only:
        ensure_b3sum(profile.install)
    machine = Machine.describe().facts
    if args.note:
        machine["note"] = args.note
    load_start = load_average()
    busy_start = cpu_busy()
    started = time.monotonic()
    sections: list[Section] = []
    failures = 0
    for key in args.only:
        title, scenario = SCENARIOS[key]
        print(f"bench: {title} ({profile.name}) ...", flush=True)
        busy = cpu_busy()
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(prefix=f"baton-bench-{key}-") as tmp:
            try:
                section = scenario(profile, Path(tmp), plot_dir)
            except KeyboardInterrupt:
                print("bench: interrupted; daemons stopped", file=sys.stderr)
                return 130
            except Exception:
                failures += 1
                error = traceback.format_exc()
                print(error, file=sys.stderr)
                section = failed_section(key, title, error, time.monotonic() - t0)
        if INTERRUPTED.is_set():
            print("bench: interrupted; daemons stopped", file=sys.stderr)
            return 130
        section.busy_before = busy
        section.load = section.load or load_average()  # at its end, if it did not say
        sections.append(section)
        for line in section.headlines:
            print(f"  {line}", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(sections, machine, command, plot_dir.name,
                          time.monotonic() - started, (load_start, load_average()), busy_start))
    print(f"bench: report written to {out}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
