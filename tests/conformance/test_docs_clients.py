"""The TypeScript examples of README.md and docs/clients.md run as written, with node,
against the suite's ``baton up`` stack: the README's agent (also docs/clients.md's
first example), then docs/clients.md's loops over the rest of the task."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from conformance_stack import Stack
from test_conformance import ROOT, TS_DRIVER

from baton_relay.kernel.names import state_name

TS_BLOCK = re.compile(r"^```ts\n(.*?)^```", re.S | re.M)
#: the lines the loop example runs after (its session `s`, as the first example opens it)
LOOP_PRELUDE = """\
import { connect, consumeEach, produceEach } from "@baton-relay/client";
const client = connect();
const s = await client.openSession("ocr-2", { ttl: 10 });
"""
LOOP_END = "await s.close();\nclient.close();\n"


def ts_blocks(path: Path) -> list[str]:
    return [m.group(1) for m in TS_BLOCK.finditer(path.read_text())]


def run_node(stack: Stack, workdir: Path, name: str, source: str) -> str:
    """``source`` as an ES module beside a node_modules holding the package, run by node
    with the operator's settings; its stdout."""
    script = workdir / name
    script.write_text(source)
    node = shutil.which("node")
    assert node, "node is not on PATH"
    done = subprocess.run([node, str(script)], cwd=workdir, capture_output=True, text=True,
                          timeout=120, env={"PATH": "/usr/bin:/bin",
                                            **stack.identity("operator")}, check=False)
    assert done.returncode == 0, f"{name} failed:\n{source}\n--- stderr\n{done.stderr}"
    return done.stdout


def test_the_typescript_examples_run_as_written(stack: Stack, tmp_path: Path) -> None:
    """The README's TypeScript agent produces `c` and consumes the first verified
    entry; docs/clients.md shows the same agent, then its loops produce and consume
    the rest: every entry of the task ends consumed."""
    assert TS_DRIVER.exists(), "the TypeScript client is not built: run `make ts-client`"
    readme = ts_blocks(ROOT / "README.md")
    docs = ts_blocks(ROOT / "docs" / "clients.md")
    assert len(readme) == 1 and len(docs) == 2
    assert docs[0] == readme[0], "docs/clients.md's first example is the README's agent"
    modules = tmp_path / "node_modules" / "@baton-relay"
    modules.mkdir(parents=True)
    (modules / "client").symlink_to(ROOT / "clients" / "typescript")
    with stack.operator() as op:
        op.operator.create_task({"task_id": "hello", "entries": [
            {"file_id": "a", "path": "a.txt"}, {"file_id": "b", "path": "b.txt"},
            {"file_id": "c", "path": "c.txt"}]})
        first = run_node(stack, tmp_path, "agent.mjs", readme[0]).split()
        assert first == ["c", "5"], first  # the only verified entry is the one it made
        looped = run_node(stack, tmp_path, "loops.mjs", LOOP_PRELUDE + docs[1] + LOOP_END)
        assert sorted(line.split()[0] for line in looped.splitlines()) == ["a", "b"], looped
        states = {e.file_id: state_name(e.state) for e in op.operator.list_entries("hello")}
    assert states == {"a": "consumed", "b": "consumed", "c": "consumed"}


def test_the_typescript_clients_own_stack_tests_pass(stack: Stack) -> None:
    """The TypeScript client's tests that need a registry (clients/typescript/test/
    stack.test.ts, skipped by `make test-ts`, which has none) run against the suite's
    stack, none skipped, none failed."""
    compiled = ROOT / "clients" / "typescript" / "dist" / "test" / "stack.test.js"
    assert compiled.exists(), "the TypeScript client is not built: run `make ts-client`"
    node = shutil.which("node")
    assert node, "node is not on PATH"
    done = subprocess.run([node, "--test", str(compiled)], capture_output=True, text=True,
                          timeout=300, check=False, cwd=compiled.parent,
                          env={"PATH": "/usr/bin:/bin", **stack.identity("operator")})
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    counts = dict(re.findall(r"^# (pass|fail|skipped) (\d+)$", done.stdout, re.M))
    assert counts.get("fail") == "0" and counts.get("skipped") == "0", done.stdout[-2000:]
    assert int(counts.get("pass", "0")) >= 4, done.stdout[-2000:]
