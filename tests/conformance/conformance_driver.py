"""The Python client's conformance driver (tests/conformance/PROTOCOL.md): agent
operations done with ``baton_relay.client``'s public asyncio API, one JSON object per
line on standard input, each answered by its id on standard output.

    BATON_REGISTRY=... BATON_CA=... BATON_CERT=... BATON_KEY=... \\
        python tests/conformance/conformance_driver.py
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from baton_relay.client import (
    AsyncClient,
    AsyncSession,
    PermanentError,
    aconsume,
    anext_lease,
    aproduce,
)
from baton_relay.kernel.contract import DEFAULT_REGISTRY
from baton_relay.kernel.errors import BatonError
from baton_relay.kernel.names import state_name, status_name
from baton_relay.kernel.v1 import baton_pb2 as pb

Op = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


def _checkpoint(c: pb.Checkpoint | None) -> dict[str, Any] | None:
    if c is None:
        return None
    return {"data": c.data.decode(), "progress": c.progress}


class Driver:
    """One actor: a client, and the session it opens."""

    def __init__(self) -> None:
        self.client = AsyncClient(os.environ.get("BATON_REGISTRY") or DEFAULT_REGISTRY)
        self._session: AsyncSession | None = None
        self.ops: dict[str, Op] = {
            name.removeprefix("op_"): getattr(self, name)
            for name in dir(self) if name.startswith("op_")
        }

    @property
    def session(self) -> AsyncSession:
        if self._session is None:
            raise RuntimeError("no session: send `open` first")
        return self._session

    async def op_open(self, a: dict[str, Any]) -> dict[str, Any]:
        self._session = await self.client.open_session(a["agent"], ttl=int(a["ttl"]))
        return {"session_id": self._session.session_id}

    async def op_close(self, a: dict[str, Any]) -> dict[str, Any]:
        session, self._session = self.session, None
        await session.close()
        return {}

    async def op_claim(self, a: dict[str, Any]) -> dict[str, Any]:
        c = await self.session.claim(a["task"], a.get("file_id", ""))
        return {"file_id": c.file_id, "token": c.token, "path": c.path,
                "attempt": c.attempt, "checkpoint": _checkpoint(c.checkpoint)}

    async def op_commit(self, a: dict[str, Any]) -> dict[str, Any]:
        entry = await self.session.commit(a["task"], a["file_id"], int(a["token"]),
                                          int(a["size"]), a["digest"])
        return {"state": state_name(entry.state)}

    async def op_fail(self, a: dict[str, Any]) -> dict[str, Any]:
        entry = await self.session.fail(a["task"], a["file_id"], int(a["token"]),
                                        a.get("reason", ""),
                                        permanent=bool(a.get("permanent", False)),
                                        delay=float(a.get("delay", 0)))
        return {"state": state_name(entry.state)}

    async def op_checkpoint(self, a: dict[str, Any]) -> dict[str, Any]:
        await self.session.checkpoint(a["task"], a["file_id"], int(a["token"]),
                                      data=a.get("data", "").encode(),
                                      progress=float(a.get("progress", 0)))
        return {}

    async def op_produce(self, a: dict[str, Any]) -> dict[str, Any]:
        data = a.get("data", "").encode()
        fail = a.get("raise", "")
        async with aproduce(self.session, a["task"], a.get("file_id", ""),
                            wait=float(a.get("wait", 0))) as out:
            await out.write(data)
            if fail == "permanent":
                raise PermanentError("the driver was asked to fail for good")
            if fail:
                raise RuntimeError("the driver was asked to fail")
        assert out.entry is not None
        return {"file_id": out.claim.file_id, "token": out.claim.token, "size": out.size,
                "digest": out.digest, "state": state_name(out.entry.state)}

    async def op_consume(self, a: dict[str, Any]) -> dict[str, Any]:
        async with aconsume(self.session, a["task"], a.get("group", "default"),
                            timeout=float(a.get("timeout", 10))) as got:
            file_id, data = got.lease.file_id, got.data
        entry = await self.client.get_entry(a["task"], file_id)
        return {"file_id": file_id, "data": data.decode(), "state": state_name(entry.state)}

    async def op_lease(self, a: dict[str, Any]) -> dict[str, Any]:
        lease = await anext_lease(self.session, a["task"], a.get("group", "default"),
                                  timeout=float(a.get("timeout", 10)))
        return {"file_id": lease.file_id, "token": lease.token, "digest": lease.digest}

    async def op_ack(self, a: dict[str, Any]) -> dict[str, Any]:
        entry = await self.session.ack(a["task"], a["file_id"], a.get("group", "default"),
                                       int(a["token"]))
        return {"state": state_name(entry.state)}

    async def op_nack(self, a: dict[str, Any]) -> dict[str, Any]:
        entry = await self.session.nack(a["task"], a["file_id"], a.get("group", "default"),
                                        int(a["token"]), delay=float(a.get("delay", 0)),
                                        permanent=bool(a.get("permanent", False)))
        return {"state": state_name(entry.state)}

    async def op_get_task(self, a: dict[str, Any]) -> dict[str, Any]:
        r = await self.client.unary_call("GetTask", pb.GetTaskRequest(task_id=a["task"]))
        return {"task_id": r.task.spec.task_id, "status": status_name(r.task.status)}

    async def op_get_entry(self, a: dict[str, Any]) -> dict[str, Any]:
        entry = await self.client.get_entry(a["task"], a["file_id"])
        return {"state": state_name(entry.state), "retry_count": entry.retry_count}

    async def answer(self, request: dict[str, Any], write: Callable[[dict[str, Any]], None]
                     ) -> None:
        reply: dict[str, Any] = {"id": request.get("id")}
        try:
            op = self.ops.get(request.get("op", ""))
            if op is None:
                raise ValueError(f"no operation {request.get('op')!r}")
            reply["result"] = await op(request.get("args") or {})
        except BatonError as e:
            reply["error"] = {"kind": type(e).__name__, "code": e.code.name,
                              "message": str(e)}
        except Exception as e:  # a helper's own failure, or the driver's
            kind = "PermanentError" if isinstance(e, PermanentError) else "Error"
            reply["error"] = {"kind": kind, "code": "", "message": str(e)}
        write(reply)


async def main() -> None:
    driver = Driver()
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 20)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)

    def write(message: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(message) + "\n")
        sys.stdout.flush()

    write({"ready": True, "client": "python"})
    running: set[asyncio.Task[None]] = set()
    while line := await reader.readline():
        if not line.strip():
            continue
        task = asyncio.ensure_future(driver.answer(json.loads(line), write))
        running.add(task)
        task.add_done_callback(running.discard)
    if running:
        await asyncio.wait(running)
    if driver._session is not None:
        await driver._session.close(revoke=False)
    await driver.client.close()


if __name__ == "__main__":
    asyncio.run(main())
