"""Evaluation during training on the generator's side (issue 16): an `EvalGrant` is sampled greedy-first with one
policy version, scored, and delivered as one `EvalResult` (actors/evaluation.py, actors/generator.py).

The generator runs in this process, its phases called in `actors.generator.run`'s order (`_pass`), against a
fake buffer link (scripted replies, every message recorded) and a fake weights poller (updates the test offers).
The engine is the simulation engine with scripted texts (`TextEngine`): its completions say what the test needs
them to say, so every verdict and reward of a result is known; it records what each request was asked (its
temperature, token budget and the policy version at `add`) and every weights load.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from actors.engine.api import EVAL_PRIORITY, TRAINING_PRIORITY, FinishedSample
from actors.engine.simulated import SimEngine
from actors.evaluation import Evaluator, is_eval_request
from actors.generator import Generator, GeneratorSettings
from actors.liveness import Pulse
from actors.rewards.functions import TimedFunction
from actors.rollouts import rollouts_maker
from actors.weights.updates import WeightsUpdate
from common.eval_messages import EvalAck, EvalGrant, EvalResult
from common.eval_metrics import result_metrics
from common.metrics import MetricsSink
from common.types import GroupAck, Heartbeat, LeaseGrant, LeaseRefused, LeaseRequest, Ok, PromptItem, RolloutGroup
from common.weight_messages import WeightsHeader
from launch.testing import run_config

HERE = "tests.actors.test_generator_eval"
SIM_TOKENS = 8  # tokens of a training sample; an eval completion has the grant's MAX_TOKENS
MAX_TOKENS = 6  # the grant's token limit: every scripted eval text fits in it
SAMPLES = 3
TEMPERATURE = 0.7
ANSWERS = (1, 2, 3)  # one eval prompt per answer


# ------------------------------------------------------------------------------------------- reward functions
def reward(completion: str, metadata: Mapping[str, Any]) -> dict[str, float]:
    """1 for exactly `#### <answer>`, plus a length component."""
    return {"correct": float(completion == f"#### {metadata['answer']}"), "length": len(completion) / 10}


def explode_on_two(completion: str, metadata: Mapping[str, Any]) -> dict[str, float]:
    """`reward`, except that it raises on every completion of the prompt whose answer is 2."""
    if metadata["answer"] == 2:
        raise RuntimeError("eval reward exploded on purpose")
    return reward(completion, metadata)


def exit_on_two(completion: str, metadata: Mapping[str, Any]) -> dict[str, float]:
    """`explode_on_two` with a BaseException: a plug-in's SystemExit ends nothing but its own score."""
    if metadata["answer"] == 2:
        raise SystemExit("eval reward exploded on purpose")
    return reward(completion, metadata)


# ----------------------------------------------------------------------------------------------- the engine
def scripted_text(answer: str, temperature: float | None, sample: int) -> str:
    """What a completion says: greedy `#### a` (strict right); samples `a` (lenient only), `#### 9` (wrong), `x`
    (wrong, no number); a training request (the engine's own temperature) says `0`."""
    if temperature is None:
        return "0"
    if temperature == 0.0:
        return f"#### {answer}"
    return [answer, "#### 9", "x"][sample % SAMPLES]


