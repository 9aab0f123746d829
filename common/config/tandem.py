"""`TandemConfig`: every section, and the rules that cross sections (one place for them)."""

from __future__ import annotations

from pydantic import (
    model_validator,
)

from common.config.algo import AlgoConfig
from common.config.base import (
    OFFLINE_STAGES,
    OPENAI_ENDPOINT,
    OPENAI_PORT_OFFSET,
    PORT_OFFSETS,
    _Section,
    connect_address,
    is_loopback,
    reaches,
)
from common.config.buffer import BufferConfig
from common.config.env import EnvConfig
from common.config.evaluation import EvalConfig
from common.config.generator import GeneratorConfig
from common.config.learner import LearnerConfig
from common.config.model import ModelConfig
from common.config.offline import DpoConfig, RmConfig, SftConfig
from common.config.ray_cluster import RayConfig
from common.config.reward import RewardConfig
from common.config.run import RunConfig
from common.config.slurm import SlurmConfig
from common.config.tracking import TrackingConfig
from common.config.weights import WeightsConfig


class TandemConfig(_Section):
    """The whole run: every role's section. Cross-role rules are checked here."""

    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    env: EnvConfig = EnvConfig()
    algo: AlgoConfig = AlgoConfig()
    generator: GeneratorConfig = GeneratorConfig()
    buffer: BufferConfig = BufferConfig()
    learner: LearnerConfig = LearnerConfig()
    weights: WeightsConfig = WeightsConfig()
    reward: RewardConfig = RewardConfig()
    ray: RayConfig = RayConfig()
    sft: SftConfig = SftConfig()
    rm: RmConfig = RmConfig()
    dpo: DpoConfig = DpoConfig()
    eval: EvalConfig = EvalConfig()
    tracking: TrackingConfig = TrackingConfig()
    slurm: SlurmConfig = SlurmConfig()

    @property
    def eval_max_tokens(self) -> int:
        """The token limit of an eval completion: eval.max_tokens, else generator.max_tokens."""
        return self.eval.max_tokens or self.generator.max_tokens

    @property
    def buffer_sampling(self) -> str:
        """buffer.sampling with `auto` resolved: `oldest_first` for a multi-turn run (env.environment), else `fifo`."""
        if self.buffer.sampling != "auto":
            return self.buffer.sampling
        return "oldest_first" if self.env.environment else "fifo"

    @property
    def overlong_budget(self) -> int:
        """L_max of the overlong penalty, in model-generated tokens: generator.max_tokens (one turn), or with a
        multi-turn environment env.max_total_tokens (the episode's completion budget, which bounds its model tokens;
        generator.max_tokens is then one turn's)."""
        return self.env.max_total_tokens if self.env.environment else self.generator.max_tokens

    @property
    def overlong_window(self) -> int:
        """DAPO's L_cache in tokens: algo.overlong_window, else a quarter of `overlong_budget` (at least 1)."""
        return self.algo.overlong_window or max(1, self.overlong_budget // 4)

    @property
    def learner_end_wait_s(self) -> float:
        """How long learner rank 0 may keep its weights published after its last step while the buffer's end waits
        for work on the final version (the final evaluation round): eval.final_timeout_s with eval.sets and
        eval.at_end, else 0 (the learner exits at once)."""
        return self.eval.final_timeout_s if self.eval.enabled and self.eval.at_end else 0.0

    @property
    def reward_service(self) -> bool:
        """Whether this run has a reward service to start: env.reward_model is set and not scored in-process."""
        return bool(self.env.reward_model) and not self.reward.in_process

    def _fill_unwritten_endpoints(self) -> None:
        """Ports the config does not write follow run.port_base (PORT_OFFSETS, and the OpenAI endpoint's port), then
        addresses it does not write follow the host and port they connect to. Written keys stay as written and are
        checked by `_unreachable_addresses`; a resolved `config.json` writes every one of them."""
        base = self.run.port_base
        if base is not None:
            for section, key, offset in PORT_OFFSETS:
                part = getattr(self, section)
                if key not in part.model_fields_set:
                    setattr(part, key, base + offset)
            if self.env.environment == OPENAI_ENDPOINT and "port" not in self.env.environment_args:
                self.env.environment_args = {**self.env.environment_args, "port": base + OPENAI_PORT_OFFSET}
        buffer = connect_address(self.buffer.host, self.buffer.port)
        weights = connect_address(self.learner.weights_host, self.learner.weights_port)
        reward = connect_address(self.reward.host, self.reward.port)
        for part, key, address in (
            (self.generator, "buffer_address", buffer),
            (self.learner, "buffer_address", buffer),
            (self.generator, "weights_address", weights),
            (self.reward, "address", reward),
        ):
            if key not in part.model_fields_set:
                setattr(part, key, address)

    def _unreachable_addresses(self) -> list[str]:
        """One line per address that does not reach the socket it names (see `reaches`)."""
        buffer = (self.buffer.host, self.buffer.port, "buffer", "buffer.host and buffer.port")
        weights = (
            self.learner.weights_host,
            self.learner.weights_port,
            "the learner's publisher",
            "learner.weights_host and learner.weights_port",
        )
        reward = (self.reward.host, self.reward.port, "the reward service", "reward.host and reward.port")
        return [
            f"{key}: '{address}' does not reach {what} {host}:{port} (leave it out to follow {follows})"
            for key, address, (host, port, what, follows) in (
                ("generator.buffer_address", self.generator.buffer_address, buffer),
                ("learner.buffer_address", self.learner.buffer_address, buffer),
                ("generator.weights_address", self.generator.weights_address, weights),
                ("reward.address", self.reward.address, reward),
            )
            if not reaches(address, host, port)
        ]

    def _lora_problems(self) -> list[str]:
        """[learner.lora] against the rest: what a LoRA learner or its weight updates cannot do here."""
        lora, problems = self.learner.lora, []
        if lora.rank == 0:
            if lora.sync == "adapter":
                problems.append(
                    'learner.lora.sync: "adapter" needs adapters (learner.lora.rank > 0); set the rank, or leave '
                    "sync out (full weights)"
                )
            return problems
        if lora.sync == "adapter" and self.weights.transport == "broadcast":
            problems.append(
                'learner.lora.sync: "adapter" updates travel over weights.transport = "relay" or "star" (the '
                'broadcast group carries no adapter settings); use one of them, or learner.lora.sync = "merged"'
            )
        return problems

    @model_validator(mode="after")
    def _cross_role_rules(self) -> TandemConfig:
        self._fill_unwritten_endpoints()
        problems = self._unreachable_addresses()
        if self.run.curve_keys_dir is None and not self.run.insecure:
            binds = [("buffer.host", self.buffer.host), ("learner.weights_host", self.learner.weights_host)]
            if self.weights.transport == "relay":
                binds.append(("weights.relay_host", self.weights.relay_host))
            if self.reward_service:
                binds.append(("reward.host", self.reward.host))
            for key, host in binds:
                if not is_loopback(host):
                    problems.append(
                        f"{key}: binding '{host}' exposes the socket beyond this machine: set run.curve_keys_dir "
                        "(CurveZMQ keys) or run.insecure = true on a trusted network"
                    )
        if self.learner.weights_port == self.buffer.port and self.learner.weights_host == self.buffer.host:
            problems.append(f"learner.weights_port: must differ from buffer.port ({self.buffer.port})")
        if self.reward_service and self.reward.port in (self.buffer.port, self.learner.weights_port):
            problems.append(
                f"reward.port: must differ from buffer.port ({self.buffer.port}) and learner.weights_port "
                f"({self.learner.weights_port})"
            )
        for name in OFFLINE_STAGES:
            batch_size = getattr(self, name).batch_size
            if batch_size % self.learner.world_size:
                problems.append(
                    f"{name}.batch_size: must be a multiple of learner.world_size = {self.learner.world_size} "
                    f"(got {batch_size})"
                )
        if self.learner.sync_every > self.algo.max_staleness + 1:
            problems.append(
                f"learner.sync_every: must be <= algo.max_staleness + 1 = {self.algo.max_staleness + 1} "
                f"(got {self.learner.sync_every}); weights published less often are staler than η allows"
            )
        if self.run.placement == "colocated" and self.algo.max_staleness > 0:
            problems.append(
                f'run.placement: "colocated" gives every core to each role in turn, which only synchronous training '
                f"leaves room for: set algo.max_staleness = 0 (got {self.algo.max_staleness}), or "
                'run.placement = "split" (the default) to train asynchronously'
            )
        problems += batch_split_problems(self.learner, self.algo, self.learner.world_size)
        problems += nodes_problems(self.learner)
        if self.run.simulate and self.weights.transport == "broadcast":
            problems.append(
                'weights.transport: "broadcast" rounds are received inside vLLM\'s workers, and run.simulate has '
                'no vLLM: use "relay" or "star" in a simulation'
            )
        if self.learner.packing and not self.learner.max_tokens_per_micro_batch:
            problems.append(
                "learner.packing: needs learner.max_tokens_per_micro_batch > 0 (the token budget of a packed "
                "micro-batch); set it, or learner.packing = false"
            )
        if self.buffer.capacity < self.learner.groups_per_step * self.algo.group_size:
            problems.append(
                f"buffer.capacity: must hold one batch = {self.learner.groups_per_step * self.algo.group_size} "
                f"samples (got {self.buffer.capacity})"
            )
        if self.buffer.filter == "no_signal" and self.algo.group_size < 2:
            problems.append(
                "buffer.filter: no_signal needs algo.group_size >= 2 (a group of one sample has no reward spread, "
                'so every group would be dropped); raise algo.group_size, or buffer.filter = "none"'
            )
        if self.buffer.filter == "no_signal" and self.algo.distill_alone:
            problems.append(
                "buffer.filter: no_signal drops the groups whose rewards are all equal, but with algo.distill_alone "
                "the teacher's term, not the reward, is the signal, and every group has it; set buffer.filter = "
                '"none", or algo.distill_alone = false'
            )
        if 0 < self.ray.generator_gpus < self.generator.tensor_parallel_size:
            problems.append(
                f"ray.generator_gpus: must be 0 (CPU) or >= generator.tensor_parallel_size = "
                f"{self.generator.tensor_parallel_size} (got {self.ray.generator_gpus})"
            )
        if self.generator.max_tokens >= self.model.max_model_len:
            problems.append(
                f"generator.max_tokens: must be < model.max_model_len = {self.model.max_model_len} "
                f"(got {self.generator.max_tokens}); the prompt needs room in the context too"
            )
        if self.algo.overlong == "penalty" and self.algo.overlong_window > self.overlong_budget:
            problems.append(
                f"algo.overlong_window: must be <= the completion budget {self.overlong_budget} "
                f"({'env.max_total_tokens' if self.env.environment else 'generator.max_tokens'}; got "
                f"{self.algo.overlong_window}); lower it, or 0 for a quarter of the budget"
            )
        if self.eval.enabled:
            if not (self.eval.reward_fn or self.env.reward_fn):  # with env.environment too: the sets are one turn
                problems.append("eval.reward_fn: empty, and so is env.reward_fn: the eval sets need a reward function")
            if self.eval.max_tokens >= self.model.max_model_len:
                problems.append(
                    f"eval.max_tokens: must be < model.max_model_len = {self.model.max_model_len} "
                    f"(got {self.eval.max_tokens})"
                )
        problems += self._lora_problems()
        if self.ray.max_learner_restarts and not self.learner.save_every:
            problems.append(
                "ray.max_learner_restarts: needs learner.save_every > 0 (a restarted learner resumes "
                "from the latest complete checkpoint)"
            )
        if problems:
            raise ValueError("\n".join(problems))  # one line each (see _format_validation_error)
        return self


def batch_split_problems(learner: LearnerConfig, algo: AlgoConfig, world_size: int) -> list[str]:
    """How a batch splits over `world_size` data-parallel ranks: whole groups per rank, and a rank's share divided
    into learner.mini_batches equal parts. One rule for both places that need it: the config at load (with
    learner.world_size) and the trainer (`learners.trainer.Trainer`, with the ranks it really has, which a Ray
    placement or a hand-built section may set apart from the config's)."""
    problems = []
    if learner.groups_per_step % world_size:
        problems.append(
            f"learner.groups_per_step: must be a multiple of learner.world_size = {world_size} "
            f"(got {learner.groups_per_step})"
        )
    rank_samples = learner.groups_per_step // world_size * algo.group_size
    if rank_samples % learner.mini_batches:
        problems.append(
            f"learner.mini_batches: must divide a rank's share of the batch, learner.groups_per_step / "
            f"learner.world_size x algo.group_size = {rank_samples} samples (got {learner.mini_batches})"
        )
    return problems


def nodes_problems(learner: LearnerConfig) -> list[str]:
    """Learner ranks across hosts started by hand (learner.nnodes): the same number on each, and a place for this
    one."""
    problems = []
    if learner.world_size % learner.nnodes:
        problems.append(
            f"learner.world_size: must be a multiple of learner.nnodes = {learner.nnodes}, the same ranks on each host "
            f"(got {learner.world_size})"
        )
    if learner.node_rank >= learner.nnodes:
        problems.append(f"learner.node_rank: must be below learner.nnodes = {learner.nnodes} (got {learner.node_rank})")
    return problems
