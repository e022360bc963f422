"""Engine connectors: inference engines (vLLM) that keep their KV in kvtier."""
