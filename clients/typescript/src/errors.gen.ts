// Written by scripts/ts_errors.py from kernel/errors.py: do not edit.
// Baton's errors, as the registry names them in the `baton-error` trailer.

/** Root of every error Baton raises on purpose. */
export class BatonError extends Error {
  /** the gRPC status code's name, e.g. "NOT_FOUND" */
  static readonly code: string = "INTERNAL";
  /** the `baton` CLI's exit status for this error */
  static readonly exitCode: number = 1;
  /** the fields the registry sent with it (`baton-fields`) */
  readonly fields: Record<string, unknown>;

  constructor(message: string, fields: Record<string, unknown> = {}) {
    super(message);
    this.name = new.target.errorName;
    this.fields = fields;
  }

  /** the error's name in the status table (what `baton-error` carries) */
  static get errorName(): string {
    return "BatonError";
  }

  /** this error's gRPC status code's name */
  get code(): string {
    return (this.constructor as typeof BatonError).code;
  }
}

/** The entry is not in a state that allows the requested transition. */
export class IllegalTransition extends BatonError {
  static override readonly code: string = "FAILED_PRECONDITION";
  static override readonly exitCode: number = 4;
  static override get errorName(): string {
    return "IllegalTransition";
  }
}

/** Someone else holds the claim on this entry. */
export class AlreadyClaimed extends IllegalTransition {
  static override readonly exitCode: number = 4;
  static override get errorName(): string {
    return "AlreadyClaimed";
  }
}

/** A producer's claim on a task one of whose consumer groups is at its backlog limit (the manifest's ``backlog_limits``): ``task_id``, ``group``, ``backlog`` (the group's verified entries not yet acked, plus the task's producer claims in flight), ``limit`` and ``over`` (backlog - limit). Nothing changed; the claim may succeed once the group has acked some, so the client's producing helpers wait. */
export class Backpressure extends BatonError {
  static override readonly code: string = "RESOURCE_EXHAUSTED";
  static override readonly exitCode: number = 9;
  static override get errorName(): string {
    return "Backpressure";
  }
}

/** Bytes read do not match the verified digest (raised client-side by consumers). */
export class ChecksumMismatch extends BatonError {
  static override readonly code: string = "DATA_LOSS";
  static override readonly exitCode: number = 4;
  static override get errorName(): string {
    return "ChecksumMismatch";
  }
}

/** A call on a ``Client`` after ``close()``; nothing was sent. */
export class ClientClosed extends BatonError {
  static override readonly exitCode: number = 1;
  static override get errorName(): string {
    return "ClientClosed";
  }
}

/** The registry (or etcd behind it) could not be reached in time. */
export class Unavailable extends BatonError {
  static override readonly code: string = "UNAVAILABLE";
  static override readonly exitCode: number = 6;
  static override get errorName(): string {
    return "Unavailable";
  }
}

/** A ``Watch`` resumed from a revision etcd's compaction has removed: the registry is reachable, the stream's place in the task's history is gone. Start over with a snapshot of that task (``start_revision`` 0). An older client sees it as ``Unavailable``. */
export class Compacted extends Unavailable {
  static override readonly exitCode: number = 6;
  static override get errorName(): string {
    return "Compacted";
  }
}

/** A compare-and-swap kept losing to concurrent writers; safe to retry. */
export class Conflict extends BatonError {
  static override readonly code: string = "ABORTED";
  static override readonly exitCode: number = 4;
  static override get errorName(): string {
    return "Conflict";
  }
}

/** No reply came within the call's timeout: the registry was slow, or the request took that long to send (``method``, ``timeout`` in seconds). The registry may have applied it; a retry with the same request id is safe. */
export class DeadlineExceeded extends Unavailable {
  static override readonly code: string = "DEADLINE_EXCEEDED";
  static override readonly exitCode: number = 6;
  static override get errorName(): string {
    return "DeadlineExceeded";
  }
}

/** The session's host is drained (``baton lease drain``): it takes no new claims or consume leases; those it holds may still be committed, failed, acked or nacked until the drain's deadline (``session_id``, ``host``). An agent's cue to finish what it holds and stop. */
export class Draining extends BatonError {
  static override readonly code: string = "FAILED_PRECONDITION";
  static override readonly exitCode: number = 8;
  static override get errorName(): string {
    return "Draining";
  }
}

/** Anything unexpected; the registry logs the cause. */
export class Internal extends BatonError {
  static override readonly code: string = "INTERNAL";
  static override readonly exitCode: number = 1;
  static override get errorName(): string {
    return "Internal";
  }
}

/** A request was malformed: a missing id, a negative size, an unknown state. */
export class InvalidArgument extends BatonError {
  static override readonly code: string = "INVALID_ARGUMENT";
  static override readonly exitCode: number = 2;
  static override get errorName(): string {
    return "InvalidArgument";
  }
}

/** A task manifest failed validation; ``problems`` lists the reasons. Over the wire at most ``MAX_LIST_ITEMS`` of them travel; ``problems_more`` then says how many more the registry found. */
export class InvalidManifest extends InvalidArgument {
  static override readonly exitCode: number = 2;
  static override get errorName(): string {
    return "InvalidManifest";
  }
}

