"""``KVTierConnector``: vLLM (V1 KV connector API) keeps its KV on kvtier.

Load it without patching vLLM::

    vllm serve MODEL --kv-transfer-config \
      '{"kv_connector":"KVTierConnector","kv_connector_module_path":"kvtier.connectors.vllm","kv_role":"kv_both"}'

``kv_connector_extra_config`` may set ``runtime_dir`` (the daemon's; default: the
per-user one ``kvtier serve`` uses), ``namespace`` (default: the model),
``model_fingerprint`` (default: computed from the model's config and weight files,
``model_identity``) and ``hint_deadline_s``, ``load_timeout_s`` and ``save_timeout_s``. Under vLLM, vLLM's
paged KV is the HBM tier: its own prefix cache serves what it still holds, and
kvtier (DRAM, NVMe) serves what fell out of it. The scheduler half
(``vllm_scheduler``) decides loads and saves; the worker half moves the bytes:
layer by layer in the forward for prefixes in staging or DRAM (``vllm_worker``),
between steps for prefixes with a block on NVMe (``vllm_async``, reported through
``get_finished``). Each request's output carries ``kv_transfer_params["kvtier"]``:
the tokens loaded from kvtier, how (``sync``/``async``) and how many failed.
"""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.client.tier_client import TierClient

from .keys import DIGEST_BYTES
from .model_identity import vllm_fingerprint
from .pp_taint import StageBoard, StageTaint, board_name
from .tp_taint import tensor_parallel_agreement
from .vllm_async import AsyncLoads
from .vllm_scheduler import SchedulerSide, Transfer
from .vllm_worker import TAINTED_STEPS, Geometry, WorkerSide

log = logging.getLogger("kvtier.connectors.vllm")

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


