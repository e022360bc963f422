"""Benchmarks and the demo workload (tools: nothing imports them)."""
