"""The messages of a weights update between a learner's publisher and the generators, declared as every wire
message is (`common.types`: `message`, field bounds, `validate`) and registered by importing this module
(`common.wire` does).

A generator asks with `WeightsRequest`; the publisher answers `WeightsNotNewer` or a `WeightsHeader` whose
`transport` says how the payload travels: as raw frames after the header ('zmq'), in chunks pulled from a parent
('relay': `ChunkRequest`, `ChunkReply`, `ChunkUnavailable`, learners/fanout.py) or over a static group
('broadcast', learners/broadcast_publisher.py). Checks of the payload itself are `common.weights`'.
"""

from __future__ import annotations

from dataclasses import field

from common.types import MAX_VERSION, ContractError, count, defaulted, message, version


@message("tensor_spec")
class TensorSpec:
    """Where one tensor lies in the concatenated payload of a weights update."""

    name: str
    dtype: str  # numpy/torch dtype name: "bfloat16", "float32", ...
    shape: list[int] = count()
    bucket: int = count()  # index of the bucket (frame) that holds it
    offset: int = count()  # byte offset inside that bucket
    nbytes: int = count()


MAX_ADDRESS_CHARS = 300  # host:port, or "host:<generator id>" for a host copy
MAX_LORA_RANK = 4096  # an adapter's rank (vLLM 0.32 serves up to 512: actors.engine.vllm refuses more at start)
MAX_LORA_ALPHA = 1e6  # the adapter's scale is lora_alpha / lora_rank
MAX_LORA_MODULES = 64  # target module names of an adapter (Llama has 7 projections)
MAX_MODULE_NAME_CHARS = 100


@message("weights_request")
class WeightsRequest:
    """Generator -> learner publisher: send weights newer than `have_version` (-1 = any).

    Relay transport (learners/fanout.py): `relay_address` is where this generator serves chunks to children
    ("" = it cannot relay), `host_id` the host whose copy it shares. A generator whose parent failed asks again with
    `failed_parent` (the parent's address as the publisher gave it) and `failure` ("stalled", "bad_chunk",
    "unavailable"), for `version`: the update it was receiving (-1 = none)."""

    generator_id: int = count()
    have_version: int = version(low=-1)
    relay_address: str = ""
    host_id: str = ""
    failed_parent: str = ""
    failure: str = ""
    version: int = defaulted(-1, -1, MAX_VERSION)
    # Broadcast transport (learners/broadcast_publisher.py): `ready_version` = the announced round this generator
    # can receive at once (-1 = none yet); `group_workers` = its vLLM workers, one group rank each (its TP size).
    ready_version: int = defaulted(-1, -1, MAX_VERSION)
    group_workers: int = defaulted(1, 1, 4096)

    def validate(self) -> None:
        for name in ("relay_address", "host_id", "failed_parent", "failure"):
            if len(getattr(self, name)) > MAX_ADDRESS_CHARS:
                raise ContractError(f"weights_request.{name}: longer than {MAX_ADDRESS_CHARS} characters")


