"""Evaluation during training in the buffer (no sockets, fake clocks): rounds open at versions 0, N, 2N, ... and
the final one, and a newer round supersedes an unleased older one; an eval grant comes ahead of training prompts
and changes nothing on the training side (admission, refusals, staleness drops, the replay buffer, the ledger);
the eval accounting identity holds through grants, results, duplicates, every rejection, expiry and re-grant; an
accepted result is one row of hand-worked metrics; a restarted buffer keeps its rounds and accepts a late
result; RunOver waits for the final round until it is done or times out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from buffers.core import BufferCore, RequestRejected
from buffers.evaluation import EvalScheduler
from buffers.journal import Journal
from buffers.state import BufferState
from common.config import EvalConfig
from common.eval_messages import EvalAck, EvalGrant, EvalResult
from common.types import (
    Batch,
    BatchRequest,
    Heartbeat,
    LeaseGrant,
    LeaseRefused,
    LeaseRequest,
    Ok,
    PromptItem,
    RunOver,
    VersionReport,
)
from common.wire import WireError, decode, encode
from tests.buffers.fakes import GROUP, ask, fake_prompts, make_group, make_settings

SETS = ["arithmetic", "arithmetic-d2"]  # names only: the prompts are fakes
PROMPTS_PER_SET = 3
LEASE_TIMEOUT_S, HEARTBEAT_TIMEOUT_S = 10.0, 3.0  # make_settings' defaults


def eval_config(**overrides: Any) -> EvalConfig:
    values = {"sets": SETS, "every": 2, "greedy": True, "samples": 2, "final_timeout_s": 30.0}
    values.update(overrides)
    return EvalConfig(**values)


def scheduler(**overrides: Any) -> EvalScheduler:
    sets = {name: fake_prompts(PROMPTS_PER_SET) for name in SETS}
    return EvalScheduler(eval_config(**overrides), sets, max_tokens=16, lease_timeout_s=LEASE_TIMEOUT_S)


def eval_core(
    journal: Journal | None = None, evaluate: bool = True, first_batch: bool | None = None, **overrides: Any
) -> BufferCore:
    """A core over 40 training prompts (make_settings), evaluating two sets of 3 prompts unless `evaluate` is false,
    whose first training batch was drawn already (eval grants wait for it) when `first_batch` (default: without a
    journal; with one, the test restores it first and then calls `draw_first_batch`)."""
    first_batch = journal is None if first_batch is None else first_batch
    settings = {k: overrides.pop(k) for k in list(overrides) if k in make_settings().__dataclass_fields__}
    evaluation = scheduler(**overrides) if evaluate else None
    core = BufferCore(BufferState(make_settings(**settings), fake_prompts(40), journal, evaluation))
    if first_batch:
        draw_first_batch(core)
    return core


FIRST_BATCH_GENERATOR = 99  # a generator of its own, so that the tests' generators hold no training lease


def draw_first_batch(core: BufferCore, now: float = 0.0) -> None:
    """Lease, push and draw the run's first training batch (step 0), as a generator and a learner would."""
    groups = core.settings.groups_per_step
    grant = ask(core, LeaseRequest(FIRST_BATCH_GENERATOR, groups, 0), now)
    assert isinstance(grant, LeaseGrant) and len(grant.prompts) == groups, grant
    for prompt in grant.prompts:
        ask(core, make_group(grant.lease_id, prompt, FIRST_BATCH_GENERATOR, size=GROUP), now)
    assert isinstance(ask(core, BatchRequest(0, 0, 1, groups, 0.0), now), Batch)


def advance(core: BufferCore, version: int, final: bool = False, now: float = 0.0) -> None:
    """The learner at step and version `version`, as the VersionReport handler records it (its order checks, which
    need draws up to that step, are not what these tests are about: see tests/buffers/fakes.advance_learner)."""
    core.state.report_version(version, version)
    core.state.evaluation.report_version(version, final, now)


def eval_grant(core: BufferCore, generator: int, version: int = 0, now: float = 0.0) -> EvalGrant:
    grant = ask(core, LeaseRequest(generator, 4, version), now)
    assert isinstance(grant, EvalGrant), grant
    return grant


