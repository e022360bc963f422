"""Benchmarks: each compares kvtier against a raw baseline measured in the same run."""
