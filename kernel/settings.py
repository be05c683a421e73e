"""One way for a daemon to read its settings: flags, ``BATON_*`` variables, a TOML file.

Precedence: flag > environment > TOML file > default. Each field ``some_name`` of a
daemon's frozen settings dataclass is the flag ``--some-name``, the variable
``BATON_SOME_NAME`` and the TOML key ``some_name``; a boolean field is a flag
without a value (and ``1/true/yes/on`` or ``0/false/no/off`` elsewhere). The
registry and the watcher both load theirs with :func:`load`; it reads the
environment only from the mapping it is given.
"""

from __future__ import annotations

import argparse
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _parse(kind: type[Any], raw: Any) -> Any:
    if kind is bool and not isinstance(raw, bool):
        text = str(raw).strip().lower()
        if text not in _TRUE | _FALSE:
            raise ValueError(raw)
        return text in _TRUE
    return kind(raw)


def load(
    cls: type[T],
    argv: Sequence[str],
    environ: Mapping[str, str],
    *,
    prog: str,
    description: str,
    help: Mapping[str, str],
    choices: Mapping[str, Sequence[str]] | None = None,
    positive: Sequence[str] = (),
    not_negative: Sequence[str] = (),
    check: Callable[[argparse.ArgumentParser, dict[str, Any]], None] | None = None,
) -> T:
    """The settings ``cls`` (a dataclass whose every field has a default) from ``argv``,
    ``environ`` and the TOML file of ``--config``/``BATON_CONFIG``; a bad value exits
    with argparse's usage error naming the setting."""
    choices = choices or {}
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", type=Path, default=environ.get("BATON_CONFIG"),
                        help="TOML file with any of the settings below (BATON_CONFIG)")
    names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
    defaults = {f.name: f.default for f in fields(cls)}  # type: ignore[arg-type]
    for name in names:
        flag = "--" + name.replace("_", "-")
        env = "BATON_" + name.upper()
        if isinstance(defaults[name], bool):
            parser.add_argument(flag, dest=name, default=None, action="store_const",
                                const=True, help=f"{help[name]} (${env}=1)")
        else:
            parser.add_argument(flag, dest=name, default=None,
                                help=f"{help[name]} (${env}, default {defaults[name]!r})")
    args = parser.parse_args(list(argv))
    from_file: dict[str, Any] = {}
    if args.config:
        try:
            from_file = tomllib.loads(Path(args.config).read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            parser.error(f"cannot read config {args.config}: {e}")
        unknown = set(from_file) - set(names)
        if unknown:
            parser.error(f"unknown settings in {args.config}: {', '.join(sorted(unknown))}")
    values: dict[str, Any] = {}
    for name in names:
        raw = getattr(args, name)
        if raw is None:
            raw = environ.get("BATON_" + name.upper())
        if raw is None:
            raw = from_file.get(name)
        if raw is None:
            continue
        kind: type[Any] = type(defaults[name])
        try:
            value = _parse(kind, raw)
        except ValueError:
            parser.error(f"{name}: {raw!r} is not a valid {kind.__name__}")
        if name in choices and value not in choices[name]:
            parser.error(f"{name}: {value!r} is not one of {', '.join(choices[name])}")
        if name in positive and value <= 0:
            parser.error(f"{name}: must be positive, not {value!r}")
        if name in not_negative and value < 0:
            parser.error(f"{name}: must be 0 or more, not {value!r}")
        values[name] = value
    if check is not None:
        check(parser, values)
    return cls(**values)
