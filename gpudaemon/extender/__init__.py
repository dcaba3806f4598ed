"""The kube-scheduler extender (`gpudaemon extender`): scores nodes from the agents' labels.

Data path: `informer` (list + watch of Nodes, Pods and the agents' Leases) feeds
`cluster.ClusterState`, which keeps one `NodeState` per GPU node up to date; the HTTP
layer (`api`) hands node names and the pod to the pure `filtering` and `policies`
functions, which never call the API server.
"""
