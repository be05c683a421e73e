/** Where the registry is and which identity to show it, from the environment. */
import { InvalidArgument } from "./errors.gen.js";

/** The registry a client reaches when `BATON_REGISTRY` is not set. */
export const DEFAULT_REGISTRY = "127.0.0.1:7390";

/** Mutual TLS: the CA of the registry's certificate, and this client's identity. */
export interface TlsFiles {
  ca: string;
  cert: string;
  key: string;
}

/** A client's settings: the registry's `HOST:PORT`, and TLS files (none: plaintext). */
export interface Settings {
  registry: string;
  tls?: TlsFiles;
  /** seconds a unary call or a stream's first reply may take (default 10) */
  timeout?: number;
}

/**
 * Settings from `BATON_REGISTRY`, `BATON_CA`, `BATON_CERT` and `BATON_KEY`: all three
 * files mean mutual TLS, none plaintext; some of them only is refused with an
 * `InvalidArgument` naming what is missing.
 */
export function settingsFromEnv(env: NodeJS.ProcessEnv = process.env): Settings {
  const registry = env.BATON_REGISTRY || DEFAULT_REGISTRY;
  const files = {
    BATON_CA: env.BATON_CA ?? "",
    BATON_CERT: env.BATON_CERT ?? "",
    BATON_KEY: env.BATON_KEY ?? "",
  };
  const given = Object.values(files).filter(Boolean).length;
  if (given === 0) return { registry };
  if (given < 3) {
    const missing = Object.entries(files)
      .filter(([, value]) => !value)
      .map(([name]) => name);
    throw new InvalidArgument(
      `mutual TLS needs BATON_CA, BATON_CERT and BATON_KEY together; missing: ${missing.join(", ")}`,
      { missing },
    );
  }
  return { registry, tls: { ca: files.BATON_CA, cert: files.BATON_CERT, key: files.BATON_KEY } };
}
