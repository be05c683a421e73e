"""The rules every verb and sweep shares: the entries' and tasks' state machines, the
claim object and the checks on what a planner read, concurrency pools, ``Core`` (retry
path, index and journal upkeep) and the sweep machinery with its election. Imports the
store and the records."""
