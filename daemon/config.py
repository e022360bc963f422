"""Typed configuration: one pydantic model per subsystem, ``extra="forbid"``.

Sources, lowest to highest precedence: field defaults < the embedded default
file (``daemon/defaults/kvtier.toml``, the shipped policy) < a TOML file
(``--config``, or else the first found by ``discover_config``: ``$KVTIER_CONFIG``,
``$XDG_CONFIG_HOME/kvtier/kvtier.toml`` (``~/.config/...``), ``/etc/kvtier/kvtier.toml``)
< ``KVTIER_<SECTION>__<FIELD>`` environment variables < CLI
``--set section.field=value`` flags. The layering is pydantic-settings' (``config_sources``).
``load_config`` itself reads only the file it is given; the commands resolve the path with
``resolve_config_path``. Errors name the source (file and line, variable, flag), the key and why;
the caller keeps its running config on any error.
"""

from __future__ import annotations

import os
from contextvars import ContextVar
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping, Optional, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from kvtier.predictor.cells import DEFAULT_CANDIDATES
from kvtier.protocol.runtime import IPC_PATH_MAX, default_data_dir, default_runtime_dir, endpoints

from .config_sources import ConfigError, env_names, explain, layers, redacted, settings_class
from .remote_config import RemoteConfig

# The environment a ``load_config`` resolves against, for the path defaults too: ``environ={}``
# (validate, replay) must not fail on a process variable it ignores (a relative KVTIER_RUNTIME_DIR).
_DEFAULTS_ENVIRON: ContextVar[Optional[Mapping[str, str]]] = ContextVar("kvtier_defaults_environ", default=None)

HOT_SECTIONS = ("policy", "scoring", "predictor")  # reloadable without restart
RESTART_SECTIONS = ("server", "tiers", "metrics")  # sockets, pools and the exporter are built once, at start


def _absolute(key: str, path: str) -> str:
    if not os.path.isabs(path):
        raise ValueError(f"{key} must be an absolute path (a relative one depends on the daemon's working "
                         f"directory), got {path!r}")
    return path


class _Section(BaseModel):
    # allow_inf_nan=False: an infinite budget or epoch, or a NaN weight, passed ``gt=0`` and
    # then broke arithmetic far from the config (int(inf // block) in the prefetcher's bucket)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True,
                              allow_inf_nan=False)


class ServerConfig(_Section):
    runtime_dir: str = Field(default_factory=lambda: default_runtime_dir(_DEFAULTS_ENVIRON.get()))
    """Directory of the ipc:// socket files (created with mode 0700; sockets 0600)."""
    tcp_port: Optional[int] = Field(default=None, ge=1, le=65535)
    """Not served: RPC over TCP had no authentication (any local user could act as any engine, or clear
    and reload the daemon). Engines attach over the ipc socket (0600, in a 0700 directory)."""

    @field_validator("runtime_dir")
    @classmethod
    def _absolute_runtime_dir(cls, v: str) -> str:
        # a relative one was served as ipc://relative/rpc.sock: clients in another directory never found it
        v = _absolute("server.runtime_dir", v)
        longest = max(len(p.encode()) - len("ipc://") for p in endpoints(v).values())
        if longest > IPC_PATH_MAX:  # else serve bound rpc.sock, then failed on telemetry.sock with a traceback
            raise ValueError(f"server.runtime_dir is too long for its socket files: {longest} bytes with "
                             f"'telemetry.sock', the limit of a unix socket path is {IPC_PATH_MAX}")
        return v

    @field_validator("tcp_port")
    @classmethod
    def _no_tcp(cls, v: Optional[int]) -> Optional[int]:
        if v is not None:
            raise ValueError("RPC over TCP is not served (it had no authentication); engines attach over the "
                             "ipc socket in server.runtime_dir, readable by its owner only")
        return v
    heartbeat_timeout_s: float = Field(default=10.0, gt=0)
    """An engine silent this long (or whose process died) loses its pins and live blocks."""
    fence_timeout_s: float = Field(default=600.0, gt=0)
    """A silent engine's pinned slots stay fenced until its process is seen dead; where the daemon cannot
    see it (another pid namespace), this long."""
    max_message_bytes: int = Field(default=16 << 20, ge=4096, le=1 << 40)  # (4x is ZeroMQ's int64 limit)
    """Frames larger than this are rejected before decoding."""
    max_batch_blocks: int = Field(default=1 << 16, ge=1)
    """Most blocks one request may name."""
    acquire_timeout_s: float = Field(default=30.0, gt=0)
    """Default deadline of an acquire that waits for promotions."""


