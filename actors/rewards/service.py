"""The reward service role: a learned reward model (env.reward_model) scores whole groups for the generators.

    tandem reward CONFIG                  # binds reward.host:reward.port (tandem run / tandem ray start it)

Protocol (common.types): `RewardRequest(request_id, prompt, completions)` -> `RewardReply(request_id, scores)`,
one score per completion in order (raw, or normalised with reward.normalize), or `RewardReply(request_id, [],
error)` when the group could not be scored. Only the roles `generator` and `eval` may ask (their CurveZMQ key
with run.curve_keys_dir; declared on loopback without keys); anything else is refused.

The loop, top to bottom (`run`):
  1. take the requests already queued (waiting up to POLL_S for one when none is pending), up to MAX_PENDING;
  2. score at most reward.batch_size completions, taken round-robin from the pending requests (each gives what
     it has left, up to what the batch has room for, and goes to the back of the line): several generators'
     groups share forward passes, and one huge group is scored in batch-sized slices between the others, so a
     small request waits at most one batch behind it, never the whole of it;
  3. reply to each request whose completions are all scored;
  4. every REPORT_S: log and write the counters (`reward_service/...` in <run_dir>/reward-0.jsonl).
SIGTERM or SIGINT ends the loop after the batch in hand; the role then exits 0.

Before decoding: the socket (`open_reward_server`) refuses a message from a peer of another role or of none
(`forbidden_role`, common.sockets.Server roles) and any frame over MAX_REQUEST_MB (ZeroMQ drops the connection
at that size): such a message costs the service no decode and no copy.

Failure modes (deliberately survived, counted and logged; the service stays up): a malformed, oversized or
wrong-version message (rejected by common.sockets with its reason: `rejected_<kind>`); a request from a role that
may not ask or of none (`rejected_forbidden_role`, before its body is decoded); a group whose scoring raised (its requests are scored again one by one, and
the one that still fails gets an error reply: `score_errors`). A reply to a generator that went away is dropped.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path

from common.config import TandemConfig, parse_cores
from common.logs import setup_logging
from common.metrics import MetricsSink
from common.signals import caught_signals
from common.sockets import Request, Server, SocketSecurity
from common.trackers import Trackers
from common.types import RewardReply, RewardRequest

POLL_S = 0.1  # longest wait for a first request: the stop signal is seen within it
MAX_REQUEST_MB = 32  # one request's frames: 256 completions of 32k tokens (~4 bytes a token) fit
MAX_PENDING = 256  # requests taken and not yet answered; more wait in the socket's queue
REPORT_S = 10.0
ASKERS = ("generator", "eval")  # the roles that may ask for scores

log = logging.getLogger("tandem.actors.reward_service")


def run(config: TandemConfig) -> int:
    """Serve reward-model scores until SIGTERM/SIGINT; returns 0. Raises (before binding) when env.reward_model
    cannot be loaded, and when reward.port is taken."""
    setup_logging("reward", 0, config.run.run_dir, simulation=config.run.simulate)
    cores = parse_cores(config.reward.cpu_cores, "reward.cpu_cores")
    if cores:
        os.sched_setaffinity(0, cores)  # before torch starts its threads: it takes one per core it may use
    with caught_signals() as stopped:
        from actors.rewards.model import RewardModelScorer
        from common.chat_format import chat_format

        started = time.monotonic()
        reward = config.reward
        scorer = RewardModelScorer(
            Path(config.env.reward_model),
            reward.dtype,
            reward.batch_size,
            config.model.max_model_len,
            reward.normalize,
            chat=chat_format(config.model),
        )
        log.info("reward model loaded in %.1fs: %s", time.monotonic() - started, scorer.describe())
        server = open_reward_server(reward.host, reward.port, SocketSecurity.from_run(config.run))
        metrics = MetricsSink(
            config.run.run_dir, "reward-0", simulation=config.run.simulate, trackers=Trackers.from_config(config)
        )
        service = RewardService(scorer, server)
        log.info(
            "reward service on %s:%d (%d threads on cores %s)",
            reward.host,
            reward.port,
            _torch_threads(),
            sorted(os.sched_getaffinity(0)),
        )
        next_report = time.monotonic() + REPORT_S
        try:
            while not stopped:
                service.serve_batch(POLL_S)
                if time.monotonic() >= next_report:
                    next_report = time.monotonic() + REPORT_S
                    service.report(metrics)
        finally:
            service.report(metrics)
            metrics.close()
            server.close()
    log.info("reward service stopped: %s", service.counters.summary())
    return 0


def open_reward_server(host: str, port: int, security: SocketSecurity) -> Server:
    """The service's socket: only ASKERS' messages are decoded, and none over MAX_REQUEST_MB (or the run's
    smaller max_message_mb)."""
    limit = min(security.max_message_bytes, MAX_REQUEST_MB << 20)
    return Server(host, port, replace(security, max_message_bytes=limit), name="reward", roles=ASKERS)


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


@dataclass
class ServiceCounters:
    """What the service has done since it started (reported as `reward_service/<name>`)."""

    groups: int = 0  # requests answered with scores
    samples: int = 0  # completions scored
    batches: int = 0  # serve_batch calls that scored something (each: one or more forward passes)
    score_errors: int = 0  # requests answered with an error
    scoring_s: float = 0.0  # seconds in the reward model
    rejected: dict[str, int] = field(default_factory=dict)  # kind -> messages refused (the server's counter)

    def values(self) -> dict[str, float]:
        values = {
            "reward_service/groups": self.groups,
            "reward_service/samples": self.samples,
            "reward_service/batches": self.batches,
            "reward_service/score_errors": self.score_errors,
            "reward_service/scoring_s": self.scoring_s,
            "reward_service/samples_per_s": self.samples / self.scoring_s if self.scoring_s else 0.0,
            "reward_service/rejected": sum(self.rejected.values()),
        }
        values.update({f"reward_service/rejected_{kind}": count for kind, count in self.rejected.items()})
        return values

    def summary(self) -> str:
        rejected = sum(self.rejected.values())
        return (
            f"{self.groups} groups, {self.samples} samples scored in {self.scoring_s:.1f}s, "
            f"{self.score_errors} errors, {rejected} messages rejected"
        )


@dataclass
class _Job:
    """A request being scored: its chats and the scores so far (`done` of them)."""

    request: Request
    chats: list[list[dict[str, str]]]
    scores: list[float] = field(default_factory=list)

    @property
    def left(self) -> int:
        return len(self.chats) - len(self.scores)


class RewardService:
    """The scoring half of the role, without the process around it (tests drive it directly). One thread."""

    def __init__(self, scorer, server: Server) -> None:  # scorer: RewardModelScorer, or anything with score_chats
        self.scorer = scorer
        self.server = server
        self.counters = ServiceCounters()
        self.pending: deque[_Job] = deque()  # requests taken, in round-robin order

    def serve_batch(self, timeout_s: float) -> int:
        """Take the queued requests (waiting up to `timeout_s` when none is pending), score one batch of at most
        batch_size completions round-robin across them, reply to those complete; returns the groups answered."""
        self._take_requests(0.0 if self.pending else timeout_s)
        if not self.pending:
            return 0
        slices = self._next_batch()
        started = time.monotonic()
        answers = self._score(slices)
        self.counters.scoring_s += time.monotonic() - started
        self.counters.batches += 1
        answered = 0
        for (job, _), answer in zip(slices, answers):
            if isinstance(answer, str):
                self.pending.remove(job)
                self._reply(job.request, answer)
                answered += 1
                continue
            job.scores += answer
            if job.left == 0:
                self.pending.remove(job)
                self._reply(job.request, job.scores)
                answered += 1
        return answered

    def _take_requests(self, timeout_s: float) -> None:
        """The requests already queued (the first within `timeout_s`), while fewer than MAX_PENDING are pending."""
        wait_s = timeout_s
        while len(self.pending) < MAX_PENDING:
            request = self.server.poll(timeout_ms=int(wait_s * 1000))
            wait_s = 0.0
            if request is None:
                break
            if self._acceptable(request):
                self.pending.append(_Job(request, _chats(request.message)))
        self.counters.rejected = dict(self.server.rejected)

    def _next_batch(self) -> list[tuple[_Job, list[list[dict[str, str]]]]]:
        """Up to batch_size chats: each pending job in turn gives what it has left (up to the room left) and goes to
        the back of the line, so the next batch starts with the jobs this one did not reach."""
        room, slices = self.scorer.batch_size, []
        for _ in range(len(self.pending)):
            if room == 0:
                break
            job = self.pending[0]
            self.pending.rotate(-1)
            take = min(room, job.left)
            slices.append((job, job.chats[len(job.scores) : len(job.scores) + take]))
            room -= take
        return slices

    def _acceptable(self, request: Request) -> bool:
        if not isinstance(request.message, RewardRequest):
            self.server.reject(
                request, f"the reward service answers RewardRequest, not {type(request.message).__name__}"
            )
            return False
        if request.role not in ASKERS:
            self.server.reject(request, f"role {request.role or 'none'!r} may not ask for scores ({', '.join(ASKERS)})")
            return False
        return True

    def _score(self, slices: list[tuple[_Job, list]]) -> list[list[float] | str]:
        """Per slice: its scores, or why it could not be scored. All together first; after a failure, each alone,
        so that one bad group does not fail the others."""
        try:
            scores = self.scorer.score_chats([chat for _, chats in slices for chat in chats])
            if not all(math.isfinite(score) for score in scores):
                raise ValueError(f"the reward model gave a non-finite score ({min(scores)} .. {max(scores)})")
            return _split(scores, [len(chats) for _, chats in slices])
        except Exception as error:  # noqa: BLE001 - a group that cannot be scored must not stop the service
            if len(slices) == 1:
                return [f"{type(error).__name__}: {error}"[:500]]
        return [answer for one in slices for answer in self._score([one])]

    def _reply(self, request: Request, answer: list[float] | str) -> None:
        group: RewardRequest = request.message
        if isinstance(answer, str):
            self.counters.score_errors += 1
            log.warning("request %d of %s not scored: %s", group.request_id, request.sender, answer)
            self.server.reply(request, RewardReply(request_id=group.request_id, scores=[], error=answer))
            return
        self.counters.groups += 1
        self.counters.samples += len(answer)
        self.server.reply(request, RewardReply(request_id=group.request_id, scores=answer))

    def report(self, metrics: MetricsSink) -> None:
        self.counters.rejected = dict(self.server.rejected)
        metrics.log(self.counters.groups, self.counters.values())
        log.info("%s", self.counters.summary())


def _chats(group: RewardRequest) -> list[list[dict[str, str]]]:
    return [[*group.prompt, {"role": "assistant", "content": text}] for text in group.completions]


def _split(scores: list[float], sizes: list[int]) -> list[list[float]]:
    answers, start = [], 0
    for size in sizes:
        answers.append(scores[start : start + size])
        start += size
    return answers
