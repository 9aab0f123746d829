"""`tandem buffer CONFIG`: the buffer service, one process with one request socket.

    tandem buffer demo --buffer.port 5555
    python -m launch.cli buffer run.toml --buffer.persist true      # resume from <run_dir>/buffer/journal.bin

It owns the dataset cursor, the prompt leases and the replay buffer (see `buffers.core` for the answer to each
message, `buffers.staleness` for the staleness bound). The loop: poll one request (at most POLL_MS), answer it,
and between requests do the housekeeping (expire leases, time out held batch requests, compact the journal)
and write `buffer/…` metrics to `<run_dir>/buffer.jsonl` every METRICS_EVERY_S. SIGTERM or SIGINT ends the
loop after the current request, and so does the end of the run: once the learner reported its last step, lease
requests and heartbeats are answered `RunOver`, and the buffer exits 0 when every live generator has heard it and
holds no lease (at most `buffer.heartbeat_timeout_s` later; `buffers.run_end`). The journal, metrics and log are
flushed and closed. Imports no torch:
prompts travel as chats, generators render them.

With eval.sets set, the buffer also loads the eval sets at start (an unknown set or an unreadable file stops it
there) and runs the evaluation rounds (`buffers.evaluation`): each accepted eval result is one record of
`<run_dir>/eval.jsonl` and TensorBoard `tb/eval`, at step = the result's policy_version, on the clock of
buffer.jsonl. A row is written right after its result is accepted, not journaled: a crash in between loses that
row (its round still counts as done).
"""

from __future__ import annotations

import dataclasses
import signal
import time
from pathlib import Path
from typing import Any

from buffers.core import BufferCore, RequestRejected
from buffers.evaluation import EvalScheduler
from buffers.journal import Journal
from buffers.state import BufferSettings, BufferState
from common.config import ConfigError, EnvConfig, TandemConfig
from common.logs import setup_logging
from common.metrics import MetricsSink
from common.prompt_sources import load_env_prompts
from common.serving import answer_safely
from common.sockets import Server, SocketSecurity
from common.trackers import Trackers
from common.types import MAX_NAME_CHARS, MAX_REWARD_COMPONENTS, max_group_bytes

POLL_MS = 20
HOUSEKEEPING_EVERY_S = 0.1
METRICS_EVERY_S = 2.0


def load_prompt_records(env: EnvConfig, seed: int) -> list[Any]:
    """The dataset as PromptRecords (prompt_id, messages, metadata), from `env.kind`. Arithmetic prompts and word
    problems come from `env.split` (by default `train`: no expression or question of the held-out split that
    evaluation measures is trained on)."""
    from common import tasks

    if env.kind == "arithmetic":
        return tasks.arithmetic_prompts(
            env.num_prompts, seed=seed, difficulty=env.difficulty, split=env.split, shots=env.shots
        )
    if env.kind == "word_problems":
        from common.word_problems import word_problem_prompts

        return word_problem_prompts(
            env.num_prompts, seed=seed, difficulty=env.difficulty, split=env.split, shots=env.shots
        )
    return load_env_prompts(env, seed)  # env.source, or env.sources mixed by weight (docs/datasets.md)


def journal_path(run_dir: Path) -> Path:
    return Path(run_dir) / "buffer" / "journal.bin"


def max_eval_result_bytes(config: TandemConfig) -> int:
    """The most an EvalResult of this run's evaluation can hold: eval.max_prompts x (greedy + samples) completions
    of 12 bytes (reward, tokens, the flags and verdicts) and every reward component at its widest, the prompt ids
    and the components' names (0 without evaluation)."""
    if not config.eval.enabled:
        return 0
    completions = config.eval.max_prompts * (int(config.eval.greedy) + config.eval.samples)
    per_completion = 12 + 4 * MAX_REWARD_COMPONENTS
    return completions * per_completion + 9 * config.eval.max_prompts + 4 * MAX_NAME_CHARS * MAX_REWARD_COMPONENTS


def socket_security(config: TandemConfig) -> SocketSecurity:
    """The run's socket security, with a message limit of twice the largest group the buffer accepts plus 1 MiB
    (`common.types.max_group_bytes`; within run.max_message_mb): nothing the buffer takes is larger, so a peer
    cannot make it hold a message of run.max_message_mb (1 GiB by default) before rejecting it. A group over its
    limits but under this one gets a counted rejection that says what is wrong (too_long); a larger message is
    refused by ZeroMQ, which drops the connection.

    Raises ConfigError when run.max_message_mb cannot carry the largest group (from a generator) or the largest
    share of a batch (to a learner rank: learner.groups_per_step / learner.world_size groups)."""
    security = SocketSecurity.from_run(config.run)
    largest = max_group_bytes(config.algo.group_size, config.model.max_model_len)
    share = config.learner.groups_per_step // config.learner.world_size * largest
    if security.max_message_bytes < share:
        raise ConfigError(
            f"run.max_message_mb: {config.run.max_message_mb:g} MiB cannot carry a learner rank's share of a batch "
            f"of the largest groups the buffer accepts ({share / (1 << 20):.1f} MiB: groups_per_step / world_size x "
            "algo.group_size x model.max_model_len tokens); raise it, or lower those"
        )
    group_limit = max(2 * largest, max_eval_result_bytes(config)) + (1 << 20)
    return dataclasses.replace(security, max_message_bytes=min(security.max_message_bytes, group_limit))


