"""A real agent process for the fair shares acceptance: claims and commits until
nothing is left to claim.

    python fair_agent.py REGISTRY TASK NAME

Prints one JSON line per claim it made, ``{"token": T, "file_id": F}``, then
``{"done": N}``: the token is the claim's etcd revision, so the lines of every agent
sorted by token give the order in which the registry handed the entries out.
"""

from __future__ import annotations

import json
import sys

import blake3

from baton_relay.client import Client, RetryPolicy
from baton_relay.kernel import errors

#: the digest of the one byte each commit claims to have written (no file is written)
DIGEST = blake3.blake3(b"x").hexdigest()


def main() -> None:
    address, task, name = sys.argv[1], sys.argv[2], sys.argv[3]
    made = 0
    with Client(address, timeout=10, retry=RetryPolicy(attempts=5, deadline=10.0)) as client, \
            client.open_session(name, ttl=30) as session:
        while True:
            try:
                claim = client.claim(task, session=session)
            except errors.NothingToClaim:
                break
            print(json.dumps({"token": claim.token, "file_id": claim.file_id}), flush=True)
            client.commit(task, claim.file_id, claim.token, 1, DIGEST, session=session)
            made += 1
    print(json.dumps({"done": made}), flush=True)


if __name__ == "__main__":
    main()
