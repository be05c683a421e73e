"""A real agent process for lease tests: claims, reports, then obeys stdin.

    python agent_proc.py REGISTRY TASK TTL

Prints one JSON line with the claim, then for each stdin line ``commit``
tries to commit and prints the outcome as one JSON line.
"""

from __future__ import annotations

import json
import sys

import blake3

from baton_relay.client import Client, RetryPolicy
from baton_relay.kernel import errors


def main() -> None:
    address, task, ttl = sys.argv[1], sys.argv[2], int(sys.argv[3])
    client = Client(address, retry=RetryPolicy(attempts=2, deadline=2.0))
    session = client.open_session("agent-proc", ttl=ttl)
    claim = client.claim(task, session=session)
    print(json.dumps(claim.as_dict()), flush=True)
    for line in sys.stdin:
        if line.strip() == "commit":
            try:
                session.check()
                # Writes no file: the digest of the one byte it claims to have written.
                entry = client.commit(task, claim.file_id, claim.token, 1,
                                      blake3.blake3(b"x").hexdigest(), session=session)
                print(json.dumps({"ok": True, "state": int(entry.state)}), flush=True)
            except errors.BatonError as e:
                print(json.dumps({"ok": False, "error": type(e).__name__}), flush=True)


if __name__ == "__main__":
    main()
