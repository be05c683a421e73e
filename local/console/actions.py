"""The console's actions: what each touches, shown before it is done, and the call it
makes as the operator's own (with the reason and evidence the registry keeps)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ...client._client import Client
from ...kernel import errors
from ...kernel.names import state_name, status_name
from ...kernel.v1 import baton_pb2 as pb


@dataclass(frozen=True)
class Action:
    title: str
    fields: tuple[str, ...]
    back: Callable[[dict[str, str]], str]


ACTIONS: dict[str, Action] = {
    "pause": Action("Pause task", ("task_id",), lambda a: f"/tasks/{a['task_id']}"),
    "resume": Action("Resume task", ("task_id",), lambda a: f"/tasks/{a['task_id']}"),
    "cancel": Action("Cancel task", ("task_id",), lambda a: f"/tasks/{a['task_id']}"),
    "requeue": Action("Requeue entry", ("task_id", "file_id"),
                      lambda a: f"/tasks/{a['task_id']}/entries/{a['file_id']}"),
    "requeue-dead": Action("Requeue every dead entry", ("task_id",),
                           lambda a: f"/tasks/{a['task_id']}"),
    "replay-group": Action("Hand one consumer group its entries again", ("task_id", "group"),
                           lambda a: f"/tasks/{a['task_id']}"),
    "revoke": Action("Revoke session", ("session_id",), lambda a: "/sessions"),
    "drain": Action("Drain host", ("host",), lambda a: "/sessions"),
    "move": Action("Move shard", ("shard", "to_watcher"), lambda a: "/watchers"),
}


def impact(c: Client, name: str, args: dict[str, str]) -> tuple[list[str], str]:
    """What the action touches, in lines, before it is done (or what stops it)."""
    try:
        if name in ("pause", "resume", "cancel"):
            task = c.operator.get_task(args["task_id"])
            agents = c.operator.list_agents()
            holding = [a for a in agents if any(k.task_id == args["task_id"]
                                                for k in a.claims)]
            claims = sum(1 for a in holding for k in a.claims
                         if k.task_id == args["task_id"])
            return [f"task {args['task_id']} is {status_name(task.status)}",
                    f"{task.open} open entries of {task.entry_count}",
                    f"{claims} claims held by {len(holding)} sessions"
                    + (" (cancel revokes them)" if name == "cancel" else "")], ""
        if name == "requeue":
            entry = c.operator.get_entry(args["task_id"], args["file_id"])
            return [f"1 entry: {entry.file_id} is {state_name(entry.state)}"
                    + (f" ({entry.error})" if entry.error else "")], ""
        if name == "requeue-dead":
            dead = c.operator.list_entries(args["task_id"], pb.ENTRY_STATE_DEAD)
            return [f"{len(dead)} dead entries go back to pending"], ""
        if name == "replay-group":
            task = c.operator.get_task(args["task_id"])
            if args["group"] not in task.spec.consumers:
                return [], (f"{args['group']!r} is not a consumer group of task "
                            f"{args['task_id']} ({', '.join(task.spec.consumers) or 'none'})")
            acked = task.consumed_by_group.get(args["group"], 0)
            others = [g for g in task.spec.consumers if g != args["group"]]
            return [f"the {acked} entries {args['group']} acked go back to it (those whose "
                    "file is still in staging)",
                    f"the other groups ({', '.join(others) or 'none'}) are not handed "
                    "them again"], ""
        if name == "revoke":
            agent = _agent(c.operator.list_agents(), int(args["session_id"]))
            return [f"1 session: {agent.agent} on {agent.host}",
                    f"{len(agent.claims)} claims go back now"], ""
        if name == "drain":
            agents = [a for a in c.operator.list_agents() if a.host == args["host"]]
            return [f"{len(agents)} sessions on {args['host']} take no new work",
                    f"{sum(len(a.claims) for a in agents)} claims they hold are revoked "
                    "at the deadline"], ""
        if name == "move":
            shards = c.operator.list_shards()
            shard = next((s for s in shards.shards if s.shard == int(args["shard"])), None)
            if shard is None:
                return [], f"no shard {args['shard']}"
            return [f"shard {shard.shard}: {shard.tasks} tasks, owner "
                    f"{shard.owner or 'nobody'} (epoch {shard.epoch}) → "
                    f"{args['to_watcher']}"], ""
    except errors.NotFound:
        raise  # nothing to confirm: the console answers 404, as for a page of it
    except (errors.BatonError, ValueError) as e:
        return [], str(e)
    return [], ""


def _agent(agents: list[pb.AgentInfo], session_id: int) -> pb.AgentInfo:
    for a in agents:
        if a.session_id == session_id:
            return a
    raise errors.NotFound(f"no session {session_id:x}")


def perform(c: Client, name: str, args: dict[str, str], reason: str, evidence: str) -> str:
    """Send the action as the operator's own call; a line saying what it did."""
    if name in ("pause", "resume", "cancel"):
        call = {"pause": c.operator.pause_task, "resume": c.operator.resume_task,
                "cancel": c.operator.cancel_task}
        task = call[name](args["task_id"], reason, evidence)
        return f"task {args['task_id']} is {status_name(task.status)}"
    if name == "requeue":
        entry = c.operator.requeue(args["task_id"], args["file_id"], reason=reason,
                                   evidence=evidence)
        return f"{entry.file_id} is {state_name(entry.state)}"
    if name == "requeue-dead":
        dead = c.operator.list_entries(args["task_id"], pb.ENTRY_STATE_DEAD)
        for e in dead:
            c.operator.requeue(args["task_id"], e.file_id, reason=reason, evidence=evidence)
        return f"{len(dead)} dead entries requeued"
    if name == "replay-group":
        replayed = c.operator.replay_task(args["task_id"], args["group"], reason=reason,
                                          evidence=evidence)
        return f"{replayed} entries handed to group {args['group']} again"
    if name == "revoke":
        done = c.operator.revoke_sessions(int(args["session_id"]), reason=reason, evidence=evidence)
        return "; ".join(f"session {s.session_id:x} of {s.agent} revoked, "
                         f"{s.claims_returned} claims returned" for s in done) or \
            "the session was already gone"
    if name == "drain":
        drained = c.operator.drain_host(args["host"], reason=reason, evidence=evidence)
        return (f"{drained.host} draining until {drained.deadline}: {drained.sessions} "
                f"sessions, {drained.claims} claims")
    if name == "move":
        shard = c.operator.move_shard(int(args["shard"]), args["to_watcher"], reason=reason,
                                      evidence=evidence)
        return f"shard {shard.shard}: owner {shard.owner}, moving to {shard.moving_to or '-'}"
    raise errors.InvalidArgument(f"unknown action {name!r}")