@dataclass
class KVTierStats(KVConnectorStats):
    """The worker's counters over an interval (blocks loaded sync/async, failed, saved, queued
    for staging room, dropped), summed over workers; vLLM logs them as KV transfer metrics."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    loads: list[Transfer] = field(default_factory=list)        # sync: in this step's forward
    loads_async: list[Transfer] = field(default_factory=list)  # between steps, reported by get_finished
    saves: list[Transfer] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)
    step: int = 0                # the scheduler's number of this step: the same on every pipeline stage
    board: Optional[str] = None  # the pipeline stages' taint board (``pp_taint``), with pipeline parallelism


def _ranks() -> tuple[int, int]:
    """(pipeline stage, tensor-parallel rank) of this worker."""
    try:
        from vllm.distributed.parallel_state import get_pipeline_model_parallel_rank, get_tensor_model_parallel_rank

        return int(get_pipeline_model_parallel_rank()), int(get_tensor_model_parallel_rank())
    except Exception:  # no model-parallel group (the scheduler process)
        return 0, 0


def scheduler_geometry(kv_cache_config: "KVCacheConfig") -> tuple[int, int]:
    """(layers, block_bytes) of one rank's kvtier block as its worker will register it
    (``vllm_worker.Geometry``: every layer's block plus a digest trailer each). A spec's
    ``page_size_bytes`` is already one rank's (vLLM divides the KV heads by the TP size
    before it builds the spec), and the worker packs every layer of every group. The
    scheduler registers ``refs_only`` (it sees its worker's blocks whatever size it states),
    but its size must still fit the daemon's slots, which the first engine to register sizes."""
    layers = sum(len(g.layer_names) for g in kv_cache_config.kv_cache_groups)
    page = int(kv_cache_config.kv_cache_groups[0].kv_cache_spec.page_size_bytes)
    return layers, (page + DIGEST_BYTES) * layers


class KVTierConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig") -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self._runtime_dir: Optional[str] = extra.get("runtime_dir") or None  # else $KVTIER_RUNTIME_DIR, ...
        self._block_size = int(vllm_config.cache_config.block_size)
        dcp = int(getattr(vllm_config.parallel_config, "decode_context_parallel_size", 1) or 1)
        if dcp > 1:  # vLLM then hashes and aligns blocks of block_size x dcp tokens, not ours
            raise ValueError(f"KVTierConnector does not support decode context parallelism "
                             f"(decode_context_parallel_size = {dcp}): vLLM's blocks of {self._block_size * dcp} "
                             f"hashed tokens would be loaded and saved as blocks of {self._block_size}")
        model = extra.get("namespace") or str(vllm_config.model_config.model)
        world = int(vllm_config.parallel_config.tensor_parallel_size)
        self._stages = int(getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1) or 1)
        # the KV cache dtype too: an fp8 and a bf16 cache of one model hold different bytes under equal keys
        kv_dtype = getattr(vllm_config.cache_config, "cache_dtype", "auto")
        # and which weights: a second model served from the same path found the first's blocks
        # (``model_identity``); ``model_fingerprint`` in the extra config states it instead
        fingerprint = str(extra.get("model_fingerprint") or vllm_fingerprint(vllm_config.model_config))
        self._ns_model = f"vllm:{model}@{fingerprint}:{vllm_config.model_config.dtype}:kv-{kv_dtype}"
        self._world = world
        self._load_timeout_s = float(extra.get("load_timeout_s", 30.0))
        self._save_timeout_s = float(extra.get("save_timeout_s", 10.0))
        self.sched: Optional[SchedulerSide] = None
        self.worker: Optional[WorkerSide] = None
        self.asyncs: Optional[AsyncLoads] = None
        self._reported: dict[str, float] = {}  # worker counters as of the last stats report
        self._clients: list[TierClient] = []
        self._step = 0  # steps scheduled so far (``KVTierMetadata.step``)
        # steps a failed load taints: every batch vLLM may schedule before it hears of it
        self._window = max(TAINTED_STEPS, int(getattr(vllm_config, "max_concurrent_batches", 1) or 1))
        self._board: Optional[StageBoard] = None  # the scheduler's, with pipeline parallelism
        self._stage_taint: Optional[StageTaint] = None  # a worker's view of it
        if role == KVConnectorRole.SCHEDULER:
            layers, block_bytes = scheduler_geometry(kv_cache_config)
            clients = []  # one per stage's and rank's namespace: a hit needs every one's shard
            for stage in range(self._stages):
                for rank in range(world):
                    client = self._client("sched", stage, rank)
                    client.register(block_bytes=block_bytes, block_tokens=self._block_size, refs_only=True,
                                    layout={"layers": layers, "role": "vllm-scheduler"},
                                    namespace=self._namespace(stage, rank))
                    clients.append(client)
            self.sched = SchedulerSide(clients, self._block_size, float(extra.get("hint_deadline_s", 0.05)))
            if self._stages > 1:
                try:
                    self._board = StageBoard(board_name(), self._stages, world, create=True)
                except OSError as e:  # the workers of later stages then save nothing (StageTaint)
                    log.warning("kvtier: no pipeline taint board (%s): stages after the first save nothing", e)

    def _namespace(self, stage: int, rank: int) -> str:
        """Each model, pipeline stage and tensor-parallel rank has its own key space (each holds
        its own layers or heads: stages of equal layer counts have one geometry, and would
        otherwise share blocks). A request's ``cache_salt`` is already part of vLLM's block
        hashes, so salted requests never share keys with unsalted ones."""
        pp = f":pp{stage}/{self._stages}" if self._stages > 1 else ""
        return f"{self._ns_model}{pp}:tp{rank}/{self._world}"

    def _client(self, role: str, stage: int, rank: int) -> TierClient:
        # unique per process: engines in other containers can have this pid too, and an id names one process
        engine_id = f"vllm-{role}-pp{stage}-tp{rank}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        c = TierClient(runtime_dir=self._runtime_dir, engine_id=engine_id)
        self._clients.append(c)
        return c

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a future miss, never a lost hand-off

    # -- worker side ----------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        geo = Geometry(kv_caches, int(self._kv_cache_config.num_blocks))
        stage, rank = _ranks()
        client = self._client("worker", stage, rank)
        client.register(block_bytes=geo.block_bytes, block_tokens=self._block_size,
                        layout={"layers": len(geo.layers), "role": "vllm-worker"},
                        namespace=self._namespace(stage, rank))
        self.asyncs = AsyncLoads(client, geo, self._load_timeout_s)
        if self._stages > 1:
            self._stage_taint = StageTaint(stage, rank, self._stages, self._world)
        self.worker = WorkerSide(client, geo, timeout_s=self._load_timeout_s, save_timeout_s=self._save_timeout_s,
                                 idle=self.asyncs.poll, agree=tensor_parallel_agreement(),
                                 stages=self._stage_taint, window=self._window)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if self.worker is not None and isinstance(kv_connector_metadata, KVTierMetadata):
            self.worker.preempted(kv_connector_metadata.preempted)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierMetadata) and self.worker is not None and self.asyncs is not None
        if self._stage_taint is not None:
            self._stage_taint.bind(meta.board)
        self.worker.start(meta.loads, saves=meta.saves, sched_step=meta.step)
        self.asyncs.start(meta.loads_async)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.worker is not None:
            self.worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        return  # a block is saved once every layer of it exists: in wait_for_save

    def wait_for_save(self) -> None:
        if self.worker is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierMetadata)
        self.worker.finish_load()
        self.worker.save(meta.saves)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        """(finished requests whose saves are done, requests whose async load finished or failed);
        a failed load's blocks are in this step's ``get_block_ids_with_load_errors``."""
        if self.worker is None or self.asyncs is None:
            return None, None
        self.asyncs.poll()
        recving, errors = self.asyncs.take()
        self.worker.errors |= errors
        return self.worker.sent(finished_req_ids) or None, recving or None

    def get_kv_connector_stats(self) -> Optional[KVConnectorStats]:
        if self.worker is None or self.asyncs is None:
            return None
        now = {**self.worker.stats, **self.asyncs.stats}
        now.pop("load_wait_s", None)
        delta = {k: v - self._reported.get(k, 0) for k, v in now.items()}
        self._reported = now
        stats = KVTierStats(data=delta)
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[dict[str, Any]] = None) -> Optional[KVConnectorStats]:
        return KVTierStats(data=dict(data or {}))

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_errors() if self.worker is not None else set()

    # -- scheduler side -------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[Optional[int], bool]:
        assert self.sched is not None
        return self.sched.matched(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        assert self.sched is not None
        self.sched.after_alloc(request, blocks.get_block_ids()[0], num_external_tokens)

    def get_external_cache_hit_sources(self, request: "Request", num_external_tokens: int) -> dict[CacheHitSource, int]:
        assert self.sched is not None
        return {CacheHitSource(k): v for k, v in self.sched.hit_sources(request, num_external_tokens).items()}

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self.sched is not None
        loads, loads_async, saves = self.sched.build(scheduler_output)
        self._step += 1
        return KVTierMetadata(loads, loads_async, saves, set(scheduler_output.preempted_req_ids or ()), self._step,
                              self._board.name if self._board is not None else None)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        if self.sched is not None:
            self.sched.load_failed(set(connector_output.invalid_block_ids or ()))

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        return self.sched.finished(request) if self.sched is not None else (False, None)

    def reset_cache(self) -> bool:
        """Refused (vLLM reports it), never claimed: vLLM asks after a weight update (``/pause``,
        ``reset_prefix_cache(reset_external=True)``), but the daemon's blocks (and the remote
        tier's) keep their keys under this namespace, and the weights changed in memory, not
        in the fingerprint: claiming a reset served the old weights' KV to the new ones. Give
        the new weights a new ``model_fingerprint`` in the connector's extra config (a new
        namespace), or restart the daemon without an NVMe or remote tier that outlives it."""
        log.warning("kvtier cannot forget this namespace's blocks; reset refused: start the engine with a new "
                    "model_fingerprint for new weights")
        return False

    def shutdown(self) -> None:
        for c in self._clients:
            c.close()
        self._clients.clear()
        for board in (self._board, self._stage_taint):
            if board is not None:
                board.close()
        self._board = self._stage_taint = None


__all__ = ["KVTierConnector", "KVTierMetadata"]
