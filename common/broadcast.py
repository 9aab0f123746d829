"""The weights broadcast group (`weights.transport = "broadcast"`): learner rank 0's publisher is group rank 0, and
every vLLM worker of the generators that take part in a round is one more rank (a generator with tensor
parallelism 2 holds two ranks), as in vLLM's own weight-transfer API.

    group = BroadcastGroup.open(host, port, rank, world_size, backend, timeout_s, join_timeout_s, device=device)
    send_round(group, version, buckets)          # rank 0: one update
    receive_round(group, header, on_bucket)      # every other rank: each bucket in turn, into a fresh buffer
    group.close()

Backends, one round protocol:
  * gloo (CPU): torch's `ProcessGroupGloo` on a `TCPStore` hosted by rank 0, made statelessly (no global
    `torch.distributed` state), as vLLM's `stateless_init_torch_distributed_process_group` makes its gloo groups.
  * nccl (CUDA): vLLM's `StatelessProcessGroup` + `PyNcclCommunicator` (what
    `vllm.distributed.weight_transfer.nccl_common.stateless_init_process_group` builds), one GPU per rank, on the
    `device` the caller names (never "the current device" of whatever thread opens it). Collectives run on the
    caller's `stream` (the learner gives a dedicated one: its training stream never queues behind a broadcast).
  * auto: nccl where CUDA is available, else gloo.
The gloo form is tested with real processes (tests/learners/test_broadcast.py) and inside vLLM's CPU workers
(tests/actors/test_broadcast_vllm.py); the nccl form has not run on a GPU (see README).

A round = a stamp, int64 [ROUND_MAGIC, policy_version, bucket count, total bytes], then every bucket (uint8, laid out
by `common.weights`) in order, each broadcast from rank 0. The header (names, dtypes, shapes, offsets) does not
travel in the group: a receiver has it already, from the publisher's ZeroMQ doorbell (authenticated there), and
`receive_round` refuses a round whose stamp disagrees with it.

A group lives for one membership (an "epoch", `learners/broadcast_publisher.py`): when a member joins, dies or
misses a round, the publisher closes it and forms the next one. `open` waits up to `join_timeout_s` for every
member, then raises `BroadcastError`. Every collective has the same deadline: when a member dies, or stops taking
part, the round fails on every other member within `timeout_s` (gloo: its timeout, or at once on a closed
connection; nccl: the communicator is aborted when the stream has not finished by then) and raises
`BroadcastError`. A group that failed a round is broken (members may disagree on where the stream stands):
`broadcast` on it raises at once, and its members form the next epoch's group instead.

Security: the store and the collectives are neither authenticated nor encrypted, and vLLM's NCCL rendezvous
deserialises the NCCL id it reads from the store with Python's object serialiser: whoever reaches the group's port
can run code in a member. So a non-loopback group address needs `insecure=True` (run.insecure: a trusted network).
"""

from __future__ import annotations

import datetime
import importlib.util
import ipaddress
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from common.weight_messages import TensorSpec, WeightsHeader
from common.weights import check_frames

log = logging.getLogger("tandem.common.broadcast")

ROUND_MAGIC = 0x54414E44454D5742  # "TANDEMWB": the first word of every round's stamp
BACKENDS = ("auto", "nccl", "gloo")
_NCCL_POLL_S = 0.001  # how often a waiting nccl member checks its stream
_JOINED_KEY = "tandem-weights/joined"  # set by rank 0 once every member reached the store


class BroadcastError(RuntimeError):
    """The group could not form, or a round failed (a member died, stalled, or disagreed about the round)."""


