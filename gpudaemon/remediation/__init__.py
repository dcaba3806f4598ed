"""Resetting a sick GPU in place, shared by the two programs that take turns at it: the
rebalancer drains the GPU and grants its reset within the fleet's limits (`grant`), the
agent checks that no one uses the GPU, runs the host driver's tool (`nvsmi`) and returns
the GPU to service. docs/remediation.md tells the whole loop."""
