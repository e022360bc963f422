"""Config validation of the NVMe directory (what can be known before any register)."""

from __future__ import annotations

import pytest

from kvtier.daemon.config import ConfigError, load_config


def test_empty_nvme_dir_with_an_nvme_tier_is_rejected() -> None:
    with pytest.raises(ConfigError, match="tiers.nvme_dir"):
        load_config(environ={}, overrides=['tiers.nvme_dir=""', "tiers.nvme_bytes=1048576"])


def test_empty_nvme_dir_without_an_nvme_tier_is_fine() -> None:
    cfg = load_config(environ={}, overrides=['tiers.nvme_dir=""', "tiers.nvme_bytes=0"])
    assert cfg.tiers.nvme_bytes == 0
