"""Engine adapters: transformers ``Cache`` backed by kvtier, and the demo workload."""
