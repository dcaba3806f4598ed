"""The kube-scheduler extender (`gpudaemon extender`): scores nodes from the agents' labels.

Data path: `kube.informer` (list + watch of Nodes, Pods and the agents' Leases) feeds
`cluster.clusterstate.ClusterState`, which keeps one `NodeState` per GPU node up to
date; the HTTP layer (`api`) hands node names and the pod to `framework`, whose steps
use the shared `cluster.scoring` and `cluster.policies` and never call the API server.
"""