def result_for(grant: EvalGrant, generator: int, version: int, **changes: Any) -> EvalResult:
    """A well-formed result of `grant`: every prompt's greedy completion right, the samples wrong."""
    prompt_ids = changes.pop("prompt_ids", [p.prompt_id for p in grant.prompts])
    m = grant.per_prompt
    total = changes.pop("total", len(prompt_ids) * m)
    right = np.array([1 if j % m == 0 else 0 for j in range(total)], np.int8)
    values = {
        "generator_id": generator,
        "lease_id": grant.lease_id,
        "policy_version": version,
        "prompt_ids": prompt_ids,
        "rewards": right.astype(np.float32),
        "num_tokens": np.full(total, 5, np.int32),
        "truncated": np.zeros(total, np.uint8),
        "strict": right,
        "lenient": right,
        "passed": right,
        "started_at": 100.0,
        "finished_at": 102.5,
    }
    values.update(changes)
    return EvalResult(**values)


def identity_holds(counters: dict[str, int]) -> bool:
    issued = counters["eval_issued"]
    return issued == counters["eval_done"] + counters["eval_requeued"] + counters["eval_outstanding"]


def training_view(core: BufferCore) -> dict[str, Any]:
    """What the training side is: its counters (no eval ones), admission, the replay buffer and the leases."""
    counters = {key: value for key, value in core.counters().items() if "eval" not in key}
    replay = [(e.seq, e.uses, e.group.group_id) for e in core.state.replay.entries.values()]
    return {
        "counters": counters,
        "admitted": core._admitted(),
        "replay": replay,
        "leases": core.state.dispenser.snapshot(),
    }


# ------------------------------------------------------------------------------------------------ rounds
def test_rounds_open_at_multiples_of_every_and_a_newer_one_supersedes_an_unleased_one() -> None:
    evaluation = scheduler(every=2)
    assert evaluation.report_version(0, final=False, now=0.0)
    assert evaluation.due == {"arithmetic": 0, "arithmetic-d2": 0}
    assert not evaluation.report_version(1, final=False, now=0.0)  # not a multiple of 2
    evaluation.report_version(2, final=False, now=0.0)
    assert evaluation.due == {"arithmetic": 2, "arithmetic-d2": 2}
    assert evaluation.counts["eval_superseded"] == 2  # both sets' round 0, never leased
    grant = evaluation.grant(0, 2, now=0.0)
    assert (grant.set_name, grant.min_version) == ("arithmetic", 2)
    evaluation.report_version(9, final=False, now=0.0)  # jumped past 4 and 6: only round 8 opens
    assert evaluation.due == {"arithmetic": 8, "arithmetic-d2": 8}
    assert evaluation.counts["eval_superseded"] == 3  # arithmetic-d2's round 2; arithmetic's round 2 is leased
    assert evaluation.counts["eval_rounds_opened"] == 3 and evaluation.opened == 8
    evaluation.report_version(4, final=False, now=0.0)  # a learner that rewound: versions reached are not re-opened
    assert evaluation.due == {"arithmetic": 8, "arithmetic-d2": 8}


def test_the_version_report_handler_opens_rounds() -> None:
    core = eval_core(first_batch=False)
    assert isinstance(ask(core, VersionReport(4, 4, resync=True)), Ok)  # a fresh buffer takes a learner's resume
    assert core.state.evaluation.due == {"arithmetic": 4, "arithmetic-d2": 4}
    assert core.counters()["eval_rounds_opened"] == 1


def test_a_grant_needs_weights_of_the_rounds_version_and_one_eval_lease_per_generator() -> None:
    core = eval_core()
    advance(core, 2)
    assert isinstance(ask(core, LeaseRequest(0, 4, 1)), LeaseGrant)  # version 1 < round 2: training prompts
    first = eval_grant(core, 0, version=2)
    assert (first.set_name, first.min_version, first.greedy, first.samples) == ("arithmetic", 2, True, 2)
    assert first.temperature == 1.0 and first.max_tokens == 16 and first.per_prompt == 3
    assert [p.prompt_id for p in first.prompts] == list(range(PROMPTS_PER_SET))
    assert first.deadline == LEASE_TIMEOUT_S
    assert isinstance(ask(core, LeaseRequest(0, 4, 2)), LeaseGrant)  # it holds an eval lease: training
    second = eval_grant(core, 1, version=3)
    assert second.set_name == "arithmetic-d2" and second.lease_id == first.lease_id + 1
    training = ask(core, LeaseRequest(2, 4, 2))  # nothing due any more: the training path (admission is full)
    assert isinstance(training, LeaseRefused) and training.reason == "full"


