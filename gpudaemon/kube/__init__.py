"""Everything that talks to the Kubernetes API server, shared by every program: `client`
(credentials, calls, errors, list + watch), `informer` (list + watch into a cache),
`backoff`, `lease` (the freshness Lease and the rule readers use to judge it) and
`leader` (leader election). The agent's own Node writers live in `gpudaemon.agent`."""