def is_loopback(host: str) -> bool:
    """`common.config.is_loopback`, without importing pydantic (benchmarks/gpu_check runs where it is absent)."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def refuse_exposed_group(host: str, insecure: bool) -> None:
    """Raise ValueError when the group's rendezvous `host` is not loopback and run.insecure is off: the store is
    unauthenticated (both ends of the group check it before joining)."""
    if not is_loopback(host) and not insecure:
        raise ValueError(
            f"weights.broadcast_host {host} exposes an unauthenticated group: set run.insecure = "
            "true on a trusted network, or keep it on loopback"
        )


def resolve_backend(backend: str) -> str:
    """'gloo' or 'nccl' for `backend` (auto: nccl when CUDA is available). Raises ValueError for a backend this
    machine cannot run (nccl without CUDA, or without vLLM) or a name that is none of `BACKENDS`."""
    if backend not in BACKENDS:
        raise ValueError(f"weights.broadcast_backend must be one of {', '.join(BACKENDS)} (got {backend!r})")
    import torch

    cuda = torch.cuda.is_available()
    resolved = backend if backend != "auto" else ("nccl" if cuda else "gloo")
    if resolved == "nccl" and not cuda:
        raise ValueError(
            "weights.broadcast_backend = 'nccl' needs a CUDA GPU in every member, and this process sees none: "
            "use 'gloo' (CPU) or 'auto'"
        )
    if resolved == "nccl" and importlib.util.find_spec("vllm") is None:
        raise ValueError(
            "weights.broadcast_backend 'nccl' is vLLM's weight-transfer group (PyNcclCommunicator), and vLLM is not "
            "installed here: install vllm beside the learner too, or use 'gloo'"
        )
    return resolved


@dataclass
class BroadcastGroup:
    """One member of the group (see the module docstring). Use from one thread at a time."""

    rank: int
    world_size: int
    backend: str  # "gloo" | "nccl"
    timeout_s: float
    device: Any  # torch.device the buckets must live on (cpu for gloo, this member's GPU for nccl)
    _collective: Any = field(repr=False)  # ProcessGroupGloo | PyNcclCommunicator
    _store: Any = field(repr=False, default=None)  # gloo: the TCPStore (rank 0 hosts it; kept alive with the group)
    broken: str = ""  # why the group failed ("" while usable)

    @classmethod
    def open(
        cls,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        backend: str,
        timeout_s: float,
        join_timeout_s: float,
        insecure: bool = False,
        device: Any = None,
    ) -> BroadcastGroup:
        """Join the group (rank 0 hosts its rendezvous on host:port); blocks until all `world_size` members joined,
        at most `join_timeout_s`; each later collective waits at most `timeout_s`. `device`: this member's GPU for
        nccl (default: cuda:0 of a process that sees one GPU; name it wherever a process sees several). Raises
        ValueError for arguments that cannot work, BroadcastError when the group does not form in time."""
        if not 0 <= rank < world_size or world_size < 2:
            raise ValueError(f"broadcast group: rank {rank} of {world_size} members (need 0 <= rank < size, size >= 2)")
        if not is_loopback(host) and not insecure:
            raise ValueError(
                f"weights.broadcast_host {host} exposes an unauthenticated group beyond this machine: keep it on "
                "loopback, or set run.insecure = true on a trusted network (see common/broadcast.py, Security)"
            )
        resolved = resolve_backend(backend)
        try:
            if resolved == "gloo":
                return cls._open_gloo(host, port, rank, world_size, timeout_s, join_timeout_s)
            return cls._open_nccl(host, port, rank, world_size, timeout_s, join_timeout_s, device)
        except (RuntimeError, OSError) as error:  # torch raises DistStoreError (a RuntimeError) on a timeout
            raise BroadcastError(
                f"broadcast group {host}:{port} ({resolved}): rank {rank} could not form the group of {world_size} "
                f"within {join_timeout_s:.0f}s ({error})"
            ) from None

    @classmethod
    def _open_gloo(
        cls, host: str, port: int, rank: int, world_size: int, timeout_s: float, join_timeout_s: float
    ) -> BroadcastGroup:
        import torch
        from torch.distributed import PrefixStore, TCPStore
        from torch.distributed.distributed_c10d import ProcessGroupGloo

        join = datetime.timedelta(seconds=join_timeout_s)
        store = TCPStore(host, port, world_size, rank == 0, timeout=join, use_libuv=False)  # rank 0: waits for all
        if rank == 0:
            store.set(_JOINED_KEY, b"1")
        else:
            store.wait([_JOINED_KEY], join)  # so the full mesh below forms at once, within `timeout_s`
        timeout = datetime.timedelta(seconds=timeout_s)
        gloo = ProcessGroupGloo(PrefixStore("tandem-weights", store), rank, world_size, timeout)
        return cls(rank, world_size, "gloo", timeout_s, torch.device("cpu"), gloo, store)

    @classmethod
    def _open_nccl(
        cls, host: str, port: int, rank: int, world_size: int, timeout_s: float, join_timeout_s: float, device: Any
    ) -> BroadcastGroup:
        import torch

        try:  # what vllm.distributed.weight_transfer.nccl_common.stateless_init_process_group does, with our timeout
            from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
            from vllm.distributed.utils import StatelessProcessGroup
            from vllm.utils.nccl import unpinned_nccl_env
        except ImportError as error:
            raise ValueError(
                f"weights.broadcast_backend 'nccl' uses vLLM's weight-transfer group, and vLLM does not import "
                f"here ({error}): install vllm beside the learner too, or use 'gloo'"
            ) from None
        device = torch.device(device if device is not None else "cuda:0")
        store = StatelessProcessGroup.create(host, port, rank, world_size, store_timeout=int(join_timeout_s))
        with unpinned_nccl_env():
            communicator = PyNcclCommunicator(store, device=device)  # blocks until every member is there
        if communicator.disabled:  # pynccl disables itself, silently, when it cannot load libnccl
            raise ValueError("vLLM's PyNcclCommunicator found no NCCL library: use weights.broadcast_backend 'gloo'")
        return cls(rank, world_size, "nccl", timeout_s, device, communicator)

    def broadcast(self, tensor: Any, stream: Any = None) -> None:
        """Broadcast `tensor` (contiguous, on `device`) from rank 0 into every member's `tensor`; returns when this
        member's copy is complete. nccl runs it on `stream` (default: the device's current stream). Raises
        BroadcastError (and marks the group broken) on a failure or past `timeout_s`."""
        if self.broken:
            raise BroadcastError(f"the broadcast group is broken ({self.broken}): the next round forms a new one")
        try:
            if self.backend == "gloo":
                self._broadcast_gloo(tensor)
            else:
                self._broadcast_nccl(tensor, stream)
        except (RuntimeError, TimeoutError) as error:
            self.broken = str(error).splitlines()[0][:300]
            if self.backend == "nccl":
                self._collective.destroy()  # ncclCommAbort: the stream's pending work is dropped
            raise BroadcastError(
                f"broadcast round failed at rank {self.rank} of {self.world_size}: {self.broken} "
                "(a member died or stalled; the next round forms a new group)"
            ) from None

    def _broadcast_gloo(self, tensor: Any) -> None:
        from torch.distributed.distributed_c10d import BroadcastOptions

        options = BroadcastOptions()
        options.rootRank, options.rootTensor = 0, 0
        self._collective.broadcast([tensor], options).wait()  # gloo's timeout bounds the wait

    def _broadcast_nccl(self, tensor: Any, stream: Any) -> None:
        import torch

        stream = stream if stream is not None else torch.cuda.current_stream(self.device)
        self._collective.broadcast(tensor, src=0, stream=stream)
        done = torch.cuda.Event()
        done.record(stream)
        deadline = time.monotonic() + self.timeout_s
        while not done.query():  # NCCL has no timeout of its own: a dead peer would leave this stream waiting
            if time.monotonic() > deadline:
                raise TimeoutError(f"nccl broadcast of {tensor.numel()} bytes unfinished after {self.timeout_s:.0f}s")
            time.sleep(_NCCL_POLL_S)

    def close(self) -> None:
        if self.backend == "nccl" and not self.broken:
            self._collective.destroy()
        self._collective = self._store = None


def _stamp(group: BroadcastGroup, version: int, sizes: Sequence[int]) -> Any:
    import torch

    words = [ROUND_MAGIC, version, len(sizes), int(sum(sizes))]
    return torch.tensor(words, dtype=torch.int64, device=group.device)


def send_round(group: BroadcastGroup, version: int, buckets: Sequence[Any], stream: Any = None) -> int:
    """Rank 0: broadcast one update (its stamp, then `buckets`, uint8 tensors on `group.device`) on `stream`;
    returns the bytes sent. Raises BroadcastError as `broadcast` does."""
    if group.rank != 0:
        raise ValueError(f"send_round runs on rank 0 only (this member is rank {group.rank})")
    group.broadcast(_stamp(group, version, [b.numel() for b in buckets]), stream)
    for bucket in buckets:
        group.broadcast(bucket, stream)
    return sum(b.numel() for b in buckets)


def receive_round(group: BroadcastGroup, header: WeightsHeader, on_bucket: Callable[[int, Any], None]) -> None:
    """Ranks 1..N: receive the round that `header` announced, one bucket at a time: each into a fresh uint8 tensor
    on `group.device` (sized `header.bucket_sizes[i]`), handed to `on_bucket(i, bucket)` before the next one
    arrives. A fresh tensor each: a consumer may keep views of earlier buckets (vLLM's layerwise reload holds a
    layer's tensors until the layer is complete), so at most the model's bytes are held, and only while a layer
    spans buckets. Raises BroadcastError when the round's stamp is not the header's (a publisher bug: the group is
    marked broken, since the stream's position is then unknown) or the round fails."""
    import torch

    stamp = _stamp(group, -1, [0])
    group.broadcast(stamp)
    magic, version, count, total = (int(word) for word in stamp.tolist())
    expected = (ROUND_MAGIC, header.policy_version, len(header.bucket_sizes), int(sum(header.bucket_sizes)))
    if (magic, version, count, total) != expected:
        group.broken = f"round stamp {(magic, version, count, total)} != the header's {expected}"
        raise BroadcastError(f"broadcast round disagrees with its header: {group.broken}")
    for index, size in enumerate(header.bucket_sizes):
        bucket = torch.empty(int(size), dtype=torch.uint8, device=group.device)
        group.broadcast(bucket)
        on_bucket(index, bucket)


def bucket_tensors(header: WeightsHeader, index: int, bucket: Any) -> list[tuple[str, Any]]:
    """(name, view) of every tensor the header lays out in bucket `index` (a uint8 tensor), in header order."""
    import torch

    return [
        (spec.name, bucket[spec.offset : spec.offset + spec.nbytes].view(getattr(torch, spec.dtype)).view(spec.shape))
        for spec in header.tensors
        if spec.bucket == index
    ]


def check_header(header: WeightsHeader) -> None:
    """`common.weights.check_frames` on the header alone, before any bucket is allocated or received: every frame
    is a zero-stride view (no memory) of its announced size. Raises `WeightsLayoutError`."""
    zero = np.zeros(1, dtype=np.uint8)
    check_frames(header, [memoryview(np.broadcast_to(zero, (size,))) for size in header.bucket_sizes])


def allocate_buckets(sizes: Sequence[int], device: Any) -> list[Any]:
    """Zeroed uint8 tensors of `sizes` on `device` (zeroed: alignment gaps stay zero, as in the ZeroMQ path)."""
    import torch

    return [torch.zeros(int(size), dtype=torch.uint8, device=device) for size in sizes]


def copy_into_buckets(specs: Sequence[TensorSpec], weights: Iterable[tuple[str, Any]], buckets: Sequence[Any]) -> None:
    """Copy each (name, tensor or numpy array) into its slot (`specs`, in the same order) of `buckets` (uint8 tensors
    on any device; a copy across devices is one `copy_`). Raises ValueError for a name, shape or dtype that is not the
    layout's (the layout describes another model)."""
    import torch

    count = 0
    for spec, (name, tensor) in zip(specs, weights, strict=True):
        if name != spec.name:
            raise ValueError(f"weights arrive out of layout order: got '{name}', expected '{spec.name}'")
        if isinstance(tensor, np.ndarray):  # bfloat16 arrives as its uint16 words (common.weights)
            tensor = torch.from_numpy(tensor)
            if spec.dtype == "bfloat16" and tensor.dtype == torch.uint16:
                tensor = tensor.view(torch.bfloat16)
        if list(tensor.shape) != list(spec.shape) or str(tensor.dtype).removeprefix("torch.") != spec.dtype:
            raise ValueError(
                f"weights '{name}': {tensor.dtype} {list(tensor.shape)} != layout {spec.dtype} {list(spec.shape)}"
            )
        slot = buckets[spec.bucket][spec.offset : spec.offset + spec.nbytes]
        slot.view(tensor.dtype).view(tensor.shape).copy_(tensor.detach(), non_blocking=True)
        count += 1
    if count != len(specs):
        raise ValueError(f"{count} tensors arrived, the layout has {len(specs)}")
