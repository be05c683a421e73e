"""A ``baton up`` stack for the conformance suite: etcd, the registry with mutual TLS, a
watcher, in a directory of its own, with a second agent identity issued from its CA."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from baton_relay.client import Client
from baton_relay.local.etcdproc import free_port

#: the identity the suite issues beside `baton up`'s own (operator, agent, watcher)
ISSUED = "pipeline-1"


class Stack:
    """A ``baton up`` stack in a directory of its own, for the module."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.address = f"127.0.0.1:{free_port()}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("BATON_")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "baton_relay.client.cli", "up",
             "--data-dir", str(data_dir), "--etcd-port", str(free_port()),
             "--registry-port", self.address.rsplit(":", 1)[1]],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
            start_new_session=True)
        self.output: list[str] = []
        ready = threading.Event()

        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.output.append(line)
                if line.startswith("ready"):
                    ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(120):
            self.stop()
            raise RuntimeError("baton up did not say ready within 120 s:\n"
                               + "".join(self.output[-40:]))
        self.pki = data_dir / "pki"
        subprocess.run(
            [sys.executable, "-m", "baton_relay.client.cli", "cert", "issue",
             "--role", "agent", "--name", ISSUED, "--pki", str(self.pki),
             "--out", str(data_dir / "ids")],
            check=True, capture_output=True, env=env, timeout=60)

    def identity(self, name: str) -> dict[str, str]:
        where = self.data_dir / "ids" if name == ISSUED else self.pki
        return {"BATON_REGISTRY": self.address, "BATON_CA": str(self.pki / "ca.crt"),
                "BATON_CERT": str(where / f"{name}.crt"),
                "BATON_KEY": str(where / f"{name}.key")}

    def operator(self) -> Client:
        ids = self.identity("operator")
        return Client(self.address, ca=ids["BATON_CA"], cert=ids["BATON_CERT"],
                      key=ids["BATON_KEY"])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
