"""Benchmarks: `scripts/bench <name> [args]` (sets up the venv and runs
`python -m bench.<name>`). Each prints a table (bench/table.py); figures and how to
read them are in docs/benchmarks.md."""
