"""Tensor-parallel ranks agree, once a step, on which steps' saves a failed KV load taints.

A rank whose own load failed drops the saves of the steps that may have read the bytes it
never loaded (``vllm_worker.TAINTED_STEPS``). Its peers' loads may have succeeded, but the
all-reduce after attention mixes every rank's heads into every rank's activations, so the
KV they compute for that request in those steps is as wrong as the failed rank's: sealed,
it would be served to every later request with that prefix. One collective at the same
point of every rank's step (``WorkerSide.save``) makes the taint the group's.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

# (the steps after this one whose saves this rank drops: -1 none, 0 this one only) -> the group's most
Agreement = Callable[[int], int]


def latest_taint(group: Any) -> Agreement:
    """An ``Agreement`` by one MAX all-reduce over ``group`` (a torch.distributed process group:
    vLLM's tensor-parallel CPU group, so no device sync). The failing rank's own window is
    what every rank adopts: it alone knows whether its failure reached vLLM this step or
    the next (``WorkerSide._taint_this_step``). Windows are relative to the step, so ranks
    agree even if their step counters did not."""
    def agree(steps_ahead: int) -> int:
        most = torch.tensor([steps_ahead], dtype=torch.int64)
        torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX, group=group)
        return int(most.item())
    return agree


def tensor_parallel_agreement() -> Optional[Agreement]:
    """The ``Agreement`` of this vLLM worker's tensor-parallel group, or None at TP 1.
    Pipeline stages are not joined: a stage reaches its save before it sends the next stage
    its activations, so a collective across stages would deadlock; later stages hear of an
    earlier stage's failed load on a shared board instead (``pp_taint``)."""
    try:
        from vllm.distributed.parallel_state import get_tp_group

        group = get_tp_group()
    except Exception:  # noqa: BLE001 - no model-parallel group (not a vLLM worker)
        return None
    if int(group.world_size) <= 1:
        return None
    return latest_taint(group.cpu_group)
