"""One producer or consumer agent process of a fault run.

    python -m tests.faults.agent --role producer --name p1.0 --registries A,B \
        --history DIR/p1.0.jsonl --seed 7 [--ttl 4] [--group g1] \
        [--ca CA --cert CRT --key KEY] [--one-client-per-replica]

It works on every active task of the registry until SIGTERM, recording every call
(see ``history.py``). It holds one client per registry replica and moves to the other
one when a call finds its replica unavailable, or (chosen by the seed, unless
``--one-client-per-replica``) one client on both replicas' addresses. With ``--ca``,
``--cert`` and ``--key`` it speaks mutual TLS as that identity. Producers use the
``produce`` helper with payloads unique to (task, file, token, agent); consumers use
``next_lease``, ``read_verified`` and ``ack``. A claim or consume whose outcome is
unknown may have left a claim behind, so the session is given up (its lease ends, the
reaper returns what it held) and a new one opened.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from types import FrameType
from typing import Any

from baton_relay.client import (
    Client,
    RetryPolicy,
    Session,
    errors,
    next_lease,
    produce,
    read_verified,
)
from baton_relay.kernel.contract import parse_temp
from baton_relay.kernel.v1 import baton_pb2 as pb

from . import payload
from .history import History, phase_of

#: payload sizes: mostly small, some past the watcher's 1 MiB multi-threaded threshold
SIZES = ((0.70, 1, 64 << 10), (0.25, 64 << 10, 1 << 20), (0.05, 1 << 20, 6 << 20))
CHUNK = 64 << 10
TASKS_REFRESH = 10.0
TASKS_IDLE = 1.0
#: etcd at its quota (``StorageFull``): a refused commit or ack is sent again after
#: these pauses (first, longest), for at most ``FULL_PATIENCE`` seconds; a refused claim
#: or consume is followed by the first pause
FULL_PAUSE = (0.25, 2.0)
FULL_PATIENCE = 60.0
#: the odds that a producer checkpoints after a chunk it wrote (the first excepted):
#: payloads of several chunks leave checkpoints that the next attempt is handed
CHECKPOINT_ODDS = 0.3
#: the odds that an attempt writes resumably (``produce(..., resumable=True)``): its
#: checkpoints are then resume points (``Output.save_point``: the temp file fsynced,
#: its name, length and digest), and it adopts the partial file of an earlier attempt
#: whose point it is handed, going on with that attempt's payload
RESUMABLE_ODDS = 0.5
#: seconds ``produce`` waits out a task's back-pressure before the agent turns to
#: another task (its claim refused with ``Backpressure``)
BACKPRESSURE_WAIT = 1.0
#: a resumable attempt's own ``resume_every``: never reached (and no fraction of the
#: expected size either), so that its points are the ones it records (and its history
#: shows) itself
NO_AUTOMATIC_POINTS = 1 << 62


#: what a resume point's data says it is (``client.producer.ResumePoint``)
RESUME_FORMAT = "baton-resume/1"


class Agent:
    def __init__(self, args: argparse.Namespace) -> None:
        self.name: str = args.name
        self.role: str = args.role
        self.group: str = args.group
        self.ttl: int = args.ttl
        self.rng = random.Random(f"{args.seed}/{self.name}")
        self.history = History(args.history, self.name)
        retry = RetryPolicy(attempts=3, initial=0.1, cap=0.5, deadline=6.0)
        replicas: list[str] = args.registries.split(",")
        # Half the agents hold one client per replica and switch themselves; the others
        # hold one client on a gRPC multi-address target, whose retries of a call (same
        # request id) move to the other replica when one dies.
        listed = self.rng.random() >= 0.5 and not args.one_client_per_replica
        self.addresses = ["ipv4:" + ",".join(replicas)] if listed else replicas
        self.clients = [Client(a, timeout=5.0, retry=retry, ca=args.ca, cert=args.cert,
                               key=args.key) for a in self.addresses]
        self.current = self.rng.randrange(len(self.clients))
        self.session: Session | None = None
        self.stop = threading.Event()
        self._tasks: list[str] = []
        self._tasks_at = 0.0

    # plumbing ---------------------------------------------------------------------

    @property
    def client(self) -> Client:
        return self.clients[self.current]

    def switch(self) -> None:
        """Use the other replica from now on (the session's keepalives too)."""
        self.current = (self.current + 1) % len(self.clients)
        if self.session is not None:
            self.session.client = self.client
        self.history.write("switch", "info", registry=self.current)

    def pause(self, seconds: float) -> None:
        self.stop.wait(seconds)

    def ensure_session(self) -> Session | None:
        if self.session is not None:
            try:
                self.session.check()
                return self.session
            except errors.SessionExpired:
                self.history.write("session-lost", "info", session=self.session.session_id)
                self.session.close(revoke=False)
                self.session = None
        self.history.invoke("open-session", registry=self.current, ttl=self.ttl)
        try:
            self.session = self.client.open_session(self.name, ttl=self.ttl)
        except errors.BatonError as e:
            self.history.error("open-session", e)
            if isinstance(e, errors.Unavailable):
                self.switch()
            self.pause(0.3)
            return None
        self.history.ok("open-session", session=self.session.session_id)
        return self.session

    def abandon_session(self, why: str) -> None:
        """A claim may be held unknowingly: end the session so the reaper returns it."""
        if self.session is None:
            return
        self.history.write("abandon-session", "info", session=self.session.session_id,
                           why=why)
        self.session.client = self.client
        self.session.close(revoke=True)
        self.session = None

    def tasks(self, idle: bool) -> list[str]:
        """The active tasks, in random order. ListTasks costs the registry two reads per
        task, so it is asked again only when idle (at most every second), or seldom."""
        age = time.monotonic() - self._tasks_at
        if age > (TASKS_IDLE if idle else TASKS_REFRESH):
            try:
                self._tasks = [t.spec.task_id for t in self.client.operator.list_tasks()
                               if t.status == pb.TASK_STATUS_ACTIVE]
                self._tasks_at = time.monotonic()
            except errors.Unavailable:
                self.switch()
            except errors.BatonError:
                pass
        tasks = list(self._tasks)
        self.rng.shuffle(tasks)
        return tasks

    def size(self) -> int:
        x = self.rng.random()
        for weight, low, high in SIZES:
            if x < weight:
                return self.rng.randint(low, high)
            x -= weight
        return 1

    def run(self) -> None:
        self.history.write("start", "info", role=self.role, group=self.group,
                           registries=self.addresses)
        worked = True
        while not self.stop.is_set():
            session = self.ensure_session()
            if session is None:
                continue
            tasks, worked = self.tasks(idle=not worked), False
            for task in tasks:
                if self.stop.is_set():
                    break
                step = self.produce_one if self.role == "producer" else self.consume_one
                if step(session, task):
                    worked = True
                    break
            if not worked:
                self.pause(0.2)
        if self.session is not None:
            self.session.close(revoke=True)
        self.history.write("stop", "info")
        self.history.close()

    # producers --------------------------------------------------------------------

    def produce_one(self, session: Session, task: str) -> bool:
        """Claim the next entry of ``task``, write its payload and commit; False if idle."""
        h, client, registry = self.history, self.client, self.current
        stage, claim, size, digest = "claim", None, 0, ""
        resumable = self.rng.random() < RESUMABLE_ODDS
        h.invoke("claim", task=task, registry=registry, session=session.session_id,
                 resumable=resumable)
        try:
            with produce(client, session, task, resumable=resumable,
                         resume_every=NO_AUTOMATIC_POINTS, resume_fraction=0,
                         wait=BACKPRESSURE_WAIT) as out:
                claim = out.claim
                handed = handed_checkpoint(claim.checkpoint)
                h.ok("claim", task=task, file=claim.file_id, token=claim.token,
                     attempt=claim.entry.retry_count, session=session.session_id,
                     resumable=resumable,
                     **({"resumed_from": handed} if handed is not None else {}))
                stage = "write"
                start = out.size
                if start:
                    # An earlier attempt's partial file, adopted: its payload goes on.
                    # produce() recorded this attempt's first resume point already.
                    h.ok("checkpoint", task=task, file=claim.file_id, token=claim.token,
                         n=start, adopted=True)
                    origin = payload.parse(os.pread(out.file.fileno(), payload.HEADER_MAX, 0))
                    assert origin is not None, "an adopted partial file without a header"
                else:
                    origin = payload.Origin(task, claim.file_id, claim.token, self.name,
                                            self.size())
                data = payload.make(origin)
                for i in range(start, len(data), CHUNK):
                    out.write(data[i:i + CHUNK])
                    if i > start and self.rng.random() < CHECKPOINT_ODDS:
                        self.checkpoint(out, task, len(data), resumable)
                size, digest = out.size, out.digest
                h.ok("write", task=task, file=claim.file_id, token=claim.token, size=size,
                     digest=digest, origin_token=origin.token, resumed_at=start)
                self.pause(self.rng.random() * 0.1)  # "work" between writing and publishing
                stage = "commit"
                h.invoke("commit", task=task, file=claim.file_id, token=claim.token,
                         size=size, digest=digest, registry=registry)
        except errors.BatonError as e:
            if stage == "claim":
                h.error("claim", e, task=task)
                if isinstance(e, errors.NothingToClaim | errors.TaskNotActive
                              | errors.Backpressure):
                    return False  # another task, or later
                if phase_of(e) == "info":
                    self.switch()
                    self.abandon_session(f"claim outcome unknown: {e}")
                elif isinstance(e, errors.SessionExpired):
                    self.abandon_session("session expired")
                if isinstance(e, errors.StorageFull):
                    self.pause(FULL_PAUSE[0])
                return True
            assert claim is not None
            if stage == "commit":
                h.error("commit", e, task=task, file=claim.file_id, token=claim.token)
                if isinstance(e, errors.StorageFull):  # refused: send it again later
                    self.commit_again(task, claim.file_id, claim.token, size, digest,
                                      full=True)
                elif phase_of(e) == "info":
                    self.switch()
                    self.commit_again(task, claim.file_id, claim.token, size, digest)
            else:  # the block failed and produce() failed the claim; that call raised
                h.error("fail", e, task=task, file=claim.file_id, token=claim.token)
                if phase_of(e) == "info":  # the claim may still be ours: let it go
                    self.switch()
                    self.abandon_session(f"fail outcome unknown: {e}")
            return True
        except OSError as e:  # writing or publishing failed; produce() failed the claim
            h.write("write", "fail", task=task, file=claim.file_id if claim else "",
                    token=claim.token if claim else 0, error=type(e).__name__,
                    message=str(e)[:300])
            return True
        assert claim is not None and out.entry is not None
        h.ok("commit", task=task, file=claim.file_id, token=claim.token,
             state=pb.EntryState.Name(out.entry.state))
        return True

    def checkpoint(self, out: Any, task: str, total: int, resumable: bool) -> None:
        """Record how far the write got: a resume point if the attempt is resumable
        (its data names the temp file, whose name holds this attempt's token, and the
        bytes on disk), else data naming this attempt's token and the bytes written;
        either way the checker can tell which checkpoint a later claim is handed. A
        refused one is recorded and the write goes on (its commit will be refused in
        turn if the token died)."""
        h, claim, done = self.history, out.claim, out.size
        fields = {"task": task, "file": claim.file_id, "token": claim.token, "n": done}
        h.invoke("checkpoint", **fields, registry=self.current)
        try:
            if resumable:
                out.save_point()
            else:
                out.checkpoint(data=json.dumps({"token": claim.token, "n": done}).encode(),
                               progress=min(done / total, 1.0), message=f"{done} bytes")
        except errors.BatonError as e:
            h.error("checkpoint", e, **fields)
        else:
            h.ok("checkpoint", **fields)

    def commit_again(self, task: str, file: str, token: int, size: int, digest: str,
                     full: bool = False) -> None:
        """The commit's outcome is unknown: send it again (through the other replica).
        With ``full`` etcd refused it at its quota: send it again after a pause, as long
        as etcd refuses (``FULL_PATIENCE`` at most); the token lives meanwhile."""
        h = self.history
        pause, give_up = FULL_PAUSE[0], time.monotonic() + FULL_PATIENCE
        while True:
            if full:
                self.pause(pause)
                pause = min(2 * pause, FULL_PAUSE[1])
            h.invoke("commit", task=task, file=file, token=token, size=size, digest=digest,
                     registry=self.current, again=True)
            try:
                entry = self.client.commit(task, file, token, size, digest)
            except errors.BatonError as e:
                h.error("commit", e, task=task, file=file, token=token)
                full = isinstance(e, errors.StorageFull)
                if full and time.monotonic() < give_up and not self.stop.is_set():
                    continue
                return
            h.ok("commit", task=task, file=file, token=token,
                 state=pb.EntryState.Name(entry.state))
            return

    # consumers --------------------------------------------------------------------

    def consume_one(self, session: Session, task: str) -> bool:
        """Take the next verified entry of ``task`` for our group, check it, ack; False if idle."""
        h, client, group = self.history, self.client, self.group
        h.invoke("consume", task=task, group=group, registry=self.current,
                 session=session.session_id)
        try:
            lease = next_lease(client, session, task, group, timeout=0.5)
        except errors.BatonError as e:
            h.error("consume", e, task=task, group=group)
            if isinstance(e, errors.NothingToClaim | errors.TaskNotActive | errors.NotFound):
                return False
            if phase_of(e) == "info":
                self.switch()
                self.abandon_session(f"consume outcome unknown: {e}")
            elif isinstance(e, errors.SessionExpired):
                self.abandon_session("session expired")
            if isinstance(e, errors.StorageFull):
                self.pause(FULL_PAUSE[0])
            return True
        ident = {"task": task, "file": lease.file_id, "group": group, "token": lease.token}
        h.ok("consume", **ident, size=lease.size, digest=lease.digest)
        try:
            data = read_verified(lease)
        except (errors.ChecksumMismatch, OSError) as e:
            h.write("read", "fail", **ident, error=type(e).__name__, message=str(e)[:300])
            self.nack(ident, f"{type(e).__name__}: {e}")
            return True
        origin = payload.traced(data)
        h.ok("read", **ident, size=len(data), digest=payload.digest(data),
             origin=asdict(origin) if origin else None)
        self.pause(self.rng.random() * 0.1)  # "work" with the bytes
        # Sent again once through the other replica when its outcome is unknown; while
        # etcd is at its quota (refused: nothing applied), again after a pause.
        again, pause, give_up = False, FULL_PAUSE[0], time.monotonic() + FULL_PATIENCE
        while True:
            h.invoke("ack", **ident, registry=self.current, again=again)
            try:
                entry = self.client.ack(task, lease.file_id, group, lease.token)
            except errors.BatonError as e:
                h.error("ack", e, **ident)
                if isinstance(e, errors.StorageFull) and time.monotonic() < give_up \
                        and not self.stop.is_set():
                    self.pause(pause)
                    pause, again = min(2 * pause, FULL_PAUSE[1]), True
                    continue
                if phase_of(e) == "info" and not again:
                    self.switch()
                    again = True
                    continue
                return True
            h.ok("ack", **ident, state=pb.EntryState.Name(entry.state))
            return True

    def nack(self, ident: dict[str, object], reason: str) -> None:
        h = self.history
        h.invoke("nack", **ident, registry=self.current)
        try:
            self.client.nack(str(ident["task"]), str(ident["file"]), self.group,
                             int(str(ident["token"])), reason=reason[:200])
        except errors.BatonError as e:
            h.error("nack", e, **ident)
            return
        h.ok("nack", **ident)


def handed_checkpoint(checkpoint: Any) -> dict[str, int] | None:
    """What a claim was handed of an earlier attempt's checkpoint: the token and the
    bytes its data names (``{"token": -1}`` for data no producer of this run wrote)."""
    if checkpoint is None:
        return None
    try:
        d = json.loads(checkpoint.data)
        if d.get("format") == RESUME_FORMAT:  # a resume point: its temp file names the token
            temp = parse_temp(str(d["temp"]))
            return {"token": temp[1] if temp else -1, "n": int(d["length"])}
        return {"token": int(d["token"]), "n": int(d["n"])}
    except (ValueError, KeyError, TypeError):
        return {"token": -1, "n": -1}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.faults.agent")
    parser.add_argument("--role", choices=("producer", "consumer"), required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--registries", required=True, help="comma-separated host:port")
    parser.add_argument("--history", required=True, type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ttl", type=int, default=4)
    parser.add_argument("--group", default="g1")
    parser.add_argument("--ca", help="CA of the registry's certificate (mutual TLS)")
    parser.add_argument("--cert", help="this agent's certificate (its identity)")
    parser.add_argument("--key", help="the key of --cert")
    parser.add_argument("--one-client-per-replica", action="store_true",
                        help="never one client on a list of replicas")
    agent = Agent(parser.parse_args(argv))

    def on_term(signum: int, frame: FrameType | None) -> None:
        agent.stop.set()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    agent.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())

