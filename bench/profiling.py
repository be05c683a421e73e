"""Where a daemon spends its CPU: a sampling profile with py-spy, when it is installed.

``py-spy record --format raw`` writes one line per distinct stack, ``frame;frame;…
count``, outermost frame first. A function's *own* samples are those in which it
is the innermost frame; its *total* samples are those in which it appears at all
(counted once per stack, so recursion does not count twice). Only samples of a
thread holding the GIL are kept (``--gil``): the Python work, not threads waiting
in ``epoll`` or in C code that released the GIL.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self

from baton_relay.local.etcdproc import tail, wait_ready

from .harness import START_TIMEOUT, BenchError, die_with_parent

#: samples per second (py-spy's default)
RATE = 100
#: py-spy prints this once it is attached and sampling
SAMPLING = "py-spy> Sampling process"


def py_spy() -> str | None:
    """The ``py-spy`` executable: on $PATH or beside this Python's; None if neither."""
    found = shutil.which("py-spy")
    if found:
        return found
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.is_file() else None


@dataclass(frozen=True)
class Function:
    name: str
    own: int
    total: int


@dataclass
class Profile:
    samples: int
    functions: list[Function]

    def top(self, n: int) -> list[Function]:
        """The ``n`` functions with the most own samples (then the most total samples)."""
        return sorted(self.functions, key=lambda f: (-f.own, -f.total, f.name))[:n]


def parse_raw(text: str) -> Profile:
    """Own and total samples per function from py-spy's raw (collapsed stack) output."""
    own: dict[str, int] = {}
    total: dict[str, int] = {}
    samples = 0
    for line in text.splitlines():
        stack, _, count_text = line.rstrip().rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        samples += count
        own[frames[-1]] = own.get(frames[-1], 0) + count
        for frame in set(frames):
            total[frame] = total.get(frame, 0) + count
    return Profile(samples, [Function(name, own.get(name, 0), n) for name, n in total.items()])


class Recorder:
    """``py-spy record`` attached to ``pid`` from ``start()`` until ``stop()``; leaving its
    ``with`` block kills a py-spy still running."""

    def __init__(self, executable: str, pid: int, out: Path) -> None:
        self.executable = executable
        self.pid = pid
        self.out = out
        self.log_path = out.with_suffix(".log")
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def start(self) -> None:
        """Attach, and return once py-spy says it samples."""
        self.out.parent.mkdir(parents=True, exist_ok=True)
        argv = [self.executable, "record", "--format", "raw", "--nolineno", "--gil",
                "--rate", str(RATE), "--pid", str(self.pid), "--output", str(self.out)]
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=die_with_parent)
        wait_ready(lambda: SAMPLING in self.log_path.read_text(errors="replace"),
                   self.process, daemon="py-spy", log_path=self.log_path, timeout=START_TIMEOUT)

    def stop(self, timeout: float = 60.0) -> Profile:
        """Stop sampling (as Ctrl-C does: py-spy then writes its file) and read the file."""
        if self.process is None:
            raise BenchError("py-spy was not started")
        self.process.send_signal(signal.SIGINT)
        try:
            status = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise BenchError(f"py-spy did not stop within {timeout:g} s") from None
        if status != 0 or not self.out.exists():
            raise BenchError(f"py-spy exited with status {status} and no profile:\n"
                             f"{tail(self.log_path)}")
        return parse_raw(self.out.read_text(errors="replace"))