class TextEngine(SimEngine):
    """The simulation engine (random tokens, real per-token versions) whose completions are replaced, at the
    same length, by `scripted_text` as UTF-8 bytes (space-padded); decode reads them back. Records every add
    (request id, temperature, max_tokens, policy version), every finished sample and every weights load (the
    version, and the eval requests in the engine at that moment)."""

    def __init__(self, max_num_seqs: int = 4) -> None:
        super().__init__(SIM_TOKENS, 0.0, max_num_seqs, seed=0)
        self.adds: list[SimpleNamespace] = []
        self.finished: list[FinishedSample] = []
        self.loads: list[SimpleNamespace] = []
        self.aborted: list[str] = []
        self._texts: dict[str, str] = {}
        self._sample_counts: Counter[bytes] = Counter()

    def add(
        self,
        request_id: str,
        prompt_tokens: list[int],
        max_tokens: int | None = None,
        temperature: float | None = None,
        priority: int = TRAINING_PRIORITY,
    ) -> None:
        super().add(request_id, prompt_tokens, max_tokens, temperature, priority)
        answer = bytes(prompt_tokens).decode().rsplit("=", 1)[-1]
        key = bytes(prompt_tokens)
        if temperature not in (None, 0.0):
            self._sample_counts[key] += 1
        self._texts[request_id] = scripted_text(answer, temperature, self._sample_counts[key] - 1)
        record = SimpleNamespace(
            request_id=request_id, temperature=temperature, max_tokens=max_tokens, priority=priority
        )
        record.version = self.policy_version
        self.adds.append(record)

    def step(self) -> list[FinishedSample]:
        out = []
        for sample in super().step():
            text = self._texts.pop(sample.request_id).encode()
            length = len(sample.completion_tokens)
            assert len(text) <= length, f"scripted text {text!r} is longer than the {length} tokens sampled"
            tokens = np.frombuffer(text.ljust(length), dtype=np.uint8).astype(np.int32)
            out.append(
                FinishedSample(
                    sample.request_id,
                    tokens,
                    sample.behaviour_logprobs,
                    sample.token_versions,
                    sample.finish_reason,
                    sample.start_version,
                )
            )
        self.finished.extend(out)
        return out

    def decode(self, tokens: np.ndarray) -> str:
        return bytes(tokens.astype(np.uint8).tolist()).decode().strip()

    def abort(self, request_ids: list[str]) -> None:
        self.aborted.extend(request_ids)
        super().abort(request_ids)

    def load_weights(self, update: Any, inflight: bool) -> None:
        running_eval = [s.request_id for s in [*self.waiting, *self.running.values()] if is_eval_request(s.request_id)]
        self.loads.append(SimpleNamespace(version=update.policy_version, running_eval=running_eval))
        super().load_weights(update, inflight)

    def eval_adds(self) -> list[SimpleNamespace]:
        return [a for a in self.adds if is_eval_request(a.request_id)]

    def running_eval_tokens(self) -> list[int]:
        """Tokens made so far by each eval request that has started and not finished."""
        return [len(s.tokens) for s in self.running.values() if is_eval_request(s.request_id)]


# ---------------------------------------------------------------------------------------------- the buffer
def eval_grant(lease_id: int = 7, min_version: int = 0, deadline_s: float = 300.0) -> EvalGrant:
    prompts = [
        PromptItem(prompt_id=100 + a, epoch=0, messages=[{"role": "user", "content": f"a={a}"}], metadata={"answer": a})
        for a in ANSWERS
    ]
    return EvalGrant(
        lease_id=lease_id,
        deadline=time.time() + deadline_s,
        set_name="arithmetic",
        min_version=min_version,
        greedy=True,
        samples=SAMPLES,
        temperature=TEMPERATURE,
        max_tokens=MAX_TOKENS,
        prompts=prompts,
    )


def training_grant(lease_id: int, prompt_ids: list[int]) -> LeaseGrant:
    prompts = [
        PromptItem(prompt_id=i, epoch=0, messages=[{"role": "user", "content": f"t={i}"}], metadata={"answer": i})
        for i in prompt_ids
    ]
    return LeaseGrant(lease_id=lease_id, deadline=time.time() + 300.0, prompts=prompts)


class FakeLink:
    """The buffer as the generator's `BufferLink` sees it: lease requests get `lease_replies` in order (then "full"
    refusals), eval results get `eval_reply(result)` (None: the buffer does not answer), groups are accepted.
    Every message is recorded in `sent`."""

    def __init__(self, lease_replies: list[Any], eval_reply: Callable[[EvalResult], Any] | None = None) -> None:
        self.lease_replies = deque(lease_replies)
        self.eval_reply = eval_reply or (lambda result: EvalAck(lease_id=result.lease_id, status="accepted"))
        self.sent: list[Any] = []
        self.reconnects = 0

    def ready(self, now: float) -> bool:
        return True

    def call(self, message: Any) -> Any:
        self.sent.append(message)
        if isinstance(message, LeaseRequest):
            return self.lease_replies.popleft() if self.lease_replies else LeaseRefused("full", 0, 60.0)
        if isinstance(message, EvalResult):
            return self.eval_reply(message)
        if isinstance(message, RolloutGroup):
            return GroupAck(lease_id=message.lease_id, prompt_id=message.prompt_id, status="accepted")
        if isinstance(message, Heartbeat):
            return Ok(learner_version=0)
        raise AssertionError(f"unexpected message {type(message).__name__}")

    def of(self, kind: type) -> list[Any]:
        return [m for m in self.sent if isinstance(m, kind)]

    def close(self) -> None:
        pass


