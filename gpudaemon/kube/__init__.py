"""Everything that talks to the Kubernetes API server, shared by the agent and the
extender: `client` (credentials, calls, errors, list + watch), `backoff`,
`nodelabels` (the agent's labels on its own Node) and `lease` (the freshness Lease and
the rule readers use to judge it)."""
