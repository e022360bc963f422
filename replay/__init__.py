"""Trace replay: the daemon's policies on real traces, against LRU and Belady."""
