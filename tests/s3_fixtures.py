"""A real S3-compatible server for tests: moto's standalone server, one process.

Each test gets a bucket of its own on the one session-wide server; boto3 finds the
server's (fake) credentials in the environment, as a deployment's would be found.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "baton-test", "AWS_SECRET_ACCESS_KEY": "baton-test",
               "AWS_DEFAULT_REGION": "us-east-1"}


@dataclass
class S3Server:
    process: subprocess.Popen[bytes]
    endpoint: str

    def client(self) -> Any:
        import boto3
        from botocore.config import Config
        return boto3.client("s3", endpoint_url=self.endpoint,
                            config=Config(retries={"max_attempts": 1}))

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def start_s3_server(port: int = 0) -> S3Server:
    """Start ``moto_server`` and wait (with a deadline) until it answers."""
    port = port or free_port()
    exe = shutil.which("moto_server", path=os.path.dirname(sys.executable)) \
        or shutil.which("moto_server")
    if exe is None:
        raise RuntimeError("moto_server is not installed (pip install 'moto[server]')")
    process = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = S3Server(process, f"http://127.0.0.1:{port}")
    deadline = time.monotonic() + 30
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"moto_server exited with {process.returncode}")
        try:
            with urllib.request.urlopen(f"{server.endpoint}/moto-api/", timeout=1):
                return server
        except (urllib.error.URLError, OSError):
            if time.monotonic() > deadline:
                server.stop()
                raise RuntimeError("moto_server did not answer within 30 s") from None
            time.sleep(0.1)  # polling a process that has not bound its port yet


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """One S3 server for the session."""
    saved = {k: os.environ.get(k) for k in CREDENTIALS}
    os.environ.update(CREDENTIALS)
    server = start_s3_server()
    try:
        yield server
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def bucket(s3_server: S3Server) -> str:
    """A fresh bucket of this test's own."""
    name = f"baton-{secrets.token_hex(6)}"
    s3_server.client().create_bucket(Bucket=name)
    return name


def keys(server: S3Server, bucket: str, prefix: str = "") -> list[str]:
    """Every object under ``prefix`` in ``bucket``, paged."""
    out: list[str] = []
    for page in server.client().get_paginator("list_objects_v2").paginate(
            Bucket=bucket, Prefix=prefix):
        out.extend(o["Key"] for o in page.get("Contents", ()))
    return sorted(out)
