"""The registry's configuration: flags, ``BATON_*`` variables, an optional TOML file.

Precedence: flag > environment > TOML file > default. Every flag ``--some-name``
has the variable ``BATON_SOME_NAME`` and the TOML key ``some_name``. This is
the only place that reads the environment.
"""

from __future__ import annotations

import argparse
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class RegistryConfig:
    etcd: str = "127.0.0.1:2379"
    listen: str = "127.0.0.1:7390"
    staging: str = "/var/lib/baton/staging"
    prefix: str = "/baton/v1/"
    reap_interval: float = 0.5
    grace: float = 10.0
    log_level: str = "INFO"


_HELP = {
    "etcd": "etcd endpoint host:port, or several (members of one cluster) joined by commas",
    "listen": "gRPC address to serve on (port 0 = pick one)",
    "staging": "staging root; a task's files live under STAGING/TASK/",
    "prefix": "etcd key prefix (start and end with '/')",
    "reap_interval": "seconds between sweeps for claims whose lease died",
    "grace": "seconds in-flight calls get to finish on SIGTERM",
    "log_level": "DEBUG, INFO, WARNING or ERROR",
}


def load_config(argv: Sequence[str], environ: Mapping[str, str]) -> RegistryConfig:
    """Build the configuration from the command line and environment (pure)."""
    parser = argparse.ArgumentParser(
        prog="baton-registry",
        description="Baton registry: the gRPC server that owns the entry state machine.",
    )
    parser.add_argument("--config", type=Path, default=environ.get("BATON_CONFIG"),
                        help="TOML file with any of the settings below (BATON_CONFIG)")
    for f in fields(RegistryConfig):
        flag = "--" + f.name.replace("_", "-")
        env = "BATON_" + f.name.upper()
        parser.add_argument(flag, dest=f.name, default=None,
                            help=f"{_HELP[f.name]} (${env}, default {f.default})")
    args = parser.parse_args(list(argv))
    from_file: dict[str, Any] = {}
    if args.config:
        try:
            from_file = tomllib.loads(Path(args.config).read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            parser.error(f"cannot read config {args.config}: {e}")
        unknown = set(from_file) - {f.name for f in fields(RegistryConfig)}
        if unknown:
            parser.error(f"unknown settings in {args.config}: {', '.join(sorted(unknown))}")
    values: dict[str, Any] = {}
    for f in fields(RegistryConfig):
        raw = getattr(args, f.name)
        if raw is None:
            raw = environ.get("BATON_" + f.name.upper())
        if raw is None:
            raw = from_file.get(f.name)
        if raw is None:
            continue
        try:
            kind: type[Any] = type(f.default)
            values[f.name] = kind(raw)
        except ValueError:
            parser.error(f"{f.name}: {raw!r} is not a valid {type(f.default).__name__}")
    return RegistryConfig(**values)
