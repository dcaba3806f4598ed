"""The node agent (`gpudaemon agent`): `app` wires the jobs; `poller` reads the backend
into `cache`; `healthmemory` and `healthlog` keep and tell sticky faults and health
changes; `metrics/` serves Prometheus; `nodelabels`, `nodehealth` and `nodewatch` write
the agent's labels, condition and Lease on its own Node. Shared layers (backends, labels,
history, kube, podresources) sit below it; no other program imports it."""