# ------------------------------------------------------------------------------------------------ training apart
def _play(core: BufferCore, evaluate: bool) -> list[Any]:
    """The same training traffic on any core; with `evaluate`, eval grants and results interleaved. Returns every
    training reply (lease grants and refusals, acks, batches) in order."""
    replies: list[Any] = []

    def train_lease(generator: int, count: int, version: int, now: float = 0.0) -> Any:
        evaluation = core.state.evaluation
        if (
            evaluate
            and core.state.drawn_high > 0  # eval grants wait for the first training batch
            and version >= min(evaluation.due.values(), default=version + 1)
            and not evaluation.holds_lease(generator)
        ):
            evals[generator] = eval_grant(core, generator, version, now)
        reply = ask(core, LeaseRequest(generator, count, version), now)
        replies.append(reply)
        return reply

    evals: dict[int, EvalGrant] = {}
    report = VersionReport(0, 0, resync=True)
    ask(core, report)
    grants = [train_lease(0, 3, 0), train_lease(1, 3, 0), train_lease(2, 3, 0)]  # admission: 4 groups at v0
    assert isinstance(grants[2], LeaseRefused) and grants[2].reason == "full"
    for generator, grant in enumerate(grants[:2]):
        replies += [ask(core, make_group(grant.lease_id, p, generator, GROUP, 0)) for p in grant.prompts]
    replies.append(ask(core, BatchRequest(0, 0, 1, 2, 0.0)))  # the first batch: eval grants may come from now on
    if evaluate:
        evals.update({generator: eval_grant(core, generator, 0) for generator in (0, 1)})
        assert ask(core, result_for(evals[0], 0, 0)).status == "accepted"
        assert ask(core, result_for(evals[1], 1, 0, total=1)).status == "rejected"
    for step in (1, 2):  # two steps trained elsewhere: the 2 groups left at v0 are too stale for step 2 (η = 1)
        core.state.report_version(step, step)
        if evaluate:
            core.state.evaluation.report_version(step, False, 0.0)
    replies.append(train_lease(2, 3, 0))  # stale
    replies.append(train_lease(0, 3, 2))
    replies.append(ask(core, BatchRequest(2, 0, 1, 2, 0.0)))  # drops the stale groups, then has too few
    return replies


def test_eval_traffic_changes_nothing_on_the_training_side() -> None:
    plain, evaluating = eval_core(evaluate=False, first_batch=False), eval_core(first_batch=False)
    expected, got = _play(plain, evaluate=False), _play(evaluating, evaluate=True)
    assert [type(r) for r in got] == [type(r) for r in expected]
    for mine, theirs in zip(got, expected):
        if isinstance(mine, Batch):
            assert [g.group_id for g in mine.groups] == [g.group_id for g in theirs.groups]
        elif isinstance(mine, LeaseGrant):
            assert [p.prompt_id for p in mine.prompts] == [p.prompt_id for p in theirs.prompts]
        else:
            assert mine == theirs
    assert training_view(evaluating) == training_view(plain)
    counters = evaluating.counters()
    assert counters["dropped_stale_groups"] == 2 and counters["eval_leases_issued"] >= 3
    assert evaluating.state.ledger.gap(evaluating.state.replay.samples, len(evaluating.state.replay)) == (0, 0)
    assert identity_holds(counters)


def test_an_eval_grant_leaves_admission_and_the_ledger_alone() -> None:
    core = eval_core()
    advance(core, 0)
    before = training_view(core)
    grant = eval_grant(core, 0)
    assert training_view(core) == before  # _admitted, refusals' inputs, replay buffer, training leases
    ask(core, result_for(grant, 0, 0))
    assert training_view(core) == before
    assert len(core.state.replay) == 0 and core.counters()["eval_done"] == PROMPTS_PER_SET