class TiersConfig(_Section):
    hbm_bytes: int = Field(default=256 << 20, ge=0)
    """HBM pool size when the daemon allocates it (an engine may supply its own region)."""
    dram_bytes: int = Field(default=1 << 30, ge=0)
    """Host DRAM pool (POSIX shared memory; pinned where CUDA exists)."""
    nvme_bytes: int = Field(default=4 << 30, ge=0)
    """NVMe slab capacity; 0 disables the NVMe tier."""
    nvme_dir: str = Field(default_factory=lambda: default_data_dir(_DEFAULTS_ENVIRON.get()))
    """Directory of the slab files (a fast local disk)."""
    io_backend: Literal["auto", "posix", "kvikio", "faulty"] = "auto"
    """NVMe I/O backend: kvikio where a CUDA driver exists, else posix (O_DIRECT); faulty = fault drills."""
    io_threads: int = Field(default=8, ge=1, le=256)
    """POSIX backend thread-pool size (the NVMe queue depth it can reach)."""
    copy_loop: Literal["auto", "none", "avx2", "avx512", "avx2_linear", "avx512_linear"] = "auto"
    """The loop host copies (HBM <-> DRAM without CUDA) stream with: "auto" times each loop this CPU runs once,
    on the DRAM pool when the tiers are built, and takes the fastest (which one is, depends on the CPU: 20% apart
    on hosts measured); a name pins one ("none" = memmove); the daemon refuses at start a loop the CPU lacks."""
    mover_workers: int = Field(default=2, ge=1, le=64)
    """Mover threads executing NVMe transfers (HBM <-> DRAM copies have one thread of their own)."""
    mover_queue_depth: int = Field(default=64, ge=1, le=4096)
    """Transfers queued per mover lane; more wait, in order, on the owner side (submitting never blocks)."""
    recovery_verify: Literal["payload", "header"] = "header"
    """On start, "header" reads the slot index a clean stop left, or after a crash the 4 KiB slot
    headers, and verifies each payload when it is first read (as every NVMe read is): a TB-scale
    tier starts in seconds and nothing corrupt is served. "payload" also reads and checksums every
    slot's payload before serving (a full read of the tier: minutes at that scale), so a torn
    payload is dropped up front instead of on first read."""
    dram_numa_node: Optional[int] = Field(default=None, ge=0)
    """Bind the DRAM pool to this NUMA node (a CXL expander shows up as one)."""
    high_watermark: float = Field(default=0.95, gt=0, le=1)
    """Demote when a tier is fuller than this fraction."""
    low_watermark: float = Field(default=0.85, gt=0, le=1)
    """...until it is back below this fraction."""
    max_blocks: int = Field(default=0, ge=0)
    """Block-table size; 0 = the total slot count of all tiers. Smaller bounds the metadata: an alloc that
    finds no free id then drops cached blocks for one (NVMe-only ones first, then DRAM's and HBM's victims)."""
    remote: RemoteConfig = Field(default_factory=RemoteConfig)
    """The shared remote tier ([tiers.remote]; off by default)."""

    # The cross-field checks are field validators of the later field (pydantic validates fields in
    # declaration order, so the earlier one is in ``info.data``): the error's location is then that
    # key, and the source that set it is the one named (a model validator's is just [tiers], which
    # blamed whatever source last touched the section: the deploy units' --set tiers.nvme_dir).
    @field_validator("nvme_dir")
    @classmethod
    def _nvme_dir_absolute_and_given(cls, v: str, info: ValidationInfo) -> str:
        # an empty path, caught here and not at the first register, would put slabs in the daemon's cwd
        if not v.strip() and info.data.get("nvme_bytes", 0) > 0:
            raise ValueError("tiers.nvme_dir is empty but tiers.nvme_bytes > 0 (give a directory, or set nvme_bytes = 0)")
        return v if not v.strip() else _absolute("tiers.nvme_dir", v)

    @field_validator("low_watermark")
    @classmethod
    def _watermarks_ordered(cls, v: float, info: ValidationInfo) -> float:
        # a low mark above the high one made each demotion pass stop while the tier was still above high
        high = info.data.get("high_watermark")
        if high is not None and v > high:
            raise ValueError(f"tiers.low_watermark ({v}) is above tiers.high_watermark ({high}): demotion runs "
                             "from above high down to low")
        return v


