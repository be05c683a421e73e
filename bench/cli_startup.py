"""CLI startup: how long one ``baton`` command takes, as the whole process an agent runs.

    python -m bench.cli_startup [--runs 21] [--before REV]

Shell agents call ``baton`` in loops, so every command pays for starting Python and
importing what it needs before its one or two calls. Each measured run is a fresh
process (the ``baton`` console script), timed from spawn to exit against a private
etcd and registry; the report gives the median and p90 of ``--runs`` runs next to
``python -c pass`` on the same interpreter. ``--before REV`` runs the same commands
with the client of that git revision too (a temporary worktree put first on
PYTHONPATH), alternating run by run with the current code so that a change in the
machine's load hits both alike. Also the ``cli`` scenario of ``python -m bench``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from baton_relay.client import Client

from .harness import BenchError, Stack, load_average, ms, worktree
from .profiles import Profile
from .report import Section, Table

ROOT = Path(__file__).resolve().parents[1]
BATON = str(Path(sys.executable).with_name("baton"))
TASK = "cli"
#: what the issue asked of the commands agents run in loops
TARGET_MS = 200

METHOD = """
Each number is the median (p90 beside it) of {runs} runs of one command as its own
process, `{baton}` through the console script, timed from spawn to exit on this
machine, against a private etcd and registry; `python -c pass` is the interpreter's
own start. `claim` claims a named entry with a new session (`--ttl 60 -o json`),
`commit` commits an entry claimed beforehand (`--size 1`); each run has its own
entry. Target for `task ls`, `claim` and `commit`: at most {target} ms.
"""


@dataclass(frozen=True)
class Command:
    label: str
    argv: list[str]


@dataclass
class Timings:
    label: str
    now: list[float]
    before: list[float]


def timed(argv: list[str], env: dict[str, str]) -> float:
    """Seconds from spawning ``argv`` to its exit; it must succeed."""
    start = time.perf_counter()
    done = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          check=False)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise BenchError(f"{' '.join(argv)} exited {done.returncode}: "
                         f"{done.stderr.decode(errors='replace').strip()}")
    return seconds


def commands(i: int, tokens: dict[str, int]) -> list[Command]:
    """The commands measured in run ``i`` (claim and commit name that run's entries)."""
    return [
        Command("python -c pass", [sys.executable, "-c", "pass"]),
        Command("baton --help", [BATON, "--help"]),
        Command("baton task ls", [BATON, "task", "ls"]),
        Command("baton task ls -o json", [BATON, "task", "ls", "-o", "json"]),
        Command("baton claim TASK FILE", [BATON, "claim", TASK, f"c{i:04d}", "--ttl", "60",
                                          "-o", "json"]),
        Command("baton commit TASK FILE", [BATON, "commit", TASK, f"m{i:04d}", "--token",
                                           str(tokens[f"m{i:04d}"]), "--size", "1"]),
    ]


def measure(address: str, runs: int, before: Path | None) -> list[Timings]:
    """Time every command ``runs`` times (alternating with ``before``'s client if given)."""
    variants = [("now", None)] + ([("before", before)] if before is not None else [])
    base = {k: v for k, v in os.environ.items() if not k.startswith("BATON_")}
    base["BATON_REGISTRY"] = address
    envs = {name: {**base, **({"PYTHONPATH": str(tree)} if tree else {})}
            for name, tree in variants}
    # Each variant claims and commits entries of its own.
    tokens = {name: prepare(address, runs, prefix=name) for name, _ in variants}
    timings: dict[str, Timings] = {}
    for i in range(runs):
        for name, _ in variants:
            for cmd in commands(i, tokens[name]):
                argv = [a.replace(f"c{i:04d}", f"{name}-c{i:04d}")
                        .replace(f"m{i:04d}", f"{name}-m{i:04d}") for a in cmd.argv]
                seconds = timed(argv, envs[name])
                t = timings.setdefault(cmd.label, Timings(cmd.label, [], []))
                (t.now if name == "now" else t.before).append(seconds)
    return list(timings.values())


def prepare(address: str, runs: int, prefix: str) -> dict[str, int]:
    """Create the task (once) and claim the entries the commit runs commit: their tokens."""
    with Client(address, timeout=60) as c:
        ids = [f"{p}-{k}{i:04d}" for p in ("now", "before") for k in "cm" for i in range(runs)]
        # `baton commit --size 1` publishes no file: the task takes commits without digest.
        c.operator.create_task({"task_id": TASK, "digest_optional": True,
                                "entries": [{"file_id": f, "path": f} for f in ids]})
        session = c.open_session(f"bench-{prefix}", ttl=600, keepalive=False)
        return {f.removeprefix(f"{prefix}-"): c.claim(TASK, f, session=session).token
                for f in ids if f.startswith(f"{prefix}-m")}


def table(timings: list[Timings], runs: int) -> Table:
    compare = any(t.before for t in timings)
    headers = ["command", "median ms", "p90 ms"]
    if compare:
        headers += ["before: median ms", "before: p90 ms", "before ÷ now"]
    out = Table(f"One command, the whole process (median of {runs} runs)", headers)
    for t in timings:
        row: list[str | int | float | None] = [f"`{t.label}`", ms(t.now, 0.5), ms(t.now, 0.9)]
        if compare:
            row += [ms(t.before, 0.5), ms(t.before, 0.9),
                    statistics.median(t.before) / statistics.median(t.now)]
        out.rows.append(row)
    return out


def run_scenario(root: Path, runs: int, before: Path | None) -> tuple[Table, list[str]]:
    with Stack(root) as stack:
        address = stack.registry(root / "staging").address
        timings = measure(address, runs, before)
    by = {t.label: statistics.median(t.now) * 1000 for t in timings}
    headline = (f"CLI startup: `baton task ls` {by['baton task ls']:.0f} ms, `claim` "
                f"{by['baton claim TASK FILE']:.0f} ms, `commit` "
                f"{by['baton commit TASK FILE']:.0f} ms per process (median; "
                f"`python -c pass` {by['python -c pass']:.0f} ms; target {TARGET_MS} ms).")
    return table(timings, runs), [headline]


def run(p: Profile, root: Path, plot_dir: Path) -> Section:
    """The ``cli`` scenario of ``python -m bench``."""
    t0 = time.monotonic()
    runs = 5 if p.name == "quick" else 21
    result, headlines = run_scenario(root, runs, None)
    return Section("cli", "CLI startup", METHOD.format(runs=runs, baton="baton",
                                                      target=TARGET_MS),
                   [result], headlines=headlines, seconds=time.monotonic() - t0,
                   load=load_average())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cli_startup",
                                     description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=21, help="runs of each command")
    parser.add_argument("--before", metavar="REV",
                        help="also time the client of this git revision, alternating")
    args = parser.parse_args(argv)
    from .report import markdown_table

    with tempfile.TemporaryDirectory(prefix="baton-bench-cli-") as tmp:
        if args.before:
            with worktree(args.before) as tree:
                result, headlines = run_scenario(Path(tmp), args.runs, tree)
        else:
            result, headlines = run_scenario(Path(tmp), args.runs, None)
    print(METHOD.format(runs=args.runs, baton=BATON, target=TARGET_MS).strip())
    print()
    print(markdown_table(result))
    print()
    print("\n".join(headlines))
    print(f"load average: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