def empty_update(version: int) -> WeightsUpdate:
    """A real (empty) full-weights update of `version`: what the generator and the engine check (its header)."""
    return WeightsUpdate(WeightsHeader(policy_version=version, tensors=[], bucket_sizes=[]), [], time.monotonic())


class FakeWeights:
    """The weights poller: `offer(version)` makes the next poll return an update of that version."""

    def __init__(self) -> None:
        self.offered: deque[Any] = deque()
        self.wanted: list[int] = []
        self.failures: dict[str, int] = {}
        self.source = None

    def offer(self, version: int) -> None:
        self.offered.append(empty_update(version))

    def poll(self, now: float, have_version: int) -> Any:
        return self.offered.popleft() if self.offered else None

    def wait(self, have_version: int, timeout_s: float) -> Any:
        return None

    def want(self, min_version: int) -> None:
        self.wanted.append(min_version)

    def idle_wait(self, timeout_s: float) -> None:
        pass

    def close(self) -> None:
        pass


# ------------------------------------------------------------------------------------------- the generator
def make_generator(
    tmp_path: Path,
    engine: TextEngine,
    link: FakeLink,
    eval_reward_fn: str = f"{HERE}:reward",
    evaluate: bool = True,
    env: dict[str, Any] | None = None,
    **generator: Any,
) -> Generator:
    config = run_config(
        tmp_path / "runs",
        "gen",
        run={"simulate": True},
        algo={"group_size": 2},
        env={"reward_fn": f"{HERE}:reward", **(env or {})},
        eval={"sets": ["arithmetic"] if evaluate else [], "reward_fn": eval_reward_fn},
        generator={"prompts_in_flight": 2, "sim_tokens": SIM_TOKENS, **generator},
    )
    return Generator(
        GeneratorSettings.from_config(config),
        engine,
        rollouts_maker(config, 0)(engine),
        link,  # type: ignore[arg-type]
        FakeWeights(),  # type: ignore[arg-type]
        [work for work in (Evaluator.from_config(config, engine),) if work is not None],
        MetricsSink(config.run.run_dir, "generator-0", simulation=True),
        Pulse(link, 0),  # type: ignore[arg-type]  # not started: the loop's heartbeat phase only notes its state
    )


def evaluator(actor: Generator) -> Evaluator:
    """The generator's evaluation, one of its side work (`actors.side_work`)."""
    (work,) = [work for work in actor.side if isinstance(work, Evaluator)]
    return work


def _pass(actor: Generator) -> None:
    """One pass of `actors.generator.run`'s loop, its phases in its order."""
    now = time.monotonic()
    actor.heartbeat(now)
    actor.outbox.flush(actor.link)
    actor.deliver_side_work()
    actor.update_weights(now)
    actor.lease_prompts(now)
    actor.submit_prompts()
    actor.advance_engine(now)


def run_until(actor: Generator, condition: Callable[[], Any], max_passes: int = 500) -> None:
    for _ in range(max_passes):
        if condition():
            return
        _pass(actor)
    raise AssertionError(f"not reached in {max_passes} passes")


@pytest.fixture
def closing():
    actors: list[Generator] = []
    yield actors.append
    for actor in actors:
        actor.close()


def _per_prompt(values: np.ndarray) -> list[list[int]]:
    m = 1 + SAMPLES
    return [values[p * m : (p + 1) * m].tolist() for p in range(len(ANSWERS))]


