/**
 * An agent session on the registry's `Session` stream: every call is a message on
 * it, answered by its call id in any order; keepalives every TTL/3 keep it; a broken
 * stream is resumed on a new one until the TTL runs out, and the calls not yet
 * answered are sent again (their request ids make each apply once).
 */
import { hostname } from "node:os";
import { create } from "@bufbuild/protobuf";
import {
  AckAndConsumeRequestSchema,
  AckRequestSchema,
  AgentCallSchema,
  CheckpointRequestSchema,
  ClaimRequestSchema,
  CommitAndClaimRequestSchema,
  CommitRequestSchema,
  ConsumeRequestSchema,
  FailRequestSchema,
  KeepAliveRequestSchema,
  NackRequestSchema,
  SessionRequestSchema,
  type AgentCall,
  type AgentReply,
  type CallError,
  type Checkpoint,
  type ClaimResponse,
  type ConsumeResponse,
  type Entry,
  type Session as SessionInfo,
  type SessionRequest,
  type SessionResponse,
} from "./gen/baton/v1/baton_pb.js";
import {
  Backpressure,
  BatonError,
  DeadlineExceeded,
  Draining,
  NotFound,
  OutcomeUnknown,
  PermissionDenied,
  SessionExpired,
  Unavailable,
} from "./errors.gen.js";
import { errorFromStatus, toBatonError } from "./errors.js";
import type { Client } from "./client.js";
import { backoffDelay, monotonic, requestId, sleep } from "./util.js";

/** The version this client tells the registry it is. */
export const CLIENT_VERSION = "0.1.0";
/** Seconds `claimWaiting` waits out back-pressure by default. */
export const BACKPRESSURE_WAIT = 300;

/** How a session is opened. */
export interface SessionOptions {
  /** seconds the session lives without a keepalive (default 10) */
  ttl?: number;
  /** the most claims it may hold at once (0: no limit) */
  slots?: number;
  /** the host it names (default: this machine's name) */
  host?: string;
}

/** A producer's claim: write `path`, then commit or fail with `token`. */
export interface Claim {
  taskId: string;
  fileId: string;
  token: bigint;
  /** absolute staging path to write */
  path: string;
  /** this attempt's number (1: the entry's first claim; 0: not said) */
  attempt: number;
  /** what an earlier attempt recorded (none: start from the beginning) */
  checkpoint?: Checkpoint;
  entry?: Entry;
}

/** A consumer's hold on a verified entry: read `path`, then ack or nack. */
export interface Lease {
  taskId: string;
  fileId: string;
  group: string;
  token: bigint;
  path: string;
  digest: string;
  size: number;
  attempt: number;
  checkpoint?: Checkpoint;
  entry?: Entry;
}

/** A claim from the registry's reply. */
function claimOf(taskId: string, r: ClaimResponse): Claim {
  return {
    taskId,
    fileId: r.entry?.fileId ?? "",
    token: r.token,
    path: r.path,
    attempt: r.attempt,
    checkpoint: r.checkpoint,
    entry: r.entry,
  };
}

/** A lease from the registry's reply. */
function leaseOf(taskId: string, r: ConsumeResponse): Lease {
  return {
    taskId,
    fileId: r.entry?.fileId ?? "",
    group: r.group,
    token: r.token,
    path: r.path,
    digest: r.digest,
    size: Number(r.size),
    attempt: r.attempt,
    checkpoint: r.checkpoint,
    entry: r.entry,
  };
}

type CallKind = Exclude<AgentCall["request"]["case"], undefined>;
type RequestOf<K extends CallKind> = Extract<AgentCall["request"], { case: K }>["value"];
type ReplyOf<K extends CallKind> = Extract<AgentReply["reply"], { case: K }>["value"];

/** The messages written on one stream, as the async iterable the transport reads. */
class Outbox implements AsyncIterable<SessionRequest> {
  #queue: SessionRequest[] = [];
  #wake: (() => void) | undefined;
  #ended = false;

