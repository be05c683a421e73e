/**
 * Consuming a file safely: wait for the next verified entry of a group, read it,
 * check its bytes against the verified BLAKE3 digest, ack when done; a block that
 * throws nacks the entry instead.
 */
import { constants } from "node:fs";
import { open } from "node:fs/promises";
import {
  BatonError,
  ChecksumMismatch,
  Draining,
  NothingToClaim,
  Unavailable,
} from "./errors.gen.js";
import { handingBack, reasonOf } from "./errors.js";
import { EntryState, TaskEvent_Kind, type TaskEvent } from "./gen/baton/v1/baton_pb.js";
import { blake3Hex } from "./blake3.js";
import type { Lease, Session } from "./session.js";
import { backoffDelay, monotonic, sleep } from "./util.js";

/** What a consume waits for: the group, and how long (seconds; none: no end). */
export interface ConsumeOptions {
  group?: string;
  timeout?: number;
}

/** A leased entry's checked bytes. */
export class Delivery {
  readonly lease: Lease;
  readonly data: Uint8Array;
  readonly #session: Session;

  constructor(session: Session, lease: Lease, data: Uint8Array) {
    this.#session = session;
    this.lease = lease;
    this.data = data;
  }

  /** Record how far the work got: the group's next lease of it carries `data`. */
  async checkpoint(options: { data?: Uint8Array; progress?: number; message?: string } = {}) {
    const l = this.lease;
    return this.#session.checkpoint(l.taskId, l.fileId, l.token, { ...options, group: l.group });
  }
}

/**
 * How long the next watch of a wait may last (seconds; undefined: no end): to the
 * caller's deadline, and at most a third of the session's TTL so a drain is seen.
 */
function waitSpan(deadline: number | undefined, timeout: number | undefined, taskId: string, group: string, session: Session) {
  const left = deadline === undefined ? undefined : deadline - monotonic();
  if (left !== undefined && left <= 0) {
    throw new NothingToClaim(`nothing verified for group '${group}' within ${timeout}s`, { task_id: taskId, group });
  }
  if (session.draining) {
    throw new Draining(`session ${session.sessionId.toString(16)} is draining: no new work`, {
      session_id: Number(session.sessionId),
    });
  }
  return Math.min(left ?? session.ttl, Math.max(session.ttl / 3, 0.5));
}

/** Whether `event` is an entry verified for `group`: a consume is worth trying. */
function wakes(event: TaskEvent, group: string): boolean {
  return (
    event.kind === TaskEvent_Kind.CHANGED &&
    event.entry?.state === EntryState.VERIFIED &&
    event.entry.consumers.includes(group)
  );
}

/** The pause after the watch broke `broken` times in a row, or `error` once time is up. */
function pauseOrRaise(deadline: number | undefined, error: BatonError, broken: number): number {
  let delay = backoffDelay(0.1, 2.0, broken);
  if (deadline !== undefined) {
    const left = deadline - monotonic();
    if (left <= 0) throw error;
    delay = Math.min(delay, left);
  }
  return delay;
}

/**
 * Consume the next verified entry for `group`, waiting for one on a watch of the task
 * opened before the first attempt. Throws `NothingToClaim` once `timeout` passes and
 * `Draining` once the session's host is drained.
 */
export async function nextLease(
  session: Session,
  taskId: string,
  { group = "default", timeout }: ConsumeOptions = {},
): Promise<Lease> {
  const deadline = timeout === undefined ? undefined : monotonic() + timeout;
  let revision = 0n;
  let attempt = true;
  let broken = 0;
  for (;;) {
    const wait = waitSpan(deadline, timeout, taskId, group, session);
    const events = session.client.watch(taskId, {
      timeout: wait,
      startRevision: revision ? revision + 1n : -1n,
      states: [EntryState.VERIFIED],
      progress: true,
      catchUp: true,
    });
    try {
      if (!revision) {
        let synced: IteratorResult<TaskEvent>;
        try {
          synced = await events.next(); // SYNCED: the watch is in place
        } catch (e) {
          if (!(e instanceof Unavailable)) throw e;
          broken += 1;
          await sleep(pauseOrRaise(deadline, e, broken));
          continue;
        }
        if (synced.done) continue;
        revision = synced.value.revision;
        attempt = true;
        broken = 0;
      }
      if (attempt) {
        // Unavailable here is not retried: the consume may have applied.
        try {
          return await session.consume(taskId, group);
        } catch (e) {
          if (!(e instanceof NothingToClaim)) throw e;
          attempt = false;
        }
      }
      try {
        for (;;) {
          const next = await events.next();
          if (next.done) break;
          if (next.value.revision > revision) revision = next.value.revision;
          if (wakes(next.value, group)) {
            attempt = true;
            break;
          }
        }
      } catch (e) {
        if (!(e instanceof Unavailable)) throw e;
        revision = 0n; // start afresh: the watch, then an attempt
        attempt = true;
        broken += 1;
        await sleep(pauseOrRaise(deadline, e, broken));
      }
    } finally {
      await events.return(undefined);
    }
  }
}