# -------------------------------------------------------------------------------------------------- tests
def test_eval_grant_is_sampled_greedy_first_scored_and_sent_as_one_result(tmp_path, closing):
    engine = TextEngine()
    link = FakeLink([eval_grant(), training_grant(1, [0, 1])])
    actor = make_generator(tmp_path, engine, link)
    closing(actor)
    _pass(actor)  # the eval grant: its requests go in at once
    assert len(engine.eval_adds()) == len(ANSWERS) * (1 + SAMPLES) and len(engine.adds) == len(engine.eval_adds())
    _pass(actor)  # ... and the generator asks for training prompts again at once, in the next pass
    assert len(link.of(LeaseRequest)) == 2 and len(engine.adds) == len(engine.eval_adds()) + 2 * 2
    run_until(actor, lambda: link.of(EvalResult) and len(actor.outbox.acks) and not actor.book.in_flight())

    # what the engine was asked: per prompt the greedy request (temperature 0) first, then the samples
    asked = [(a.temperature, a.max_tokens, a.version) for a in engine.eval_adds()]
    assert asked == [(t, MAX_TOKENS, 0) for _ in ANSWERS for t in [0.0] + [TEMPERATURE] * SAMPLES]
    training = [a for a in engine.adds if not is_eval_request(a.request_id)]
    assert [(a.temperature, a.max_tokens) for a in training] == [(None, None)] * 4  # the engine's own settings
    # evaluation only takes the batch slots training leaves free (the engine's priority scheduling)
    assert {a.priority for a in engine.eval_adds()} == {EVAL_PRIORITY}
    assert {a.priority for a in training} == {TRAINING_PRIORITY}
    assert {a.request_id for a in engine.eval_adds()}.isdisjoint(a.request_id for a in training)

    (result,) = link.of(EvalResult)
    result.validate()
    assert result.lease_id == 7 and result.generator_id == 0 and result.policy_version == 0
    assert result.prompt_ids == [100 + a for a in ANSWERS]
    # greedy "#### a" | "a" | "#### 9" | "x", for every prompt (scripted_text)
    assert _per_prompt(result.strict) == [[1, 0, 0, 0]] * 3
    assert _per_prompt(result.lenient) == [[1, 1, 0, 0]] * 3
    assert _per_prompt(result.passed) == [[1, 0, 0, 0]] * 3
    assert _per_prompt(result.reward_components["correct"]) == [[1, 0, 0, 0]] * 3
    np.testing.assert_allclose(  # length / 10 of "#### a", "a", "#### 9", "x": float32 of short decimals
        result.reward_components["length"], np.tile(np.float32([0.6, 0.1, 0.6, 0.1]), 3), rtol=0, atol=1e-7
    )
    np.testing.assert_allclose(result.rewards, result.reward_components["correct"] + result.reward_components["length"])
    assert (result.num_tokens == MAX_TOKENS).all() and (result.truncated == 1).all()  # the sim stops at the limit
    assert result.started_at <= result.finished_at

    metrics = result_metrics(result, greedy=True, samples=SAMPLES)
    assert metrics["greedy/strict_accuracy"] == 1.0 and metrics["greedy/lenient_accuracy"] == 1.0
    assert metrics["strict_accuracy"] == 0.0 and metrics["lenient_accuracy"] == pytest.approx(1 / 3)
    assert metrics["prompts"] == 3 and metrics["samples"] == 9

    values = evaluator(actor).metrics()
    assert values["actor/eval_leases"] == 1 and values["actor/eval_completions"] == 12
    assert values["actor/eval_delivered"] == 1 and values["actor/eval_unsent"] == 0
    assert values["actor/eval_redone"] == values["actor/eval_rejected"] == values["actor/eval_reward_errors"] == 0
    assert actor.outbox.acks["accepted"] == 2  # training went on beside it