  push(message: SessionRequest): void {
    if (this.#ended) return;
    this.#queue.push(message);
    this.#wake?.();
  }

  /** No more messages: the stream's writing side ends. */
  end(): void {
    this.#ended = true;
    this.#wake?.();
  }

  async *[Symbol.asyncIterator](): AsyncIterator<SessionRequest> {
    for (;;) {
      while (this.#queue.length) yield this.#queue.shift()!;
      if (this.#ended) return;
      await new Promise<void>((resolve) => (this.#wake = resolve));
      this.#wake = undefined;
    }
  }
}

/** One stream of the session. */
interface Stream {
  outbox: Outbox;
  abort: AbortController;
  replies: AsyncIterator<SessionResponse>;
  reader?: Promise<void>;
}

/** A call sent and not yet answered: sent again on a new stream if its stream broke. */
interface Pending {
  call: AgentCall;
  sentOn: Stream | undefined;
  resolve(reply: AgentReply): void;
  reject(error: BatonError): void;
}

/** The Baton error a call on the stream (or a fused step's missing next) ended with. */
export function errorOfCall(error: CallError): BatonError {
  return errorFromStatus(error.code, error.details, error.metadata);
}

/**
 * An agent session and its calls. `lost` turns true once the registry says the
 * session is gone or no keepalive succeeded for a whole TTL: calls are then refused
 * with `SessionExpired`. `draining` turns true once its host is drained.
 */
export class Session {
  readonly client: Client;
  agent: string;
  ttl: number;
  slots: number;
  sessionId = 0n;
  lost = false;
  draining = false;
  /** streams this session was resumed on after one broke */
  resumed = 0;
  /** when the last keepalive that succeeded was sent (monotonic seconds) */
  lastOk = monotonic();
  readonly #host: string;
  #stream: Stream | undefined;
  #connected = false;
  #closing = false;
  #nextId = 1n;
  readonly #pending = new Map<bigint, Pending>();
  #keepTimer: NodeJS.Timeout | undefined;

  constructor(client: Client, agent: string, options: SessionOptions = {}) {
    this.client = client;
    this.agent = agent;
    this.ttl = options.ttl ?? 10;
    this.slots = options.slots ?? 0;
    this.#host = options.host || hostname();
  }

  // the stream -------------------------------------------------------------------

  /** Open the session: the first message of its first stream. */
  async open(): Promise<void> {
    const sent = monotonic();
    const session = await this.#connect(
      create(SessionRequestSchema, {
        kind: {
          case: "open",
          value: {
            agent: this.agent,
            ttl: BigInt(Math.round(this.ttl)),
            host: this.#host,
            pid: process.pid,
            version: CLIENT_VERSION,
            slots: this.slots,
          },
        },
      }),
    );
    this.sessionId = session.sessionId;
    this.agent = session.agent;
    this.ttl = Number(session.ttl) || this.ttl;
    this.slots = session.slots;
    this.lastOk = sent;
    this.#keep(this.#interval());
  }

  /** A new stream, its first message sent and the session it answers read. */
  async #connect(first: SessionRequest): Promise<SessionInfo> {
    const outbox = new Outbox();
    const abort = new AbortController();
    outbox.push(first);
    const replies = this.client.agent.session(outbox, { signal: abort.signal })[Symbol.asyncIterator]();
    const limit = this.client.timeout;
    let timer: NodeJS.Timeout | undefined;
    let reply: IteratorResult<SessionResponse>;
    try {
      reply = await Promise.race([
        replies.next(),
        new Promise<never>((_, reject) => {
          timer = setTimeout(
            () => reject(new Unavailable(`Session: no reply from the registry within ${limit} s`)),
            limit * 1000,
          );
        }),
      ]);
    } catch (e) {
      abort.abort();
      throw toBatonError(e);
    } finally {
      clearTimeout(timer);
    }
    if (reply.done || reply.value.kind.case !== "session") {
      abort.abort();
      throw new Unavailable("Session: the stream ended before the session was open");
    }
    const stream: Stream = { outbox, abort, replies };
    this.#stream = stream;
    this.#connected = true;
    stream.reader = this.#read(stream);
    return reply.value.kind.value;
  }

  /** Hand each reply to its call until the stream ends; then resume on a new one. */
  async #read(stream: Stream): Promise<void> {
    try {
      for (;;) {
        const next = await stream.replies.next();
        if (next.done) break;
        const message = next.value;
        if (message.kind.case !== "reply") continue;
        this.#pending.get(message.kind.value.callId)?.resolve(message.kind.value);
      }
    } catch {
      // the stream broke: resumed below
    }
    if (this.#closing || stream !== this.#stream) return;
    this.#connected = false;
    await this.#resume();
  }

  /** Take the session up on a new stream and send again what was not answered. */
  async #resume(): Promise<void> {
    for (let attempt = 1; ; attempt++) {
      if (this.#closing) return;
      if (monotonic() - this.lastOk > this.ttl) {
        this.#lose(
          new SessionExpired(
            `session ${this.sessionId.toString(16)} of ${this.agent} was lost: no stream to the registry for its whole TTL (${this.ttl} s)`,
            { session_id: Number(this.sessionId) },
          ),
        );
        return;
      }
      const sent = monotonic();
      try {
        await this.#connect(
          create(SessionRequestSchema, { kind: { case: "resume", value: { sessionId: this.sessionId } } }),
        );
      } catch (e) {
        const error = toBatonError(e);
        if (error instanceof SessionExpired || error instanceof NotFound || error instanceof PermissionDenied) {
          this.#lose(error);
          return;
        }
        await sleep(backoffDelay(0.05, 1.0, attempt));
        continue;
      }
      this.lastOk = sent; // resuming refreshed the lease
      this.resumed += 1;
      for (const pending of this.#pending.values()) this.#send(pending);
      return;
    }
  }

  /** Write a call on the current stream, unless it went there already. */
  #send(pending: Pending): void {
    const stream = this.#stream;
    if (!this.#connected || stream === undefined || pending.sentOn === stream) return;
    pending.sentOn = stream;
    stream.outbox.push(create(SessionRequestSchema, { kind: { case: "call", value: pending.call } }));
  }

  /** Send one call and wait for its reply (`wait` seconds at most); its error thrown. */
  async ask<K extends CallKind>(kind: K, request: RequestOf<K>, wait?: number): Promise<ReplyOf<K>> {
    this.check();
    if ("requestId" in request && !request.requestId) request.requestId = requestId();
    const call = create(AgentCallSchema, {
      callId: this.#nextId++,
      request: { case: kind, value: request } as AgentCall["request"],
    });
    const limit = wait ?? this.client.timeout;
    let timer: NodeJS.Timeout | undefined;
    const reply = await new Promise<AgentReply>((resolve, reject) => {
      const pending: Pending = { call, sentOn: undefined, resolve, reject };
      this.#pending.set(call.callId, pending);
      timer = setTimeout(
        () =>
          reject(
            new DeadlineExceeded(`${kind}: no reply from the registry within ${limit} s (deadline exceeded)`, {
              method: kind,
              timeout: limit,
            }),
          ),
        limit * 1000,
      );
      this.#send(pending);
    }).finally(() => {
      clearTimeout(timer);
      this.#pending.delete(call.callId);
    });
    if (reply.reply.case === "error") throw errorOfCall(reply.reply.value);
    if (reply.reply.case !== kind) {
      throw new Unavailable(`${kind}: the registry answered with ${reply.reply.case ?? "nothing"}`);
    }
    return reply.reply.value as ReplyOf<K>;
  }

  /** A call that takes new work: a `Draining` refusal marks the session. */
  async #work<K extends CallKind>(kind: K, request: RequestOf<K>): Promise<ReplyOf<K>> {
    try {
      return await this.ask(kind, request);
    } catch (e) {
      if (e instanceof Draining) this.draining = true;
      throw e;
    }
  }

  #lose(error: BatonError): void {
    this.lost = true;
    this.#closing = true;
    clearTimeout(this.#keepTimer);
    for (const pending of this.#pending.values()) {
      if (pending.sentOn === undefined) {
        pending.reject(error); // never sent: it certainly did not apply
      } else {
        const kind = pending.call.request.case ?? "call";
        pending.reject(
          new OutcomeUnknown(`${error.message}; its ${kind} call was in flight and may have applied`, {
            session_id: Number(this.sessionId),
            call: kind,
          }),
        );
      }
    }
    this.#stream?.abort.abort();
  }

  #interval(): number {
    return Math.max(this.ttl / 3, 0.2);
  }

