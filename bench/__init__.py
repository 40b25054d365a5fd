"""Benchmark harness: scripts that print figures (not timed tests). Entry point: ``python -m bench.run --all``."""
