"""What ``bench tiers``' headline ratios are: the kvtier steps each is the worse of, and its target.

Apart from ``tiers.py`` (which imports torch) so that pooling saved runs
(``tiers_runs.py``) reads them without the seconds that import takes.
"""

from __future__ import annotations

from .intervals import rep_ratios

# the kvtier steps each headline ratio is the worse of
HEADLINE_STEPS: dict[str, tuple[str, ...]] = {
    "dram_copy": ("hbm_to_dram", "dram_to_hbm"),
    "nvme_write": ("dram_to_nvme",),
    "nvme_read": ("nvme_to_dram",),
}
TARGETS: dict[str, float] = {"dram_copy": 0.9, "nvme_write": 0.85, "nvme_read": 0.85}
HEADS = tuple(HEADLINE_STEPS)


def step_ratios(times: dict[str, list[float]], head: str, raw: str) -> list[list[float]]:
    """Per kvtier step of a headline, its per-repetition ratios against the baseline ``raw``."""
    return [rep_ratios(times, o, raw) for o in HEADLINE_STEPS[head]]


__all__ = ["HEADLINE_STEPS", "TARGETS", "HEADS", "step_ratios"]
