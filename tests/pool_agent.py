"""An agent process of the pools test: produces a task's entries until none is left.

    python pool_agent.py REGISTRY TASK NAME

Claims with the producer helper; when nothing can be claimed now (the pool at its
limit, say) it waits a little and tries again; when its session is taken away (an
operator's revoke) it opens another. It exits once the task has nothing left to
claim or in hand, printing how many entries it committed.
"""

from __future__ import annotations

import random
import sys
import time

from baton_relay.client import Client, RetryPolicy, produce
from baton_relay.kernel import errors

#: seconds of each session's lease: a killed agent's claim comes back after about this
TTL = 4


def main() -> None:
    address, task, name = sys.argv[1:4]
    client = Client(address, retry=RetryPolicy(attempts=3, deadline=3.0))
    session = None
    done = 0
    while True:
        try:
            if session is None or session.lost.is_set():
                session = client.open_session(name, ttl=TTL)
            with produce(client, session, task) as out:
                out.write(f"{task}/{out.claim.file_id} by {name}".encode())
            done += 1
        except errors.NothingToClaim:
            states = client.operator.get_task(task).states
            if not states.get("pending", 0) and not states.get("writing", 0):
                break
            time.sleep(random.uniform(0.01, 0.05))
        except errors.BatonError as e:  # its session revoked or lost (a loaded machine)
            print(f"{name}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            session = None  # a new one, and go on
            time.sleep(random.uniform(0.05, 0.2))
    print(done, flush=True)


if __name__ == "__main__":
    main()
