"""Shared pieces of the CLI: settings, options, errors and rendering.

Every run of ``baton`` is a new process, and shell agents run it in loops, so this
module imports only what every command needs (click, the errors): gRPC and the
stubs come with the client on its first use, rich with the first table, BLAKE3
with the first file hashed.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, BinaryIO, TypeVar, cast

import click

from ...kernel import errors

if TYPE_CHECKING:
    from google.protobuf.descriptor import Descriptor, EnumDescriptor
    from google.protobuf.message import Message
    from rich.console import Console, RenderableType
    from rich.table import Table

    from ...kernel.v1 import baton_pb2 as pb
    from .._client import Client, Session

F = TypeVar("F", bound=Callable[..., Any])

#: files at least this large get a progress bar (when stderr is a terminal)
PROGRESS_MIN_BYTES = 8 << 20
#: files at least this large are hashed with every core
PARALLEL_HASH_MIN_BYTES = 16 << 20
CHUNK = 4 << 20
DIGEST_PREFIX = 12
STATES = ("pending", "writing", "written", "verified", "consumed", "dead")


# --- settings, errors, rendering helpers ------------------------------------------


@dataclass
class Settings:
    """The group's options; the client is made on first use and closed at exit."""

    registry: str
    timeout: float
    ca: str = ""
    cert: str = ""
    key: str = ""
    _client: Client | None = field(default=None, repr=False)

    def client(self) -> Client:
        if self._client is None:
            from .._client import Client, RetryPolicy

            # Retries of UNAVAILABLE stop at --timeout too: an unreachable registry
            # must not hold a script for the library's default 30 s.
            retry = RetryPolicy(deadline=self.timeout)
            self._client = Client(self.registry, timeout=self.timeout, retry=retry,
                                  ca=self.ca, cert=self.cert, key=self.key)
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


pass_settings = click.make_pass_decorator(Settings)


class UsageLine(click.UsageError):
    """A usage error told in one line: ``baton: COMMAND: what was wrong; see 'baton
    COMMAND --help'`` (click's own shows the usage, a hint and the error on four)."""

    def __init__(self, error: click.UsageError) -> None:
        names = []
        ctx = error.ctx
        while ctx is not None and ctx.parent is not None:
            names.append(ctx.info_name or "")
            ctx = ctx.parent
        command = " ".join(reversed(names))
        what = " ".join(line.strip() for line in error.format_message().splitlines()
                        if line.strip()).rstrip(".")
        if what[:1].isupper() and what[1:2].islower():  # "Missing argument", not "FILE_ID"
            what = what[0].lower() + what[1:]
        where = f"{command}: " if command else ""
        helper = " ".join(["baton", *reversed(names), "--help"])
        super().__init__(f"{where}{what}; see '{helper}'", error.ctx)

    def show(self, file: IO[Any] | None = None) -> None:
        click.echo(f"baton: {self.message}", file=file, err=file is None)


@contextmanager
def usage_in_one_line() -> Iterator[None]:
    """Turn click's usage errors into :class:`UsageLine`; a group named without a
    command (``baton task``) still shows its help."""
    try:
        yield
    except (UsageLine, click.exceptions.NoArgsIsHelpError):
        raise
    except click.UsageError as e:
        raise UsageLine(e) from e


class BatonGroup(click.Group):
    """A group that turns expected errors into one stderr line and an exit status."""

    def make_context(self, info_name: str | None, args: list[str],
                     parent: click.Context | None = None, **extra: Any) -> click.Context:
        with usage_in_one_line():
            return super().make_context(info_name, args, parent, **extra)

    def invoke(self, ctx: click.Context) -> Any:
        with usage_in_one_line():
            return self._invoke(ctx)

    def _invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except errors.BatonError as e:
            message = _one_line(e)
            settings = ctx.find_object(Settings)
            if isinstance(e, errors.DeadlineExceeded):
                message += "; a busy registry or a large request may need a longer --timeout"
            elif isinstance(e, errors.Unavailable) and settings is not None:
                message = f"registry {settings.registry} unavailable: {message}"
            _fail(ctx, message, e.exit_code)
        except BrokenPipeError:
            # The reader of our stdout went away (`baton watch | head`): stop quietly,
            # and keep Python from complaining while it flushes stdout at exit.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            ctx.exit(1)
        except OSError as e:
            _fail(ctx, str(e), 1)


def _one_line(e: errors.BatonError) -> str:
    lines = e.message.strip().splitlines() or [type(e).__name__]
    log_path = getattr(e, "log_path", None)
    if len(lines) > 1 and log_path:
        return f"{lines[0]} (see {log_path})"
    return lines[0]