# ------------------------------------------------------------------------------------------------ accounting
def test_the_eval_identity_holds_through_every_outcome() -> None:
    core = eval_core()
    evaluation = core.state.evaluation
    advance(core, 0)
    steps: list[tuple[str, dict[str, int]]] = []

    def check(what: str) -> dict[str, int]:
        counters = core.counters()
        assert identity_holds(counters), (what, counters)
        steps.append((what, counters))
        return counters

    a = eval_grant(core, 0)
    b = eval_grant(core, 1)
    check("two grants")
    assert ask(core, result_for(a, 0, 0)).status == "accepted"
    assert ask(core, result_for(a, 0, 0)).status == "duplicate"
    counters = check("accepted, then a duplicate")
    assert (counters["eval_results_accepted"], counters["eval_duplicates"]) == (1, 1)
    wrong_owner = ask(core, result_for(b, 5, 0))
    assert wrong_owner.status == "rejected" and "belongs to generator 1" in wrong_owner.reason
    assert evaluation.leases[b.lease_id].state == "active"  # another peer cannot end generator 1's lease
    unknown = ask(core, result_for(b, 1, 0, lease_id=999))
    assert unknown.status == "rejected" and "unknown" in unknown.reason
    check("wrong owner, unknown lease")
    assert core.counters()["eval_outstanding"] == PROMPTS_PER_SET

    rejections = {
        "wrong_prompts": {"prompt_ids": [2, 1, 0]},
        "wrong_layout": {"total": PROMPTS_PER_SET * 2},
        "old_version": {"version": 0},  # below the round's version 2
        "future_version": {"version": 4},  # above newest = learner step 2 + sync_every 1
    }
    advance(core, 2)  # round 2 of both sets
    for generator, (kind, change) in enumerate(rejections.items(), start=10):
        grant = eval_grant(core, generator, version=3 if kind == "future_version" else 2)
        version = change.pop("version", 2)
        ack = ask(core, result_for(grant, generator, version, **change))
        assert ack.status == "rejected" and ack.reason, kind
        assert evaluation.leases[grant.lease_id].state == "rejected"
        assert grant.set_name in evaluation.due  # its round is due again
        counters = check(kind)
        assert counters[f"rejected_eval_{kind}"] == 1
    late = ask(core, result_for(grant, generator, 2))  # the last rejected lease, answered again
    assert late.status == "rejected" and "rejected before" in late.reason
    counters = check("late result of a rejected lease")
    assert counters["rejected_eval_lease_ended"] == 1
    assert counters["eval_requeued"] == 4 * PROMPTS_PER_SET


def test_a_dead_generators_eval_lease_expires_and_is_granted_again() -> None:
    core = eval_core()
    advance(core, 0)
    grant = eval_grant(core, 0, now=0.0)
    assert isinstance(ask(core, Heartbeat(1, 0, []), now=2.0), Ok)
    assert isinstance(ask(core, Heartbeat(1, 0, []), now=4.0), Ok)  # generator 1 alive, generator 0 silent 4 s
    core.tick(4.0)
    counters = core.counters()
    assert counters["eval_leases_expired"] == 1 and counters["eval_requeued"] == PROMPTS_PER_SET
    assert identity_holds(counters) and counters["eval_outstanding"] == 0
    again = eval_grant(core, 1, now=4.0)
    assert again.set_name == grant.set_name and again.lease_id != grant.lease_id
    late = ask(core, result_for(grant, 0, 0), now=5.0)
    assert late.status == "rejected" and "expired" in late.reason
    assert ask(core, result_for(again, 1, 0), now=5.0).status == "accepted"
    counters = core.counters()
    assert identity_holds(counters) and counters["eval_done"] == PROMPTS_PER_SET
    assert counters["eval_issued"] == 2 * PROMPTS_PER_SET


