"""Benchmarks: scripts that measure, run from the repository root as ``python -m benchmarks.NAME``."""