class PolicyConfig(_Section):
    name: str = "kvtier"
    """Placement policy from the registry: kvtier (the Beta value model), lru, s3fifo (belady and the
    published references arc, lirs, w-tinylfu, sieve, 2q, lhd, gdsf: replay only)."""
    epoch_s: float = Field(default=1.0, gt=0)
    """Seconds in which repeated acquires of one block count as one access (the daemon's dedup window)."""
    admission: bool = True
    """Bypass a tier for blocks worth less than its victim."""
    samples: int = Field(default=16, ge=1, le=1024)
    """kvtier: residents sampled per eviction (the lowest value among them goes)."""
    prior_strength: float = Field(default=2.0, gt=0)
    """kvtier: pseudo-observations a cell borrows from its parent cell's reuse rate (hierarchical shrinkage;
    0 would leave a cell without evidence 0/0, a NaN value that the daemon never evicts)."""
    refresh_every: int = Field(default=2000, ge=100)
    """kvtier: accesses between rebuilds of the value tables (O(cells x ages) each)."""
    memory_horizons: float = Field(default=32.0, gt=0)
    """kvtier: the evidence decays with a time constant of this many eviction ages of the cache."""
    shadow_blocks: int = Field(default=128, ge=8, le=1 << 16)
    """kvtier: residents of each shadow cache that chooses the value model online (larger: surer, costlier)."""
    default_candidate: int = Field(default=2, ge=0, le=len(DEFAULT_CANDIDATES) - 1)
    """kvtier: the candidate model used until the shadow caches have evidence (index in the grid)."""
    evidence_floor: float = Field(default=0.01, ge=0, le=1)
    """kvtier: a missed block does not displace a resident while both are reused within the horizon
    with probability below this (no evidence either way: the resident stays; 0: off)."""
    prefetch_budget_bytes_per_s: float = Field(default=8e9, gt=0)
    """Bandwidth the prefetcher may spend on hinted and predicted promotions."""
    speculate: bool = False
    """With nothing hinted and HBM below its high watermark, promote the most valuable DRAM blocks
    (off by default: on the demo workload 2 of 98 such promotions were read before they left HBM)."""

    @field_validator("name")
    @classmethod
    def _known_policy(cls, v: str) -> str:
        from kvtier.policy import POLICIES

        if v not in POLICIES:
            daemon = sorted(k for k, c in POLICIES.items()
                            if not getattr(c, "offline", False) and not getattr(c, "replay_only", False))
            raise ValueError(f"unknown policy {v!r}; the daemon runs {daemon} (the others are for `kvtier replay`)")
        if getattr(POLICIES[v], "offline", False):
            raise ValueError(f"policy {v!r} needs the future and runs only in replay")
        if getattr(POLICIES[v], "replay_only", False):
            raise ValueError(f"policy {v!r} is a published reference for replay (no incremental victim query)")
        return v

    def params(self) -> dict[str, Any]:
        """Keyword arguments for the policy constructor."""
        return self.model_dump(exclude={"name", "prefetch_budget_bytes_per_s", "speculate"})


class ScoringConfig(_Section):
    ema: float = Field(default=0.3, gt=0, le=1)
    """Weight of a new attention-mass report in the importance EMA."""
    sink_blocks: int = Field(default=1, ge=0)
    """Leading blocks of a sequence treated as attention sinks (importance 1), by their place
    in the last attention report that named them (a report is one sequence's blocks in order)."""
    recency_blocks: int = Field(default=4, ge=0)
    """Trailing blocks of a sequence kept at importance >= recency_floor."""
    recency_floor: float = Field(default=0.5, ge=0, le=1)
    """Importance floor of the recency window."""
    segment_weights: dict[str, Annotated[float, Field(ge=0)]] = Field(
        default_factory=lambda: {"system": 1.0, "user": 0.8, "assistant": 0.7, "document": 0.6})
    """Multiplier of the attention EMA per segment tag (unknown tags weigh 1); the sink and
    recency priors are not scaled."""
    importance_floor: float = Field(default=0.2, ge=0, le=1)
    """weight(s) = (floor + (1 - floor) * s) / (floor + (1 - floor) / 2): importance tilts value, never
    zeroes it; a block nobody reported on (s = 0.5) weighs 1."""


class PredictorConfig(_Section):
    calibration_sample: int = Field(default=8, ge=1, le=4096)
    """kvtier: 1 decision in N (by block id hash) is scored against its outcome for calibration and metrics."""
    calibration_bins: int = Field(default=10, ge=2, le=100)
    """Reliability bins of the calibration tracker (Brier, ECE)."""
    track_calibration: bool = True
    """Score predictions against outcomes (costs a little per access)."""
    recalibrate: bool = True
    """kvtier: state each decision's probability through a monotone map learned online from the outcomes
    of earlier ones (per candidate model); decisions rank by the model's own. ``ece_raw`` is the model's."""


