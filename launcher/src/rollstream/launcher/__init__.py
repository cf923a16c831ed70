"""The operator's tools: `rollstream up` (the whole system as local processes, supervised),
`status`, `config`, `plot`, `secrets`, and the embedded redis-server. No service imports this
package; it imports the services' settings classes to compose a run's configuration."""
