"""Producing a file safely, for asyncio: ``producer``'s helpers on an
:class:`~baton_relay.client.aio.AsyncSession`.

    async with AsyncClient(registry) as c, c.session("ocr-1") as s:
        async with aproduce(s, "t1", "a") as out:
            await out.write(b"hello")
        async with contextlib.aclosing(aproduce_each(s, "t1")) as outputs:
            async for out in outputs:
                with out:
                    await out.write(render(out.claim.file_id))

The file work is the blocking helpers' own (``staging.staged``: the entry's
directory reached without following a symlink, a temp file nobody can guess, fsync,
the rename into the claim's path, BLAKE3 as bytes go in, an earlier attempt's partial
file adopted); only the calls to the registry are awaited: the claim (back-pressure
waited out), the checkpoints of a resumable write, the commit, the fail.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from typing import Any

from ..kernel import tracing
from ..kernel.errors import Draining, NothingToClaim
from ..kernel.v1 import baton_pb2 as pb
from ._wire import Attributes, Claim
from .aio import AsyncSession
from .failures import handing_back
from .producer import (
    AHEAD,
    LINGER,
    Done,
    Pace,
    attempt_span,
    claim_span,
    claimed,
    step_commits,
    step_spans,
    stepped,
)
from .retry import BACKPRESSURE_WAIT
from .staging import (
    RESUME_EVERY,
    RESUME_FRACTION,
    OutputFile,
    Resume,
    failure,
    new_nonce,
    staged,
)

__all__ = ["AsyncOutput", "aproduce", "aproduce_each"]

log = logging.getLogger("baton.client")


@dataclass
class AsyncOutput(OutputFile):
    """The open temp file of a claim (``Output``, for asyncio): ``await out.write(...)``;
    size and digest follow along. ``close()`` (or leaving ``with out:`` without an
    error) says the bytes are complete."""

    #: where ``checkpoint`` is recorded: the session holding the claim
    _session: AsyncSession | None = None

    async def write(self, data: bytes | bytearray | memoryview) -> int:
        """Append ``data`` (the file's write itself does not wait for the loop); a
        resumable write records a resume point each time ``resume_every`` bytes have
        gone in since the last one."""
        for _ in self._fill(data):
            await self.save_point()
        return memoryview(data).nbytes

    async def save_point(self) -> pb.Checkpoint:
        """Make what was written so far durable and record it as the point a later
        attempt resumes from (``Output.save_point``)."""
        data, progress, message = self._point()
        kept = await self.checkpoint(data=data, progress=progress, message=message)
        self._saved = self.size
        return kept

    async def checkpoint(self, *, data: bytes = b"", progress: float = 0.0,
                         message: str = "") -> pb.Checkpoint:
        """Record how far this attempt got: if it does not finish, the next attempt's
        claim carries ``data`` (``claim.checkpoint``) to resume from."""
        assert self._session is not None, "an AsyncOutput made by aproduce() checkpoints"
        c = self.claim
        with tracing.child(self._trace, "baton.checkpoint", progress=progress):
            return await self._session.checkpoint(c.task_id, c.file_id, c.token, data=data,
                                                  progress=progress, message=message)


async def _claim(session: AsyncSession, task_id: str, file_id: str, root: Any,
                 wait: float) -> Claim:
    """Claim for the attempt whose span is ``root`` (``producer.claim_span``),
    back-pressure waited out for up to ``wait`` seconds."""
    with claim_span(root) as parent:
        claim = await session.claim_waiting(task_id, file_id, wait=wait,
                                            traceparent=parent)
    claimed(root, claim)
    return claim


@asynccontextmanager
async def _writing(session: AsyncSession, claim: Claim, nonce: Callable[[], str],
                   attributes: Attributes, resume: Resume | None = None,
                   trace: str = "") -> AsyncIterator[AsyncOutput]:
    """Yield the claim's output; once the block ends, the file is under its final name
    and on disk, ready to commit. A block that raises fails the entry."""
    made: list[AsyncOutput] = []

    def output(**fields: Any) -> AsyncOutput:
        made.append(AsyncOutput(**fields, _session=session))
        return made[0]

    try:
        with staged(claim, nonce, attributes, resume or Resume(), trace, output,
                    session.check) as out:
            if out._adopted:
                await out.save_point()  # the file's new name, for an attempt after this one
            yield out
    except BaseException as e:
        permanent, delay = handing_back(e)
        await session.fail(claim.task_id, claim.file_id, claim.token,
                           reason=failure(e, made[0] if made else None),
                           permanent=permanent, delay=delay)
        raise


@asynccontextmanager
async def aproduce(
    session: AsyncSession, task_id: str, file_id: str = "", *,
    nonce: Callable[[], str] = new_nonce, attributes: Attributes = None,
    resumable: bool = False, resume_every: int = RESUME_EVERY,
    resume_fraction: float = RESUME_FRACTION, expected_size: int = 0,
    wait: float = BACKPRESSURE_WAIT,
) -> AsyncIterator[AsyncOutput]:
    """``produce``: claim an entry and yield its output; publish and commit when the
    block ends. The same arguments, the same resume points, the same failures: a block
    that raises removes the temp file (a resumable write keeps what a resume point
    recorded) and fails the entry, a ``PermanentError`` for good, a ``RetryAfter``
    after its delay; back-pressure is waited out for up to ``wait`` seconds."""
    resume = Resume.of(resumable, resume_every, resume_fraction, expected_size)
    root = attempt_span(task_id, file_id)
    claim = await _claim(session, task_id, file_id, root, wait)
    trace = tracing.traceparent(root)
    try:
        async with _writing(session, claim, nonce, attributes, resume, trace) as out:
            yield out
        with tracing.child(trace, "baton.commit", size=out.size):
            out.entry = await session.commit(task_id, claim.file_id, claim.token, out.size,
                                             out.digest, attributes=out.attributes)
    except BaseException as e:
        tracing.end(root, e)
        raise
    tracing.end(root)


async def aproduce_each(session: AsyncSession, task_id: str, *,
                        nonce: Callable[[], str] = new_nonce,
                        wait: float = BACKPRESSURE_WAIT, ahead: int = AHEAD,
                        linger: float = LINGER) -> AsyncIterator[AsyncOutput]:
    """``produce_each``: claim the task's entries one after another, each output
    yielded to be written; a step commits what the loop wrote and claims what it works
    on next in one message (up to ``ahead`` entries ahead, as the loop's pace allows
    within ``linger`` seconds). Ends without an error when nothing is left to claim or
    once the session's host is drained. Leaving the loop commits what was written
    (the output in hand too, if closed), gives back what was claimed ahead, and fails
    an output in hand that was not closed; as for any async generator, that happens
    when the generator is closed, so a loop that may ``break`` wraps it in
    ``contextlib.aclosing``."""
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
                    hand.append((await _claim(session, task_id, "", root, wait), root))
                except (NothingToClaim, Draining):
                    return
            claim, root = hand.popleft()
            trace = tracing.traceparent(root)
            began = time.monotonic()
            left = False  # the loop was left with the output in hand closed
            try:
                async with _writing(session, claim, nonce, None, trace=trace) as out:
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
            if not hand or now - oldest >= linger or session.draining:
                more = 0 if session.draining else max(0, pace.want() - len(hand))
                hand.extend(await _step(session, task_id, done, more))
                done.clear()
    finally:
        await _hand_back(session, done, hand)


async def _step(session: AsyncSession, task_id: str, done: list[Done],
                more: int) -> list[tuple[Claim, Any]]:
    """Commit ``done`` and claim up to ``more`` next entries, in one message."""
    spans, started = step_spans(task_id, more)
    entries, claims = await session.commit_and_claim_batch(
        step_commits(done), task_id, more,
        traceparents=[tracing.traceparent(s) for s in spans])
    return stepped(done, entries, claims, spans, started)


async def _commit_one(session: AsyncSession, done: Done) -> None:
    out, root, trace = done
    c = out.claim
    try:
        with tracing.child(trace, "baton.commit", size=out.size):
            out.entry = await session.commit(c.task_id, c.file_id, c.token, out.size,
                                             out.digest, attributes=out.attributes)
    except BaseException as e:
        tracing.end(root, e)
        raise
    tracing.end(root)


async def _hand_back(session: AsyncSession, done: list[Done],
                     hand: deque[tuple[Claim, Any]]) -> None:
    """As a loop ends: commit what it wrote (one by one if the step of all of them is
    refused) and give back what it claimed ahead and did not begin (``produce_each``'s
    ``_hand_back``)."""
    if done:
        with suppress(Exception):  # refused as a whole: each is committed on its own below
            await _step(session, done[0][0].claim.task_id, done, 0)
    for d in done:
        if d[0].entry is None:
            try:
                await _commit_one(session, d)
            except Exception as e:
                log.warning("could not commit %s/%s as the loop ended: %s",
                            d[0].claim.task_id, d[0].claim.file_id, e)
    done.clear()
    while hand:
        claim, _ = hand.popleft()
        try:
            await session.fail(claim.task_id, claim.file_id, claim.token, release=True,
                               reason="the producer's loop ended before it began")
        except Exception as e:
            log.info("could not give %s/%s back as the loop ended (the registry will, "
                     "with the session or at its deadline): %s", claim.task_id,
                     claim.file_id, e)
