/**
 * Turning a gRPC status back into Baton's typed errors, and the failures a produce or
 * consume block throws to say how its entry is handed back.
 */
import { Code, ConnectError } from "@connectrpc/connect";
import {
  BatonError,
  ERRORS,
  Internal,
  TRANSPORT,
  Unavailable,
} from "./errors.gen.js";

/** The trailer naming the error's class. */
export const ERROR_KEY = "baton-error";
/** The trailer carrying the error's fields as JSON. */
export const FIELDS_KEY = "baton-fields";
/** The longest message kept, in characters. */
export const MAX_DETAILS = 2048;

/** Fields no error may have replaced by what the registry sends. */
const RESERVED = new Set(["message", "fields", "code", "exit_code", "args"]);
const IDENTIFIER = /^[A-Za-z_][A-Za-z0-9_]*$/;

/** gRPC's status code names, by Connect's numeric code. */
const CODE_NAMES: Readonly<Record<number, string>> = {
  [Code.Canceled]: "CANCELLED",
  [Code.Unknown]: "UNKNOWN",
  [Code.InvalidArgument]: "INVALID_ARGUMENT",
  [Code.DeadlineExceeded]: "DEADLINE_EXCEEDED",
  [Code.NotFound]: "NOT_FOUND",
  [Code.AlreadyExists]: "ALREADY_EXISTS",
  [Code.PermissionDenied]: "PERMISSION_DENIED",
  [Code.ResourceExhausted]: "RESOURCE_EXHAUSTED",
  [Code.FailedPrecondition]: "FAILED_PRECONDITION",
  [Code.Aborted]: "ABORTED",
  [Code.OutOfRange]: "OUT_OF_RANGE",
  [Code.Unimplemented]: "UNIMPLEMENTED",
  [Code.Internal]: "INTERNAL",
  [Code.Unavailable]: "UNAVAILABLE",
  [Code.DataLoss]: "DATA_LOSS",
  [Code.Unauthenticated]: "UNAUTHENTICATED",
};

/** The gRPC name of a Connect status code, e.g. `NOT_FOUND`. */
export function codeName(code: Code): string {
  return CODE_NAMES[code] ?? "UNKNOWN";
}

/** `text` cut to `limit` characters, saying how many were left out. */
function clip(text: string, limit: number): string {
  if (text.length <= limit) return text;
  return `${text.slice(0, limit)}… (${(text.length - limit).toLocaleString("en-US")} more characters)`;
}

/**
 * The Baton error a status carries: the class named by `baton-error` with the fields
 * of `baton-fields`; without a name, the transport's error for `code` (any other
 * code: `Internal`, its message prefixed with the code's name).
 */
export function errorFromStatus(
  code: string,
  details: string,
  metadata: Record<string, string>,
): BatonError {
  const message = clip(details || code.toLowerCase(), MAX_DETAILS);
  const cls = Object.hasOwn(ERRORS, metadata[ERROR_KEY] ?? "")
    ? ERRORS[metadata[ERROR_KEY]!]
    : undefined;
  if (cls === undefined) {
    const transport = (Object.hasOwn(TRANSPORT, code) && TRANSPORT[code]) || Internal;
    return new transport(transport === Internal ? `${code}: ${message}` : message);
  }
  let parsed: unknown = {};
  try {
    parsed = JSON.parse(metadata[FIELDS_KEY] ?? "{}");
  } catch {
    parsed = {};
  }
  const fields: Record<string, unknown> = {};
  if (parsed !== null && typeof parsed === "object" && !Array.isArray(parsed)) {
    for (const [key, value] of Object.entries(parsed)) {
      if (!RESERVED.has(key) && IDENTIFIER.test(key)) fields[key] = value;
    }
  }
  return new cls(message, fields);
}

/**
 * The Baton error of a failed call: a ConnectError's status and trailers through
 * `errorFromStatus`; a Baton error as it is; anything else (the connection itself
 * failed) `Unavailable`.
 */
export function toBatonError(error: unknown): BatonError {
  if (error instanceof BatonError) return error;
  if (error instanceof ConnectError) {
    const metadata: Record<string, string> = {};
    error.metadata.forEach((value, key) => {
      metadata[key] = value;
    });
    return errorFromStatus(codeName(error.code), error.rawMessage, metadata);
  }
  const text = error instanceof Error ? error.message : String(error);
  return new Unavailable(text || "the registry could not be reached");
}

/**
 * No retry can succeed: a producer's entry goes dead at once, its retries not spent;
 * a consumer gives the entry up, and it goes dead for every group.
 */
export class PermanentError extends Error {
  constructor(message = "") {
    super(message);
    this.name = "PermanentError";
  }
}

/**
 * Try again no sooner than `seconds` from now: a producer's entry is claimable again
 * then; a consumer's entry goes back to its group then.
 */
export class RetryAfter extends Error {
  readonly seconds: number;

  constructor(seconds: number, reason = "") {
    super(reason || `retry after ${seconds} s`);
    this.name = "RetryAfter";
    this.seconds = seconds;
  }
}

/** The `permanent` flag and `delay` a fail or nack takes for `error`. */
export function handingBack(error: unknown): { permanent: boolean; delay: number } {
  if (error instanceof PermanentError) return { permanent: true, delay: 0 };
  if (error instanceof RetryAfter) return { permanent: false, delay: error.seconds };
  return { permanent: false, delay: 0 };
}

/** Why an attempt failed, as the journal says it: `Name: message`. */
export function reasonOf(error: unknown): string {
  if (error instanceof Error) return `${error.name}: ${error.message}`;
  return `Error: ${String(error)}`;
}