/** A request is larger than a registry accepts (``size`` and ``limit`` in bytes, when the client refused it before sending), or the transport refused a message as too large (gRPC's ``RESOURCE_EXHAUSTED`` without Baton's error name). */
export class MessageTooLarge extends InvalidArgument {
  static override readonly code: string = "RESOURCE_EXHAUSTED";
  static override readonly exitCode: number = 2;
  static override get errorName(): string {
    return "MessageTooLarge";
  }
}

/** The task, entry or session named does not exist. */
export class NotFound extends BatonError {
  static override readonly code: string = "NOT_FOUND";
  static override readonly exitCode: number = 5;
  static override get errorName(): string {
    return "NotFound";
  }
}

/** The caller's identity may not do this: its role is not allowed the call (``role``, ``method``), the claim or session belongs to another identity, or the task's access rules leave it out. Nothing changed. */
export class PermissionDenied extends BatonError {
  static override readonly code: string = "PERMISSION_DENIED";
  static override readonly exitCode: number = 7;
  static override get errorName(): string {
    return "PermissionDenied";
  }
}

/** A watcher reported on a task whose shard it does not own at the epoch it names: the shard moved (``shard``, ``owner``, ``epoch``), or the report is not the owner's at all. It is not believed, so nothing changed; the current owner reports instead. */
export class NotShardOwner extends PermissionDenied {
  static override readonly exitCode: number = 7;
  static override get errorName(): string {
    return "NotShardOwner";
  }
}

/** No entry of the task can be claimed (or consumed) right now. */
export class NothingToClaim extends BatonError {
  static override readonly code: string = "NOT_FOUND";
  static override readonly exitCode: number = 3;
  static override get errorName(): string {
    return "NothingToClaim";
  }
}

/** A call went out but its reply never will: the session carrying it was lost while it was in flight (``session_id``, ``call``). The registry may have applied it; a retry with the same request id is safe where the call allows one. */
export class OutcomeUnknown extends Unavailable {
  static override readonly exitCode: number = 6;
  static override get errorName(): string {
    return "OutcomeUnknown";
  }
}

/** The agent session's lease is gone; claims made under it are dead. */
export class SessionExpired extends BatonError {
  static override readonly code: string = "FAILED_PRECONDITION";
  static override readonly exitCode: number = 4;
  static override get errorName(): string {
    return "SessionExpired";
  }
}

/** The agent session already holds as many claims as its slot limit allows. */
export class SlotsExhausted extends BatonError {
  static override readonly code: string = "RESOURCE_EXHAUSTED";
  static override readonly exitCode: number = 3;
  static override get errorName(): string {
    return "SlotsExhausted";
  }
}

/** A watcher's report that would fail an entry which moved since the watcher read the file (a commit came meanwhile): not judged; the watcher looks again. */
export class StaleReport extends BatonError {
  static override readonly code: string = "FAILED_PRECONDITION";
  static override readonly exitCode: number = 4;
  static override get errorName(): string {
    return "StaleReport";
  }
}

/** The fencing token is not the live claim's: the claim was lost or superseded. */
export class StaleToken extends BatonError {
  static override readonly code: string = "FAILED_PRECONDITION";
  static override readonly exitCode: number = 4;
  static override get errorName(): string {
    return "StaleToken";
  }
}

/** etcd's database reached its quota (``NOSPACE``): every write is refused until an operator frees space (archive or remove finished tasks, compact, defragment) and disarms the alarm (docs/operations.md, "etcd upkeep"); reads still work. Nothing changed. Not retried: it lasts until someone acts. */
export class StorageFull extends BatonError {
  static override readonly code: string = "RESOURCE_EXHAUSTED";
  static override readonly exitCode: number = 6;
  static override get errorName(): string {
    return "StorageFull";
  }
}

/** A different manifest already exists under this task id (``task_id``). */
export class TaskExists extends BatonError {
  static override readonly code: string = "ALREADY_EXISTS";
  static override readonly exitCode: number = 4;
  static override get errorName(): string {
    return "TaskExists";
  }
}

/** The task is being created, paused, cancelled or completed. */
export class TaskNotActive extends BatonError {
  static override readonly code: string = "FAILED_PRECONDITION";
  static override readonly exitCode: number = 4;
  static override get errorName(): string {
    return "TaskNotActive";
  }
}

/** Every error of the table, by its name. */
export const ERRORS: Readonly<Record<string, typeof BatonError>> = {
  BatonError,
  IllegalTransition,
  AlreadyClaimed,
  Backpressure,
  ChecksumMismatch,
  ClientClosed,
  Unavailable,
  Compacted,
  Conflict,
  DeadlineExceeded,
  Draining,
  Internal,
  InvalidArgument,
  InvalidManifest,
  MessageTooLarge,
  NotFound,
  PermissionDenied,
  NotShardOwner,
  NothingToClaim,
  OutcomeUnknown,
  SessionExpired,
  SlotsExhausted,
  StaleReport,
  StaleToken,
  StorageFull,
  TaskExists,
  TaskNotActive,
};

/** The error a status without a `baton-error` name becomes (it came from the
 * transport or a proxy, not a registry's handler); any other code: Internal. */
export const TRANSPORT: Readonly<Record<string, typeof BatonError>> = {
  INVALID_ARGUMENT: InvalidArgument,
  UNAVAILABLE: Unavailable,
  DEADLINE_EXCEEDED: DeadlineExceeded,
  RESOURCE_EXHAUSTED: MessageTooLarge,
  PERMISSION_DENIED: PermissionDenied,
  UNAUTHENTICATED: PermissionDenied,
};
