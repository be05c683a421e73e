"""The records: what is stored (``model``), identities and access rules, manifest
validation, routing rules, fair shares and the archive's storage interface. Imports
nothing of the registry outside itself."""
