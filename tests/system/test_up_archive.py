"""``baton up`` takes the registry's archive options (``--archive-…``), so the archive
can be tried locally as it is deployed: to a directory, or to an S3 store (here moto's
S3 server, a real process) with no hand-written config file."""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner
from s3_fixtures import S3Server, keys
from test_cli import SUBPROCESS_TIMEOUT, Lines, cli_env

from baton_relay.client import Client
from baton_relay.client.cli import cli
from baton_relay.local.etcdproc import free_port
from baton_relay.local.stack import UpOptions, child_specs
from baton_relay.registry.edge.config import RegistryConfig


def test_up_has_every_archive_option_of_the_registry() -> None:
    """Each `--archive-…` setting of the registry is an option of `baton up`."""
    from baton_relay.local.cli import ARCHIVE_OPTIONS

    registry = {f.name for f in dataclasses.fields(RegistryConfig)
                if f.name.startswith("archive_")}
    assert set(ARCHIVE_OPTIONS) == registry


def test_the_archive_options_reach_the_registry(tmp_path: Path) -> None:
    """Given an S3 bucket the stack's registry archives there, not to DATA_DIR/archive;
    given none, to DATA_DIR/archive as before."""
    plain = UpOptions(data_dir=tmp_path, staging=tmp_path / "staging")
    argv = child_specs(plain, "127.0.0.1:1")[0].argv
    assert argv[argv.index("--archive-dir") + 1] == str(tmp_path / "archive")
    s3 = dataclasses.replace(plain, archive=(("archive_s3_bucket", "b"),
                                             ("archive_after", "0.0")))
    argv = child_specs(s3, "127.0.0.1:1")[0].argv
    assert "--archive-dir" not in argv
    assert argv[argv.index("--archive-s3-bucket") + 1] == "b"
    assert argv[argv.index("--archive-after") + 1] == "0.0"


@pytest.mark.parametrize(("args", "says"), [
    (["--archive-dir", "x", "--archive-s3-bucket", "b"], "not both"),
    (["--archive-s3-endpoint", "http://127.0.0.1:9"], "need --archive-s3-bucket"),
])
def test_two_archive_stores_are_a_usage_error(tmp_path: Path, args: list[str],
                                              says: str) -> None:
    """One archive store, not two, and S3 settings only with a bucket: exit 2, one line."""
    result = CliRunner().invoke(cli, ["up", "--data-dir", str(tmp_path), *args],
                                prog_name="baton")
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("baton: up: ") and says in result.stderr
    assert len(result.stderr.splitlines()) == 1


@pytest.mark.slow
def test_up_archives_a_finished_task_to_s3(tmp_path: Path, s3_server: S3Server, bucket: str,
                                           wait_for: Callable[..., None]) -> None:
    """`baton up --archive-s3-bucket B --archive-s3-endpoint URL` archives a finished
    task to that bucket, and lists it as archived."""
    registry_port = free_port()
    address = f"127.0.0.1:{registry_port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "baton_relay.client.cli", "up", "--insecure",
         "--data-dir", str(tmp_path / "data"), "--etcd-port", str(free_port()),
         "--registry-port", str(registry_port), "--archive-s3-bucket", bucket,
         "--archive-s3-endpoint", s3_server.endpoint, "--archive-s3-prefix", "local/",
         "--archive-after", "0", "--archive-interval", "0.2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env(address))
    try:
        Lines(proc).until(lambda line: line.startswith("ready"), timeout=60)
        with Client(address) as c:
            c.operator.create_task({"task_id": "t1",
                                    "entries": [{"file_id": "a", "path": "a.bin"}]})
            c.operator.cancel_task("t1", "tried the archive")
            wait_for(lambda: "local/t1.jsonl.gz" in keys(s3_server, bucket, "local/"),
                     timeout=60, what="the archive in the bucket")
            wait_for(lambda: [t.spec.task_id
                              for t in c.operator.list_tasks(archived=True)] == ["t1"],
                     timeout=30, what="the task listed as archived")
        assert not (tmp_path / "data" / "archive").exists()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=SUBPROCESS_TIMEOUT) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
