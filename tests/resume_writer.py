"""A producer process writing one large entry resumably, for tests/system/test_resume.py.

    python resume_writer.py REGISTRY TASK FILE_ID SIZE RESUME_EVERY TTL [CHUNK]

Writes SIZE bytes of ``block(i)`` (1 MiB blocks, see ``block``) through
``produce(..., resumable=True)``, going on from where an adopted partial file ends,
CHUNK bytes per write call (a block by default). RESUME_EVERY 0: the library's own
resume points (``produce``'s defaults).
Prints JSON lines: ``{"start": N}`` (bytes adopted), ``{"saved": N}`` after each resume
point, then ``{"done": STATE, "written": N}`` (bytes this process wrote).
"""

from __future__ import annotations

import json
import sys
import time

import blake3

from baton_relay.client import Client, RetryPolicy, errors, produce

BLOCK = 1 << 20


def block(i: int) -> bytes:
    """The ``i``-th MiB of the payload: the same in every process."""
    return blake3.blake3(i.to_bytes(8, "big")).digest(length=BLOCK)


def payload(pos: int, n: int) -> bytes:
    """The ``n`` bytes of the payload from ``pos`` on."""
    parts = []
    while n > 0:
        i, offset = divmod(pos, BLOCK)
        part = block(i)[offset:offset + n]
        parts.append(part)
        pos += len(part)
        n -= len(part)
    return b"".join(parts)


def say(**kw: object) -> None:
    print(json.dumps(kw), flush=True)


def main() -> None:
    address, task, file_id = sys.argv[1], sys.argv[2], sys.argv[3]
    size, every, ttl = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
    chunk = int(sys.argv[7]) if len(sys.argv) > 7 else BLOCK
    options = {"resume_every": every} if every else {}
    client = Client(address, retry=RetryPolicy(attempts=3, deadline=5.0))
    deadline = time.monotonic() + 60
    with client.open_session("resume-writer", ttl=ttl) as session:
        while True:
            try:
                with produce(client, session, task, file_id, resumable=True,
                             expected_size=size, **options) as out:
                    start = out.size
                    say(start=start, attempt=out.claim.attempt)
                    saved = out._saved
                    pos = start
                    while pos < size:
                        data = payload(pos, min(chunk, size - pos))
                        out.write(data)
                        pos += len(data)
                        if out._saved != saved:
                            saved = out._saved
                            say(saved=saved)
                break
            except (errors.IllegalTransition, errors.NothingToClaim):
                # The earlier attempt's claim is not back yet (its session's TTL runs).
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    assert out.entry is not None
    say(done=int(out.entry.state), written=size - start)


if __name__ == "__main__":
    main()