def test_an_eval_result_carries_one_version_when_an_update_lands_mid_request(tmp_path, closing):
    # inflight_weight_update: the load happens while eval requests run; they are aborted and the lease redone
    engine = TextEngine(max_num_seqs=4)  # 12 eval requests, 4 at a time: a load finds some half done
    link = FakeLink([eval_grant()])
    actor = make_generator(tmp_path, engine, link, inflight_weight_update=True)
    closing(actor)
    run_until(actor, lambda: any(0 < n < MAX_TOKENS for n in engine.running_eval_tokens()))
    first_attempt = {a.request_id for a in engine.eval_adds()}
    actor.weights.offer(1)
    run_until(actor, lambda: link.of(EvalResult))

    (load,) = engine.loads
    assert load.version == 1 and load.running_eval == []  # aborted before the load
    assert set(engine.aborted) <= first_attempt and engine.aborted
    redo = [a for a in engine.eval_adds() if a.request_id not in first_attempt]
    assert len(redo) == len(ANSWERS) * (1 + SAMPLES) and {a.version for a in redo} == {1}  # the whole lease, at v1
    redone = {a.request_id for a in redo}
    finished = [s for s in engine.finished if s.request_id in redone]
    assert len(finished) == len(redo) and all((s.token_versions == 1).all() for s in finished)
    (result,) = link.of(EvalResult)
    assert result.policy_version == 1 and len(result.rewards) == len(redo)
    assert _per_prompt(result.strict) == [[1, 0, 0, 0]] * 3
    assert evaluator(actor).metrics()["actor/eval_redone"] == 1


def test_mixed_versions_found_at_the_end_redo_the_whole_lease(tmp_path):
    # the last line of defence: a load that bypassed `before_load` leaves completions with tokens of two versions
    engine = TextEngine(max_num_seqs=4)
    evaluation = Evaluator(engine, reward, generator_id=3, max_model_len=1024)
    assert evaluation.accept(eval_grant())
    assert evaluation.submit() == 12
    for sample in engine.step():  # one token each for the first 4
        evaluation.on_sample(sample)
    engine.load_weights(empty_update(1), inflight=True)
    while engine.num_unfinished():
        for sample in engine.step():
            evaluation.on_sample(sample)
    assert evaluation.counts["redone"] == 1 and not evaluation.unsent and evaluation.lease is not None
    assert evaluation.submit() == 12  # the whole lease again, at v1
    assert evaluation.submit() == 0  # once
    while engine.num_unfinished():
        for sample in engine.step():
            evaluation.on_sample(sample)
    (result,) = evaluation.unsent
    assert result.policy_version == 1 and result.generator_id == 3 and evaluation.lease is None


def test_default_mode_never_loads_weights_while_eval_requests_run(tmp_path, closing):
    engine = TextEngine()
    link = FakeLink([training_grant(1, [0]), eval_grant(), training_grant(2, [1])])
    actor = make_generator(tmp_path, engine, link)
    closing(actor)
    _pass(actor)  # training prompt 0 runs
    actor.weights.offer(1)
    _pass(actor)  # the update is pending (prompt 0 runs), then the eval grant comes: not added while it waits
    assert actor.pending_update is not None and isinstance(link.lease_replies[0], LeaseGrant)
    assert engine.eval_adds() == []
    run_until(actor, lambda: link.of(EvalResult))
    assert [(load.version, load.running_eval) for load in engine.loads] == [(1, [])]
    assert {a.version for a in engine.eval_adds()} == {1}  # added after the load, with its version
    # a second update while the eval requests run waits for them
    evaluator(actor).accept(eval_grant(lease_id=8))
    _pass(actor)
    assert engine.running_eval_tokens() or engine.waiting
    actor.weights.offer(2)
    run_until(actor, lambda: len(link.of(EvalResult)) == 2 and engine.loads[-1].version == 2)
    assert all(load.running_eval == [] for load in engine.loads)
    assert [r.policy_version for r in link.of(EvalResult)] == [1, 1]
    assert evaluator(actor).metrics()["actor/eval_redone"] == 0


