"""The sweeps: work the elected replica does on its own (the scheduler, deadlines,
stalls, cross-task waits, archiving). Imports the verbs and below."""
