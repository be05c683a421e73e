"""Type-check Baton as the package it is, whatever its checkout's folder is called.

The repository's root is the package ``baton_relay`` (pyproject's ``package-dir``), so a
checker that names modules after folders would call them ``CHECKOUT.kernel.errors`` and
refuse a checkout folder that is not an identifier (``git clone URL baton-relay``). This
runs mypy (strict, configured in pyproject.toml) on a temporary folder where the
checkout is reachable as ``baton_relay``: the modules get their real names.

    python scripts/typecheck.py [MYPY ARGS...]
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str]) -> int:
    config = ROOT / "pyproject.toml"
    files = tomllib.loads(config.read_text())["tool"]["mypy"]["files"]
    with tempfile.TemporaryDirectory(prefix="baton-typecheck-") as tmp:
        (Path(tmp) / "baton_relay").symlink_to(ROOT, target_is_directory=True)
        cache = ROOT / ".mypy_cache"
        return subprocess.call(
            [sys.executable, "-m", "mypy", "--config-file", str(config),
             "--cache-dir", str(cache), *argv,
             *(f"baton_relay/{f}" for f in files)],
            cwd=tmp, env={**os.environ, "MYPY_FORCE_COLOR": os.environ.get(
                "MYPY_FORCE_COLOR", "0")})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
