"""A producer that publishes whatever its claim's fate, as a careless shell agent would.

    python zombie_producer.py REGISTRY TASK FILE TTL

It claims FILE, writes its payload to a temp file beside the path the claim gave,
prints the claim as one JSON line, and waits. On the line ``publish`` it renames the
temp file onto that path without asking whether its claim still lives, prints
``{"renamed": PATH}``, then tries to commit and prints ``{"outcome": ...}``.
"""

from __future__ import annotations

import json
import os
import sys

import blake3

from baton_relay.client import Client, RetryPolicy
from baton_relay.client.producer import temp_name
from baton_relay.kernel import errors

PAYLOAD = b"Z" * 1000


def main() -> None:
    address, task, file, ttl = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    client = Client(address, retry=RetryPolicy(attempts=2, deadline=2.0))
    session = client.open_session("zombie", ttl=ttl)
    claim = client.claim(task, file, session=session)
    directory, name = os.path.split(claim.path)
    os.makedirs(directory, exist_ok=True)
    temp = os.path.join(directory, temp_name(name, claim.token))
    with open(temp, "wb") as f:
        f.write(PAYLOAD)
    print(json.dumps(claim.as_dict()), flush=True)
    sys.stdin.readline()
    os.rename(temp, claim.path)
    print(json.dumps({"renamed": claim.path}), flush=True)
    try:
        client.commit(task, claim.file_id, claim.token, len(PAYLOAD),
                      blake3.blake3(PAYLOAD).hexdigest(), session=session)
        outcome = "committed"
    except errors.BatonError as e:
        outcome = type(e).__name__
    print(json.dumps({"outcome": outcome}), flush=True)


if __name__ == "__main__":
    main()
