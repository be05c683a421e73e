"""The peer: seed 000's JSON manifest on a shared directory, as agents would run it.

Seed 000 §3.2 keeps every entry in one JSON file with a global ``version``. An
update reads the file, checks that the version is still the one the caller read,
bumps it, writes a temp file in the same directory and ``os.replace``s it onto the
manifest. :func:`update_manifest` below is that function as the seed prints it;
:func:`claim` and :func:`commit` are its producer steps from §4.1 (take a pending
entry: ``writing``, owner, lease; then ``ready`` with the checksum).

Two variants run:

* ``seed`` — exactly that. The version check and the replace are separate steps,
  so two agents that read the same version both "win": the later replace wipes the
  earlier one's change (its claim vanishes and the entry is handed out again),
  and the seed ignores a failed update when it marks an entry ready.
* ``flock`` — the same code made correct: every read-check-write runs under an
  exclusive ``flock`` on a lock file beside the manifest (the manifest itself
  cannot be locked: ``os.replace`` swaps its inode).

Each agent records what it claimed; an entry claimed by two agents is a double claim.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from .pool import Ready

LEASE_SECONDS = 300


def now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_plus_seconds(seconds: int) -> str:
    return (datetime.now(UTC) + timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%SZ")


def new_manifest(path: Path, task_id: str, entries: int) -> None:
    """A manifest of ``entries`` pending entries, shaped like the seed's example (§2.2)."""
    manifest = {
        "task_id": task_id,
        "version": 1,
        "entries": [
            {"file_id": f"e{i:06d}", "path": f"/shared/{task_id}/e{i:06d}", "state": "pending",
             "owner": None, "updated_at": now_iso()}
            for i in range(entries)
        ],
    }
    path.write_text(json.dumps(manifest, indent=2))


def read_manifest(manifest_path: Path | str) -> Any:
    with open(manifest_path) as f:
        return json.load(f)


# The seed's update_manifest (§3.2), unchanged apart from the formatting.
def update_manifest(manifest_path: Path | str, expected_version: int, new_entries: Any) -> bool:
    with open(manifest_path) as f:
        current = json.load(f)
    if current["version"] != expected_version:
        return False  # version conflict: the caller reads again
    current["version"] += 1
    current["entries"] = new_entries
    current["updated_at"] = now_iso()
    # temp file, then atomic rename, so nobody reads half a manifest
    dir_name = os.path.dirname(manifest_path)
    fd, tmp_path = tempfile.mkstemp(dir=dir_name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(current, f, indent=2)
        os.replace(tmp_path, manifest_path)  # atomic
        return True
    except Exception:
        os.unlink(tmp_path)
        raise


def claim(manifest_path: Path, agent: str) -> str | None:
    """Take the first pending entry (§4.1 steps 1-2); its file id, None if none is left."""
    while True:
        manifest = read_manifest(manifest_path)
        entry = next((e for e in manifest["entries"] if e["state"] == "pending"), None)
        if entry is None:
            return None
        entry["state"] = "writing"
        entry["owner"] = agent
        entry["lease_expire_at"] = now_plus_seconds(LEASE_SECONDS)
        if not update_manifest(manifest_path, manifest["version"], manifest["entries"]):
            continue  # version conflict: read again and pick again
        return str(entry["file_id"])


def commit(manifest_path: Path, file_id: str, checksum: str) -> bool:
    """Mark the entry ready (§4.1 step 4); whether the update went in (the seed ignores it)."""
    manifest = read_manifest(manifest_path)
    entry = next(e for e in manifest["entries"] if e["file_id"] == file_id)
    entry["state"] = "ready"
    entry["checksum"] = checksum
    entry["lease_expire_at"] = None
    return update_manifest(manifest_path, manifest["version"], manifest["entries"])


@contextlib.contextmanager
def locked(lock: Any) -> Iterator[None]:
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(lock, fcntl.LOCK_UN)


@dataclass(frozen=True)
class PeerArgs:
    manifest: str
    variant: str  # "seed" or "flock"
    agent: str
    seconds: float


@dataclass
class PeerResult:
    cycles: int
    #: seconds each claim took, version conflicts and lock waits included
    latencies: list[float]
    claimed: list[str]
    #: commits whose update_manifest returned False (the seed carries on regardless)
    failed_commits: int
    end: float


def agent(args: PeerArgs, ready: Ready) -> PeerResult:
    """One agent: claim → commit until nothing is pending or ``seconds`` pass."""
    path = Path(args.manifest)
    lat: list[float] = []
    claimed: list[str] = []
    failed = 0
    # The lock file is opened once per agent: flock locks belong to an open file.
    with open(path.with_suffix(".lock"), "a") as lock:
        guard = (lambda: locked(lock)) if args.variant == "flock" else contextlib.nullcontext
        deadline = ready() + args.seconds
        while time.monotonic() < deadline:
            t0 = time.perf_counter()
            with guard():
                file_id = claim(path, args.agent)
            if file_id is None:
                break
            lat.append(time.perf_counter() - t0)
            claimed.append(file_id)
            with guard():
                failed += not commit(path, file_id, "blake3:0")
    return PeerResult(len(claimed), lat, claimed, failed, time.monotonic())


def not_ready(manifest_path: Path, committed: set[str]) -> int:
    """How many of ``committed`` the final manifest does not show as ready (lost updates)."""
    entries = read_manifest(manifest_path)["entries"]
    return sum(1 for e in entries if e["file_id"] in committed and e["state"] != "ready")
