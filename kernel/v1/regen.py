"""Regenerate the committed stubs from the contract, ``kernel/proto/baton/v1/baton.proto``.

Run ``python -m baton_relay.kernel.v1.regen`` from the repository root after editing the
contract; ``tests/unit/test_contract.py`` fails while the committed stubs are stale.
Needs the ``dev`` extra (grpcio-tools, mypy-protobuf).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

#: this folder, where the stubs live
HERE = Path(__file__).resolve().parent
#: the contract's root, laid out by its package's path as the ecosystem does (buf
#: checks it there): the descriptor's file name is baton/v1/baton.proto in every
#: process's protobuf pool
PROTO_ROOT = HERE.parent / "proto"
VIRTUAL = "baton/v1"


def generate(out_dir: Path) -> None:
    """Write baton_pb2.py, baton_pb2.pyi and baton_pb2_grpc.py into ``out_dir``; the
    gRPC module imports the messages relatively, so the stubs work wherever the package
    is (as baton_relay.kernel.v1, installed or in the repository)."""
    from grpc_tools import protoc  # dev-only dependency

    # protoc finds the mypy plugin on PATH; it lives beside this interpreter.
    bindir = os.path.dirname(sys.executable)
    os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={tmp}",
            f"--grpc_python_out={tmp}",
            f"--mypy_out={tmp}",
            f"{VIRTUAL}/baton.proto",
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        out_dir.mkdir(parents=True, exist_ok=True)
        made = Path(tmp) / VIRTUAL
        for name in ("baton_pb2.py", "baton_pb2.pyi", "baton_pb2_grpc.py"):
            text = (made / name).read_text()
            text = text.replace(f"from {VIRTUAL.replace('/', '.')} import baton_pb2",
                                "from . import baton_pb2")
            (out_dir / name).write_text(text)


if __name__ == "__main__":
    generate(HERE)
    sys.stdout.write("regenerated the kernel's v1 stubs\n")