def test_heartbeats_renew_the_eval_lease_of_a_slow_generator() -> None:
    """An evaluation that takes 10 x lease_timeout_s on a live generator keeps its lease; its result is accepted."""
    core = eval_core(stall_timeout_s=60.0)
    advance(core, 0)
    grant = eval_grant(core, 0, now=0.0)
    for t in range(2, int(10 * LEASE_TIMEOUT_S), 2):
        assert isinstance(ask(core, Heartbeat(0, 0, [], progress=t, eval_lease_ids=[grant.lease_id]), t), Ok)
        core.tick(t + 0.5)
    assert core.counters()["eval_leases_expired"] == 0
    assert ask(core, result_for(grant, 0, 0), now=10 * LEASE_TIMEOUT_S).status == "accepted"
    # another generator cannot renew it: a heartbeat naming a foreign eval lease changes nothing
    other = eval_grant(core, 1, now=100.0)
    ask(core, Heartbeat(0, 0, [], progress=999, eval_lease_ids=[other.lease_id]), now=105.0)
    assert core.state.evaluation.leases[other.lease_id].deadline == 100.0 + LEASE_TIMEOUT_S


def test_eval_grants_wait_for_the_first_training_batch() -> None:
    """On a slow machine an eval round sampled before the first batch would delay the learner's first step by as
    long as it takes: until a batch was drawn, the due round stays due and the generator gets training prompts."""
    core = eval_core(first_batch=False)
    advance(core, 0)
    assert core.state.evaluation.due == {"arithmetic": 0, "arithmetic-d2": 0}
    first = ask(core, LeaseRequest(0, 2, 0))
    assert isinstance(first, LeaseGrant) and isinstance(ask(core, LeaseRequest(1, 2, 0)), LeaseGrant)
    assert core.counters()["eval_leases_issued"] == 0
    for prompt in first.prompts:
        ask(core, make_group(first.lease_id, prompt, 0, size=GROUP))
    assert isinstance(ask(core, LeaseRequest(0, 2, 0)), LeaseRefused)  # full, and still no eval grant
    assert isinstance(ask(core, BatchRequest(0, 0, 1, 2, 0.0)), Batch)
    grant = eval_grant(core, 0)
    assert (grant.set_name, grant.min_version) == ("arithmetic", 0)  # the round of version 0, still due


def test_an_overdue_eval_lease_expires_and_ended_leases_are_forgotten() -> None:
    core = eval_core(heartbeat_timeout_s=1000.0)
    advance(core, 0)
    grant = eval_grant(core, 0, now=0.0)
    core.tick(LEASE_TIMEOUT_S - 1)
    assert core.counters()["eval_leases_expired"] == 0
    core.tick(LEASE_TIMEOUT_S + 1)
    assert core.counters()["eval_leases_expired"] == 1
    core.tick(3 * LEASE_TIMEOUT_S)  # retained lease_timeout_s after its end: then unknown
    assert grant.lease_id not in core.state.evaluation.leases
    assert "unknown" in ask(core, result_for(grant, 0, 0), now=3 * LEASE_TIMEOUT_S).reason


# ------------------------------------------------------------------------------------------------ rows
def test_an_accepted_result_is_one_row_keyed_by_its_version() -> None:
    core = eval_core()
    advance(core, 2)
    grant = eval_grant(core, 0, version=3)
    assert ask(core, result_for(grant, 0, 3)).status == "accepted"
    [(version, row)] = core.state.evaluation.take_rows()
    assert version == 3 and core.state.evaluation.take_rows() == []
    p = "eval/arithmetic/"
    # result_for: 3 prompts x (greedy right, 2 samples wrong), 5 tokens each, reward 1 for a right one
    assert row[p + "greedy/strict_accuracy"] == 1.0 and row[p + "greedy/pass@k"] == 1.0
    assert row[p + "strict_accuracy"] == 0.0 and row[p + "pass@1"] == 0.0 and row[p + "pass@k"] == 0.0
    assert (row[p + "k"], row[p + "greedy/k"], row[p + "prompts"], row[p + "samples"]) == (2, 1, 3, 6)
    assert row[p + "mean_tokens"] == 5.0 and row[p + "truncated_share"] == 0.0
    assert row[p + "learner_version"] == 2 and row[p + "wall_s"] == 2.5
    assert all(key.startswith(p) for key in row)


