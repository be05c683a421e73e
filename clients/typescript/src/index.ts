/** Baton's TypeScript client: agent sessions, produce and consume, typed errors. */
export * from "./errors.gen.js";
export {
  errorFromStatus,
  toBatonError,
  codeName,
  handingBack,
  PermanentError,
  RetryAfter,
} from "./errors.js";
export { settingsFromEnv, DEFAULT_REGISTRY, type Settings, type TlsFiles } from "./settings.js";
export { Client, connect, type WatchOptions } from "./client.js";
export {
  Session,
  BACKPRESSURE_WAIT,
  CLIENT_VERSION,
  type Claim,
  type Lease,
  type SessionOptions,
  type FailOptions,
  type NackOptions,
  type CheckpointOptions,
} from "./session.js";
export { produce, produceEach, Output, tempName, newNonce, TEMP_MARKER } from "./produce.js";
export { consume, consumeEach, nextLease, readVerified, Delivery, type ConsumeOptions } from "./consume.js";
export { blake3Hex } from "./blake3.js";
export { entryStateName, taskStatusName } from "./names.js";
export * as pb from "./gen/baton/v1/baton_pb.js";
