"""Engine <-> daemon contract: wire format, runtime-dir discovery, shared-memory regions."""
