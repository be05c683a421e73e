import assert from "node:assert/strict";
import { test } from "node:test";
import { Code, ConnectError } from "@connectrpc/connect";
import {
  Backpressure,
  BatonError,
  DeadlineExceeded,
  Internal,
  PermanentError,
  RetryAfter,
  StaleToken,
  Unavailable,
  errorFromStatus,
  handingBack,
  toBatonError,
} from "../src/index.js";

test("a named error comes back as its class, with its fields", () => {
  const e = errorFromStatus("RESOURCE_EXHAUSTED", "group g is at its limit", {
    "baton-error": "Backpressure",
    "baton-fields": JSON.stringify({ task_id: "t1", group: "g", backlog: 5, message: "not a field" }),
  });
  assert.ok(e instanceof Backpressure);
  assert.equal(e.name, "Backpressure");
  assert.equal(e.code, "RESOURCE_EXHAUSTED");
  assert.equal(e.message, "group g is at its limit");
  assert.deepEqual(e.fields, { task_id: "t1", group: "g", backlog: 5 });
});

test("fields that are not a JSON object are dropped", () => {
  const e = errorFromStatus("FAILED_PRECONDITION", "stale", { "baton-error": "StaleToken", "baton-fields": "[1" });
  assert.ok(e instanceof StaleToken);
  assert.deepEqual(e.fields, {});
});

test("an unknown error name maps by its code, as a transport error", () => {
  const e = errorFromStatus("UNAVAILABLE", "replica gone", { "baton-error": "NoSuchError" });
  assert.equal(e.constructor, Unavailable);
  assert.equal(e.message, "replica gone");
});

test("a status without a name maps through the transport table", () => {
  const e = errorFromStatus("DEADLINE_EXCEEDED", "", {});
  assert.ok(e instanceof DeadlineExceeded);
  assert.equal(e.message, "deadline_exceeded");
});

test("an unknown code without a name is Internal, prefixed with the code", () => {
  const e = errorFromStatus("DATA_LOSS", "bits fell out", {});
  assert.equal(e.constructor, Internal);
  assert.equal(e.message, "DATA_LOSS: bits fell out");
});

test("a ConnectError's trailers name the error", () => {
  const metadata = new Headers({ "baton-error": "StaleToken", "baton-fields": '{"token": 7}' });
  const e = toBatonError(new ConnectError("token 7 is stale", Code.FailedPrecondition, metadata));
  assert.ok(e instanceof StaleToken);
  assert.equal(e.message, "token 7 is stale");
  assert.equal(e.fields.token, 7);
});

test("a failure outside gRPC (the connection) is Unavailable", () => {
  const e = toBatonError(new Error("connect ECONNREFUSED 127.0.0.1:1"));
  assert.equal(e.constructor, Unavailable);
  assert.ok(toBatonError(e) === e, "a Baton error passes through");
  assert.ok(e instanceof BatonError);
});

test("PermanentError and RetryAfter say how an entry is handed back", () => {
  assert.deepEqual(handingBack(new PermanentError("gone")), { permanent: true, delay: 0 });
  const later = new RetryAfter(30, "upstream says wait");
  assert.equal(later.seconds, 30);
  assert.equal(later.message, "upstream says wait");
  assert.equal(new RetryAfter(2.5).message, "retry after 2.5 s");
  assert.deepEqual(handingBack(later), { permanent: false, delay: 30 });
  assert.deepEqual(handingBack(new Error("x")), { permanent: false, delay: 0 });
});
