"""`gpudaemon rebalance`: move work off unhealthy GPUs and defragment for pending pods,
through the Eviction API, as one leader at a time. `planner` decides, `app` acts."""
