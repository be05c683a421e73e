"""The baton-registry process: health, reflection, config, graceful SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from registry_fixtures import allow_suite_etcd

from baton_relay.kernel.contract import SERVICES
from baton_relay.registry.edge.config import RegistryConfig, load_config


def test_config_precedence_flag_env_file(tmp_path: Path) -> None:
    """A flag beats BATON_* which beats the TOML file which beats the default."""
    toml = tmp_path / "r.toml"
    toml.write_text('etcd = "file:1"\nstaging = "/from/file"\nreap_interval = 2.5\n')
    cfg = load_config(["--config", str(toml), "--etcd", "flag:1"],
                      {"BATON_ETCD": "env:1", "BATON_STAGING": "/from/env"})
    assert (cfg.etcd, cfg.staging, cfg.reap_interval) == ("flag:1", "/from/env", 2.5)
    assert cfg.listen == RegistryConfig().listen


def test_config_rejects_unknown_keys_and_bad_values(tmp_path: Path) -> None:
    """Typos in the TOML file and non-numbers for numbers are usage errors."""
    toml = tmp_path / "r.toml"
    toml.write_text('etcdd = "x"\n')
    with pytest.raises(SystemExit):
        load_config(["--config", str(toml)], {})
    with pytest.raises(SystemExit):
        load_config([], {"BATON_REAP_INTERVAL": "soon"})


def test_registry_process_serves_health_and_stops_on_sigterm(etcd: Any, prefix: str,
                                                              tmp_path: Path) -> None:
    """The daemon reports SERVING, exposes reflection, and exits 0 on SIGTERM."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "baton_relay.registry", "--insecure", "--etcd", etcd.endpoint,
         *allow_suite_etcd(), "--listen",
         "127.0.0.1:0", "--staging", str(tmp_path), "--prefix", prefix],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("baton-registry listening on "), line
        address = line.split()[-1]
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for service in ("", "baton.v1.Registry", *SERVICES):
                reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            refl = reflection_pb2_grpc.ServerReflectionStub(channel)
            answers = refl.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
            names = {s.name for a in answers for s in a.list_services_response.service}
            assert set(SERVICES) <= names
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_background_task_that_ignores_the_stop_is_cancelled_and_named(
    registry_factory: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """A stop always ends: a background task still running ``STOP_TIMEOUT`` after the
    stop was asked (here one that never looks) is cancelled, and the log names it."""
    import asyncio
    import logging
    import time

    from baton_relay.registry.edge import server

    monkeypatch.setattr(server, "STOP_TIMEOUT", 0.5)
    handle = registry_factory()
    cancelled: list[bool] = []

    async def stubborn_sweep() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def add() -> None:
        handle._running._background.append(asyncio.create_task(stubborn_sweep()))

    asyncio.run_coroutine_threadsafe(add(), handle._loop).result(timeout=10)
    caplog.set_level(logging.WARNING, logger="baton.registry")
    started = time.monotonic()
    handle.stop()
    assert time.monotonic() - started < 20
    assert cancelled == [True]
    assert any("stubborn_sweep" in r.getMessage() and "cancelled" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
