/**
 * Producing a file safely: claim an entry, write its bytes to a temp file beside the
 * claim's path, fsync, rename into the path, fsync the directory, commit the size and
 * BLAKE3 digest. A block that throws fails the entry instead.
 */
import { randomBytes } from "node:crypto";
import { constants } from "node:fs";
import { lstat, mkdir, open, rename, unlink, type FileHandle } from "node:fs/promises";
import { basename, dirname, join } from "node:path";
import { Draining, InvalidArgument, NothingToClaim } from "./errors.gen.js";
import { handingBack, reasonOf } from "./errors.js";
import type { Entry } from "./gen/baton/v1/baton_pb.js";
import { blake3Hasher } from "./blake3.js";
import { BACKPRESSURE_WAIT, type Claim, type Session } from "./session.js";

/** What marks a file being written: watchers never hash one. */
export const TEMP_MARKER = ".baton-tmp-";
/** Random bytes in a temp file's name (hex-encoded). */
export const NONCE_BYTES = 8;
/** The longest file name most file systems take, in bytes. */
export const NAME_MAX = 255;

/** The random part of a temp file's name. */
export function newNonce(): string {
  return randomBytes(NONCE_BYTES).toString("hex");
}

/**
 * The name `name`'s bytes are written under before the rename publishes them:
 * `.NAME.baton-tmp-TOKEN-NONCE`. A name too long for the file system loses the end
 * of its NAME part, never the marker or the nonce.
 */
export function tempName(name: string, token: bigint | number, nonce: string = newNonce()): string {
  const tail = `${TEMP_MARKER}${token}-${nonce}`;
  const room = Math.max(NAME_MAX - 1 - Buffer.byteLength(tail), 0);
  let head = name;
  if (Buffer.byteLength(head) > room) {
    // cut at a character boundary within `room` bytes
    head = new TextDecoder().decode(Buffer.from(name).subarray(0, room)).replace(/\uFFFD+$/, "");
  }
  return `.${head}${tail}`;
}

/** The open temp file of a claim: `await out.write(bytes)`; size and digest follow. */
export class Output {
  readonly claim: Claim;
  /** bytes written so far */
  size = 0;
  /** the entry as committed, once it is */
  entry: Entry | undefined;
  readonly #session: Session;
  readonly #file: FileHandle;
  readonly #hash = blake3Hasher();
  #digest = "";
  #closed = false;

  constructor(session: Session, claim: Claim, file: FileHandle) {
    this.#session = session;
    this.claim = claim;
    this.#file = file;
  }