def _fail(ctx: click.Context, message: str, code: int) -> None:
    click.echo(f"baton: {message}", err=True)
    ctx.exit(code)


def default_agent() -> str:
    """``hostname-pid``, reduced to the characters an agent name may hold."""
    name = re.sub(r"[^A-Za-z0-9._-]", "-", f"{socket.gethostname()}-{os.getpid()}")
    return name.lstrip("._-")[:128] or f"agent-{os.getpid()}"


def parse_session_id(ctx: click.Context, param: click.Parameter, value: str) -> int:
    """A session (etcd lease) id: decimal as ``claim`` prints it, or ``0x``-hex as logged."""
    text = value.strip().lower()
    try:
        number = int(text, 16) if text.startswith("0x") else int(text, 10)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a session id (decimal, or hex with 0x)",
                                 ctx, param) from None
    if number <= 0:
        raise click.BadParameter(f"{value!r} is not a session id (must be positive)", ctx, param)
    return number


def output_option(f: F) -> F:
    return click.option(
        "-o", "--output", type=click.Choice(["table", "json"]), default="table",
        show_default=True, help="table: for people; json: for scripts",
    )(f)  # fmt: skip


def agent_option(f: F) -> F:
    return click.option(
        "--agent", envvar="BATON_AGENT", show_envvar=True, default=default_agent,
        show_default="HOSTNAME-PID", help="agent name recorded as the owner",
    )(f)  # fmt: skip


def ttl_option(f: F) -> F:
    return click.option(
        "--ttl", type=click.IntRange(2, 3600), default=60, show_default=True,
        help="seconds the session (and its claim) lives unless kept alive",
    )(f)  # fmt: skip


def slots_option(f: F) -> F:
    return click.option(
        "--slots", type=click.IntRange(0, 10_000), default=0, show_default=True,
        help="claims the session may hold at once (0: no limit)",
    )(f)  # fmt: skip


def as_dict(msg: Message) -> dict[str, Any]:
    """A message as JSON-ready data: proto field names, every field, numbers as numbers,
    and enum values by the short names the tables show (:func:`enum_name`)."""
    from google.protobuf import json_format

    data = json_format.MessageToDict(
        msg,
        preserving_proto_field_name=True,
        always_print_fields_with_no_presence=True,
        unquote_int64_if_possible=True,
        use_integers_for_enums=True,
    )
    _name_enums(cast("Descriptor", msg.DESCRIPTOR), data)
    return data


def enum_name(enum: EnumDescriptor, number: int) -> str | int:
    """An enum value as people read it (``verified``, ``active``, ``snapshot``): the
    wire's name (``ENTRY_STATE_VERIFIED``) without its enum's prefix, in lower case,
    as ``kernel.names`` gives it to the tables. The unspecified value keeps its prefix
    (``entry_state_unspecified``); a number this client does not know stays a number."""
    value = enum.values_by_number.get(number)
    if value is None:
        return number
    prefix = re.sub(r"(?<!^)(?=[A-Z])", "_", enum.name).upper() + "_"
    return value.name.removeprefix(prefix).lower() if number else value.name.lower()


def _name_enums(descriptor: Descriptor, data: dict[str, Any]) -> None:
    """Replace, in ``data`` (``descriptor``'s message as MessageToDict made it with
    integer enums), every enum number by :func:`enum_name`."""
    for fd in descriptor.fields:
        if fd.name not in data:
            continue
        value = data[fd.name]
        if fd.enum_type is not None:
            if isinstance(value, list):
                data[fd.name] = [enum_name(fd.enum_type, v) for v in value]
            else:
                data[fd.name] = enum_name(fd.enum_type, value)
            continue
        message = fd.message_type
        if message is None or message.full_name.startswith("google.protobuf."):
            continue  # well-known types (Timestamp, Struct) have their own JSON
        if message.GetOptions().map_entry:
            entry_value = message.fields_by_name["value"]
            if entry_value.enum_type is not None:
                data[fd.name] = {k: enum_name(entry_value.enum_type, v)
                                    for k, v in value.items()}
            elif (entry_value.message_type is not None
                  and not entry_value.message_type.full_name.startswith("google.protobuf.")):
                for item in value.values():
                    _name_enums(entry_value.message_type, item)
        elif isinstance(value, list):
            for item in value:
                _name_enums(message, item)
        elif isinstance(value, dict):
            _name_enums(message, value)


