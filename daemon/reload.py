"""Hot reload: re-read the config sources, apply the hot sections, and name every other change.

``[policy]``, ``[scoring]`` and ``[predictor]`` apply to a running daemon;
``[server]``, ``[tiers]`` and ``[metrics]`` are built once at start, so their
changes are listed as needing a restart instead of being dropped silently.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

from .config import HOT_SECTIONS, KvtierConfig, load_config

# keys of hot sections that the running policies were built with: once a node runs, a change
# waits for a restart (reported so), the rest of the section applies at once
RESTART_WITH_NODE = ("policy.name", "policy.refresh_every", "policy.shadow_blocks", "policy.default_candidate")


def changed_keys(old: KvtierConfig, new: KvtierConfig) -> list[str]:
    """``section.field`` of every field whose value differs, in declaration order."""
    out = []
    for section in KvtierConfig.model_fields:
        a, b = getattr(old, section), getattr(new, section)
        out += [f"{section}.{name}" for name in type(a).model_fields if getattr(a, name) != getattr(b, name)]
    return out


@dataclass
class ReloadPlan:
    """What a reload does: the config to run, and every changed key sorted by whether it applies now."""

    config: KvtierConfig  # the running config with the hot sections of the fresh one
    sections: list[str]  # hot sections that changed (the service reconfigures these)
    applied: list[str]  # changed keys in effect from now on
    restart: list[str]  # changed keys of restart-only sections: kept at their running value


def plan_reload(current: KvtierConfig, path: "str | Path | None", environ: Optional[Mapping[str, str]] = None,
                overrides: Sequence[str] = ()) -> ReloadPlan:
    """Re-read the sources; take only the hot sections, and name every other change instead of
    dropping it silently. Raises ConfigError (the caller keeps ``current``) when anything is invalid."""
    fresh = load_config(path, environ, overrides)
    merged = current.model_copy(deep=True)
    sections = []
    for name in HOT_SECTIONS:
        if getattr(fresh, name) != getattr(current, name):
            sections.append(name)
        setattr(merged, name, getattr(fresh, name))
    keys = changed_keys(current, fresh)
    applied = [k for k in keys if k.split(".", 1)[0] in HOT_SECTIONS]
    return ReloadPlan(merged, sections, applied, [k for k in keys if k not in applied])


def reload_hot(current: KvtierConfig, path: "str | Path | None", environ: Optional[Mapping[str, str]] = None,
               overrides: Sequence[str] = ()) -> tuple[KvtierConfig, list[str]]:
    """``plan_reload`` as (new config, changed hot sections)."""
    plan = plan_reload(current, path, environ, overrides)
    return plan.config, plan.sections


__all__ = ["RESTART_WITH_NODE", "ReloadPlan", "changed_keys", "plan_reload", "reload_hot"]