  /** Append `data` (text is written as UTF-8). */
  async write(data: Uint8Array | string): Promise<number> {
    if (this.#closed) throw new InvalidArgument(`${this.claim.fileId}: the output is closed`);
    const bytes = typeof data === "string" ? Buffer.from(data) : data;
    await this.#file.write(bytes);
    this.#hash.update(bytes);
    this.size += bytes.byteLength;
    return bytes.byteLength;
  }

  /** Say the bytes are complete (a `produceEach` loop left after it commits them). */
  close(): void {
    this.#closed = true;
  }

  /** Whether `close()` was called. */
  get closed(): boolean {
    return this.#closed;
  }

  /** The BLAKE3 hex digest of the bytes written (final once the output is done). */
  get digest(): string {
    return this.#digest || this.#hash.hex();
  }

  /** Record how far this attempt got: the next attempt's claim carries `data`. */
  async checkpoint(options: { data?: Uint8Array; progress?: number; message?: string } = {}) {
    const c = this.claim;
    return this.#session.checkpoint(c.taskId, c.fileId, c.token, options);
  }

  /** Make the bytes durable and publish them under the claim's path. */
  async finish(tmp: string): Promise<void> {
    await this.#file.sync();
    await this.#file.close();
    this.#digest = this.#hash.hex();
    this.#session.check();
    await refuseLink(this.claim.path);
    await rename(tmp, this.claim.path);
    await syncDir(dirname(this.claim.path));
  }

  /** Close the file without publishing it. */
  async abandon(): Promise<void> {
    await this.#file.close().catch(() => undefined);
  }
}

/** Refuse a symlink at the final name: the path is not ours to publish to. */
async function refuseLink(path: string): Promise<void> {
  const seen = await lstat(path).catch(() => undefined);
  if (seen?.isSymbolicLink()) {
    throw new InvalidArgument(`${path}: the final name is a symlink (refused, not replaced)`, { path });
  }
}

/** fsync a directory, so a rename in it is durable. */
async function syncDir(path: string): Promise<void> {
  const dir = await open(path, constants.O_RDONLY | constants.O_DIRECTORY);
  try {
    await dir.sync();
  } finally {
    await dir.close();
  }
}

/** The temp file of a claim, created beside its path (its directory made if missing). */
async function begin(session: Session, claim: Claim): Promise<{ out: Output; tmp: string }> {
  const dir = dirname(claim.path);
  await mkdir(dir, { recursive: true });
  await refuseLink(claim.path);
  const tmp = join(dir, tempName(basename(claim.path), claim.token));
  const flags = constants.O_WRONLY | constants.O_CREAT | constants.O_EXCL | constants.O_NOFOLLOW;
  const file = await open(tmp, flags, 0o666);
  return { out: new Output(session, claim, file), tmp };
}

/** Remove a temp file that will not be published. */
async function discard(out: Output, tmp: string): Promise<void> {
  await out.abandon();
  await unlink(tmp).catch(() => undefined);
}

/**
 * Write a claimed entry with `block`, then publish and commit it; if `block` throws,
 * the temp file is removed and the entry failed (a `PermanentError` for good, a
 * `RetryAfter` after its delay, anything else for a retry), and the error rethrown.
 */
async function write<T>(
  session: Session,
  claim: Claim,
  block: (out: Output) => Promise<T> | T,
): Promise<{ out: Output; result: T }> {
  let out: Output | undefined;
  let tmp = "";
  try {
    ({ out, tmp } = await begin(session, claim));
    const result = await block(out);
    await out.finish(tmp);
    tmp = "";
    return { out, result };
  } catch (e) {
    if (out !== undefined && tmp) await discard(out, tmp);
    await session.fail(claim.taskId, claim.fileId, claim.token, { reason: reasonOf(e), ...handingBack(e) });
    throw e;
  }
}

/**
 * Produce one entry of `taskId` (`fileId`, or the next claimable one): claim it
 * (back-pressure waited out for up to `wait` seconds), hand `block` its output, then
 * publish and commit. Returns the output (its `entry` as committed).
 */
export async function produce(
  session: Session,
  taskId: string,
  fileId: string,
  block: (out: Output) => Promise<unknown> | unknown,
  { wait = BACKPRESSURE_WAIT }: { wait?: number } = {},
): Promise<Output> {
  const claim = await session.claimWaiting(taskId, fileId, { wait });
  const { out } = await write(session, claim, block);
  out.entry = await session.commit(taskId, claim.fileId, claim.token, out.size, out.digest);
  return out;
}

/**
 * The task's entries one after another, each an output to write: an output is
 * published and committed when the loop asks for the next (with the next claim in the
 * same message). Ends when nothing is left to claim or the session's host is drained.
 * Leaving the loop (`break`, a throw) fails the output in hand, unless it was
 * `close()`d, which commits it.
 */
export async function* produceEach(
  session: Session,
  taskId: string,
  { wait = BACKPRESSURE_WAIT }: { wait?: number } = {},
): AsyncGenerator<Output, void, undefined> {
  let claim: Claim | undefined;
  for (;;) {
    if (claim === undefined) {
      if (session.draining) return;
      try {
        claim = await session.claimWaiting(taskId, "", { wait });
      } catch (e) {
        if (e instanceof NothingToClaim || e instanceof Draining) return;
        throw e;
      }
    }
    const { out, tmp } = await begin(session, claim);
    let resumed = false;
    try {
      yield out;
      resumed = true;
    } finally {
      if (!resumed && !out.closed) {
        // left with the output in hand, not closed: it may be partial
        await discard(out, tmp);
        const reason =
          `left with its output not closed (${out.size} bytes written): a break, return or ` +
          "exception in the producing loop's body; close() an output whose bytes are complete to have it committed";
        await session.fail(claim.taskId, claim.fileId, claim.token, { reason });
      } else if (!resumed) {
        await finishOrFail(session, out, tmp);
        out.entry = await session.commit(taskId, claim.fileId, claim.token, out.size, out.digest);
      }
    }
    await finishOrFail(session, out, tmp);
    if (session.draining) {
      out.entry = await session.commit(taskId, claim.fileId, claim.token, out.size, out.digest);
      claim = undefined;
    } else {
      [out.entry, claim] = await session.commitAndClaim(taskId, claim.fileId, claim.token, out.size, out.digest);
    }
  }
}

/** Publish an output; a failure to do so fails its entry and is rethrown. */
async function finishOrFail(session: Session, out: Output, tmp: string): Promise<void> {
  try {
    await out.finish(tmp);
  } catch (e) {
    await discard(out, tmp);
    const c = out.claim;
    await session.fail(c.taskId, c.fileId, c.token, { reason: reasonOf(e), ...handingBack(e) });
    throw e;
  }
}
