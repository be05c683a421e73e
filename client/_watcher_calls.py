"""What watchers call (the registry's WatcherService): membership, shards, and what
they found on disk."""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence

from ..kernel import errors
from ..kernel.contract import version
from ..kernel.v1 import baton_pb2 as pb
from ._connection import Calls
from ._wire import error_of


class WatcherCalls(Calls):
    """The WatcherService's calls: ``client.watcher`` (membership, shards, and what a
    watcher found on disk)."""

    def report(self, task_id: str, file_id: str, size: int, digest: str,
               identity: pb.FileIdentity | None = None, reporter: str = "", *,
               watcher_id: str = "", shard_epoch: int = 0, token: int = 0,
               traceparent: str = "") -> pb.Entry:
        """Report what a watcher hashed on disk (the registry verifies against it).
        ``watcher_id``, ``shard_epoch``: the reporting watcher and the epoch at which
        it owns the task's shard (once watchers hold shards, only the owner counts).
        ``token``: the attempt whose file was read (only the current one's counts).
        ``traceparent``: the verification's span, kept on the entry once verified."""
        req = pb.ReportVerificationRequest(task_id=task_id, file_id=file_id, size=size,
                                           digest=digest, identity=identity,
                                           reporter=reporter, watcher_id=watcher_id,
                                           shard_epoch=shard_epoch, token=token,
                                           traceparent=traceparent)
        return self._call("ReportVerification", req).entry  # type: ignore[no-any-return]

    def report_batch(self, reports: Sequence[pb.ReportVerificationRequest]
                     ) -> list[pb.Entry | errors.BatonError]:
        """Many ``report``s in one call (at most ``MAX_REPORT_BATCH``): each applied on
        its own; for each, in order, the entry after it or the error it alone ended
        with. Each report gets a request id, so a batch sent again after a lost reply
        applies none twice."""
        for report in reports:
            if not report.request_id:
                report.request_id = os.urandom(16).hex()
        req = pb.ReportVerificationBatchRequest(reports=reports)
        return [r.entry if r.HasField("entry") else error_of(r.error)
                for r in self._call("ReportVerificationBatch", req).results]

    def report_problem(self, task_id: str, file_id: str, kind: int, reason: str,
                       reporter: str = "", *, watcher_id: str = "",
                       shard_epoch: int = 0, token: int = 0) -> pb.Entry:
        """Report that a file cannot be vouched for
        (``pb.ReportProblemRequest.KIND_CORRUPTED``/``KIND_MISSING``); ``token``: the
        attempt whose file it is, as for ``report``."""
        req = pb.ReportProblemRequest(task_id=task_id, file_id=file_id, kind=kind,  # type: ignore[arg-type]
                               reason=reason, reporter=reporter, watcher_id=watcher_id,
                               shard_epoch=shard_epoch, token=token)
        return self._call("ReportProblem", req).entry  # type: ignore[no-any-return]

    def remove_staged(self, task_id: str, file_id: str, size: int, digest: str,
                      reporter: str = "", *, watcher_id: str = "",
                      shard_epoch: int = 0) -> pb.RemoveStagedResponse:
        """Ask to remove a consumed entry's file from staging, giving the size and
        digest read from it just now; the outcome says whether to unlink it (only the
        owner of the task's shard at ``shard_epoch`` is believed)."""
        req = pb.RemoveStagedRequest(task_id=task_id, file_id=file_id, size=size,
                                     digest=digest, reporter=reporter,
                                     watcher_id=watcher_id, shard_epoch=shard_epoch)
        return self._call("RemoveStaged", req)  # type: ignore[no-any-return]

    def register_watcher(self, root: str, reporter: str = "", ttl: int = 10,
                         capacity: pb.WatcherCapacity | None = None, *,
                         previous: str = "") -> pb.RegisterWatcherResponse:
        """Register a watcher on its own lease; keep it with :meth:`watcher_heartbeat`.
        ``previous``: the registration this watcher had before it restarted, which ends
        now (its shards are the new one's at once)."""
        req = pb.RegisterWatcherRequest(host=socket.gethostname(), pid=os.getpid(), root=root,
                                        reporter=reporter, ttl=ttl, version=version(),
                                        capacity=capacity, previous_watcher_id=previous)
        return self._call("RegisterWatcher", req)  # type: ignore[no-any-return]

    def watcher_heartbeat(self, watcher_id: str, capacity: pb.WatcherCapacity | None = None
                          ) -> pb.WatcherHeartbeatResponse:
        """Refresh a watcher's lease; the shards it owns now (and those to hand over)."""
        req = pb.WatcherHeartbeatRequest(watcher_id=watcher_id, capacity=capacity)
        return self._call("WatcherHeartbeat", req)  # type: ignore[no-any-return]

    def release_shard(self, watcher_id: str, shard: int, epoch: int) -> pb.ShardInfo:
        req = pb.ReleaseShardRequest(watcher_id=watcher_id, shard=shard, epoch=epoch)
        return self._call("ReleaseShard", req).shard  # type: ignore[no-any-return]
