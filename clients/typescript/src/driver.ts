/**
 * The TypeScript client's conformance driver (tests/conformance/PROTOCOL.md): agent
 * operations done with the client's public API, one JSON object per line on standard
 * input, each answered by its id on standard output.
 */
import { createInterface } from "node:readline";
import {
  BatonError,
  PermanentError,
  connect,
  consume,
  entryStateName,
  nextLease,
  produce,
  settingsFromEnv,
  taskStatusName,
  type Client,
  type Session,
} from "./index.js";

type Args = Record<string, unknown>;
type Op = (args: Args) => Promise<Record<string, unknown>>;

const text = (value: unknown, otherwise = ""): string => (value === undefined || value === null ? otherwise : String(value));
const num = (value: unknown, otherwise = 0): number => (value === undefined || value === null ? otherwise : Number(value));
const decode = (data: Uint8Array): string => new TextDecoder().decode(data);
const encode = (data: string): Uint8Array => new TextEncoder().encode(data);

/** One actor: a client, and the session it opens. */
class Driver {
  readonly client: Client;
  session: Session | undefined;
  readonly ops: Record<string, Op>;

  constructor(client: Client) {
    this.client = client;
    this.ops = {
      open: (a) => this.open(a),
      close: () => this.close(),
      claim: (a) => this.claim(a),
      commit: (a) => this.commit(a),
      fail: (a) => this.fail(a),
      checkpoint: (a) => this.checkpoint(a),
      produce: (a) => this.produce(a),
      consume: (a) => this.consume(a),
      lease: (a) => this.lease(a),
      ack: (a) => this.ack(a),
      nack: (a) => this.nack(a),
      get_task: (a) => this.getTask(a),
      get_entry: (a) => this.getEntry(a),
    };
  }

  get s(): Session {
    if (this.session === undefined) throw new Error("no session: send `open` first");
    return this.session;
  }

  async open(a: Args) {
    this.session = await this.client.openSession(text(a.agent), { ttl: Math.trunc(num(a.ttl, 10)) });
    return { session_id: this.session.sessionId };
  }

  async close() {
    const session = this.s;
    this.session = undefined;
    await session.close();
    return {};
  }

  async claim(a: Args) {
    const c = await this.s.claim(text(a.task), text(a.file_id));
    return {
      file_id: c.fileId,
      token: c.token,
      path: c.path,
      attempt: c.attempt,
      checkpoint: c.checkpoint ? { data: decode(c.checkpoint.data), progress: c.checkpoint.progress } : null,
    };
  }

  async commit(a: Args) {
    const entry = await this.s.commit(text(a.task), text(a.file_id), BigInt(num(a.token)), num(a.size), text(a.digest));
    return { state: entryStateName(entry.state) };
  }

  async fail(a: Args) {
    const entry = await this.s.fail(text(a.task), text(a.file_id), BigInt(num(a.token)), {
      reason: text(a.reason),
      permanent: Boolean(a.permanent),
      delay: num(a.delay),
    });
    return { state: entryStateName(entry.state) };
  }

  async checkpoint(a: Args) {
    await this.s.checkpoint(text(a.task), text(a.file_id), BigInt(num(a.token)), {
      data: encode(text(a.data)),
      progress: num(a.progress),
    });
    return {};
  }

  async produce(a: Args) {
    const fail = text(a.raise);
    const out = await produce(
      this.s,
      text(a.task),
      text(a.file_id),
      async (out) => {
        await out.write(encode(text(a.data)));
        if (fail === "permanent") throw new PermanentError("the driver was asked to fail for good");
        if (fail) throw new Error("the driver was asked to fail");
      },
      { wait: num(a.wait) },
    );
    return {
      file_id: out.claim.fileId,
      token: out.claim.token,
      size: out.size,
      digest: out.digest,
      state: entryStateName(out.entry!.state),
    };
  }

  async consume(a: Args) {
    const task = text(a.task);
    const got = await consume(this.s, task, { group: text(a.group, "default"), timeout: num(a.timeout, 10) }, (d) => ({
      fileId: d.lease.fileId,
      data: decode(d.data),
    }));
    const entry = await this.client.getEntry(task, got.fileId);
    return { file_id: got.fileId, data: got.data, state: entryStateName(entry.state) };
  }

  async lease(a: Args) {
    const lease = await nextLease(this.s, text(a.task), { group: text(a.group, "default"), timeout: num(a.timeout, 10) });
    return { file_id: lease.fileId, token: lease.token, digest: lease.digest };
  }

  async ack(a: Args) {
    const entry = await this.s.ack(text(a.task), text(a.file_id), text(a.group, "default"), BigInt(num(a.token)));
    return { state: entryStateName(entry.state) };
  }

  async nack(a: Args) {
    const entry = await this.s.nack(text(a.task), text(a.file_id), text(a.group, "default"), BigInt(num(a.token)), {
      delay: num(a.delay),
      permanent: Boolean(a.permanent),
    });
    return { state: entryStateName(entry.state) };
  }

  async getTask(a: Args) {
    const task = await this.client.getTask(text(a.task));
    return { task_id: task.spec?.taskId ?? "", status: taskStatusName(task.status) };
  }

  async getEntry(a: Args) {
    const entry = await this.client.getEntry(text(a.task), text(a.file_id));
    return { state: entryStateName(entry.state), retry_count: entry.retryCount };
  }

  /** Run one request and its reply: a result, or the error by its class's name. */
  async answer(request: { id?: unknown; op?: unknown; args?: Args }): Promise<Record<string, unknown>> {
    const reply: Record<string, unknown> = { id: request.id ?? null };
    try {
      const op = this.ops[text(request.op)];
      if (op === undefined || !Object.hasOwn(this.ops, text(request.op))) {
        throw new Error(`no operation '${text(request.op)}'`);
      }
      reply.result = await op(request.args ?? {});
    } catch (e) {
      if (e instanceof BatonError) {
        reply.error = { kind: e.name, code: e.code, message: e.message };
      } else {
        const kind = e instanceof PermanentError ? "PermanentError" : "Error";
        reply.error = { kind, code: "", message: e instanceof Error ? e.message : String(e) };
      }
    }
    return reply;
  }
}

/** JSON text in which a bigint (a session id, a token) is written as its exact number. */
function toJson(value: unknown): string {
  return JSON.stringify(value, (_, v) => (typeof v === "bigint" ? `\u0000big:${v}` : v)).replace(
    /"\\u0000big:(-?\d+)"/g,
    "$1",
  );
}

async function main(): Promise<void> {
  const driver = new Driver(connect(settingsFromEnv()));
  const write = (message: unknown) => process.stdout.write(`${toJson(message)}\n`);
  write({ ready: true, client: "typescript" });
  const running = new Set<Promise<void>>();
  for await (const line of createInterface({ input: process.stdin, crlfDelay: Infinity })) {
    if (!line.trim()) continue;
    let request;
    try {
      request = JSON.parse(line);
    } catch (e) {
      write({ id: null, error: { kind: "Error", code: "", message: `not JSON: ${(e as Error).message}` } });
      continue;
    }
    const task = driver.answer(request).then((reply) => {
      write(reply);
    });
    running.add(task);
    void task.finally(() => running.delete(task));
  }
  await Promise.all(running);
  await driver.session?.close({ revoke: false });
  driver.client.close();
}

main().then(
  () => process.exit(0),
  (e) => {
    process.stderr.write(`driver: ${e instanceof Error ? e.stack : String(e)}\n`);
    process.exit(1);
  },
);
