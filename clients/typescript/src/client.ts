/** A connection to a Baton registry: unary reads, the task watch, agent sessions. */
import { readFileSync } from "node:fs";
import { create } from "@bufbuild/protobuf";
import { Code, ConnectError, createClient, type Client as RpcClient } from "@connectrpc/connect";
import { createGrpcTransport } from "@connectrpc/connect-node";
import {
  AgentService,
  EntryState,
  OperatorService,
  TaskEventSchema,
  type Entry,
  type Task,
  type TaskEvent,
} from "./gen/baton/v1/baton_pb.js";
import { ClientClosed, InvalidArgument, Unavailable } from "./errors.gen.js";
import { toBatonError } from "./errors.js";
import { settingsFromEnv, type Settings } from "./settings.js";
import { Session, type SessionOptions } from "./session.js";
import { backoffDelay, sleep } from "./util.js";

/** How a unary call is tried again on `Unavailable`: attempts, backoff, overall bound. */
const RETRY = { attempts: 6, initial: 0.1, cap: 2.0, deadline: 30.0 };

/** What `watch` follows of a task's events. */
export interface WatchOptions {
  /** the revision to start from (0: a snapshot first; -1: from now, SYNCED first) */
  startRevision?: bigint;
  /** only moves into these states (none: every change) */
  states?: EntryState[];
  /** send progress events while nothing changes */
  progress?: boolean;
  /** catch up from `startRevision` before following */
  catchUp?: boolean;
  /** seconds after which the iteration ends quietly (none: never) */
  timeout?: number;
  /** ends the iteration quietly when aborted */
  signal?: AbortSignal;
}

/**
 * A client of one registry. Its calls turn a failed status into Baton's typed errors
 * (`StaleToken`, `NotFound`, ...); a registry that cannot be reached is `Unavailable`.
 */
export class Client {
  /** the registry's `HOST:PORT` */
  readonly target: string;
  /** seconds a unary call (or a stream's first reply) may take */
  readonly timeout: number;
  /** the agents' service */
  readonly agent: RpcClient<typeof AgentService>;
  /** the operators' service (the reads) */
  readonly operator: RpcClient<typeof OperatorService>;
  #closed = false;

  constructor(settings: Settings) {
    this.target = settings.registry;
    this.timeout = settings.timeout ?? 10;
    const transport = createGrpcTransport({
      baseUrl: `${settings.tls ? "https" : "http"}://${settings.registry}`,
      nodeOptions: settings.tls ? tlsOptions(settings.tls) : {},
      pingIntervalMs: 5_000,
      pingIdleConnection: true,
    });
    this.agent = createClient(AgentService, transport);
    this.operator = createClient(OperatorService, transport);
  }

  /** Whether `close()` was called. */
  get closed(): boolean {
    return this.#closed;
  }

  /**
   * Call `fn` (one unary RPC) with the client's deadline, its failure as a Baton
   * error; with `retry`, `Unavailable` is tried again with jittered backoff.
   */
  async call<T>(
    method: string,
    fn: (options: { timeoutMs: number }) => Promise<T>,
    { retry = true }: { retry?: boolean } = {},
  ): Promise<T> {
    if (this.#closed) throw new ClientClosed(`${method}: this client of ${this.target} is closed`);
    const started = Date.now();
    for (let attempt = 1; ; attempt++) {
      try {
        return await fn({ timeoutMs: Math.max(1, Math.round(this.timeout * 1000)) });
      } catch (e) {
        const error = toBatonError(e);
        const spent = (Date.now() - started) / 1000;
        if (!retry || !(error instanceof Unavailable) || attempt >= RETRY.attempts || spent >= RETRY.deadline) {
          throw error;
        }
        await sleep(backoffDelay(RETRY.initial, RETRY.cap, attempt));
      }
    }
  }

  /** Open an agent session on a stream: its calls, keepalives and resumption. */
  async openSession(agent: string, options: SessionOptions = {}): Promise<Session> {
    if (this.#closed) throw new ClientClosed(`this client of ${this.target} is closed`);
    const session = new Session(this, agent, options);
    await session.open();
    return session;
  }

  /** A task as the registry has it now. */
  async getTask(taskId: string): Promise<Task> {
    const r = await this.call("GetTask", (o) => this.operator.getTask({ taskId }, o));
    if (!r.task) throw new InvalidArgument(`GetTask: no task in the reply for ${taskId}`);
    return r.task;
  }

  /** An entry as the registry has it now. */
  async getEntry(taskId: string, fileId: string): Promise<Entry> {
    const r = await this.call("GetEntry", (o) => this.operator.getEntry({ taskId, fileId }, o));
    if (!r.entry) throw new InvalidArgument(`GetEntry: no entry in the reply for ${taskId}/${fileId}`);
    return r.entry;
  }

  /**
   * A task's events, one at a time. The iteration ends quietly when the registry ends
   * the stream, when `timeout` passes or `signal` aborts; a failure throws its Baton
   * error (`Unavailable`, `NotFound`, `Compacted`...).
   */
  async *watch(taskId: string, options: WatchOptions = {}): AsyncGenerator<TaskEvent> {
    if (this.#closed) throw new ClientClosed(`this client of ${this.target} is closed`);
    const request = {
      taskId,
      startRevision: options.startRevision ?? 0n,
      states: options.states ?? [],
      progress: options.progress ?? false,
      catchUp: options.catchUp ?? false,
      together: true,
    };
    const abort = new AbortController();
    const stop = () => abort.abort();
    options.signal?.addEventListener("abort", stop, { once: true });
    if (options.signal?.aborted) return;
    try {
      const stream = this.agent.watch(request, {
        signal: abort.signal,
        timeoutMs: options.timeout === undefined ? undefined : Math.max(1, Math.round(options.timeout * 1000)),
      });
      for await (const reply of stream) {
        const events = reply.events.length ? reply.events : [reply.event ?? create(TaskEventSchema)];
        yield* events;
      }
    } catch (e) {
      if (e instanceof ConnectError && (e.code === Code.DeadlineExceeded || e.code === Code.Canceled)) return;
      if (abort.signal.aborted) return;
      throw toBatonError(e);
    } finally {
      options.signal?.removeEventListener("abort", stop);
      abort.abort();
    }
  }

  /** Refuse further calls. (Connections close once nothing uses them.) */
  close(): void {
    this.#closed = true;
  }
}

/** Node's TLS options from the identity files; a file that cannot be read is named. */
function tlsOptions(files: { ca: string; cert: string; key: string }) {
  const read = (what: string, path: string): Buffer => {
    try {
      return readFileSync(path);
    } catch (e) {
      const why = e instanceof Error ? e.message : String(e);
      throw new InvalidArgument(`cannot read the ${what} ${path}: ${why}`, { path });
    }
  };
  return {
    ca: read("CA (BATON_CA)", files.ca),
    cert: read("certificate (BATON_CERT)", files.cert),
    key: read("key (BATON_KEY)", files.key),
  };
}

/** A client of the registry `settings` name (default: from the environment). */
export function connect(settings: Settings = settingsFromEnv()): Client {
  return new Client(settings);
}
