"""The ``kvtier`` command line (tools: nothing imports it)."""
