"""What operators call (the registry's OperatorService): tasks and entries, the
journal, sessions and leases, watchers and shards."""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator
from typing import Any

import grpc

from ..kernel import errors
from ..kernel.backoff import Backoff
from ..kernel.contract import (
    MAX_MANIFEST_BYTES,
    mib,
)
from ..kernel.errors import BatonError
from ..kernel.v1 import baton_pb2 as pb
from ._connection import Calls
from ._wire import raise_from_rpc


class OperatorCalls(Calls):
    """The OperatorService's calls: ``client.operator`` (tasks and entries, the journal,
    sessions and leases, watchers and shards, pools)."""

    def create_task(self, spec: pb.TaskSpec | dict[str, Any]) -> tuple[pb.Task, bool]:
        """Create a task from a manifest; (task, created). Same manifest again: no-op."""
        if isinstance(spec, dict):
            spec = parse_manifest(spec)
        check_manifest_size(spec)
        resp = self._call("CreateTask", pb.CreateTaskRequest(spec=spec))
        return resp.task, resp.created

    def get_task(self, task_id: str) -> pb.Task:
        return self._call("GetTask", pb.GetTaskRequest(task_id=task_id)).task  # type: ignore[no-any-return]

    def list_tasks(self, archived: bool = False) -> list[pb.Task]:
        """The tasks in etcd; with ``archived``, the tasks archived out of it."""
        return list(self._call("ListTasks", pb.ListTasksRequest(archived=archived)).tasks)

    def watch_tasks(self, timeout: float | None = None) -> Generator[pb.Task, None, None]:
        """Every task header, then each again as it changes (created, paused, completed)."""
        call = self._method("WatchTasks")(pb.WatchTasksRequest(), timeout=timeout)
        try:
            for reply in call:
                yield reply.task
        except grpc.RpcError as e:
            if e.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
                return
            raise raise_from_rpc(e) from None
        finally:
            call.cancel()

    def follow_tasks(self, stop: threading.Event, *, retry: float = 0.5,
                     on_lost: Callable[[BatonError], None] | None = None
                     ) -> Generator[pb.Task, None, None]:
        """Every task header, then each again as it changes, until ``stop`` is set (looked
        at between messages; closing the client ends it at once). The stream is resumed
        from where it stood when it ends or breaks (the registry's progress messages keep
        that revision current while nothing changes), so a header is sent again only if
        it changed meanwhile. A broken stream is tried again after a backoff (from
        ``retry`` seconds, doubling, at most 5 s), ``on_lost`` told of each break. A
        registry that predates resumes sends no revision: each stream it serves then
        starts with every header, as ``watch_tasks`` does."""
        revision, failures = 0, 0
        backoff = Backoff(retry, max(retry, 5.0))
        while not stop.is_set():
            call = self._method("WatchTasks")(
                pb.WatchTasksRequest(start_revision=revision, progress=True))
            try:
                for reply in call:
                    failures = 0
                    if reply.revision:
                        revision = max(revision, reply.revision + 1)
                    if reply.HasField("task"):
                        yield reply.task
                    if stop.is_set():
                        return
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.CANCELLED or stop.is_set():
                    return
                failures += 1
                if on_lost is not None:
                    on_lost(raise_from_rpc(e))
                stop.wait(backoff.delay(failures))
            finally:
                call.cancel()

    def get_entry(self, task_id: str, file_id: str) -> pb.Entry:
        req = pb.GetEntryRequest(task_id=task_id, file_id=file_id)
        return self._call("GetEntry", req).entry  # type: ignore[no-any-return]

    def list_entries(self, task_id: str, state: int = 0, limit: int = 0) -> list[pb.Entry]:
        req = pb.ListEntriesRequest(task_id=task_id, state=state, limit=limit)  # type: ignore[arg-type]
        return list(self._call("ListEntries", req).entries)

    def pause_task(self, task_id: str, reason: str = "", evidence: str = "") -> pb.Task:
        """No new work: claims and consumes are refused (``TaskNotActive``) until
        ``resume_task``; claims and consumes in hand may still be finished."""
        req = pb.PauseTaskRequest(task_id=task_id, reason=reason, evidence=evidence)
        return self._call("PauseTask", req).task  # type: ignore[no-any-return]

    def resume_task(self, task_id: str, reason: str = "", evidence: str = "") -> pb.Task:
        req = pb.ResumeTaskRequest(task_id=task_id, reason=reason, evidence=evidence)
        return self._call("ResumeTask", req).task  # type: ignore[no-any-return]

    def cancel_task(self, task_id: str, reason: str = "", evidence: str = "") -> pb.Task:
        """Stop the task for good: its claims are revoked (their tokens die)."""
        req = pb.CancelTaskRequest(task_id=task_id, reason=reason, evidence=evidence)
        return self._call("CancelTask", req).task  # type: ignore[no-any-return]

    def archive_task(self, task_id: str, reason: str = "") -> pb.Task:
        """Archive a completed or cancelled task now: out of etcd, into the archive."""
        req = pb.ArchiveTaskRequest(task_id=task_id, reason=reason)
        return self._call("ArchiveTask", req).task  # type: ignore[no-any-return]

    def delete_task(self, task_id: str, reason: str = "", *,
                    discard_history: bool = False) -> pb.DeleteTaskResponse:
        """Remove a task that never ran (no entry was ever claimed) or is stuck being
        created, and every key of it; an interrupted delete, sent again, finishes. A
        task that ran is refused with ``IllegalTransition`` (it is kept for audit),
        unless it is cancelled and ``discard_history`` says to delete its journal too."""
        req = pb.DeleteTaskRequest(task_id=task_id, reason=reason,
                                   discard_history=discard_history)
        return self._call("DeleteTask", req)  # type: ignore[no-any-return]

    def requeue(self, task_id: str, file_id: str, group: str = "", *, reason: str = "",
                evidence: str = "") -> pb.Entry:
        """Bring a dead entry back to pending with a fresh retry budget; with ``group``,
        hand an entry that group acked to it again (the other groups' acks stay).
        ``reason`` and ``evidence`` go into the entry's journal."""
        req = pb.RequeueRequest(task_id=task_id, file_id=file_id, group=group, reason=reason,
                                evidence=evidence)
        return self._call("Requeue", req).entry  # type: ignore[no-any-return]

    def replay_task(self, task_id: str, group: str, *, reason: str = "",
                    evidence: str = "") -> int:
        """Hand ``group`` every entry of the task it acked (whose file is still in
        staging) again, the other groups' acks untouched; how many entries.
        ``reason`` and ``evidence`` go into each entry's journal."""
        req = pb.RequeueRequest(task_id=task_id, group=group, reason=reason,
                                evidence=evidence)
        return int(self._call("Requeue", req).replayed)

    def journal(self, task_id: str, file_id: str = "", limit: int = 0) -> list[pb.JournalRecord]:
        """The journal's records, oldest first: the newest ``limit`` (0: all, up to the
        registry's bound on a reply; ``journal_reply`` says how many there are)."""
        return list(self.journal_reply(task_id, file_id, limit).records)

    def journal_reply(self, task_id: str, file_id: str = "", limit: int = 0
                      ) -> pb.JournalResponse:
        """``journal``'s reply: its records and ``total``, how many the journal holds."""
        req = pb.JournalRequest(task_id=task_id, file_id=file_id, limit=limit)
        return self._call("Journal", req)  # type: ignore[no-any-return]

    def explain(self, task_id: str, file_id: str) -> pb.ExplainResponse:
        req = pb.ExplainRequest(task_id=task_id, file_id=file_id)
        return self._call("Explain", req)  # type: ignore[no-any-return]

    def list_agents(self) -> list[pb.AgentInfo]:
        return list(self._call("ListAgents", pb.ListAgentsRequest()).agents)

    def revoke_sessions(self, session_id: int = 0, *, agent: str = "", host: str = "",
                        reason: str = "", evidence: str = "") -> list[pb.RevokedSession]:
        """Revoke the session named, or every session of ``agent`` or of ``host``: their
        claims go back at once without spending a retry, their tokens die."""
        req = pb.RevokeSessionRequest(session_id=session_id, agent=agent, host=host,
                                      reason=reason, evidence=evidence)
        return list(self._call("RevokeSession", req).sessions)

    def rotate_leases(self, session_id: int = 0, *, every: bool = False, host: str = "",
                      ttl: int = 0) -> list[pb.RotatedSession]:
        """Move the session named (every session, those of ``host``) onto a fresh etcd
        lease, with ``ttl`` (0: its own) from its next keepalive; claims, tokens and
        session ids stay. The new lease has no more time than the old one had left."""
        req = pb.RotateLeaseRequest(session_id=session_id, all=every, host=host, ttl=ttl)
        return list(self._call("RotateLease", req).sessions)

    def drain_host(self, host: str, deadline: int = 0, reason: str = "",
                   evidence: str = "") -> pb.DrainHostResponse:
        """Drain ``host``: its sessions take no new work; what they still hold after
        ``deadline`` seconds (0: the registry's default) is revoked."""
        req = pb.DrainHostRequest(host=host, deadline_seconds=deadline, reason=reason,
                                  evidence=evidence)
        return self._call("DrainHost", req)  # type: ignore[no-any-return]

    def undrain_host(self, host: str) -> pb.UndrainHostResponse:
        return self._call("UndrainHost", pb.UndrainHostRequest(host=host))  # type: ignore[no-any-return]

    def list_watchers(self) -> list[pb.WatcherInfo]:
        return list(self._call("ListWatchers", pb.ListWatchersRequest()).watchers)

    def list_shards(self) -> pb.ListShardsResponse:
        return self._call("ListShards", pb.ListShardsRequest())  # type: ignore[no-any-return]

    def move_shard(self, shard: int, to_watcher: str, deadline: int = 0, reason: str = "",
                   evidence: str = "") -> pb.ShardInfo:
        """Start moving a shard (its owner hands it over within ``deadline`` seconds)."""
        req = pb.MoveShardRequest(shard=shard, to_watcher=to_watcher, deadline=deadline,
                                  reason=reason, evidence=evidence)
        return self._call("MoveShard", req).shard  # type: ignore[no-any-return]

    def rebalance(self, dry_run: bool = False) -> list[pb.ShardMove]:
        return list(self._call("Rebalance", pb.RebalanceRequest(dry_run=dry_run)).moves)

    def drain_watcher(self, watcher_id: str, undo: bool = False) -> pb.DrainWatcherResponse:
        req = pb.DrainWatcherRequest(watcher_id=watcher_id, undo=undo)
        return self._call("DrainWatcher", req)  # type: ignore[no-any-return]

    def set_pool(self, name: str, limit: int, *, reason: str = "",
                 evidence: str = "") -> pb.PoolInfo:
        """Define a concurrency pool of ``limit`` units, or change its limit (live)."""
        req = pb.SetPoolRequest(name=name, limit=limit, reason=reason, evidence=evidence)
        return self._call("SetPool", req).pool  # type: ignore[no-any-return]

    def list_pools(self) -> list[pb.PoolInfo]:
        """Every pool: its limit, units in use and their holders, entries waiting."""
        return list(self._call("ListPools", pb.ListPoolsRequest()).pools)

    def delete_pool(self, name: str, *, reason: str = "", evidence: str = "") -> bool:
        """Remove a pool's definition (its entries wait until it is defined again)."""
        req = pb.DeletePoolRequest(name=name, reason=reason, evidence=evidence)
        return bool(self._call("DeletePool", req).deleted)


def check_manifest_size(spec: pb.TaskSpec) -> None:
    """Refuse a manifest larger than a registry accepts, before sending it."""
    size = spec.ByteSize()
    if size > MAX_MANIFEST_BYTES:
        why = (f"the manifest is {mib(size)} encoded; a registry accepts at most "
               f"{mib(MAX_MANIFEST_BYTES)} (split the task, or shorten paths, ids and labels)")
        raise errors.InvalidManifest(f"invalid manifest: {why}", problems=[why],
                                     size=size, limit=MAX_MANIFEST_BYTES)


def parse_manifest(data: dict[str, Any]) -> pb.TaskSpec:
    """A manifest (JSON object) as a ``TaskSpec``; unknown fields are an error."""
    from google.protobuf import json_format  # only manifests need it, not every command

    try:
        return json_format.ParseDict(data, pb.TaskSpec())
    except json_format.ParseError as e:
        raise errors.InvalidManifest(f"invalid manifest: {e}", problems=[str(e)]) from None
