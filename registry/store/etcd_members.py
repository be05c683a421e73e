"""Which etcd release each member runs, and whether the registry may serve on it.

A production registry reads every member's version when it starts
(:meth:`EtcdMembers.check`, through ``Etcd.member_statuses``) and refuses to start when a
member runs a release of ``etcd_versions.KNOWN_BAD`` that ``--allow-etcd-version``
does not name. While it serves, the same check runs every ``--etcd-check-interval``
seconds, so a member added, replaced or upgraded in place is seen: when an affected
one appears, the registry's health service reports ``NOT_SERVING`` for the
registry's service (the whole server, "", stays ``SERVING``: the process is well, a
restart would not help) and says why in its log, in the health reply's trailing
metadata and in ``/metrics``. Calls are still served: the data already lives on that
cluster, and turning agents away would only expire their sessions and send every
claim back; a readiness probe takes the replica out of rotation, and the operator
upgrades the member (the registry turns ``SERVING`` again by itself) or restarts
the registry with the flag. See docs/operations.md, "etcd versions".
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ...kernel.errors import BatonError, InvalidArgument
from .etcd import Etcd, Member
from .etcd_versions import affected_by, parse_version, refusal

log = logging.getLogger("baton.registry")

__all__ = ["EtcdMembers", "EtcdVersionRefused", "allowed_versions"]

#: trailing metadata of a health reply: every member and its version
MEMBERS_KEY = "baton-etcd-members"
#: trailing metadata of a health reply while an etcd member's release is refused
REASON_KEY = "baton-health-reason"


class EtcdVersionRefused(BatonError):
    """An etcd member runs a release with a known bug that ``--allow-etcd-version``
    does not name; ``members`` are their names, ``version`` the release."""

    members: list[str]
    version: str


def allowed_versions(setting: str) -> frozenset[str]:
    """The releases of ``--allow-etcd-version`` (``3.5.1`` or ``3.5.1,3.5.2``)."""
    versions = [v.strip() for v in setting.split(",") if v.strip()]
    for version in versions:
        parsed = parse_version(version)
        if parsed is None or ".".join(map(str, parsed)) != version:
            raise InvalidArgument(
                f"--allow-etcd-version: {version!r} is not an etcd release like 3.5.1 "
                "(several: comma-separated)", setting="--allow-etcd-version")
    return frozenset(versions)


class EtcdMembers:
    """The members last read and what the registry makes of their releases."""

    def __init__(self, etcd: Etcd, allowed: frozenset[str] = frozenset()) -> None:
        self.etcd = etcd
        self.allowed = allowed
        self.members: list[Member] = []
        #: one paragraph per refused release (empty: the registry may serve)
        self.refusals: list[str] = []

    @property
    def reason(self) -> str:
        """Why the registry should not serve ("" when it may)."""
        return " ".join(self.refusals)

    def versions(self) -> str:
        """``name=version,...`` of every member (``unknown`` when it could not be asked)."""
        return ",".join(f"{m.label}={m.version or 'unknown'}" for m in self.members)

    def judge(self, members: Sequence[Member]) -> list[str]:
        """One refusal paragraph per affected release not allowed, naming its members."""
        by_version: dict[str, list[str]] = {}
        for member in members:
            if affected_by(member.version) and member.version not in self.allowed:
                by_version.setdefault(member.version, []).append(member.label)
        return [refusal(names, version) for version, names in sorted(by_version.items())]

    async def check(self) -> list[str]:
        """Read the members again; the refusals (logged when they change)."""
        members = await self.etcd.member_statuses()
        self._update(members, self.judge(members))
        return self.refusals

    async def require(self) -> None:
        """Read the members once, as a registry starts: raise :class:`EtcdVersionRefused`
        (every refusal in its message) when a member's release is refused."""
        members = await self.etcd.member_statuses()
        refusals = self.judge(members)
        if refusals:
            refused = [m for m in members
                       if affected_by(m.version) and m.version not in self.allowed]
            raise EtcdVersionRefused(" ".join(refusals), members=[m.label for m in refused],
                                     version=refused[0].version)
        self._update(members, refusals)

    def _update(self, members: Sequence[Member], refusals: list[str]) -> None:
        if [(m.id, m.version) for m in members] != [(m.id, m.version) for m in self.members]:
            log.info("etcd members: %s", ", ".join(
                f"{m.label} {m.version or 'unknown'}" for m in members))
            for m in members:
                if m.problem:
                    log.warning("etcd member %s: version unknown, %s (asked again in the "
                                "next check)", m.label, m.problem)
                elif affected_by(m.version) and m.version in self.allowed:
                    log.warning("etcd member %s runs etcd %s, which has known bugs "
                                "(docs/operations.md, etcd versions); served anyway: "
                                "--allow-etcd-version names it", m.label, m.version)
        if refusals != self.refusals:
            for paragraph in refusals:
                log.error("%s The registry's health is NOT_SERVING until then (calls are "
                          "still served).", paragraph)
            if not refusals:
                log.info("no etcd member runs a refused release any more; health SERVING")
        self.members, self.refusals = list(members), refusals