def test_undefined_metrics_are_left_out_of_the_row() -> None:
    core = eval_core()
    advance(core, 0)
    grant = eval_grant(core, 0)
    undefined = np.full(PROMPTS_PER_SET * 3, -1, np.int8)
    ask(core, result_for(grant, 0, 0, strict=undefined, lenient=undefined, passed=undefined))
    [(_, row)] = core.state.evaluation.take_rows()
    assert "eval/arithmetic/strict_accuracy" not in row and "eval/arithmetic/pass@k" not in row
    assert row["eval/arithmetic/mean_reward"] == 0.0


# ------------------------------------------------------------------------------------------------ malformed input
def test_a_malformed_eval_result_is_refused_and_counted_and_the_buffer_answers_on() -> None:
    core = eval_core()
    advance(core, 0)
    grant = eval_grant(core, 0)
    bad = result_for(grant, 0, 0, num_tokens=np.full(2, 5, np.int32))  # misaligned: the wire refuses it
    with pytest.raises(WireError) as error:
        decode(encode(bad))
    assert "num_tokens" in error.value.reason
    with pytest.raises(RequestRejected) as refused:  # only a generator may send one
        core.handle(result_for(grant, 0, 0), "me", "test", 0.0, role="learner")
    assert refused.value.kind == "forbidden_role"
    ack = ask(core, result_for(grant, 0, 0, total=1))
    assert isinstance(ack, EvalAck) and ack.status == "rejected" and "completions" in ack.reason
    assert core.counters()["rejected_eval_wrong_layout"] == 1
    assert isinstance(ask(core, LeaseRequest(3, 2, 0)), EvalGrant)  # still serving


def test_a_buffer_without_evaluation_refuses_eval_results() -> None:
    core = eval_core(evaluate=False)
    items = [PromptItem(p.prompt_id, 0, p.messages, p.metadata) for p in fake_prompts(2)]
    grant = EvalGrant(1, 0.0, "arithmetic", 0, True, 0, 1.0, 8, items)
    with pytest.raises(RequestRejected) as refused:
        core.handle(result_for(grant, 0, 0), "me", "test", 0.0)
    assert refused.value.kind == "eval_off"
    assert not any("eval" in key for key in core.counters())


# ------------------------------------------------------------------------------------------------ journal
def test_a_restarted_buffer_keeps_its_rounds_and_accepts_a_late_result(tmp_path: Path) -> None:
    path = tmp_path / "journal.bin"
    core = eval_core(Journal(path))
    core.state.restore(0.0)
    draw_first_batch(core)
    ask(core, VersionReport(0, 0, resync=True))
    grant = eval_grant(core, 0)
    assert ask(core, result_for(eval_grant(core, 1), 1, 0)).status == "accepted"
    snapshot = core.state.evaluation.snapshot()
    counters = core.counters()
    core.state.journal.close()

    restarted = eval_core(Journal(path))
    restarted.state.restore(1.0)
    assert restarted.state.evaluation.snapshot() == snapshot
    assert restarted.counters() == counters
    assert ask(restarted, result_for(grant, 0, 0), now=1.5).status == "accepted"
    assert identity_holds(restarted.counters())

    restarted.state.compact(2.0)  # the compacted journal holds the eval state too
    snapshot, counters = restarted.state.evaluation.snapshot(), restarted.counters()
    restarted.state.journal.close()
    again = eval_core(Journal(path))
    again.state.restore(3.0)
    assert again.state.evaluation.snapshot() == snapshot and again.counters() == counters
    assert ask(again, result_for(grant, 0, 0), now=3.5).status == "duplicate"
    again.state.journal.close()


def test_a_journal_that_evaluated_replays_into_a_buffer_that_does_not(tmp_path: Path) -> None:
    path = tmp_path / "journal.bin"
    core = eval_core(Journal(path))
    core.state.restore(0.0)
    draw_first_batch(core)
    ask(core, VersionReport(0, 0, resync=True))
    eval_grant(core, 0)
    training = training_view(core)
    core.state.journal.close()
    plain = eval_core(Journal(path), evaluate=False)
    assert plain.state.restore(1.0) > 0
    assert training_view(plain) == training
    plain.state.journal.close()


