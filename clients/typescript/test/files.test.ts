import assert from "node:assert/strict";
import { test } from "node:test";
import { TEMP_MARKER, blake3Hex, newNonce, tempName } from "../src/index.js";

const bytes = (text: string) => new TextEncoder().encode(text);

test("BLAKE3 of known inputs, in lowercase hex", () => {
  assert.equal(blake3Hex(new Uint8Array()), "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262");
  assert.equal(blake3Hex(bytes("abc")), "6437b3ac38465133ffb63b75273a8db548c558465d79db03fd359c6cd5bd9d85");
  // one zero byte: the first of the reference test vectors
  assert.equal(blake3Hex(new Uint8Array([0])), "2d3adedff11b61f14c886e35afa036736dcd87a74d27b5c1510225d0f592e213");
});

test("the temp name is .NAME.baton-tmp-TOKEN-NONCE", () => {
  assert.equal(TEMP_MARKER, ".baton-tmp-");
  assert.equal(tempName("a~t42.txt", 42n, "0123456789abcdef"), ".a~t42.txt.baton-tmp-42-0123456789abcdef");
  assert.match(tempName("f.bin", 7), /^\.f\.bin\.baton-tmp-7-[0-9a-f]{16}$/);
  assert.match(newNonce(), /^[0-9a-f]{16}$/);
  assert.notEqual(newNonce(), newNonce());
});

test("a name too long loses the end of its NAME part, never the marker or nonce", () => {
  const name = tempName("é".repeat(200), 1, "0123456789abcdef");
  assert.ok(Buffer.byteLength(name) <= 255, `${Buffer.byteLength(name)} bytes`);
  assert.ok(name.endsWith(".baton-tmp-1-0123456789abcdef"));
  assert.ok(!name.includes("\uFFFD"), "no character is cut in half");
});
