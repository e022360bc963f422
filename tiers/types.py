"""Shared small types: tier ids, block states, the error taxonomy."""

from __future__ import annotations

import enum


class Tier(enum.IntEnum):
    HBM = 0
    DRAM = 1
    NVME = 2

    @property
    def medium(self) -> str:
        """vLLM KV-event medium name of this tier."""
        return ("GPU", "CPU", "STORAGE")[self]


N_TIERS = len(Tier)
TIER_NAMES = tuple(t.name.lower() for t in Tier)


class BlockState(enum.IntEnum):
    FREE = 0  # table entry unused
    OPEN = 1  # being written; private to one sequence
    SEALED = 2  # full and immutable; content-addressed by key


# Plain ints for numpy expressions. On Python 3.11 an IntEnum member in a numpy
# comparison or shift costs ~4 µs (numpy probes the enum's metaclass for array
# hooks, and each probe raises inside ``EnumType.__getattr__``); an int ~0.1 µs.
FREE, OPEN, SEALED = int(BlockState.FREE), int(BlockState.OPEN), int(BlockState.SEALED)
# the namespace column of a block a restart recovered whose namespace has not registered
# yet: no engine has it, so nobody finds or names the block until its owner claims it
UNCLAIMED_NS = 0xFFFF
ORPHAN_OWNER = 1  # the owner written for an unclaimed block's copy: no namespace claims it
HBM, DRAM, NVME = int(Tier.HBM), int(Tier.DRAM), int(Tier.NVME)


class TierError(RuntimeError):
    """A transfer or tier operation failed (I/O error, corrupt data)."""


class CorruptBlockError(TierError):
    """Bytes read back do not match the block's recorded checksum."""


def parse_tier(value: "Tier | int | str") -> Tier:
    if isinstance(value, Tier):
        return value
    if isinstance(value, str):
        try:
            return Tier[value.upper()]
        except KeyError:
            raise ValueError(f"unknown tier {value!r}; expected one of {TIER_NAMES}") from None
    try:
        return Tier(int(value))
    except ValueError:
        raise ValueError(f"unknown tier {value!r}") from None

def geometry_ident(geometry: "tuple[int, int] | tuple[int, int, str]") -> bytes:
    """Bytes naming a block geometry (bytes, tokens and, where the engine stated it, KV dtype) in
    the stable identities (NVMe owner, remote tag). Without a dtype it is what it was before the
    dtype joined the geometry, so blocks a restart recovers keep their owner."""
    ident = b"%dB/%dT" % (int(geometry[0]), int(geometry[1]))
    dtype = str(geometry[2]) if len(geometry) > 2 else ""
    return ident + (b"/" + dtype.encode() if dtype else b"")


# counted by the tiers (and placement's NVMe skips): in stats io.events and kvtier_tier_events_total
DATA_PLANE_EVENTS = ("corrupt_copies", "keys_detached", "nvme_read_retries", "nvme_write_backoffs",
                     "nvme_backoff_skips", "seal_dedup", "seal_kept_distinct", "slots_zeroed")
