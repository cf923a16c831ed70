"""The operator's tools: `rollstream up` (a plan of the whole system as local processes,
plan.py, and its supervisor, up.py), `status`, `config`, `plot`, `secrets`, the embedded
redis-server, and the colocated process (`up --colocate sync` or `async`: the trainer and a
generator in one process, colocated.py; the setting and its checks, colocation.py). No service imports this package; it imports the services' settings classes to
compose a run's configuration."""