def run(config: TandemConfig) -> int:
    """Serve until SIGTERM/SIGINT, or until the run is over (the learner's final report came and every live
    generator heard it: `buffers.run_end`); returns 0. Raises on a port in use or an unreadable dataset/journal."""
    run_dir = config.run.run_dir
    log = setup_logging("buffer", 0, run_dir, simulation=config.run.simulate)
    stop = _stop_on_signals()
    prompts = load_prompt_records(config.env, config.run.seed)
    journal = Journal(journal_path(run_dir)) if config.buffer.persist else None
    evaluation = EvalScheduler.from_config(config)  # None without eval.sets
    state = BufferState(BufferSettings.from_config(config), prompts, journal, evaluation)
    restored = state.restore(time.time())
    if restored:
        log.info(
            "resumed from %s: %d events, %d groups buffered, epoch %d, learner step %d",
            journal.path,
            restored,
            len(state.replay),
            state.dispenser.epoch,
            state.learner_version,
        )
    server = Server(config.buffer.host, config.buffer.port, socket_security(config), name="buffer")
    core = BufferCore(state, wire_rejections=server.rejected)
    trackers = Trackers.from_config(config)
    sink = MetricsSink(run_dir, "buffer", simulation=config.run.simulate, trackers=trackers)
    for extension in core.extensions:  # their own rows (eval.jsonl), on the clock of buffer.jsonl
        extension.open_sink(run_dir, sink.start_time, config.run.simulate, trackers)
    log.info(
        "buffer on %s:%d: %d prompts, capacity %d samples, η = %d, B = %d, messages up to %.2f MB",
        config.buffer.host,
        config.buffer.port,
        len(prompts),
        config.buffer.capacity,
        config.algo.max_staleness,
        config.learner.groups_per_step,
        server.security.max_message_bytes / 1e6,
    )
    next_housekeeping = next_metrics = time.monotonic()
    try:
        while not stop:
            request = server.poll(timeout_ms=POLL_MS)
            if request is not None:  # a fault while answering is a rejected message (common.serving), not the end
                answer_safely(server, request, lambda request: _answer(server, core, request))
                for extension in core.extensions:
                    extension.flush()
            if time.monotonic() >= next_housekeeping:
                for reply_to, message in core.tick(time.time()):
                    server.reply(reply_to, message)
                if core.run_over(time.time()):
                    stop.append(f"run over at learner step {core.end.step}")
                next_housekeeping = time.monotonic() + HOUSEKEEPING_EVERY_S
            if time.monotonic() >= next_metrics:
                sink.log(state.learner_version, core.metrics())
                state.save_counters()
                next_metrics = time.monotonic() + METRICS_EVERY_S
    finally:
        sink.log(state.learner_version, core.metrics())
        state.save_counters()
        sink.close()
        for extension in core.extensions:
            extension.close()
        server.close()
        if journal is not None:
            journal.close()
        log.info("buffer stopped (%s): %s", stop[0] if stop else "error", _summary(core.counters()))
    return 0


def _answer(server: Server, core: BufferCore, request: Any) -> None:
    """Answer one request; a refused one (malformed for its state, or from a role that may not send it: see
    `buffers.authority`) gets an ErrorReply, is counted under its kind and is not journaled (the buffer stays up)."""
    try:
        replies = core.handle(request.message, request, request.sender, time.time(), role=request.role)
    except RequestRejected as refusal:
        server.reject(request, refusal.reason, refusal.kind)
        return
    for reply_to, message in replies:
        server.reply(reply_to, message)


def _stop_on_signals() -> list[str]:
    """A list that becomes non-empty (the signal's name) on SIGTERM or SIGINT."""
    stop: list[str] = []

    def request_stop(signum: int, _: Any) -> None:
        stop.append(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    return stop


def _summary(counters: dict[str, int]) -> str:
    keys = ("arrived", "trained", "dropped_stale", "dropped_no_signal", "evicted", "rejected", "buffered", "duplicates")
    keys += ("leases_issued",)
    if "eval_issued" in counters:  # evaluating: its accounting line too
        keys += ("eval_issued", "eval_done", "eval_requeued", "eval_outstanding", "eval_results_accepted")
        keys += ("eval_superseded", "eval_final_timed_out")
    return ", ".join(f"{key} {counters.get(key, 0)}" for key in keys)