@pytest.mark.parametrize("reward_fn", ["explode_on_two", "exit_on_two"])
def test_a_raising_reward_function_is_counted_and_scored_zero_with_its_verdicts(tmp_path, closing, caplog, reward_fn):
    engine = TextEngine()
    link = FakeLink([eval_grant()])
    actor = make_generator(tmp_path, engine, link, eval_reward_fn=f"{HERE}:{reward_fn}")
    closing(actor)
    with caplog.at_level(logging.WARNING, "tandem.actors.evaluation"):
        run_until(actor, lambda: link.of(EvalResult))
    (result,) = link.of(EvalResult)
    rewards = _per_prompt(result.rewards)
    assert rewards[1] == [0.0] * 4  # the prompt of answer 2; the others as `reward` scores them
    assert rewards[0] == rewards[2] == pytest.approx([1.6, 0.1, 0.6, 0.1], abs=1e-6)  # float32 of 1.6, 0.1, 0.6
    assert _per_prompt(result.strict) == [[1, 0, 0, 0]] * 3  # the text's verdicts are kept
    assert _per_prompt(result.lenient) == [[1, 1, 0, 0]] * 3
    assert _per_prompt(result.reward_components["correct"])[1] == [0, 0, 0, 0]
    assert evaluator(actor).metrics()["actor/eval_reward_errors"] == 4
    assert "eval reward exploded on purpose" in caplog.text
    assert evaluator(actor).metrics()["actor/eval_delivered"] == 1


RELEASE = threading.Event()  # what `block_on_two` waits for (set at the test's end: no thread lingers)


def block_on_two(completion: str, metadata: Mapping[str, Any]) -> dict[str, float]:
    """`reward`, except that it blocks on every completion of the prompt whose answer is 2."""
    if metadata["answer"] == 2:
        RELEASE.wait(60)
    return reward(completion, metadata)


def test_a_blocking_eval_reward_function_is_cut_and_scored_zero(tmp_path, closing):
    """Evaluation's reward function runs as training's does (actors.rewards.functions.TimedFunction): past the timeout its
    completion is scored 0 and counted, and the result is delivered; the generator's loop is never held."""
    RELEASE.clear()
    engine = TextEngine()
    link = FakeLink([eval_grant()])
    actor = make_generator(tmp_path, engine, link)
    closing(actor)
    evaluator(actor).reward_fn = TimedFunction(block_on_two, 0.1, "env.reward_timeout_s")
    try:
        run_until(actor, lambda: link.of(EvalResult))
        (result,) = link.of(EvalResult)
        assert _per_prompt(result.rewards)[1] == [0.0] * 4  # the prompt of answer 2: cut, scored 0
        assert evaluator(actor).metrics()["actor/eval_reward_errors"] >= 1
    finally:
        RELEASE.set()
        evaluator(actor).reward_fn.close()


def test_buffer_away_keeps_the_result_and_a_rejected_ack_drops_it(tmp_path, closing, caplog):
    replies: deque[Any] = deque([None, EvalAck(lease_id=7, status="rejected", reason="prompt ids differ")])
    engine = TextEngine()
    link = FakeLink([eval_grant()], eval_reply=lambda result: replies.popleft())
    actor = make_generator(tmp_path, engine, link)
    closing(actor)
    run_until(actor, lambda: link.of(EvalResult))
    assert len(evaluator(actor).unsent) == 1  # the buffer did not answer: kept
    with caplog.at_level(logging.WARNING, "tandem.actors.evaluation"):
        actor.deliver_side_work()
    assert [type(m) for m in link.sent if isinstance(m, EvalResult)] == [EvalResult] * 2  # the same result again
    assert not evaluator(actor).unsent and not evaluator(actor).busy
    assert "prompt ids differ" in caplog.text
    values = evaluator(actor).metrics()
    assert values["actor/eval_rejected"] == 1 and values["actor/eval_delivered"] == 0


def test_eval_work_past_its_first_deadline_goes_on(tmp_path):
    """The grant's deadline is the first one only: heartbeats renew the lease at the buffer (actors.liveness), so a
    slow evaluation is never dropped by it."""
    engine = TextEngine()
    evaluation = Evaluator(engine, reward, generator_id=0, max_model_len=1024)
    evaluation.accept(eval_grant(deadline_s=-1.0))
    evaluation.submit()
    link = FakeLink([])
    evaluation.deliver(link)  # type: ignore[arg-type]
    assert evaluation.lease is not None and engine.num_unfinished() > 0 and evaluation.counts["expired"] == 0
    assert evaluation.lease_ids() == [7]