# ------------------------------------------------------------------------------------------------ the end of a run
def test_run_over_waits_for_the_final_round() -> None:
    core = eval_core(first_batch=False)  # a learner resumed at its last step: the final round needs no batch
    assert isinstance(ask(core, VersionReport(3, 3, resync=True, final=True), now=0.0), Ok)
    assert core.state.evaluation.final_version == 3
    assert core.counters()["eval_final_pending"] == 2
    assert isinstance(ask(core, Heartbeat(0, 3, []), now=1.0), Ok)  # not RunOver yet
    stale = ask(core, LeaseRequest(0, 4, 2), now=1.0)
    assert (stale.reason, stale.min_version) == ("stale", 3)  # load the final weights first
    first = eval_grant(core, 0, version=3, now=1.0)
    full = ask(core, LeaseRequest(0, 4, 3), now=1.0)  # holds an eval lease: no training prompts at the end
    assert isinstance(full, LeaseRefused) and full.reason == "full"
    second = eval_grant(core, 1, version=3, now=1.0)
    assert ask(core, result_for(first, 0, 3), now=2.0).status == "accepted"
    assert core.counters()["eval_final_pending"] == 1 and not core.run_over(2.0)
    assert ask(core, result_for(second, 1, 3), now=2.0).status == "accepted"
    assert core.counters()["eval_final_pending"] == 0
    assert ask(core, Heartbeat(0, 3, []), now=2.5) == RunOver(step=3)
    assert ask(core, LeaseRequest(1, 4, 3), now=2.5) == RunOver(step=3)
    assert core.run_over(2.5)


def test_run_over_comes_after_the_final_timeout_without_results() -> None:
    core = eval_core(final_timeout_s=30.0)
    ask(core, VersionReport(0, 0, final=True), now=0.0)
    eval_grant(core, 0, now=0.0)
    assert isinstance(ask(core, Heartbeat(0, 0, []), now=29.0), Ok)
    assert not core.run_over(29.0)
    core.tick(29.0)
    core.tick(30.5)  # generator 0 was heard at 29: its lease has not expired, the final round timed out
    counters = core.counters()
    assert counters["eval_final_pending"] == 0 and counters["eval_final_timed_out"] == 2
    assert ask(core, Heartbeat(0, 0, []), now=30.5) == RunOver(step=0)
    assert core.run_over(30.5)


def test_without_at_end_the_run_ends_at_once() -> None:
    core = eval_core(at_end=False)
    ask(core, VersionReport(0, 0, final=True))
    assert core.counters()["eval_final_pending"] == 0
    assert ask(core, LeaseRequest(0, 4, 0)) == RunOver(step=0)


def test_an_announcement_without_final_cancels_the_final_wait() -> None:
    core = eval_core()
    ask(core, VersionReport(0, 0, final=True))
    assert core.counters()["eval_final_pending"] == 2
    ask(core, VersionReport(0, 0, resync=True))  # a learner resumed with more total_steps
    assert core.counters()["eval_final_pending"] == 0
    assert isinstance(ask(core, LeaseRequest(0, 4, 0)), EvalGrant)  # the round of version 0 is still due


def test_a_result_forged_on_another_connection_is_refused_and_the_real_one_accepted() -> None:
    """A peer holding the generator role names another generator's id and eval lease: the result did not come on the
    connection the grant went to, so it is refused (counted) and the lease is left alone for its holder."""
    core = eval_core()
    advance(core, 0)
    grant = eval_grant(core, 0)  # asked on the connection "test" (tests.buffers.fakes.ask)
    ((_, forged),) = core.handle(result_for(grant, 0, 0), reply_to="them", sender="forger@00ff", now=1.0)
    assert forged.status == "rejected" and "another connection" in forged.reason
    assert core.counters()["rejected_eval_wrong_holder"] == 1
    assert core.state.evaluation.leases[grant.lease_id].state == "active"
    assert ask(core, result_for(grant, 0, 0), now=2.0).status == "accepted"
