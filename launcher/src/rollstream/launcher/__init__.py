"""The operator's tools: `rollstream up` (the whole system as local processes, supervised),
`status`, `config`, `plot`, `secrets`, the embedded redis-server, and the colocated process
(`up --colocate` or `--colocate-async`: the trainer and a generator in one process,
colocated.py). No service imports this package; it imports the services' settings classes to
compose a run's configuration."""
