"""The broadcast transport inside vLLM: a weight-transfer engine registered with vLLM 0.32's public API.

    register_backend()                                   # in every process that imports actors.engine.vllm (workers too)
    EngineArgs(..., weight_transfer_config=WeightTransferConfig(backend=BACKEND))
    load = BroadcastLoad(engine.collective_rpc)          # the generator's side of one round
    timings = load.run(ticket, header)                   # init (new epoch) + start + update_weights + finish

vLLM's API (`vllm.distributed.weight_transfer`, docs: training/weight_transfer) gives each worker a
`WeightTransferEngine`, built at model load from `weight_transfer_config`, and four worker methods reached through
`collective_rpc`: `init_weight_transfer_engine`, `start_weight_update`, `update_weights`, `finish_weight_update`
(plus `shutdown_weight_transfer_engine`). Every worker of the engine (tensor-parallel rank r) joins the group as its
own rank, rank_offset + r, as vLLM's NCCL engine and `examples/rl` do; no copy of the model is made outside the
workers, and nothing crosses GPUs by IPC.

`BroadcastTransferEngine` is vLLM's NCCL engine's lifecycle with Tandem's round (common/broadcast.py) on the wire:
  * `init_transfer_engine`: close the previous epoch's group, join this epoch's (gloo on CPU, NCCL on GPUs, on the
    worker's own device), within `join_timeout_s`;
  * `start_weight_update` / `finish_weight_update`: vLLM's layerwise reload (initialize / finalize), which loads
    each layer on the side and swaps it in when all of its tensors arrived;
  * `update_weights`: the round's stamp is checked against the header (from the authenticated doorbell), then each
    bucket is received into a fresh buffer and its tensors handed to `model.load_weights` (plus the new embedding
    as the output layer of a tied model: vLLM 0.32's layerwise reload would otherwise put the old one back). Every
    collective is bounded by `timeout_s` (NCCL: the communicator is aborted), so a dead publisher fails the RPC
    instead of freezing the worker.
A failed round leaves some layers on the new weights and some on the old: the generator then samples nothing until
the next round loads (`VllmEngine.needs_weights`).

Registered as BACKEND with vLLM's `WeightTransferEngineFactory` (its extension point) when `actors.engine.vllm` is
imported, which vLLM's worker processes do to mix in `WeightLoader`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from common.broadcast import BroadcastGroup, bucket_tensors, receive_round
from common.weight_messages import TensorSpec, WeightsHeader

log = logging.getLogger("tandem.actors.weight_transfer")

BACKEND = "tandem_broadcast"


@dataclass
class GroupTicket:
    """Where and as what this generator takes part in a round: its workers are ranks rank_offset .. + workers - 1
    of `world_size` in the group of `epoch`, whose rendezvous is host:port."""

    epoch: int
    host: str
    port: int
    world_size: int
    rank_offset: int
    backend: str
    timeout_s: float
    join_timeout_s: float
    insecure: bool


def update_info(header: WeightsHeader) -> dict[str, Any]:
    """What `update_weights` needs of the header, as plain values (collective_rpc's arguments)."""
    return {
        "version": header.policy_version,
        "bucket_sizes": list(header.bucket_sizes),
        "tensors": [[s.name, s.dtype, list(s.shape), s.bucket, s.offset, s.nbytes] for s in header.tensors],
    }


class BroadcastLoad:
    """The generator's side of one round: the worker RPCs in order. `rpc(method, args=())` is the engine's
    `collective_rpc`. Keeps the epoch its workers joined (a new epoch re-forms their group first)."""

    def __init__(self, rpc: Callable[..., Any]) -> None:
        self.rpc = rpc
        self.epoch = -1
        self.swapping = False  # a round's layers are being swapped in: a failure now leaves the model mixed

    def run(self, ticket: GroupTicket, header: WeightsHeader) -> dict[str, float | str]:
        """Join the ticket's group when it is a new epoch, then receive and load the round. Returns where the time
        went ("path": "broadcast"; map_s: joining the group, load_s: the round, process_s: the layerwise finish).
        Raises what the workers raised (the group is then left for the next epoch); `swapping` then says whether
        some layers may already hold the new weights."""
        started = time.perf_counter()
        if ticket.epoch != self.epoch:
            if self.epoch >= 0:
                self.rpc("shutdown_weight_transfer_engine")
            self.epoch = -1
            self.rpc("init_weight_transfer_engine", args=(asdict(ticket),))
            self.epoch = ticket.epoch
        joined = time.perf_counter()
        self.rpc("start_weight_update")
        self.swapping = True
        try:
            self.rpc("update_weights", args=(update_info(header),))
        except BaseException:
            self.epoch = -1  # the group is broken: the next round joins the next epoch's
            raise
        loaded = time.perf_counter()
        self.rpc("finish_weight_update")
        self.swapping = False
        return {
            "path": "broadcast",
            "map_s": joined - started,
            "load_s": loaded - joined,
            "process_s": time.perf_counter() - loaded,
        }


def register_backend() -> None:
    """Register BACKEND with vLLM's weight-transfer factory (once per process; a no-op without vLLM)."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:
        return
    try:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "BroadcastTransferEngine")
    except ValueError:  # registered already (this module imported again): 0.32 has no "is registered" query
        pass


def _engine_class() -> type:
    """BroadcastTransferEngine, built on vLLM's base class when it is first needed (this module imports without
    vLLM: the generator's tests and the learner use GroupTicket and update_info)."""
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )

    @dataclass
    class InitInfo(WeightTransferInitInfo, GroupTicket):
        pass

    @dataclass
    class UpdateInfo(WeightTransferUpdateInfo):
        version: int
        bucket_sizes: list[int]
        tensors: list[list[Any]]

    class Engine(WeightTransferEngine[InitInfo, UpdateInfo]):
        """See the module docstring."""

        init_info_cls = InitInfo
        update_info_cls = UpdateInfo
        supports_draft_weight_update = False

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.group: BroadcastGroup | None = None

        def init_transfer_engine(self, init_info: InitInfo) -> None:
            self.shutdown()
            parallel = self.parallel_config
            rank = init_info.rank_offset + parallel.data_parallel_index * parallel.world_size + parallel.rank
            self.group = BroadcastGroup.open(
                init_info.host,
                init_info.port,
                rank,
                init_info.world_size,
                init_info.backend,
                init_info.timeout_s,
                init_info.join_timeout_s,
                init_info.insecure,
                device=self.device,
            )
            log.info("weights group epoch %d joined as rank %d of %d", init_info.epoch, rank, init_info.world_size)

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)

        def update_weights(self, update_info: dict[str, Any]) -> None:
            """The base class's, without its `torch.accelerator.synchronize()`, which raises on a CPU worker: a
            CUDA receive is synchronised by `BroadcastGroup.broadcast` (it waits for each bucket) and by the
            loads on the current stream."""
            self.receive_weights(self.parse_update_info(update_info))

        def receive_weights(self, update_info: UpdateInfo) -> None:
            from actors.weights.cuda import with_tied_head

            if self.group is None:
                raise RuntimeError("weights round before init_weight_transfer_engine: no group joined")
            specs = [TensorSpec(n, d, list(s), b, o, size) for n, d, s, b, o, size in update_info.tensors]
            header = WeightsHeader(
                policy_version=update_info.version,
                tensors=specs,
                bucket_sizes=update_info.bucket_sizes,
                transport="broadcast",
            )
            names = {spec.name for spec in specs}
            hf_config = self.model_config.hf_config

            def load(index: int, bucket: Any) -> None:
                tensors = iter(bucket_tensors(header, index, bucket))
                self.model.load_weights(with_tied_head(tensors, hf_config, names))

            receive_round(self.group, header, load)

        def shutdown(self) -> None:
            if self.group is not None:
                self.group.close()
                self.group = None

    return Engine


def __getattr__(name: str) -> Any:
    """`BroadcastTransferEngine`, resolved lazily (vLLM's factory imports this module and reads it by name)."""
    if name == "BroadcastTransferEngine":
        engine = _engine_class()
        globals()[name] = engine
        return engine
    raise AttributeError(name)
