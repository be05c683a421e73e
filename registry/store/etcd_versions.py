"""etcd releases with a known bug that can lose or break Baton's data, as one table.

:data:`KNOWN_BAD` is the single source of what an affected etcd is: ``baton up``
warns with it when it can only find an affected binary (``local.etcdproc``),
a production registry refuses to serve against an affected member with it
(``registry.etcd_members``), and the table in docs/operations.md ("etcd versions")
is :func:`markdown_table` (a test keeps the two equal). Imports nothing but the
standard library, so the local stack can read it without the server's dependencies.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "INSTALL_INSTEAD",
    "KNOWN_BAD",
    "KnownBug",
    "affected_by",
    "crash_loses_writes",
    "markdown_table",
    "parse_version",
    "refusal",
    "warning_lines",
]

Version = tuple[int, int, int]

#: what to run instead of an affected release
INSTALL_INSTEAD = (
    "etcd 3.4 (Debian/Ubuntu: `apt-get install etcd-server`, 3.4.23) or etcd 3.5.5 and later"
)


@dataclass(frozen=True)
class KnownBug:
    """A bug of the etcd releases ``first`` to ``last`` (both included)."""

    first: Version
    last: Version
    #: where it is tracked, e.g. ``etcd-io/etcd#13766``
    bug: str
    #: what goes wrong, in a few words
    what: str
    #: what it risks for Baton's data, in a few words
    risk: str
    #: the first 3.5 release without it (every 3.4 release is without it too)
    fixed_in: str
    #: whether a member killed (SIGKILL, power loss) can lose acknowledged writes
    crash_loses_writes: bool = False

    @property
    def versions(self) -> str:
        """``3.5.0 to 3.5.2`` (plain ASCII: it travels in gRPC metadata too)"""
        return f"{_text(self.first)} to {_text(self.last)}"

    def covers(self, version: Version) -> bool:
        return self.first <= version <= self.last


KNOWN_BAD: tuple[KnownBug, ...] = (
    KnownBug(
        (3, 5, 0), (3, 5, 2), "etcd-io/etcd#13766",
        "a member that crashes can come back without writes it had already applied "
        "and acknowledged",
        "writes lost if etcd crashes (an entry's state, a claim, a journal record)",
        "3.5.3", crash_loses_writes=True),
    KnownBug(
        (3, 5, 0), (3, 5, 4), "etcd-io/etcd#14110",
        "a read-only transaction that times out can panic the member",
        "etcd members crash under load (and, with #13766, lose writes)", "3.5.5"),
)

_VERSION = re.compile(r"v?(\d+)\.(\d+)\.(\d+)")


def parse_version(text: str) -> Version | None:
    """``"3.5.1"`` (or ``"v3.5.1"``, ``"3.5.1-rc.0"``) as (3, 5, 1); None if it is no
    version (an unknown member version is ``""``)."""
    match = _VERSION.match(text.strip())
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2)), int(match.group(3))


def _text(version: Version) -> str:
    return ".".join(str(n) for n in version)


def affected_by(version: str) -> list[KnownBug]:
    """The known bugs of the etcd release ``version`` (none for an unreadable one)."""
    parsed = parse_version(version)
    if parsed is None:
        return []
    return [bug for bug in KNOWN_BAD if bug.covers(parsed)]


def crash_loses_writes(version: str) -> bool:
    """Whether a member of ``version`` that is killed can lose acknowledged writes (the
    fault suite leaves its etcd-killing nemesis out on such releases)."""
    return any(b.crash_loses_writes for b in affected_by(version))


def _bugs(bugs: Iterable[KnownBug]) -> str:
    return "; ".join(f"{b.bug} ({b.versions}: {b.what}; risk: {b.risk})" for b in bugs)


def refusal(members: Sequence[str], version: str, flag: str = "--allow-etcd-version") -> str:
    """Why a registry will not serve against ``members`` running ``version``, in one
    paragraph naming the bugs, what to install and ``flag`` (the way to accept it)."""
    who = (f"etcd member {members[0]} runs" if len(members) == 1
           else f"etcd members {', '.join(members)} run")
    return (f"{who} etcd {version}, which has known bugs: "
            f"{_bugs(affected_by(version))}. Upgrade to {INSTALL_INSTEAD}; "
            f"or, to serve anyway and accept the risk, start the registry with "
            f"{flag} {version} (BATON_ALLOW_ETCD_VERSION={version}).")


def warning_lines(binary: str, version: str) -> list[str]:
    """What ``baton up`` prints first when the only etcd it found is ``version``."""
    lines = [f"WARNING: the only etcd found is {version} ({binary}), which has known bugs:"]
    lines += [f"WARNING:   {b.bug} ({b.versions}): {b.what}; risk: {b.risk}"
              for b in affected_by(version)]
    lines.append("WARNING: writes can be lost if etcd crashes. Install "
                 f"{INSTALL_INSTEAD} and put it on PATH; this stack runs anyway.")
    return lines


def markdown_table() -> str:
    """The table of docs/operations.md, "etcd versions" (kept equal by a test)."""
    rows = ["| etcd releases | bug | what goes wrong | what it risks | install instead |",
            "|---|---|---|---|---|"]
    rows += [f"| {b.versions} | {b.bug} | {b.what} | {b.risk} | 3.4.x, or {b.fixed_in} "
             "and later |" for b in KNOWN_BAD]
    return "\n".join(rows)
