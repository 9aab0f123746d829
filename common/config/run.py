"""`[run]`: the run's name, directory, seed, ports, keys and placement."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import (
    Field,
    field_validator,
)

from common.config.base import (
    _RUN_NAME,
    MAX_MESSAGE_MB,
    MAX_PORT_OFFSET,
    MAX_SEED_PART,
    OPENAI_ENDPOINT,
    _not_empty_path,
    _Section,
)
from common.config.tracking import TRACKERS


class RunConfig(_Section):
    """Run-wide settings: identity, directories, seed, security of the sockets."""

    name: str = Field("tandem", description="Run name; the run directory is `<root>/<name>`.", min_length=1)
    root: Path = Field(Path("runs"), description="Parent folder of run directories.")
    seed: int = Field(0, description="Seed for the prompt order, sampling and initialisation.", ge=0, le=MAX_SEED_PART)
    simulate: bool = Field(
        False,
        description="SIMULATION MODE: replace vLLM and DeepSpeed by compute stand-ins of configured cost "
        "(see `[generator] sim_*` and `[learner] sim_*`); sockets, leases, staleness and the buffer stay real.",
    )
    insecure: bool = Field(
        False,
        description="Allow binding a non-loopback address without CurveZMQ keys (logs a warning). "
        "Only for trusted private networks.",
    )
    curve_keys_dir: Path | None = Field(
        None,
        description="Folder with CurveZMQ keys made by `tandem keys DIR`: `server.key_secret` and one key per role "
        "(`generator`, `learner`, `reward`, `eval`, `monitor`: `ROLE.key` public, `ROLE.key_secret` mode 0600). The "
        "key a client connects with is its role. Required to bind a non-loopback address unless insecure.",
    )
    max_message_mb: float = Field(
        1024.0,
        description="Largest message any socket accepts, in MiB (weights travel in buckets below it).",
        gt=0,
        le=MAX_MESSAGE_MB,
    )
    share_gpus: bool = Field(
        False,
        description="`tandem run` on a machine with fewer GPUs than its roles need (learner.world_size, then "
        "generator.tensor_parallel_size per generator, then one for the reward service): false = refuse to start, "
        "true = hand the GPUs out in that order again from the first (one GPU: every role on it, the demo), "
        "provided the vLLM engines on a shared GPU together take at most half of it "
        "(generator.gpu_memory_utilization each): the learner, started first, and the reward model need the rest.",
    )
    placement: Literal["split", "colocated"] = Field(
        "split",
        description="How `tandem run` shares this machine's cores. `split`: the generators the first half, the "
        "learner the rest (the reward service, if any, the generators' last core). `colocated`: every role pinned "
        "to every core, each phase of synchronous training (generate, then train) given the whole machine in "
        "turn, as OpenRLHF's --colocate_all_models and veRL's hybrid engine do; only with algo.max_staleness = 0 "
        "(asynchronous roles would fight for the cores). Explicit generator/learner/reward.cpu_cores win either "
        "way. `tandem ray` refuses `colocated` (Ray places each role by its resources). What it costs: "
        "docs/placement.md.",
    )
    port_base: int | None = Field(
        None,
        description="One number that moves every fixed port the run binds: buffer.port = base, "
        "learner.weights_port = base + 1, weights.broadcast_port = base + 2, reward.port = base + 4 and, with the "
        f"OpenAI endpoint (env.environment = `{OPENAI_ENDPOINT}`), env.environment_args.port = base + 3. A port key "
        "written explicitly wins. Unset: 5555, 5556, 29517, 5559 and 8000. (`tandem ray` picks free ports on its "
        "nodes for the buffer, the publisher and the reward service; relays and torchrun always take free ports.)",
        ge=1,
        le=65535 - MAX_PORT_OFFSET,
    )

    trackers: list[Literal[TRACKERS]] = Field(  # type: ignore[valid-type]
        ["tensorboard"],
        description="Where every role's metrics go besides `<run_dir>/<stream>.jsonl`: any of `tensorboard` "
        "(`<run_dir>/tb/<stream>`), `wandb` and `mlflow` (settings in `[tracking]`; `pip install "
        "'tandem-rl[trackers]'`). Empty: the JSON lines only.",
    )

    @field_validator("trackers")
    @classmethod
    def _trackers_once(cls, trackers: list[str]) -> list[str]:
        if len(set(trackers)) != len(trackers):
            raise ValueError(f"names a tracker twice: {trackers}")
        return trackers

    @field_validator("name")
    @classmethod
    def _name_is_one_folder(cls, name: str) -> str:
        if not _RUN_NAME.match(name):
            raise ValueError(
                "must be letters, digits, '_', '.' or '-', not starting with '.': it names the folder <root>/<name>"
            )
        return name

    @field_validator("root", mode="before")
    @classmethod
    def _root_not_empty(cls, root: Any) -> Any:
        return _not_empty_path(root, "'.' is the working directory")

    @field_validator("curve_keys_dir", mode="before")
    @classmethod
    def _keys_dir_not_empty(cls, folder: Any) -> Any:
        return _not_empty_path(folder, "leave it out (no keys: loopback only) or name the folder of the keys")

    @property
    def run_dir(self) -> Path:
        return self.root / self.name
