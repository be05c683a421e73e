"""Regenerate the committed stubs from ``baton.proto``.

Run ``python -m baton_relay.kernel.v1.regen`` from the repository root after editing the
contract; ``tests/test_contract.py`` fails while the committed stubs are stale.
Needs the ``dev`` extra (grpcio-tools, mypy-protobuf).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

#: the import root, the kernel's folder: the contract is compiled as
#: baton_relay/kernel/v1/baton.proto, so the generated modules import each other as
#: baton_relay.kernel.v1
SRC = Path(__file__).resolve().parents[3]
PROTO = "baton_relay/kernel/v1/baton.proto"


def generate(out_dir: Path) -> None:
    """Write baton_pb2.py, baton_pb2.pyi and baton_pb2_grpc.py under
    ``out_dir/baton_relay/kernel/v1``."""
    from grpc_tools import protoc  # dev-only dependency

    # protoc finds the mypy plugin on PATH; it lives beside this interpreter.
    bindir = os.path.dirname(sys.executable)
    os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{SRC}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--mypy_out={out_dir}",
        str(SRC / PROTO),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


if __name__ == "__main__":
    generate(SRC)
    sys.stdout.write("regenerated the kernel's v1 stubs\n")
