/** BLAKE3, the digest Baton checks every file with. */
import { blake3 } from "@noble/hashes/blake3";
import { bytesToHex } from "@noble/hashes/utils";

/** BLAKE3's 32-byte hash of `data`, in lowercase hex. */
export function blake3Hex(data: Uint8Array): string {
  return bytesToHex(blake3(data));
}

/** An incremental BLAKE3: feed bytes with `update`, then take `hex()` once. */
export function blake3Hasher(): { update(data: Uint8Array): void; hex(): string } {
  const hash = blake3.create({});
  return {
    update: (data) => {
      hash.update(data);
    },
    hex: () => bytesToHex(hash.digest()),
  };
}
