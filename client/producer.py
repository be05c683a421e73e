"""Producing a file safely: claim, write a temp file, fsync, rename, fsync the dir, commit.

The file work (the staging tree reached without following a symlink, a temp file
nobody can guess, resume points, the rename) is ``staging``'s, shared with the asyncio
helpers (``aproducer``); here are the blocking client's claims, checkpoints, commits
and fails around it.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from ..kernel import tracing
from ..kernel.backoff import Backoff
from ..kernel.contract import TEMP_MARKER
from ..kernel.errors import (
    NOTHING_TAKEN,
    Backpressure,
    Draining,
    InvalidArgument,
    NothingToClaim,
)
from ..kernel.v1 import baton_pb2 as pb
from ._client import Client, Session
from ._wire import Attributes, Claim
from .failures import handing_back
from .retry import BACKPRESSURE_BACKOFF, BACKPRESSURE_WAIT, waiting_line
from .staging import (
    NAME_MAX,
    NONCE_BYTES,
    RESUME_EVERY,
    RESUME_FRACTION,
    RESUME_MIN,
    OutputFile,
    Refusal,
    Resume,
    ResumePoint,
    entry_parts,
    failure,
    new_nonce,
    open_entry_dir,
    refuse_link,
    resume_interval,
    staged,
    temp_name,
    temp_path,
)

__all__ = ["AHEAD", "LINGER", "NAME_MAX", "NONCE_BYTES", "RESUME_EVERY", "RESUME_FRACTION",
           "RESUME_MIN", "TEMP_MARKER", "Output", "OutputFile", "Refusal", "Resume",
           "ResumePoint", "claim_waiting", "entry_parts", "failure", "new_nonce",
           "open_entry_dir", "produce", "produce_each", "put", "refuse_link",
           "resume_interval", "staged", "temp_name", "temp_path"]

log = logging.getLogger("baton.client")

@dataclass
class Output(OutputFile):
    """The open temp file of a claim: write to it; size and digest follow along.

    ``close()`` (or leaving ``with out:`` without an error, or closing ``file``) says
    the bytes are complete: nothing more is written, and ``produce_each`` commits the
    output even if its loop is then left with ``break``."""

    #: where ``checkpoint`` is recorded: the client and the session holding the claim
    _client: Client | None = None
    _session: Session | int = 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        """Append ``data``; a resumable write records a resume point each time
        ``resume_every`` bytes have gone in since the last one, in the middle of a
        call if need be (so a large call does not stretch the work a kill loses)."""
        for _ in self._fill(data):
            self.save_point()
        return memoryview(data).nbytes

    def save_point(self) -> pb.Checkpoint:
        """Make what was written so far durable and record it as the point a later
        attempt resumes from (a resumable write does this on its own, see
        ``produce``); the checkpoint as kept, with the progress over the expected size
        (the caller's ``expected_size``, else the entry's)."""
        data, progress, message = self._point()
        kept = self.checkpoint(data=data, progress=progress, message=message)
        self._saved = self.size
        return kept

    def checkpoint(self, *, data: bytes = b"", progress: float = 0.0,
                   message: str = "") -> pb.Checkpoint:
        """Record how far this attempt got: if it does not finish, the next attempt's
        claim carries ``data`` (``claim.checkpoint``) to resume from."""
        assert self._client is not None, "an Output made by produce() records checkpoints"
        c = self.claim
        with tracing.child(self._trace, "baton.checkpoint", progress=progress):
            return self._client.checkpoint(c.task_id, c.file_id, c.token, data=data,
                                           progress=progress, message=message,
                                           session=self._session)


def attempt_span(task_id: str, file_id: str) -> Any:
    """The span of a producer's attempt (None when traces are off): the root of a trace
    of its own, linked to the span current here (the work that makes the file, such as
    a consumer's of the stage before)."""
    if not tracing.ENABLED:
        return None
    return tracing.start("baton.produce", link=tracing.current(),
                         attributes={"baton.task": task_id, "baton.file_id": file_id})


def _claim(client: Client, session: Session | int, task_id: str, file_id: str,
           root: Any, wait: float) -> Claim:
    """Claim for the attempt whose span is ``root`` (``claim_span``). Back-pressure is
    waited out for up to ``wait`` seconds (``claim_waiting``)."""
    with claim_span(root) as parent:
        claim = claim_waiting(client, session, task_id, file_id, wait=wait,
                              traceparent=parent)
    claimed(root, claim)
    return claim


@contextmanager
def claim_span(root: Any) -> Iterator[str]:
    """Within: a claim for the attempt whose span is ``root`` (None: untraced), made
    with the traceparent yielded ("" untraced): the entry keeps it (the watcher's and
    the consumers' spans follow it). A claim that takes nothing (refused with
    back-pressure, nothing to claim, a drained host) is no attempt and leaves no
    trace: its spans are never ended, so never sent. ``claimed`` notes what it took."""
    if root is None:
        yield ""
        return
    parent = tracing.traceparent(root)
    span = tracing.start("baton.claim", parent=parent)
    try:
        # The registry sends no span of a refused call either (NOTHING_TAKEN).
        with tracing.active(span):
            yield parent
    except NOTHING_TAKEN:
        raise  # nothing was taken: no trace of it
    except BaseException as e:
        tracing.end(span, e)
        tracing.end(root, e)
        raise
    tracing.end(span)


def claimed(root: Any, claim: Claim) -> None:
    if root is None:
        return
    tracing.annotate(root, **{"baton.file_id": claim.file_id, "baton.token": claim.token,
                              "baton.attempt": claim.attempt})


def claim_waiting(client: Client, session: Session | int, task_id: str, file_id: str = "",
                  *, wait: float = BACKPRESSURE_WAIT,
                  backoff: Backoff = BACKPRESSURE_BACKOFF,
                  sleep: Callable[[float], None] = time.sleep,
                  clock: Callable[[], float] = time.monotonic,
                  traceparent: str | None = None) -> Claim:
    """``client.claim``, waiting out ``Backpressure`` (a consumer group of the task at
    its backlog limit) with jittered backoff for up to ``wait`` seconds, then raising
    the last refusal. Logged at INFO once per wait; other errors are raised at once.
    ``traceparent``: as ``Client.claim`` takes it."""
    deadline = clock() + wait
    failures = 0
    while True:
        try:
            return client.claim(task_id, file_id, session=session, traceparent=traceparent)
        except Backpressure as e:
            left = deadline - clock()
            if left <= 0:
                raise
            failures += 1
            if failures == 1:
                log.info(waiting_line(e, wait))
            sleep(min(backoff.delay(failures), left))


@contextmanager
def produce(
    client: Client, session: Session | int, task_id: str, file_id: str = "", *,
    nonce: Callable[[], str] = new_nonce, attributes: Attributes = None,
    resumable: bool = False, resume_every: int = RESUME_EVERY,
    resume_fraction: float = RESUME_FRACTION, expected_size: int = 0,
    wait: float = BACKPRESSURE_WAIT,
) -> Iterator[Output]:
    """Claim an entry and yield its output; publish and commit when the block ends.

    ``resumable``: the output is fsynced and a checkpoint records the temp file, its
    length and their BLAKE3 (a ``ResumePoint``) each time ``resume_every`` bytes
    (8 MiB) or ``resume_fraction`` (5 %) of the expected size, whichever is fewer
    bytes, have been written since the last point (``resume_interval``: never under
    1 MiB for the fraction; ``resume_fraction=0`` leaves ``resume_every`` alone). A
    block that fails keeps the temp file. The next attempt at the entry (another
    process, after the registry took this claim back) adopts that file if its recorded
    prefix is intact, and its ``Output.size`` says where to go on writing from;
    otherwise it starts from nothing. So a killed attempt's lost work, what the next
    one writes again, is at most that interval. The expected size is
    ``expected_size``, else the entry's (the manifest's ``expected_size``, carried by
    the claim); it is also the total of the progress each point records.

    If the block raises, the temp file is removed and the entry failed (it goes
    back to ``pending`` or to ``dead``), and the exception propagates: a
    ``PermanentError`` sends it to ``dead`` at once, a ``RetryAfter`` makes it
    claimable again after its delay (``baton_relay.client.failures``). The file
    becomes visible under its final name only complete and on disk.

    A symlink in the entry's path below the staging root, or at its final name,
    fails the entry the same way with ``InvalidArgument``; nothing is written
    through it. ``nonce`` makes the random part of the temp file's name.
    ``attributes`` (or ``Output.attributes``, set in the block) go with the commit.
    A claim refused with ``Backpressure`` is tried again with jittered backoff for up
    to ``wait`` seconds (``claim_waiting``).
    """
    resume = Resume.of(resumable, resume_every, resume_fraction, expected_size)
    root = attempt_span(task_id, file_id)
    claim = _claim(client, session, task_id, file_id, root, wait)
    trace = tracing.traceparent(root)
    try:
        with _writing(client, session, claim, nonce, attributes, resume, trace) as out:
            yield out
        with tracing.child(trace, "baton.commit", size=out.size):
            out.entry = client.commit(task_id, claim.file_id, claim.token, out.size,
                                      out.digest, attributes=out.attributes, session=session)
    except BaseException as e:
        tracing.end(root, e)
        raise
    tracing.end(root)


@contextmanager
def _writing(client: Client, session: Session | int, claim: Claim,
             nonce: Callable[[], str], attributes: Attributes,
             resume: Resume | None = None, trace: str = "") -> Iterator[Output]:
    """Yield the claim's output; once the block ends, the file is under its final name
    and on disk, ready to commit. A block that raises fails the entry (``staged``)."""
    made: list[Output] = []

    def output(**fields: Any) -> Output:
        made.append(Output(**fields, _client=client, _session=session))
        return made[0]

    # A claim lost while we wrote (paused past the TTL) must not publish over the
    # attempt that replaced it; the registry would refuse the commit anyway.
    check = session.check if isinstance(session, Session) else _trusted
    try:
        with staged(claim, nonce, attributes, resume or Resume(), trace, output,
                    check) as out:
            if out._adopted:
                out.save_point()  # the file's new name, for an attempt after this one
            yield out
    except BaseException as e:
        permanent, delay = handing_back(e)
        client.fail(claim.task_id, claim.file_id, claim.token,
                    reason=failure(e, made[0] if made else None), session=session,
                    permanent=permanent, delay=delay)
        raise


def _trusted() -> None:
    """A session named by its id: the registry alone decides whether it still holds."""


#: the most entries ``produce_each`` claims in one step, and how long (seconds) what it
#: has written may wait for its commit while it works on entries claimed ahead
AHEAD = 8
LINGER = 0.5


class Pace:
    """How long a loop's steps take (a moving average of the body's time), so that a
    step claims as many entries as the loop writes within ``linger``: a fast loop
    works ahead (one message for several entries), a slow one claims one at a time."""

    def __init__(self, ahead: int, linger: float) -> None:
        if ahead < 1:
            raise InvalidArgument(f"ahead must be at least 1, not {ahead}")
        if linger < 0:
            raise InvalidArgument(f"linger must not be negative, not {linger}")
        self.ahead, self.linger = ahead, linger
        self.step = 0.0  # 0: not measured yet

    def lap(self, seconds: float) -> None:
        self.step = seconds if not self.step else 0.8 * self.step + 0.2 * seconds

    def want(self) -> int:
        if not self.step:
            return 1
        return max(1, min(self.ahead, int(self.linger / self.step)))


#: an output written and not committed yet: with its attempt's span and traceparent
Done = tuple[OutputFile, Any, str]


def produce_each(client: Client, session: Session, task_id: str, *,
                 nonce: Callable[[], str] = new_nonce,
                 wait: float = BACKPRESSURE_WAIT, ahead: int = AHEAD,
                 linger: float = LINGER) -> Iterator[Output]:
    """Claim the task's entries one after another: each output is yielded to be
    written; what is written is published and committed by the next step.

    On a session kept on its stream, a step is one message and one etcd transaction
    that commits what the loop has written and claims what it works on next. A loop
    whose steps are quick works ahead: a step claims as many entries (at most
    ``ahead``) as the loop writes within ``linger`` seconds, and commits them
    together once they are all written (or once the first has waited ``linger``) —
    so each output's ``entry`` is set when its step commits it. A slow loop (a step
    longer than ``linger``) claims one entry per step, committing each as the loop
    asks for the next; ``ahead=1`` always does. Without a stream, each output is
    committed as the loop asks for the next, and the next one claimed on its own.

    The loop ends, without an error, when nothing is left to claim or once the
    session's host is drained (``Session.draining``). Leaving the loop (its end,
    ``break``, ``return``, an exception) commits what was written: every output the
    loop went past, and the one in hand if the body closed it (``out.close()``, or
    ``with out:`` left without an error). It gives back the entries claimed ahead
    and not begun, as they were (no retry spent). The output in hand that was not
    closed is failed, as ``produce`` fails a block that raises (a retry spent): Python
    leaves the loop's generator the same way for a ``break`` and for an exception
    raised in the body, so it may be partial — and one not written at all may be an
    entry the body failed on before its first byte, which must count as a failure
    (else it would go round forever). So a loop that stops at a deadline closes the
    output it wrote, then breaks: nothing it claimed is failed. Back-pressure is
    waited out as ``produce`` does. For example::

        for out in produce_each(client, session, "scan-42"):
            with out:  # complete once the block ends without an error
                out.write(render(out.claim.file_id))
            if time.monotonic() > deadline:
                break  # commits it, gives back what was claimed ahead
    """
    pace = Pace(ahead, linger)
    hand: deque[tuple[Claim, Any]] = deque()  # claimed, not begun: with their spans
    done: list[Done] = []
    oldest = 0.0  # when the first output of ``done`` was written
    try:
        while True:
            if session.draining:
                return
            if not hand:
                root = attempt_span(task_id, "")
                try:
                    hand.append((_claim(client, session, task_id, "", root, wait), root))
                except (NothingToClaim, Draining):
                    return
            claim, root = hand.popleft()
            trace = tracing.traceparent(root)
            began = time.monotonic()
            left = False  # the loop was left with the output in hand closed
            try:
                with _writing(client, session, claim, nonce, None, trace=trace) as out:
                    try:
                        yield out
                    except GeneratorExit:
                        if not out.closed:
                            raise  # it may be partial: the entry is failed
                        left = True  # complete: published below, committed as we end
            except BaseException as e:
                tracing.end(root, e)
                raise
            if left:
                done.append((out, root, trace))
                return  # ``_hand_back`` commits it with the rest
            now = time.monotonic()
            pace.lap(now - began)
            if not done:
                oldest = now
            done.append((out, root, trace))
            if session.stream is None:
                _commit_one(client, session, done.pop())
            elif not hand or now - oldest >= linger or session.draining:
                more = 0 if session.draining else max(0, pace.want() - len(hand))
                hand.extend(_step(client, session, task_id, done, more))
                done.clear()
    finally:
        _hand_back(client, session, done, hand)


def _ended(done: Done, entry: pb.Entry, started: int) -> None:
    """``done`` was committed as ``entry`` by a step that began at ``started``."""
    out, root, trace = done
    out.entry = entry
    if root is not None:
        tracing.end(tracing.start("baton.commit", parent=trace, start_ns=started,
                                  attributes={"baton.size": out.size}))
        tracing.end(root)


def _commit_one(client: Client, session: Session, done: Done) -> None:
    out, root, trace = done
    c = out.claim
    try:
        with tracing.child(trace, "baton.commit", size=out.size):
            out.entry = client.commit(c.task_id, c.file_id, c.token, out.size, out.digest,
                                      attributes=out.attributes, session=session)
    except BaseException as e:
        tracing.end(root, e)
        raise
    tracing.end(root)


def _step(client: Client, session: Session, task_id: str, done: list[Done],
          more: int) -> list[tuple[Claim, Any]]:
    """Commit ``done`` and claim up to ``more`` next entries, in one message: the claims
    taken, with their attempts' spans (a span that claimed nothing is never ended,
    so never sent)."""
    spans, started = step_spans(task_id, more)
    entries, claims = client.commit_and_claim_batch(
        step_commits(done), task_id, more, session=session,
        traceparents=[tracing.traceparent(s) for s in spans])
    return stepped(done, entries, claims, spans, started)


def step_spans(task_id: str, more: int) -> tuple[list[Any], int]:
    """The spans of a step's next attempts (none when traces are off), and its start."""
    spans = [attempt_span(task_id, "") for _ in range(more)] if tracing.ENABLED else []
    return spans, time.time_ns()


def step_commits(done: list[Done]) -> list[tuple[str, str, int, int, str, Attributes]]:
    """The commits of a step: the outputs written since the last one."""
    return [(o.claim.task_id, o.claim.file_id, o.claim.token, o.size, o.digest, o.attributes)
            for o, _, _ in done]


def stepped(done: list[Done], entries: list[pb.Entry], claims: list[Claim],
            spans: list[Any], started: int) -> list[tuple[Claim, Any]]:
    """What a step did: ``done`` committed as ``entries``, ``claims`` taken (with their
    attempts' spans)."""
    for d, entry in zip(done, entries, strict=True):
        _ended(d, entry, started)
    taken = []
    for i, claim in enumerate(claims):
        root = spans[i] if spans else None
        if root is not None:
            tracing.end(tracing.start("baton.claim", parent=tracing.traceparent(root),
                                      start_ns=started))
            claimed(root, claim)
        taken.append((claim, root))
    return taken


def _hand_back(client: Client, session: Session, done: list[Done],
               hand: deque[tuple[Claim, Any]]) -> None:
    """As a loop ends: commit what it wrote (one by one if the step of all of them is
    refused: one lost claim does not keep the others' files unpublished) and give
    back what it claimed ahead and did not begin. What cannot be done is logged: the
    registry gives those claims back with the session, or at their deadlines."""
    if done and session.stream is not None:
        with suppress(Exception):  # refused as a whole: each is committed on its own below
            _step(client, session, done[0][0].claim.task_id, done, 0)
    for d in done:
        if d[0].entry is None:
            try:
                _commit_one(client, session, d)
            except Exception as e:
                log.warning("could not commit %s/%s as the loop ended: %s",
                            d[0].claim.task_id, d[0].claim.file_id, e)
    done.clear()
    while hand:
        claim, _ = hand.popleft()
        try:
            client.fail(claim.task_id, claim.file_id, claim.token, session=session,
                        release=True, reason="the producer's loop ended before it began")
        except Exception as e:
            log.info("could not give %s/%s back as the loop ended (the registry will, "
                     "with the session or at its deadline): %s", claim.task_id,
                     claim.file_id, e)


def put(client: Client, session: Session | int, task_id: str, file_id: str,
        src: Path | BinaryIO, chunk: int = 1 << 20, *,
        attributes: Attributes = None, resumable: bool = False,
        resume_every: int = RESUME_EVERY, resume_fraction: float = RESUME_FRACTION,
        size: int = 0, wait: float = BACKPRESSURE_WAIT) -> pb.Entry:
    """Claim ``file_id``, copy ``src`` into it durably, and commit (with
    ``attributes``, for the task's routing rules). ``resumable``, ``resume_every``,
    ``resume_fraction``: as ``produce``'s; an attempt that adopts an earlier one's
    partial file copies only the rest of ``src`` (skipped by seeking, or by reading it
    when it cannot seek). ``size``: of ``src``, the expected size for the progress
    shown and the resume points (a path's is looked up; else the entry's). ``wait``:
    seconds to wait out back-pressure, as ``produce``'s."""
    if isinstance(src, Path):
        with open(src, "rb") as f:
            return put(client, session, task_id, file_id, f, chunk, attributes=attributes,
                       resumable=resumable, resume_every=resume_every,
                       resume_fraction=resume_fraction,
                       size=size or os.fstat(f.fileno()).st_size, wait=wait)
    with produce(client, session, task_id, file_id, attributes=attributes,
                 resumable=resumable, resume_every=resume_every,
                 resume_fraction=resume_fraction, expected_size=size, wait=wait) as out:
        if out.size:
            _skip(src, out.size, chunk)
        shutil.copyfileobj(src, out, chunk)
    assert out.entry is not None
    return out.entry


def _skip(src: BinaryIO, n: int, chunk: int) -> None:
    """Move ``src`` ``n`` bytes on: what an adopted partial file already holds."""
    try:
        src.seek(n, os.SEEK_CUR)
        return
    except (OSError, ValueError, AttributeError):
        pass
    while n > 0:
        data = src.read(min(chunk, n))
        if not data:
            raise InvalidArgument("the source is shorter than the partial file resumed")
        n -= len(data)