@message("weights_header")
class WeightsHeader:
    """Learner -> generator: the header of a weights update. `transport` says how the payload travels: 'zmq' (the
    buckets follow this header as raw frames), 'relay' (chunks pulled from `parent`, checked against
    `chunk_digests`), 'broadcast' (over the static group). `lora_rank` > 0: an adapter-only update (the LoRA matrices,
    `common.weights.check_adapter`); 0: the full weights."""

    policy_version: int = version()
    tensors: list[TensorSpec]
    bucket_sizes: list[int] = count()  # bytes of each bucket
    transport: str = "zmq"
    # relay: the payload comes in chunks (`common.weights.chunk_ranges`) pulled from `parent` ("" = this publisher,
    # "host:<generator id>" = that generator's copy on this host, else a generator's relay address); every chunk's
    # sha256 comes here, from the publisher, so a relay cannot alter what it forwards. `depth`: hops from the
    # publisher once attached there.
    chunk_bytes: int = defaulted(0)
    chunk_digests: list[str] = field(default_factory=list)
    parent: str = ""
    depth: int = defaulted(0)
    # An adapter-only update (learner.lora.sync = "adapter"): `lora_rank` > 0, the tensors are the LoRA A/B matrices
    # of the modules named in `lora_target_modules` (peft's names without "base_model.model.", e.g.
    # "model.layers.0.self_attn.q_proj.lora_A.weight"), scaled by lora_alpha / lora_rank. 0 = full weights.
    lora_rank: int = defaulted(0, 0, MAX_LORA_RANK)
    lora_alpha: float = 0.0
    lora_target_modules: list[str] = field(default_factory=list)
    # broadcast: the round's group, set once every member is known (`group_epoch` -1: announced, not yet sealed).
    # A member's workers are ranks group_rank .. group_rank + its workers - 1 of `group_size` (rank 0: the
    # publisher), rendezvous at the publisher's broadcast_host:group_port; group_rank -1 = not in this round.
    group_epoch: int = defaulted(-1, -1, MAX_VERSION)
    group_port: int = defaulted(0, 0, 65535)
    group_size: int = defaulted(0, 0, 1 << 20)
    group_rank: int = defaulted(-1, -1, 1 << 20)

    def validate(self) -> None:
        if len(self.parent) > MAX_ADDRESS_CHARS:
            raise ContractError(f"weights_header.parent: longer than {MAX_ADDRESS_CHARS} characters")
        self._validate_adapter()
        if any(len(d) != 64 for d in self.chunk_digests):
            raise ContractError("weights_header.chunk_digests: each must be a sha256 hex digest (64 characters)")
        for spec in self.tensors:
            if not 0 <= spec.bucket < len(self.bucket_sizes):
                raise ContractError(f"weights_header.{spec.name}: bucket {spec.bucket} out of range")
            if spec.offset < 0 or spec.offset + spec.nbytes > self.bucket_sizes[spec.bucket]:
                raise ContractError(f"weights_header.{spec.name}: bytes outside its bucket")

    def _validate_adapter(self) -> None:
        if self.lora_rank == 0:
            if self.lora_alpha != 0.0 or self.lora_target_modules:
                raise ContractError("weights_header: lora_alpha / lora_target_modules set on a full update (rank 0)")
            return
        if not 0 < self.lora_alpha <= MAX_LORA_ALPHA:
            raise ContractError(f"weights_header.lora_alpha: {self.lora_alpha} is outside (0, {MAX_LORA_ALPHA}]")
        modules = self.lora_target_modules
        if not 1 <= len(modules) <= MAX_LORA_MODULES:
            raise ContractError(f"weights_header.lora_target_modules: {len(modules)} names (1 to {MAX_LORA_MODULES})")
        if len(set(modules)) != len(modules):
            raise ContractError("weights_header.lora_target_modules: a name is repeated")
        for name in modules:
            if len(name) > MAX_MODULE_NAME_CHARS or not name.isidentifier() or not name.isascii():
                raise ContractError(
                    f"weights_header.lora_target_modules: {name[:40]!r} is not a module name (an ASCII identifier "
                    f"of at most {MAX_MODULE_NAME_CHARS} characters, e.g. 'q_proj')"
                )


@message("weights_not_newer")
class WeightsNotNewer:
    """Learner -> generator: nothing newer than what you have; `latest_version` is the current one."""

    latest_version: int = version(low=-1)


@message("chunk_request")
class ChunkRequest:
    """Generator -> its relay parent (or the publisher): chunks of `version` from index `first`, at most
    `max_chunks` of them. The parent answers with the contiguous run of chunks it holds from `first` (at least
    one: it holds the request until chunk `first` arrives), or `ChunkUnavailable`."""

    generator_id: int = count()
    version: int = version()
    first: int = count()
    max_chunks: int = count(1, 1024)


@message("chunk_reply")
class ChunkReply:
    """The chunks `first .. first + n_chunks - 1` of `version`, one raw frame each (checked against the digests of
    the publisher's header by the receiver, never trusted). n_chunks = 0: the parent is alive but does not hold
    chunk `first` yet (it answers a held request so after a while, so a child tells a waiting parent from a dead
    one)."""

    version: int = version()
    first: int = count()
    n_chunks: int = count(0, 1024)


@message("chunk_unavailable")
class ChunkUnavailable:
    """The parent holds no copy of `version` (any more): ask the publisher for another parent."""

    version: int = version()
    reason: str = ""
