"""Who is calling, and what each role may call: the registry's one access table.

A caller is the identity in its client certificate (docs/security.md): the CN is
its name, each OU that names a role is a role it holds. The API is three services,
one per audience (agents, watchers, operators); :data:`POLICY` maps every method to
the roles that may call it: its service's role (:data:`AUDIENCE`) plus the few
per-method :data:`EXCEPTIONS`. A method missing from it is refused to everyone (deny
by default). The access interceptor (``interceptors.Access``) enforces it for every
call before a handler runs, the only place it is checked.

A registry serving plaintext (``--insecure``) has no identities: every caller is
:data:`ANONYMOUS`, which holds every role.
"""

from __future__ import annotations

import contextvars
import fnmatch
import functools
import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from ...kernel.errors import PermissionDenied
from ...kernel.pki import ROLES
from ...kernel.pki import identity as cert_identity
from ...kernel.v1 import baton_pb2 as pb

OPERATOR, AGENT, WATCHER = ROLES


class _HasToken(Protocol):
    token: int


T = TypeVar("T", bound=_HasToken)
_ANY = frozenset(ROLES)

#: the services of the contract and the audience each serves (its role)
SERVICE_AUDIENCE: Mapping[str, str] = {
    "AgentService": AGENT, "WatcherService": WATCHER, "OperatorService": OPERATOR,
}

#: every method of the registry by the audience it serves: the service it is in.
#: Each audience's methods are open to its role; what else a method allows is an
#: exception, listed once in :data:`EXCEPTIONS`, so the table never restates per
#: method what the service already implies.
AUDIENCE: Mapping[str, str] = {
    method.name: SERVICE_AUDIENCE[service.name]
    for service in pb.DESCRIPTOR.services_by_name.values()
    for method in service.methods
}

#: the roles each audience's methods are open to
AUDIENCE_ROLES: Mapping[str, frozenset[str]] = {
    AGENT: frozenset({AGENT}),
    WATCHER: frozenset({WATCHER}),
    OPERATOR: frozenset({OPERATOR}),
}

#: the per-method exceptions: roles a method allows beyond its audience's, and why
EXCEPTIONS: Mapping[str, frozenset[str]] = {
    # reads: everyone with an identity (tokens are redacted for non-operators)
    **dict.fromkeys(("GetTask", "ListTasks", "GetEntry", "ListEntries", "Journal",
                     "Explain", "WatchTasks"), frozenset({AGENT, WATCHER})),
    "Watch": frozenset({OPERATOR, WATCHER}),
    # tasks are made by pipelines (agents) as well as people
    "CreateTask": frozenset({AGENT}),
    # an operator may close any session (``baton release``)
    "CloseSession": frozenset({OPERATOR}),
    # watchers read the membership and shard map they hold shards by
    "ListWatchers": frozenset({WATCHER}),
    "ListShards": frozenset({WATCHER}),
}

#: every method of the registry and the roles that may call it: its
#: audience's roles plus its exceptions
POLICY: Mapping[str, frozenset[str]] = {
    method: AUDIENCE_ROLES[audience] | EXCEPTIONS.get(method, frozenset())
    for method, audience in AUDIENCE.items()
}


@dataclass(frozen=True)
class Caller:
    """The identity behind a call: a name and the roles it holds."""

    name: str
    roles: frozenset[str]

    @property
    def operator(self) -> bool:
        return OPERATOR in self.roles

    def describe(self) -> str:
        roles = ", ".join(sorted(self.roles)) or "no role"
        return f"{self.name or 'an anonymous caller'} ({roles})"


#: every caller of a registry that serves plaintext (``--insecure``)
ANONYMOUS = Caller("", _ANY)

_current: contextvars.ContextVar[Caller] = contextvars.ContextVar("baton_caller",
                                                                  default=ANONYMOUS)


def current() -> Caller:
    """The caller of the call being handled (set before the handler runs)."""
    return _current.get()


@functools.lru_cache(maxsize=4096)
def _from_pem(pem: bytes) -> Caller:
    name, roles = cert_identity(pem)
    return Caller(name, frozenset(roles))


def caller_of(auth_context: Mapping[str, Iterable[bytes]], secure: bool) -> Caller:
    """The caller a connection's authentication context names (``ANONYMOUS`` when
    the registry serves plaintext). A TLS peer without a certificate has no name and
    no role: every method refuses it."""
    if not secure:
        return ANONYMOUS
    pems = list(auth_context.get("x509_pem_cert", ()))
    if not pems:
        return Caller("", frozenset())
    return _from_pem(pems[0])


def enter(caller: Caller) -> None:
    """Make ``caller`` what :func:`current` returns for the rest of the call (the
    authentication interceptor's one step)."""
    _current.set(caller)


def authorize(method: str, caller: Caller) -> None:
    """Let ``caller`` into ``method`` or raise ``PermissionDenied``."""
    allowed = POLICY.get(method, frozenset())
    if not allowed & caller.roles:
        need = " or ".join(sorted(allowed)) or "no role (not in the access table)"
        raise PermissionDenied(
            f"{method} is not allowed to {caller.describe()}: it needs the role {need}",
            method=method, identity=caller.name, roles=sorted(caller.roles))


def scoped_request_id(caller: Caller, call: str, request: Any) -> str:
    """``request``'s request id as recorded: scoped to its caller, to the call (method)
    and to the request's other fields. A replay then only ever returns the reply of
    the very same call: another identity's same id, or the same id sent again with
    another call or other arguments (a client's mistake), is another request, applied
    on its own — never answered with a reply recorded for something else."""
    request_id: str = request.request_id
    if not request_id:
        return request_id
    h = hashlib.blake2b(digest_size=8)
    for part in (caller.name, call):
        h.update(part.encode())
        h.update(b"\0")
    request.request_id = ""
    try:
        h.update(request.SerializeToString(deterministic=True))
    finally:
        request.request_id = request_id
    return f"{h.hexdigest()}.{request_id}"


def matches(name: str, patterns: Iterable[str]) -> bool:
    """Whether an identity name matches one of the shell patterns (case-sensitive)."""
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def may(caller: Caller, patterns: Iterable[str]) -> bool:
    """Whether ``caller`` passes an access rule: no patterns allow everyone; an
    anonymous caller (plaintext registry) passes every rule."""
    patterns = list(patterns)
    return not patterns or caller is ANONYMOUS or matches(caller.name, patterns)


def redact(message: T, caller: Caller) -> T:
    """An entry or journal record with its fencing token cleared, for a caller who is
    not an operator: a token names a live claim, and only its holder learns it (from
    the claim's reply)."""
    if not caller.operator:
        message.token = 0
    return message