  /** The next keepalive in `seconds`; TTL/10 after one that failed. */
  #keep(seconds: number): void {
    this.#keepTimer = setTimeout(async () => {
      if (this.#closing) return;
      try {
        await this.refresh();
      } catch (e) {
        if (this.#closing) return;
        if (e instanceof SessionExpired) {
          this.#lose(e);
          return;
        }
        if (monotonic() - this.lastOk > this.ttl) {
          this.#lose(
            new SessionExpired(
              `session ${this.sessionId.toString(16)} lost: no keepalive for ${this.ttl} s (${(e as Error).message})`,
              { session_id: Number(this.sessionId) },
            ),
          );
          return;
        }
        this.#keep(Math.max(this.ttl / 10, 0.1));
        return;
      }
      if (!this.#closing) this.#keep(this.#interval());
    }, seconds * 1000);
  }

  /** Throw `SessionExpired` if this session can no longer be trusted. */
  check(): void {
    if (this.lost || monotonic() - this.lastOk > this.ttl) {
      this.lost = true;
      throw new SessionExpired(`session ${this.sessionId.toString(16)} of ${this.agent} was lost`, {
        session_id: Number(this.sessionId),
      });
    }
  }

  /** Refresh the session's lease once (a keepalive message); the TTL it has now. */
  async refresh(): Promise<number> {
    const sent = monotonic();
    const reply = await this.ask(
      "keepalive",
      create(KeepAliveRequestSchema, { sessionId: this.sessionId }),
      Math.max(this.ttl / 3, 1),
    );
    this.lastOk = sent;
    if (reply.ttl > 0n) this.ttl = Number(reply.ttl);
    this.draining = reply.draining;
    return Number(reply.ttl);
  }

  /**
   * End the stream; with `revoke` (the default) end the session too, so its claims go
   * back at once (`CloseSession`).
   */
  async close({ revoke = true }: { revoke?: boolean } = {}): Promise<void> {
    if (this.#closing && this.lost) return;
    this.#closing = true;
    clearTimeout(this.#keepTimer);
    const stream = this.#stream;
    if (stream !== undefined && this.#connected) {
      // Said done: the registry answers what is in flight and ends the stream.
      stream.outbox.end();
      await Promise.race([stream.reader, sleep(1)]);
    }
    stream?.abort.abort();
    if (revoke && !this.lost) {
      try {
        await this.client.call(
          "CloseSession",
          (o) => this.client.agent.closeSession({ sessionId: this.sessionId }, o),
          { retry: false },
        );
      } catch {
        // the registry ends the session at its TTL all the same
      }
    }
    this.lost = true;
  }

  // the agent's calls --------------------------------------------------------------

  /** Claim an entry (`fileId`), or the next claimable one, for writing. */
  async claim(taskId: string, fileId = ""): Promise<Claim> {
    const r = await this.#work(
      "claim",
      create(ClaimRequestSchema, { taskId, fileId, sessionId: this.sessionId }),
    );
    return claimOf(taskId, r);
  }

  /**
   * `claim`, waiting out `Backpressure` (a consumer group at its backlog limit) with
   * jittered backoff (0.05 s doubling to 2 s) for up to `wait` seconds, then throwing
   * the last refusal.
   */
  async claimWaiting(taskId: string, fileId = "", { wait = BACKPRESSURE_WAIT }: { wait?: number } = {}): Promise<Claim> {
    const deadline = monotonic() + wait;
    for (let failures = 1; ; failures++) {
      try {
        return await this.claim(taskId, fileId);
      } catch (e) {
        if (!(e instanceof Backpressure)) throw e;
        const left = deadline - monotonic();
        if (left <= 0) throw e;
        await sleep(Math.min(backoffDelay(0.05, 2.0, failures), left));
      }
    }
  }

  /** Publish a claim's file: its size and BLAKE3 hex `digest`. The entry as committed. */
  async commit(taskId: string, fileId: string, token: bigint | number, size: number, digest = ""): Promise<Entry> {
    const r = await this.ask(
      "commit",
      create(CommitRequestSchema, {
        taskId,
        fileId,
        token: BigInt(token),
        size: BigInt(size),
        digest,
        sessionId: this.sessionId,
      }),
    );
    return r.entry!;
  }

  /**
   * Give a claim up: the entry is retried after its backoff (after `delay` seconds
   * when given), or goes dead at once, no retry spent, when `permanent`.
   */
  async fail(
    taskId: string,
    fileId: string,
    token: bigint | number,
    { reason = "", permanent = false, delay = 0, release = false }: FailOptions = {},
  ): Promise<Entry> {
    const r = await this.ask(
      "fail",
      create(FailRequestSchema, {
        taskId,
        fileId,
        token: BigInt(token),
        reason,
        sessionId: this.sessionId,
        permanent,
        delaySeconds: delay,
        release,
      }),
    );
    return r.entry!;
  }

  /**
   * Record how far the attempt holding `token` got (with `group`: a consume lease's);
   * the next attempt's claim carries it if this one does not finish.
   */
  async checkpoint(
    taskId: string,
    fileId: string,
    token: bigint | number,
    { data = new Uint8Array(), progress = 0, message = "", group = "" }: CheckpointOptions = {},
  ): Promise<Checkpoint | undefined> {
    const r = await this.ask(
      "checkpoint",
      create(CheckpointRequestSchema, {
        taskId,
        fileId,
        token: BigInt(token),
        group,
        data,
        progress,
        message,
        sessionId: this.sessionId,
      }),
    );
    return r.checkpoint;
  }

  /** Take a verified entry (or the next one) for `group`. */
  async consume(taskId: string, group = "default", fileId = ""): Promise<Lease> {
    const r = await this.#work(
      "consume",
      create(ConsumeRequestSchema, { taskId, group, fileId, sessionId: this.sessionId }),
    );
    return leaseOf(taskId, r);
  }

  /** Mark a lease's entry done for `group`. */
  async ack(taskId: string, fileId: string, group: string, token: bigint | number): Promise<Entry> {
    const r = await this.ask(
      "ack",
      create(AckRequestSchema, { taskId, fileId, group, token: BigInt(token), sessionId: this.sessionId }),
    );
    return r.entry!;
  }

  /**
   * Hand a lease back to the group (after `delay` seconds when given), or, when
   * `permanent`, give the entry up: it goes dead for every group.
   */
  async nack(
    taskId: string,
    fileId: string,
    group: string,
    token: bigint | number,
    { reason = "", delay = 0, permanent = false }: NackOptions = {},
  ): Promise<Entry> {
    const r = await this.ask(
      "nack",
      create(NackRequestSchema, {
        taskId,
        fileId,
        group,
        token: BigInt(token),
        reason,
        sessionId: this.sessionId,
        delaySeconds: delay,
        permanent,
      }),
    );
    return r.entry!;
  }

  /**
   * Commit a claim and claim the task's next entry in one message: the committed
   * entry, and the next claim (none when nothing can be taken now).
   */
  async commitAndClaim(
    taskId: string,
    fileId: string,
    token: bigint | number,
    size: number,
    digest = "",
  ): Promise<[Entry, Claim | undefined]> {
    const r = await this.ask(
      "commitAndClaim",
      create(CommitAndClaimRequestSchema, {
        commit: {
          taskId,
          fileId,
          token: BigInt(token),
          size: BigInt(size),
          digest,
          sessionId: this.sessionId,
          requestId: requestId(),
        },
        claim: { taskId, sessionId: this.sessionId },
      }),
    );
    if (r.next) return [r.entry!, claimOf(taskId, r.next)];
    this.#noted(r.nextError);
    return [r.entry!, undefined];
  }

  /**
   * Ack a lease and take the group's next entry in one message: the acked entry,
   * and the next lease (none when there is none to take now).
   */
  async ackAndConsume(
    taskId: string,
    fileId: string,
    group: string,
    token: bigint | number,
  ): Promise<[Entry, Lease | undefined]> {
    const r = await this.ask(
      "ackAndConsume",
      create(AckAndConsumeRequestSchema, {
        ack: { taskId, fileId, group, token: BigInt(token), sessionId: this.sessionId, requestId: requestId() },
        consume: { taskId, group, sessionId: this.sessionId },
      }),
    );
    if (r.next) return [r.entry!, leaseOf(taskId, r.next)];
    this.#noted(r.nextError);
    return [r.entry!, undefined];
  }

  /** What a fused step's missing next says of the session (drained, lost). */
  #noted(why: CallError | undefined): void {
    if (!why?.code) return;
    const error = errorOfCall(why);
    if (error instanceof Draining) this.draining = true;
    else if (error instanceof SessionExpired) this.#lose(error);
  }
}

/** How `fail` hands a claim back. */
export interface FailOptions {
  reason?: string;
  permanent?: boolean;
  delay?: number;
  /** the attempt never began: pending again at once, no retry spent */
  release?: boolean;
}

/** How `nack` hands a lease back. */
export interface NackOptions {
  reason?: string;
  permanent?: boolean;
  delay?: number;
}

/** What `checkpoint` records. */
export interface CheckpointOptions {
  data?: Uint8Array;
  progress?: number;
  message?: string;
  /** a consumer group: the checkpoint is of its lease */
  group?: string;
}