def test_a_second_grant_replaces_the_held_lease(tmp_path):
    """The buffer grants only to a generator it holds no eval lease for: a second grant means it ended the first, so
    the first is dropped (its requests aborted) and the second sampled; a repeat of the held grant changes nothing."""
    engine = TextEngine()
    evaluation = Evaluator(engine, reward, generator_id=0, max_model_len=1024)
    assert evaluation.accept(eval_grant(lease_id=7))
    evaluation.submit()
    first = set(evaluation.lease.outstanding())
    assert not evaluation.accept(eval_grant(lease_id=7)) and evaluation.lease_ids() == [7]
    assert evaluation.accept(eval_grant(lease_id=8))
    assert evaluation.lease_ids() == [8] and evaluation.counts["superseded"] == 1
    evaluation.submit()
    assert first.isdisjoint(evaluation.lease.outstanding())
    assert engine.num_unfinished() == len(evaluation.lease.outstanding())


def test_a_grant_to_a_generator_that_does_not_evaluate_is_ignored(tmp_path, closing, caplog):
    engine = TextEngine()
    link = FakeLink([eval_grant(), training_grant(1, [0])])
    actor = make_generator(tmp_path, engine, link, evaluate=False)
    closing(actor)
    assert actor.side == []
    with caplog.at_level(logging.WARNING, "tandem.actors.generator"):
        _pass(actor)
        _pass(actor)  # asks for training prompts again at once
    assert "lease reply EvalGrant (lease_id 7, set_name arithmetic) ignored" in caplog.text
    assert engine.eval_adds() == [] and len(link.of(LeaseRequest)) == 2 and len(engine.adds) == 2


def test_a_multi_turn_generator_evaluates_in_one_turn_beside_its_episodes(tmp_path, closing):
    """Training runs episodes through env.environment; the eval sets are still sampled in one turn and scored by
    the eval's reward function (the generator routes finished samples by request id, whatever made them)."""
    engine = TextEngine()
    link = FakeLink([eval_grant(), training_grant(1, [0, 1])])
    actor = make_generator(tmp_path, engine, link, env={"environment": "tests.actors.env_fakes:TwoTurnEnv"})
    closing(actor)
    assert evaluator(actor) is not None
    run_until(actor, lambda: link.of(EvalResult) and len(actor.outbox.acks) and not actor.book.in_flight())
    (result,) = link.of(EvalResult)
    result.validate()
    assert _per_prompt(result.strict) == [[1, 0, 0, 0]] * 3  # the same scripted verdicts as single-turn's
    assert actor.outbox.acks["accepted"] == 2  # both episodes' groups went on beside it


def test_inflight_loads_wait_for_a_lease_redone_twice(tmp_path, closing):
    # updates faster than an evaluation: two redos, then the next load waits for the lease (HOLD_AFTER_REDOS)
    engine = TextEngine(max_num_seqs=4)
    link = FakeLink([eval_grant()])
    actor = make_generator(tmp_path, engine, link, inflight_weight_update=True)
    closing(actor)
    for version in (1, 2, 3):
        run_until(actor, lambda: any(0 < n < MAX_TOKENS for n in engine.running_eval_tokens()))
        actor.weights.offer(version)
        _pass(actor)
    assert [load.version for load in engine.loads] == [1, 2] and actor.pending_update is not None  # v3 held
    run_until(actor, lambda: link.of(EvalResult) and len(engine.loads) == 3)
    (result,) = link.of(EvalResult)
    assert result.policy_version == 2 and all(load.running_eval == [] for load in engine.loads)
    assert evaluator(actor).metrics()["actor/eval_redone"] == 2


def test_prompts_too_long_get_empty_truncated_completions(tmp_path):
    engine = TextEngine()
    evaluation = Evaluator(engine, reward, generator_id=0, max_model_len=len("user: a=1"))  # every prompt too long
    assert evaluation.accept(eval_grant())
    assert evaluation.submit() == 0 and engine.num_unfinished() == 0
    (result,) = evaluation.unsent
    result.validate()
    assert (result.num_tokens == 0).all() and (result.truncated == 1).all()
    assert (result.strict == 0).all() and (result.lenient == 0).all() and (result.rewards == 0).all()
    assert evaluation.metrics()["actor/eval_prompts_too_long"] == len(ANSWERS)
