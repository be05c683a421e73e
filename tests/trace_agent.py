"""An agent process of the traces test: one stage of a pipeline, traced by the
``OTEL_*`` environment it is started with.

    python trace_agent.py REGISTRY produce TASK              # produce_each, fused steps
    python trace_agent.py REGISTRY relay SRC GROUP DST N     # consume_each SRC, put DST
    python trace_agent.py REGISTRY consume TASK GROUP N      # consume, unary calls

Each prints one JSON line per entry it handled, then ``{"done": true}``; it exits
once its entries are handled (its spans are sent at exit). The producer ends when
nothing is left to claim.
"""

from __future__ import annotations

import io
import json
import sys

from baton_relay.client import Client, consume, consume_each, produce_each, put


def say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def main() -> None:
    address, mode, *args = sys.argv[1:]
    client = Client(address)
    if mode == "produce":
        task = args[0]
        with client.open_session(f"producer-{task}", ttl=10) as session:
            for out in produce_each(client, session, task):
                out.write(f"{task}/{out.claim.file_id} made at stage one".encode())
                out.checkpoint(progress=1.0, message="written")
                say(file_id=out.claim.file_id, token=out.claim.token)
    elif mode == "relay":
        src, group, dst, n = args[0], args[1], args[2], int(args[3])
        with client.open_session(f"relay-{group}", ttl=10) as session:
            done = 0
            while done < n:  # each delivery is acked as the loop asks for the next
                for delivery in consume_each(client, session, src, group, timeout=3):
                    data = delivery.data + f" | passed on by {group}".encode()
                    put(client, session, dst, delivery.lease.file_id, io.BytesIO(data))
                    done += 1
                    say(file_id=delivery.lease.file_id, token=delivery.lease.token)
    elif mode == "consume":
        task, group, n = args[0], args[1], int(args[2])
        # keepalive=False: its calls are unary ones (traceparent metadata)
        session = client.open_session(f"consumer-{group}", ttl=30, keepalive=False)
        for _ in range(n):
            with consume(client, session, task, group, timeout=60) as delivery:
                say(file_id=delivery.lease.file_id, token=delivery.lease.token)
        client.close_session(session.session_id)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    say(done=True)
    client.close()


if __name__ == "__main__":
    main()
