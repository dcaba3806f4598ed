"""The shared cluster library: what the extender, the rebalancer and `gpudaemon status`
all read. `state` (NodeState, PodShape), `podspec` (what a pod asks for), `clusterstate`
(ClusterState: one NodeState per GPU node from Nodes, Pods and Leases, built from
`nodes`, `freshness` and `assume`, and the consumers' views), `selectors`
(which pods the programs watch), `reservations` (the rebalancer's reservations on its
Lease), `scoring` (`check_node`, ranking) and `policies/`, and `metrics` (the counts
every reader keeps). Pure data and rules: no program's wiring, no HTTP server."""
