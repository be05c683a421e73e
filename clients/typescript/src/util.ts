/** Small helpers the client's modules share. */
import { randomBytes } from "node:crypto";

/** Resolve after `seconds`. */
export function sleep(seconds: number): Promise<void> {
  return new Promise((resolve) => setTimeout(resolve, Math.max(0, seconds * 1000)));
}

/**
 * Baton's backoff with full jitter: after failure `n` (1, 2, ...) anything up to
 * `initial * 2^(n-1)` seconds, at most `cap`.
 */
export function backoffDelay(initial: number, cap: number, failures: number): number {
  if (failures < 1) return 0;
  return Math.random() * Math.min(cap, initial * 2 ** (failures - 1));
}

/** A new request id: a call sent again with it applies once. */
export function requestId(): string {
  return randomBytes(16).toString("hex");
}

/** Seconds on a clock that only goes forward. */
export function monotonic(): number {
  return performance.now() / 1000;
}
