"""GPU health: the signals NVML gives beyond the old one bit, and the verdict per GPU
(a state and the action it needs) from one table (verdict.py, xid.py)."""