def emit_json(data: Any) -> None:
    click.echo(json.dumps(data))


def folding_table(*columns: str, whole: tuple[str, ...] = (),
                  min_widths: dict[str, int] | None = None) -> Table:
    """A table whose cells wrap (long words fold) when the terminal is narrow,
    rather than being cut short with an ellipsis; ``whole`` columns never wrap."""
    from rich.table import Table

    table = Table()
    for name in columns:
        min_width = (min_widths or {}).get(name)
        if name in whole:
            table.add_column(name, no_wrap=True, min_width=min_width)
        else:
            table.add_column(name, overflow="fold", min_width=min_width)
    return table


#: the widest a table printed to a pipe or file may get
MAX_PIPE_WIDTH = 1000


def emit_table(table: RenderableType) -> None:
    """Print a table (or a group of them): fitted to a terminal; at its natural width
    into a pipe or file (unless COLUMNS says otherwise), so each row stays one line
    for grep."""
    from rich.console import Console

    console = Console(soft_wrap=False)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        natural = Console(width=MAX_PIPE_WIDTH).measure(table).maximum
        console = Console(soft_wrap=False, width=max(natural, 1))
    console.print(table)


def err_console() -> Console:
    from rich.console import Console

    return Console(stderr=True)


def state_name(state: int) -> str:
    from ...kernel import names  # loads the stubs: only commands that show entries

    return names.state_name(state)


def status_name(status: int) -> str:
    from ...kernel import names

    return names.status_name(status)


def session_json(session_id: int) -> str:
    # A string, as ProtoJSON writes int64: lease ids exceed 2**53 and jq 1.6 would
    # round them to a different, dead lease.
    return str(session_id)


def entry_summary(entry: pb.Entry) -> str:
    from ...kernel.v1 import baton_pb2 as pb

    text = f"{entry.task_id}/{entry.file_id}: {state_name(entry.state)}"
    if entry.state in (pb.ENTRY_STATE_PENDING, pb.ENTRY_STATE_DEAD) and entry.retry_count:
        text += f" (retry {entry.retry_count}/{entry.max_retries})"
    if entry.state in (pb.ENTRY_STATE_WRITTEN, pb.ENTRY_STATE_VERIFIED, pb.ENTRY_STATE_CONSUMED):
        text += f", {entry.size} bytes"
    if entry.consumed_by:
        text += f", acked by {', '.join(entry.consumed_by)}"
    if entry.error and entry.state in (pb.ENTRY_STATE_PENDING, pb.ENTRY_STATE_DEAD):
        text += f"; last error: {entry.error}"
    return text


def emit_entry(entry: pb.Entry, output: str) -> None:
    if output == "json":
        emit_json(as_dict(entry))
    else:
        click.echo(entry_summary(entry))


@contextmanager
def progress_reader(f: BinaryIO, total: int, description: str) -> Iterator[BinaryIO]:
    """``f``, with a progress bar on stderr for large reads in a terminal."""
    console = err_console()
    if total < PROGRESS_MIN_BYTES or not console.is_terminal:
        yield f
        return
    import rich.progress

    with rich.progress.wrap_file(f, total, description=description, console=console,
                                 transient=True) as wrapped:
        yield wrapped


def hash_file(path: Path) -> tuple[int, str]:
    """Size and BLAKE3 hex digest of what was read from ``path``."""
    import blake3

    total = path.stat().st_size
    threads = blake3.blake3.AUTO if total >= PARALLEL_HASH_MIN_BYTES else 1
    digest, size = blake3.blake3(max_threads=threads), 0
    with path.open("rb") as f, progress_reader(f, total, f"hashing {path.name}") as src:
        while chunk := src.read(CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def close_quietly(client: Client, session: Session) -> None:
    """Revoke a session whose claim failed; the command's own error is what matters."""
    with suppress(errors.BatonError):
        client.close_session(session.session_id)


def session_line(session: Session) -> str:
    return (f"session  {session.session_id}  (ttl {session.ttl} s; extend with "
            f"`baton keepalive {session.session_id}`)")


# --- the group ------------------------------------------------------------------


EXIT_STATUS = ("Exit status: 0 ok, 1 other error, 2 invalid input or usage, 3 nothing to "
               "claim or consume, or the session's slots are full, 4 refused (stale token, "
               "illegal transition, exists, session expired, task not active), 5 not found, "
               "6 registry unavailable, or no reply within --timeout, 7 permission denied (the "
               "identity's role or the task's access rules), 8 the session's host is "
               "drained (no new work).")

