import assert from "node:assert/strict";
import { test } from "node:test";
import { DEFAULT_REGISTRY, InvalidArgument, settingsFromEnv } from "../src/index.js";

test("no TLS variable: plaintext to BATON_REGISTRY", () => {
  assert.deepEqual(settingsFromEnv({ BATON_REGISTRY: "10.0.0.1:9000" }), { registry: "10.0.0.1:9000" });
});

test("nothing set: the default registry", () => {
  assert.equal(settingsFromEnv({}).registry, DEFAULT_REGISTRY);
  assert.equal(DEFAULT_REGISTRY, "127.0.0.1:7390");
});

test("all three TLS variables: mutual TLS with those files", () => {
  const settings = settingsFromEnv({ BATON_CA: "/p/ca.crt", BATON_CERT: "/p/a.crt", BATON_KEY: "/p/a.key" });
  assert.deepEqual(settings.tls, { ca: "/p/ca.crt", cert: "/p/a.crt", key: "/p/a.key" });
});

test("a partial set is refused, naming what is missing", () => {
  assert.throws(
    () => settingsFromEnv({ BATON_CA: "/p/ca.crt" }),
    (e: unknown) => {
      assert.ok(e instanceof InvalidArgument);
      assert.match(e.message, /missing: BATON_CERT, BATON_KEY$/);
      assert.deepEqual(e.fields.missing, ["BATON_CERT", "BATON_KEY"]);
      return true;
    },
  );
  assert.throws(() => settingsFromEnv({ BATON_CERT: "c", BATON_KEY: "k" }), /missing: BATON_CA$/);
});