class MetricsConfig(_Section):
    enabled: bool = True
    """Serve Prometheus metrics over HTTP."""
    host: str = "127.0.0.1"
    """Bind address of the exporter."""
    port: int = Field(default=9464, ge=0, le=65535)
    """Exporter port; 0 picks a free one (reported by `kvtier stats`)."""


class KvtierConfig(_Section):
    server: ServerConfig = Field(default_factory=ServerConfig)
    tiers: TiersConfig = Field(default_factory=TiersConfig)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    scoring: ScoringConfig = Field(default_factory=ScoringConfig)
    predictor: PredictorConfig = Field(default_factory=PredictorConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)


SYSTEM_CONFIG = "/etc/kvtier/kvtier.toml"
CONFIG_ENV = "KVTIER_CONFIG"


def discovery_candidates(environ: Optional[Mapping[str, str]] = None) -> list[str]:
    """Where a config file is looked for when none is named, first match wins."""
    env = os.environ if environ is None else environ
    out = []
    if env.get(CONFIG_ENV):
        out.append(env[CONFIG_ENV])
    xdg = env.get("XDG_CONFIG_HOME") or os.path.join(env.get("HOME") or os.path.expanduser("~"), ".config")
    out.append(os.path.join(xdg, "kvtier", "kvtier.toml"))
    out.append(SYSTEM_CONFIG)
    return out


def discover_config(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The first existing file of ``discovery_candidates``, or None. ``$KVTIER_CONFIG`` naming a
    file that does not exist is an error, not a silent fall-through to the next candidate."""
    env = os.environ if environ is None else environ
    named = env.get(CONFIG_ENV)
    if named and not os.path.isfile(named):
        raise ConfigError(f"{CONFIG_ENV}={named}: no such file")
    return next((c for c in discovery_candidates(env) if os.path.isfile(c)), None)


def resolve_config_path(path: "str | Path | None", environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """``--config`` when given, else the discovered file (None: the shipped default alone)."""
    return str(path) if path is not None else discover_config(environ)


def config_sources(path: "str | Path | None", environ: Optional[Mapping[str, str]] = None,
                   overrides: Sequence[str] = ()) -> list[str]:
    """The sources ``load_config(path, environ, overrides)`` merges, lowest precedence first."""
    out = ["field defaults", f"shipped default ({SHIPPED_DEFAULT})"]
    if path is not None:
        out.append(f"file {path}")
    out += [f"environment {k}" for k in env_names(os.environ if environ is None else environ)]
    out += [f"--set {redacted(o)}" for o in overrides]
    return out


SHIPPED_DEFAULT = "kvtier/daemon/defaults/kvtier.toml"
# keys whose validators read other keys: an error is the concern of whichever source set any of them
CHECKED_AGAINST = {"tiers.low_watermark": ("tiers.high_watermark",), "tiers.nvme_dir": ("tiers.nvme_bytes",)}
_Settings = settings_class(KvtierConfig)  # the sections as a pydantic-settings class


def load_config(path: "str | Path | None" = None, environ: Optional[Mapping[str, str]] = None,
                overrides: Sequence[str] = ()) -> KvtierConfig:
    """Effective config from every source (see module docstring); ``environ={}`` ignores the
    process environment. Raises ConfigError naming the source, key and reason."""
    with resources.as_file(resources.files("kvtier.daemon").joinpath("defaults/kvtier.toml")) as shipped:
        files = [(shipped, "shipped default")] + ([(path, str(path))] if path is not None else [])
        sources = layers(_Settings, files, os.environ if environ is None else environ, overrides)
    token = _DEFAULTS_ENVIRON.set(environ)
    try:
        settings = _Settings(_build_sources=(sources, {}))
        return KvtierConfig(**{name: getattr(settings, name) for name in KvtierConfig.model_fields})
    except ValidationError as e:
        raise explain(e, sources, CHECKED_AGAINST) from None
    except OSError as e:  # a default that cannot be used (a relative $KVTIER_RUNTIME_DIR)
        raise ConfigError(f"{e.filename}: {e.strerror}" if e.filename else str(e)) from None
    finally:
        _DEFAULTS_ENVIRON.reset(token)


__all__ = ["ConfigError", "KvtierConfig", "HOT_SECTIONS", "RESTART_SECTIONS",
           "config_sources", "discover_config", "discovery_candidates", "resolve_config_path", "load_config",
           "default_runtime_dir", "default_data_dir"]
