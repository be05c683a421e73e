/** The short names of entry states and task statuses: `verified`, `active`, ... */
import { EntryState, TaskStatus } from "./gen/baton/v1/baton_pb.js";

/** An entry state's short name (`pending`, `verified`, `dead`, ...). */
export function entryStateName(state: EntryState): string {
  return state ? (EntryState[state] ?? String(state)).toLowerCase() : "entry_state_unspecified";
}

/** A task status's short name (`active`, `paused`, `completed`, ...). */
export function taskStatusName(status: TaskStatus): string {
  return status ? (TaskStatus[status] ?? String(status)).toLowerCase() : "task_status_unspecified";
}