/**
 * The bytes of a leased entry, checked against the verified size and digest
 * (`ChecksumMismatch` otherwise; a symlink or a file that is not regular is refused).
 */
export async function readVerified(lease: Lease): Promise<Uint8Array> {
  const refused = (reason: string) =>
    new ChecksumMismatch(`${lease.path}: ${reason}; not the verified file`, {
      task_id: lease.taskId,
      file_id: lease.fileId,
      path: lease.path,
    });
  let file;
  try {
    file = await open(lease.path, constants.O_RDONLY | constants.O_NOFOLLOW);
  } catch (e) {
    if ((e as NodeJS.ErrnoException).code === "ELOOP") throw refused("it is a symlink (refused, not followed)");
    throw e;
  }
  let data: Uint8Array;
  try {
    const stat = await file.stat();
    if (!stat.isFile()) throw refused("not a regular file");
    // One byte more than the verified size tells a file that grew.
    const buffer = Buffer.alloc(lease.size + 1);
    let length = 0;
    for (;;) {
      const { bytesRead } = await file.read(buffer, length, buffer.length - length, length);
      if (bytesRead === 0 || length + bytesRead >= buffer.length) {
        length += bytesRead;
        break;
      }
      length += bytesRead;
    }
    data = buffer.subarray(0, length);
  } finally {
    await file.close();
  }
  const digest = blake3Hex(data);
  if (data.length !== lease.size || digest !== lease.digest) {
    throw new ChecksumMismatch(
      `${lease.path}: read ${data.length} bytes with digest ${digest}, expected ${lease.size} bytes with digest ${lease.digest}`,
      { task_id: lease.taskId, file_id: lease.fileId },
    );
  }
  return data;
}

/** Nack a lease for `error`; a lease already gone is left to the registry's reaper. */
async function handBack(session: Session, lease: Lease, error: unknown, reason = reasonOf(error)) {
  try {
    await session.nack(lease.taskId, lease.fileId, lease.group, lease.token, { reason, ...handingBack(error) });
  } catch (e) {
    if (!(e instanceof BatonError)) throw e;
  }
}

/**
 * Consume the next verified entry of `group` (waiting up to `timeout` seconds): hand
 * `block` its checked bytes, and ack when it returns. Bytes that do not match the
 * verified digest, or a block that throws, nack the entry (a `PermanentError` gives
 * it up, a `RetryAfter` hands it back after its delay) and the error is rethrown.
 */
export async function consume<T>(
  session: Session,
  taskId: string,
  options: ConsumeOptions,
  block: (delivery: Delivery) => Promise<T> | T,
): Promise<T> {
  const group = options.group ?? "default";
  const lease = await nextLease(session, taskId, { group, timeout: options.timeout });
  let result: T;
  try {
    const data = await readVerified(lease);
    result = await block(new Delivery(session, lease, data));
  } catch (e) {
    await handBack(session, lease, e);
    throw e;
  }
  await session.ack(taskId, lease.fileId, group, lease.token);
  return result;
}

/**
 * The group's verified entries one after another, each acked when the loop asks for
 * the next (in the same message as the next one's consume). Ends when none is
 * verified within `timeout` or the session's host is drained. Leaving the loop
 * (`break`, a throw) nacks the entry in hand.
 */
export async function* consumeEach(
  session: Session,
  taskId: string,
  { group = "default", timeout }: ConsumeOptions = {},
): AsyncGenerator<Delivery, void, undefined> {
  let lease: Lease | undefined;
  for (;;) {
    if (lease === undefined) {
      if (session.draining) return;
      try {
        lease = await nextLease(session, taskId, { group, timeout });
      } catch (e) {
        if (e instanceof NothingToClaim || e instanceof Draining) return;
        throw e;
      }
    }
    let data: Uint8Array;
    try {
      data = await readVerified(lease);
    } catch (e) {
      await handBack(session, lease, e);
      throw e;
    }
    let resumed = false;
    try {
      yield new Delivery(session, lease, data);
      resumed = true;
    } finally {
      if (!resumed) await handBack(session, lease, undefined, "the consuming loop was left with the entry in hand");
    }
    if (session.draining) {
      await session.ack(taskId, lease.fileId, group, lease.token);
      lease = undefined;
    } else {
      [, lease] = await session.ackAndConsume(taskId, lease.fileId, group, lease.token);
    }
  }
}
