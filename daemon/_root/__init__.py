"""kvtier: predictive, semantic KV-cache tiering (HBM -> DRAM -> NVMe).

The subpackages live at the repository top level (``daemon/``, ``tiers/``, ...)
and are mapped into this namespace at install time so that no generic
top-level module names (``daemon``, ``kernels``) leak into site-packages.
"""

__version__ = "0.1.0"
