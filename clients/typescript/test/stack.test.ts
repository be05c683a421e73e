import assert from "node:assert/strict";
import { randomBytes } from "node:crypto";
import { readFile } from "node:fs/promises";
import { test } from "node:test";
import {
  PermanentError,
  blake3Hex,
  connect,
  consume,
  consumeEach,
  entryStateName,
  produce,
  produceEach,
  settingsFromEnv,
  type Client,
} from "../src/index.js";

const skip = process.env.BATON_REGISTRY
  ? false
  : "BATON_REGISTRY is not set: these tests need a running stack (baton up)";
const text = (data: Uint8Array) => new TextDecoder().decode(data);

/** A new task of `files` entries on the stack. */
async function newTask(client: Client, files: string[]): Promise<string> {
  const taskId = `ts-${randomBytes(4).toString("hex")}`;
  await client.operator.createTask({
    spec: { taskId, entries: files.map((fileId) => ({ fileId, path: `out/${fileId}.txt` })) },
  });
  return taskId;
}

test("claim, produce and consume one entry: the bytes and digest go round", { skip }, async () => {
  const client = connect(settingsFromEnv());
  const taskId = await newTask(client, ["a"]);
  const session = await client.openSession("ts-test", { ttl: 10 });
  try {
    const out = await produce(session, taskId, "a", async (o) => {
      await o.write("hello, ");
      await o.write(new TextEncoder().encode("baton"));
    });
    assert.equal(out.size, 12);
    assert.equal(out.digest, blake3Hex(new TextEncoder().encode("hello, baton")));
    assert.equal(text(await readFile(out.claim.path)), "hello, baton");
    assert.ok(["written", "verified"].includes(entryStateName(out.entry!.state)));

    const got = await consume(session, taskId, { group: "default", timeout: 10 }, (d) => ({
      fileId: d.lease.fileId,
      data: text(d.data),
      digest: d.lease.digest,
    }));
    assert.deepEqual(got, { fileId: "a", data: "hello, baton", digest: out.digest });
    assert.equal(entryStateName((await client.getEntry(taskId, "a")).state), "consumed");
  } finally {
    await session.close();
  }
});

test("a block that throws PermanentError fails its entry for good", { skip }, async () => {
  const client = connect(settingsFromEnv());
  const taskId = await newTask(client, ["a"]);
  const session = await client.openSession("ts-test", { ttl: 10 });
  try {
    await assert.rejects(
      produce(session, taskId, "a", async (o) => {
        await o.write("partial");
        throw new PermanentError("the source is gone");
      }),
      PermanentError,
    );
    const entry = await client.getEntry(taskId, "a");
    assert.equal(entryStateName(entry.state), "dead");
    assert.equal(entry.retryCount, 0);
  } finally {
    await session.close();
  }
});

test("produceEach and consumeEach commit and ack as the loops move on", { skip }, async () => {
  const client = connect(settingsFromEnv());
  const taskId = await newTask(client, ["a", "b"]);
  const session = await client.openSession("ts-test", { ttl: 10 });
  try {
    const produced: string[] = [];
    for await (const out of produceEach(session, taskId, { wait: 0 })) {
      await out.write(`data of ${out.claim.fileId}`);
      produced.push(out.claim.fileId);
    }
    assert.deepEqual(produced.sort(), ["a", "b"]);

    const seen: Record<string, string> = {};
    for await (const got of consumeEach(session, taskId, { group: "default", timeout: 2 })) {
      seen[got.lease.fileId] = text(got.data);
    }
    assert.deepEqual(seen, { a: "data of a", b: "data of b" });
    for (const fileId of ["a", "b"]) {
      assert.equal(entryStateName((await client.getEntry(taskId, fileId)).state), "consumed");
    }
  } finally {
    await session.close();
  }
});

test("a consumeEach body that throws nacks the entry in hand", { skip }, async () => {
  const client = connect(settingsFromEnv());
  const taskId = await newTask(client, ["a"]);
  const session = await client.openSession("ts-test", { ttl: 10 });
  try {
    await produce(session, taskId, "a", (o) => o.write("x"));
    await assert.rejects(async () => {
      for await (const got of consumeEach(session, taskId, { timeout: 10 })) {
        assert.equal(got.lease.fileId, "a");
        throw new Error("the work failed");
      }
    }, /the work failed/);
    // handed back to the group: it can be consumed again
    const again = await consume(session, taskId, { timeout: 10 }, (d) => text(d.data));
    assert.equal(again, "x");
  } finally {
    await session.close();
  }
});
