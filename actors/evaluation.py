"""The eval work of one generator (evaluation during training, issue 16): sample an `EvalGrant`'s prompts with one
policy version, score them, and deliver one `EvalResult` to the buffer.

    evaluation = Evaluator.from_config(config, engine)   # None without eval sets
    evaluation.accept(grant)                  # the buffer's EvalGrant (the reply to a LeaseRequest)
    evaluation.submit()                       # adds its requests once the engine holds >= grant.min_version
    ... for sample in engine.step(): evaluation.on_sample(sample) if is_eval_request(sample.request_id) ...
    evaluation.before_load()                  # inflight_weight_update: abort and redo what runs, before a load
    evaluation.deliver(link)                  # sends finished results until acknowledged; drops expired work

Layout: per prompt, in the grant's order, the greedy completion first (temperature 0) if `grant.greedy`, then
`grant.samples` at `grant.temperature`, each of at most `grant.max_tokens` tokens: completion p * m + j of the
result belongs to prompt p (m = `grant.per_prompt`). Request ids `eval:<lease>:<attempt>:<p * m + j>` never
collide with training ids (`actors.groups.sample_request_id`: three integers) nor with an earlier attempt's.

One version per result: every request of a lease is added with the engine's current policy version, and when the
last one is back every token of every completion must carry that version (`FinishedSample.token_versions`). If one
does not, the whole lease is sampled again (counted `actor/eval_redone`; nothing is aborted, since nothing runs
any more). With `generator.inflight_weight_update`, the generator calls `before_load` first: the lease's running
requests are aborted and the whole lease redone after the load (counted too). After `HOLD_AFTER_REDOS` redos of one
lease, `holds_weights()` asks the generator to hold its next load until the lease is in, so a generator whose
updates come faster than an evaluation takes still finishes it; a lease redone `MAX_EVAL_ATTEMPTS` times is dropped.

Scoring: `common.eval_metrics.score_completion` with `eval.reward_fn or env.reward_fn` (searched in
`env.plugin_paths`, as training's reward is). A prompt too long for `model.max_model_len` gets empty completions
(0 tokens, truncated) so the result keeps its layout; logged and counted (`actor/eval_prompts_too_long`).

Liveness: the generator's heartbeats list the eval lease it holds (`lease_ids`), and the buffer renews it for as
long as the generator lives and makes progress, however long the evaluation takes on a slow machine: the grant's
`deadline` is only the first one, and nothing here drops work by it. The buffer grants an eval lease only to a
generator for which it holds none, so a second grant means the buffer ended the first (expired it: the generator
was taken for stuck or dead): the old lease is dropped (its requests aborted, counted `actor/eval_superseded`) and
the new one taken. A generator never samples one eval lease while being granted others.

Failure modes (survived, counted, logged; never fatal): a reward function that raises on a completion (it is
scored 0 with no components, its strict/lenient verdicts kept from its text: `actor/eval_reward_errors`); a
rejected result (`EvalAck` "rejected" or an `ErrorReply`: logged with the reason and dropped, `actor/eval_rejected`;
the buffer grants its set again); the buffer away (the result is kept and sent again; at most `MAX_UNSENT` results,
the oldest dropped, `actor/eval_expired`); a grant that samples nothing (logged, ignored).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from actors.engine.api import EVAL_PRIORITY, Engine, FinishedSample
from actors.outbox import BufferLink
from actors.rewards.functions import TimedFunction
from common.config import TandemConfig
from common.eval_messages import EvalAck, EvalGrant, EvalResult
from common.eval_metrics import (
    TRUNCATED,
    Completion,
    ScoredCompletion,
    answer_verdicts,
    expected_answer,
    score_completion,
)
from common.types import ErrorReply, RunOver

log = logging.getLogger("tandem.actors.evaluation")
MAX_UNSENT = 8  # finished results kept while the buffer does not answer (one per round at most; older ones dropped)

EVAL_REQUEST_PREFIX = "eval:"
HOLD_AFTER_REDOS = 2  # inflight mode: after this many redos of one lease, weights loads wait for it
MAX_EVAL_ATTEMPTS = 5  # a lease sampled this often without one clean version is dropped (its set is granted again)
GREEDY = 0.0  # the temperature of the greedy completion

RewardFn = Callable[[str, Mapping[str, Any]], Any]


def eval_request_id(lease_id: int, attempt: int, index: int) -> str:
    """The engine request id of completion `index` (= p * m + j) of attempt `attempt` of eval lease `lease_id`."""
    return f"{EVAL_REQUEST_PREFIX}{lease_id}:{attempt}:{index}"


def is_eval_request(request_id: str) -> bool:
    return request_id.startswith(EVAL_REQUEST_PREFIX)


def _parse_eval_request_id(request_id: str) -> tuple[int, int, int]:
    lease_id, attempt, index = request_id[len(EVAL_REQUEST_PREFIX) :].split(":")
    return int(lease_id), int(attempt), int(index)


@dataclass
class _Lease:
    """One eval grant while it is sampled. `version` is the policy version its requests went in with (-1: not in
    the engine now); `samples[p * m + j]` is None until that completion is back."""

    grant: EvalGrant
    prompt_tokens: list[list[int] | None]  # None: longer than model.max_model_len (empty completions)
    attempt: int = 0
    version: int = -1
    samples: list[FinishedSample | None] = field(default_factory=list)
    started_at: float = 0.0  # unix time its first requests went to the engine (first attempt)

    def outstanding(self) -> list[str]:
        return [eval_request_id(self.grant.lease_id, self.attempt, i) for i, s in enumerate(self.samples) if s is None]


def _empty_sample(request_id: str, version: int) -> FinishedSample:
    """The completion of a prompt that cannot be sampled (too long): no tokens, stopped at the limit."""
    empty = np.zeros(0, dtype=np.int32)
    return FinishedSample(request_id, empty, np.zeros(0, dtype=np.float32), empty, TRUNCATED, version)


class Evaluator:
    """The eval lease a generator holds (at most one) and its results until the buffer acknowledges them (see the
    module docstring). One thread: the generator's."""

    def __init__(self, engine: Engine, reward_fn: RewardFn, generator_id: int, max_model_len: int) -> None:
        self.engine = engine
        self.reward_fn = reward_fn
        self.generator_id = generator_id
        self.max_model_len = max_model_len
        self.lease: _Lease | None = None
        self.unsent: deque[EvalResult] = deque()  # finished results not yet answered, oldest first
        self.counts: Counter[str] = Counter()

    @classmethod
    def from_config(cls, config: TandemConfig, engine: Engine) -> Evaluator | None:
        """The eval work of a generator whose config has eval sets, else None. A misnamed reward function raises
        now. A multi-turn generator (env.environment) evaluates too: the sets are sampled in one turn (prompt,
        one completion, eval.reward_fn or env.reward_fn), beside its episodes."""
        if not config.eval.enabled:
            return None
        from common.reward_routing import reward_fn_for

        # eval.reward_fn: another function for every row, with its own defaults (env.reward_fn_args are
        # env.reward_fn's); else the run's, routed by data_source as in training
        reward_fn = reward_fn_for(config.env, override=config.eval.reward_fn)
        # on a worker thread within env.reward_timeout_s: one that blocks is scored 0, never holds the generator
        timed = TimedFunction(reward_fn, config.env.reward_timeout_s, "env.reward_timeout_s")
        return cls(engine, timed, config.generator.index, config.model.max_model_len)

    # ------------------------------------------------------------------------------------------------ the lease
    @property
    def busy(self) -> bool:
        """An eval lease is held, or a result waits for the buffer's answer."""
        return self.lease is not None or bool(self.unsent)

    @property
    def in_engine(self) -> bool:
        """Requests of the eval lease are in the engine now."""
        return self.lease is not None and self.lease.version >= 0

    def holds_weights(self) -> bool:
        """Inflight mode: hold the next weights load until the lease is in (it was redone `HOLD_AFTER_REDOS`
        times already, see the module docstring)."""
        return self.in_engine and self.lease is not None and self.lease.attempt >= HOLD_AFTER_REDOS

    def lease_ids(self) -> list[int]:
        """The eval lease being sampled, for the heartbeat (which renews it at the buffer)."""
        return [] if self.lease is None else [self.lease.grant.lease_id]

    # ---------------------------------------------------------------------- the generator's seam (actors.side_work)
    def takes(self, reply: Any) -> bool:
        """Eval grants are this work's (the buffer sends one instead of prompts when an evaluation is due)."""
        return isinstance(reply, EvalGrant)

    def take(self, reply: EvalGrant) -> int | None:
        """`accept` the grant; the version it needs when taken (the generator fetches it), else None."""
        return reply.min_version if self.accept(reply) else None

    def owns(self, request_id: str) -> bool:
        return is_eval_request(request_id)

    def keeps_running(self, link_up: bool) -> bool:
        """A lease is held, or a result waits for the buffer while the buffer answers."""
        return self.lease is not None or (bool(self.unsent) and link_up)

    def accept(self, grant: EvalGrant) -> bool:
        """Take a grant (rendering its prompts); False, logged, when it samples nothing. A lease still held is
        dropped first: the buffer grants only to a generator it holds no active eval lease for, so it ended that one
        (module docstring); a repeat of the held grant is ignored."""
        if self.lease is not None and self.lease.grant.lease_id == grant.lease_id:
            return False
        if self.lease is not None:
            self.counts["superseded"] += 1
            self.drop(f"the buffer ended it and granted eval lease {grant.lease_id} ({grant.set_name}) instead")
        if not grant.prompts or grant.per_prompt < 1:
            log.warning(
                "eval grant %d (%s) samples nothing (%d prompts x %d): ignored",
                grant.lease_id,
                grant.set_name,
                len(grant.prompts),
                grant.per_prompt,
            )
            return False
        tokens: list[list[int] | None] = []
        for prompt in grant.prompts:
            rendered = self.engine.render(prompt)
            if len(rendered) >= self.max_model_len:
                self.counts["prompts_too_long"] += 1
                log.error(
                    "eval set %s: prompt %d has %d tokens, model.max_model_len is %d: scored as empty completions "
                    "(raise model.max_model_len)",
                    grant.set_name,
                    prompt.prompt_id,
                    len(rendered),
                    self.max_model_len,
                )
                tokens.append(None)
            else:
                tokens.append(rendered)
        self.lease = _Lease(grant, tokens)
        self.counts["leases"] += 1
        log.info(
            "eval lease %d: set %s, %d prompts x %d completions, version >= %d",
            grant.lease_id,
            grant.set_name,
            len(grant.prompts),
            grant.per_prompt,
            grant.min_version,
        )
        return True

    def submit(self) -> int:
        """Add the lease's requests to the engine, all with its current policy version, once that version is the
        grant's or newer; returns how many were added (0 when none is due). The caller decides when adding is
        allowed (not while a default-mode weights load waits for the engine to drain)."""
        lease = self.lease
        if lease is None or lease.version >= 0 or self.engine.policy_version < lease.grant.min_version:
            return 0
        grant, version = lease.grant, self.engine.policy_version
        m = grant.per_prompt
        lease.version = version
        lease.samples = [None] * (len(grant.prompts) * m)
        if lease.started_at == 0.0:
            lease.started_at = time.time()
        added = 0
        for p, tokens in enumerate(lease.prompt_tokens):
            for j in range(m):
                index = p * m + j
                request_id = eval_request_id(grant.lease_id, lease.attempt, index)
                if tokens is None:
                    lease.samples[index] = _empty_sample(request_id, version)
                    continue
                temperature = GREEDY if grant.greedy and j == 0 else grant.temperature
                self.engine.add(
                    request_id, tokens, max_tokens=grant.max_tokens, temperature=temperature, priority=EVAL_PRIORITY
                )
                added += 1
        if added == 0:  # every prompt too long: nothing to wait for
            self._finish()
        return added

    def on_sample(self, sample: FinishedSample) -> None:
        """Take a finished eval sample (one of an earlier attempt, or of a dropped lease, is ignored); when the
        lease's last one is in, check its versions and score it, or redo it."""
        lease = self.lease
        lease_id, attempt, index = _parse_eval_request_id(sample.request_id)
        if lease is None or lease_id != lease.grant.lease_id or attempt != lease.attempt or lease.version < 0:
            return
        if not 0 <= index < len(lease.samples) or lease.samples[index] is not None:
            log.warning("eval sample %s is not one this lease waits for: ignored", sample.request_id)
            return
        lease.samples[index] = sample
        if all(s is not None for s in lease.samples):
            self._finish()

    def before_load(self) -> None:
        """A weights load is about to happen (inflight mode): abort the lease's running requests and sample the
        whole lease again after it, so that no result mixes versions."""
        if self.in_engine:
            assert self.lease is not None
            self.engine.abort(self.lease.outstanding())
            self._redo("a weights load came while its requests ran")

    def drop(self, why: str) -> None:
        """Give up the lease (draining, the run is over, exit): its requests are aborted, the buffer expires it."""
        if self.lease is None:
            return
        if self.in_engine:
            self.engine.abort(self.lease.outstanding())
        log.info("eval lease %d (%s) dropped: %s", self.lease.grant.lease_id, self.lease.grant.set_name, why)
        self.lease = None

    def _redo(self, why: str) -> None:
        lease = self.lease
        assert lease is not None
        self.counts["redone"] += 1
        if lease.attempt + 1 >= MAX_EVAL_ATTEMPTS:
            log.error("eval lease %d: %s, %d times; dropped", lease.grant.lease_id, why, MAX_EVAL_ATTEMPTS)
            self.lease = None
            return
        log.info("eval lease %d: %s; sampled again (attempt %d)", lease.grant.lease_id, why, lease.attempt + 2)
        lease.attempt += 1
        lease.version = -1
        lease.samples = []

    def _finish(self) -> None:
        lease = self.lease
        assert lease is not None
        samples = [s for s in lease.samples if s is not None]
        mixed = [s.request_id for s in samples if np.any(s.token_versions != lease.version)]
        if mixed:
            self._redo(f"{len(mixed)} completions hold tokens of a version other than v{lease.version}")
            return
        grant = lease.grant
        m = grant.per_prompt
        scored = [
            self._score(sample, grant.prompts[i // m].metadata, grant.set_name) for i, sample in enumerate(samples)
        ]
        result = build_eval_result(grant, scored, self.generator_id, lease.version, lease.started_at, time.time())
        self.counts["completions"] += len(scored)
        self.unsent.append(result)
        while len(self.unsent) > MAX_UNSENT:
            self.counts["expired"] += 1
            log.warning("eval result of lease %d never answered: dropped", self.unsent.popleft().lease_id)
        self.lease = None

    def _score(self, sample: FinishedSample, metadata: Mapping[str, Any], set_name: str) -> ScoredCompletion:
        completion = Completion(
            self.engine.decode(sample.completion_tokens), len(sample.completion_tokens), sample.finish_reason
        )
        try:
            return score_completion(completion, metadata, self.reward_fn)
        except BaseException as error:  # noqa: BLE001 - a user reward function may raise anything, SystemExit too
            self.counts["reward_errors"] += 1
            log.warning(
                "eval set %s: the reward function failed (%d so far), scored 0: %s",
                set_name,
                self.counts["reward_errors"],
                f"{type(error).__name__}: {error}"[:300],
            )
            strict, lenient, passed = _text_verdicts(completion.text, metadata)
            return ScoredCompletion(completion, 0.0, {}, strict, lenient, passed)

    # ------------------------------------------------------------------------------------------- to the buffer
    def deliver(self, link: BufferLink) -> int:
        """Send the finished results oldest first until the buffer stops answering; returns how many it answered."""
        answered = 0
        while self.unsent and link.ready(time.monotonic()):
            result = self.unsent[0]
            reply = link.call(result)
            if reply is None:  # the buffer is away: sent again later, until the deadline
                break
            self.unsent.popleft()
            self._settle(result, reply)
            answered += 1
        return answered

    def _settle(self, result: EvalResult, reply: Any) -> None:
        if isinstance(reply, EvalAck) and reply.status in ("accepted", "duplicate"):
            self.counts[f"results_{reply.status}"] += 1
            return
        if isinstance(reply, (EvalAck, ErrorReply)):
            reason = reply.reason or (reply.status if isinstance(reply, EvalAck) else "")
        elif isinstance(reply, RunOver):
            reason = "the run is over"
        else:
            reason = f"unexpected {type(reply).__name__}"
        self.counts["rejected"] += 1
        log.warning(
            "buffer rejected the eval result of lease %d (v%d, %d completions): %s",
            result.lease_id,
            result.policy_version,
            len(result.rewards),
            reason,
        )

    def metrics(self) -> dict[str, float]:
        """Counts since start (`actor/eval_...`), for the generator's report."""
        names = ("leases", "completions", "redone", "reward_errors", "rejected", "expired", "superseded")
        names += ("prompts_too_long",)
        values = {f"actor/eval_{name}": float(self.counts[name]) for name in names}
        values["actor/eval_delivered"] = float(self.counts["results_accepted"] + self.counts["results_duplicate"])
        values["actor/eval_unsent"] = float(len(self.unsent))
        return values


def _text_verdicts(text: str, metadata: Mapping[str, Any]) -> tuple[bool | None, bool | None, bool | None]:
    """(strict, lenient, passed) of a completion whose reward function failed: the answer verdicts its text earns,
    and passed = strict; without an answer strict/lenient are not defined and it did not pass (nothing said it
    was right). A malformed `answer` leaves all three undefined."""
    try:
        expected = expected_answer(metadata)
    except ValueError:
        return None, None, None
    if expected is None:
        return None, None, False
    strict, lenient = answer_verdicts(text, expected)
    return strict, lenient, strict


def _verdict(value: bool | None) -> int:
    return -1 if value is None else int(value)


def build_eval_result(
    grant: EvalGrant,
    scored: list[ScoredCompletion],
    generator_id: int,
    policy_version: int,
    started_at: float,
    finished_at: float,
) -> EvalResult:
    """The columnar `EvalResult` of a grant's scored completions, `scored[p * m + j]` (prompt-major, the greedy one
    first). Verdicts None -> -1; reward components are the union over the lease, absent ones 0. Raises ValueError
    when `scored` is not len(grant.prompts) x grant.per_prompt."""
    expected = len(grant.prompts) * grant.per_prompt
    if len(scored) != expected:
        raise ValueError(f"eval lease {grant.lease_id}: {len(scored)} scored completions, expected {expected}")
    names = sorted({name for s in scored for name in s.components})
    return EvalResult(
        generator_id=generator_id,
        lease_id=grant.lease_id,
        policy_version=policy_version,
        prompt_ids=[prompt.prompt_id for prompt in grant.prompts],
        rewards=np.asarray([s.reward for s in scored], dtype=np.float32),
        num_tokens=np.asarray([s.completion.num_tokens for s in scored], dtype=np.int32),
        truncated=np.asarray([s.completion.finish_reason == TRUNCATED for s in scored], dtype=np.uint8),
        strict=np.asarray([_verdict(s.strict) for s in scored], dtype=np.int8),
        lenient=np.asarray([_verdict(s.lenient) for s in scored], dtype=np.int8),
        passed=np.asarray([_verdict(s.passed) for s in scored], dtype=np.int8),
        reward_components={
            name: np.asarray([s.components.get(name, 0.0) for s in scored], dtype=np.float32) for name in names
        },
        started_at=started_at,
        finished_at=finished_at,
    )
