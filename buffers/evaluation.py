"""Evaluation during training, the buffer's side: rounds, eval leases, results and their rows (issue 16).

    evaluation = EvalScheduler.load(config.eval, max_tokens=config.eval_max_tokens, lease_timeout_s=300.0)
    evaluation.report_version(policy_version, final=False, now=now)    # opens a round at 0, N, 2N, ...
    grant = evaluation.grant(generator_id, policy_version, now)        # an EvalGrant, or None: train instead
    ack = evaluation.receive(result, now, learner_version, newest_version)   # EvalAck; a row on acceptance
    evaluation.expire(now, dead_generators)                             # overdue eval leases: their set is due again
    for version, row in evaluation.take_rows(): sink.log(version, row)  # `eval/<label>/<metric>`

Pure bookkeeping: no sockets, no clock (`now` is passed in), no journal (the buffer journals `snapshot()` after
every change and replays it with `restore`: buffers.state).

Rounds. The learner reports the versions it publishes; the first report at or past a multiple of N = eval.every
opens a round at that multiple (versions 0, N, 2N, ...; a report that jumps past several opens only the newest),
and with eval.at_end the final report opens one at the final version. A round is one eval lease per set (every
prompt of the set, at most eval.max_prompts). A round is *due* until it is leased; a set's due round is replaced
by a newer one (counted `eval_superseded`, in set-rounds). A round is opened once per version: a learner that
resumes from an older checkpoint does not re-open the versions it had reached.

Leases. A generator that holds no eval lease and samples with policy_version >= a due round's version gets that
round (the first such set in eval.sets order) as an `EvalGrant`, with its own lease ids. The lease ends when its
result is accepted, when its result is rejected, or when it expires (no heartbeat of its generator listed it for
lease_timeout_s: `renew`; or its generator fell silent past buffer.heartbeat_timeout_s, or stuck past
buffer.stall_timeout_s); a rejected or expired lease makes its round due again (unless a newer
round of that set is due, leased or done: then it is superseded). Ended leases are kept `retain_s` so that a
re-sent result is told `duplicate`.

Result checks (EvalAck "rejected" + reason, counted `rejected_eval_<kind>`): unknown_lease, wrong_generator and
wrong_holder (a result must come on the connection its grant went to: a peer holding the generator role cannot
forge another generator's result by naming its id; the lease is left alone in both cases: a peer cannot end another's
lease; after a buffer restart the connections are new and results are checked by generator id only), lease_ended (expired or rejected before), and on the
owner's active lease, which then ends and is requeued: wrong_prompts (not the lease's prompt ids in its order),
wrong_layout (not P x m completions), old_version (below the round's version), future_version (above the newest
version the learner can have published).

Accounting (`counters`, in prompts): eval_issued = eval_done + eval_requeued + eval_outstanding (requeued: prompts
of expired or rejected eval leases), besides eval_leases_issued, eval_leases_expired, eval_results_accepted,
eval_duplicates, eval_superseded, eval_rounds_opened, rejected_eval_<kind>. None of it touches the training ledger.
eval_final_pending: sets of the final round not done yet (0 before the final report, once all are done, and once
eval.final_timeout_s passed after it: `eval_final_timed_out` counts the sets it gave up on).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from buffers.leases import PromptRecordLike
from common.config import EvalConfig, TandemConfig
from common.eval_messages import EvalAck, EvalGrant, EvalResult
from common.eval_metrics import result_metrics
from common.eval_sets import eval_set, set_label
from common.prompt_sources import RowMapping, env_row_mapping
from common.types import PromptItem

log = logging.getLogger("tandem.buffer.eval")

ACTIVE, DONE, EXPIRED, REJECTED = "active", "done", "expired", "rejected"
COUNTERS = (
    "eval_rounds_opened",
    "eval_leases_issued",
    "eval_leases_expired",
    "eval_issued",
    "eval_done",
    "eval_requeued",
    "eval_results_accepted",
    "eval_duplicates",
    "eval_superseded",
    "eval_final_timed_out",
)


@dataclass
class EvalLease:
    """One eval set handed to one generator for the round of `round_version`."""

    lease_id: int
    generator_id: int
    set_name: str
    round_version: int
    deadline: float
    prompt_ids: list[int]
    greedy: bool
    samples: int
    state: str = ACTIVE
    ended_at: float = 0.0
    # The connection the grant went to (`common.sockets.Request.sender`: its routing id is ZeroMQ's, unforgeable):
    # only a result from it is taken. Not journaled: after a restart every connection is new, and "" binds nothing.
    holder: str = ""

    @property
    def per_prompt(self) -> int:
        return int(self.greedy) + self.samples

    def to_record(self) -> list[Any]:
        return [
            self.lease_id,
            self.generator_id,
            self.set_name,
            self.round_version,
            self.deadline,
            list(self.prompt_ids),
            self.greedy,
            self.samples,
            self.state,
            self.ended_at,
        ]

    @classmethod
    def from_record(cls, record: Sequence[Any]) -> EvalLease:
        lease_id, generator, name, version, deadline, prompts, greedy, samples, state, ended_at = record
        return cls(lease_id, generator, name, version, deadline, list(prompts), greedy, samples, state, ended_at)


def load_sets(
    config: EvalConfig, shots: int = 0, mapping: RowMapping | None = None
) -> dict[str, list[PromptRecordLike]]:
    """The prompts of every set of eval.sets (at most eval.max_prompts each, arithmetic ones with the run's
    env.shots worked examples, file sets read with `mapping`: the run's `common.prompt_sources.env_row_mapping`),
    in config order. Raises what `common.eval_sets.eval_set` raises for an unknown set or an unreadable file (the
    buffer does not start)."""
    return {
        name: eval_set(name, limit=config.max_prompts, shots=shots, mapping=mapping).records for name in config.sets
    }


class EvalScheduler:
    """Rounds, eval leases and results (see the module docstring). Not thread-safe (the buffer's loop owns it)."""

    def __init__(
        self,
        config: EvalConfig,
        sets: Mapping[str, Sequence[PromptRecordLike]],
        max_tokens: int,
        lease_timeout_s: float,
        retain_s: float | None = None,
    ) -> None:
        """`sets`: name -> prompts (`load_sets`); `max_tokens`: the token limit of an eval completion
        (TandemConfig.eval_max_tokens). Raises ValueError for an empty set or repeated prompt ids."""
        for name, records in sets.items():
            ids = [record.prompt_id for record in records]
            if not ids or len(set(ids)) != len(ids):
                raise ValueError(f"eval set {name!r}: needs >= 1 prompt with distinct prompt ids (got {len(ids)})")
        self.config, self.max_tokens, self.lease_timeout_s = config, max_tokens, lease_timeout_s
        self.retain_s = lease_timeout_s if retain_s is None else retain_s
        self.sets = {name: {record.prompt_id: record for record in records} for name, records in sets.items()}
        self.labels = {name: set_label(name) for name in self.sets}
        self.due: dict[str, int] = {}  # set -> version of its round waiting for a lease
        self.done: dict[str, int] = {name: -1 for name in self.sets}  # set -> newest round version with a result
        self.opened = -1  # the newest regular round opened (a multiple of eval.every)
        self.final_version: int | None = None  # the final round's version, once the learner's final report came
        self.final_deadline = 0.0
        self.final_timed_out = False
        self.leases: dict[int, EvalLease] = {}  # active and recently ended
        self.next_lease_id = 1
        self.counts: Counter[str] = Counter({key: 0 for key in COUNTERS})
        self.rows: list[tuple[int, dict[str, Any]]] = []  # (policy_version, row) not yet taken by the service

    @classmethod
    def from_config(cls, config: TandemConfig) -> EvalScheduler | None:
        """The scheduler of a run with eval.sets (`load`, with the buffer's lease timeouts and the env's row
        mapping and shots), logged; None without eval sets."""
        if not config.eval.enabled:
            return None
        buffer = config.buffer
        scheduler = cls.load(
            config.eval,
            config.eval_max_tokens,
            buffer.lease_timeout_s,
            max(buffer.lease_timeout_s, buffer.heartbeat_timeout_s),
            shots=config.env.shots,
            mapping=env_row_mapping(config.env),
        )
        log.info("evaluation: %s every %d versions", ", ".join(config.eval.sets), config.eval.every)
        return scheduler

    @classmethod
    def load(
        cls,
        config: EvalConfig,
        max_tokens: int,
        lease_timeout_s: float,
        retain_s: float | None = None,
        shots: int = 0,
        mapping: RowMapping | None = None,
    ) -> EvalScheduler:
        """A scheduler over the sets of `config` (`load_sets`, with `shots` worked examples: env.shots, and file sets
        read with `mapping`: the run's column mapping)."""
        return cls(config, load_sets(config, shots, mapping), max_tokens, lease_timeout_s, retain_s)

    # ------------------------------------------------------------------------------------------ rounds
    def report_version(self, policy_version: int, final: bool, now: float) -> bool:
        """The learner published `policy_version` (`final`: its last); returns whether anything changed."""
        changed = False
        round_version = policy_version // self.config.every * self.config.every
        if round_version > self.opened:
            self.opened = round_version
            self._open_round(round_version)
            changed = True
        if final and self.config.at_end and self.final_version != policy_version:
            self.final_version, self.final_deadline = policy_version, now + self.config.final_timeout_s
            self.final_timed_out = False
            self._open_round(policy_version)
            changed = True
            log.info("final evaluation of version %d: %d sets pending", policy_version, self.final_pending)
        return changed

    def reopen(self) -> bool:
        """A learner announced itself without `final` after the final report: the run goes on, no final wait."""
        if self.final_version is None:
            return False
        self.final_version, self.final_timed_out = None, False
        return True

    def _open_round(self, version: int) -> None:
        opened = [self._make_due(name, version, requeued=False) for name in self.sets]
        self.counts["eval_rounds_opened"] += int(any(opened))

    def _make_due(self, name: str, version: int, requeued: bool) -> bool:
        """Round `version` of set `name` becomes due (True), unless that set has a round >= it done, leased or
        due (then a requeued round is superseded; a newly opened one is covered already)."""
        leased = [x.round_version for x in self.leases.values() if x.state == ACTIVE and x.set_name == name]
        if max(self.done[name], self.due.get(name, -1), *leased) >= version:
            self.counts["eval_superseded"] += int(requeued)
            return False
        if name in self.due:
            self.counts["eval_superseded"] += 1
        self.due[name] = version
        return True

    # ------------------------------------------------------------------------------------------ the final round
    @property
    def final_pending(self) -> int:
        """Sets of the final round with no result yet (0 without a final round, or once it timed out)."""
        if self.final_version is None or self.final_timed_out:
            return 0
        return sum(1 for name in self.sets if self.done[name] < self.final_version)

    def final_waiting(self, now: float) -> bool:
        """The end of the run waits for the final round: sets pending and eval.final_timeout_s not passed."""
        return self.final_pending > 0 and now < self.final_deadline

    def check_final_timeout(self, now: float) -> bool:
        """Give up on the final round once eval.final_timeout_s passed; returns whether it gave up now."""
        pending = self.final_pending
        if pending == 0 or now < self.final_deadline:
            return False
        self.final_timed_out = True
        self.counts["eval_final_timed_out"] += pending
        log.warning(
            "final evaluation of version %s: %d sets without a result after eval.final_timeout_s = %.0fs: ending the "
            "run without them (more generators, fewer eval.max_prompts or a longer timeout would finish it)",
            self.final_version,
            pending,
            self.config.final_timeout_s,
        )
        return True

    def stale_for_final(self, policy_version: int) -> int | None:
        """While the final round waits: the version a generator must load to take part, if it holds older weights
        (the oldest due round it cannot take), else None."""
        versions = [version for version in self.due.values() if version > policy_version]
        return min(versions) if versions else None

    # ------------------------------------------------------------------------------------------ leases
    def holds_lease(self, generator_id: int) -> bool:
        return any(lease.generator_id == generator_id and lease.state == ACTIVE for lease in self.leases.values())

    def grant(self, generator_id: int, policy_version: int, now: float, holder: str = "") -> EvalGrant | None:
        """The eval lease for this generator now (module docstring), or None: it gets training prompts instead.
        `holder`: the connection that asked (the lease's result must come from it)."""
        if not self.due or self.holds_lease(generator_id):
            return None
        name = next((name for name in self.sets if self.due.get(name, policy_version + 1) <= policy_version), None)
        if name is None:
            return None
        version = self.due.pop(name)
        records = self.sets[name]
        lease = EvalLease(
            self.next_lease_id,
            generator_id,
            name,
            version,
            now + self.lease_timeout_s,
            list(records),
            self.config.greedy,
            self.config.samples,
            holder=holder,
        )
        self.next_lease_id += 1
        self.leases[lease.lease_id] = lease
        self.counts["eval_leases_issued"] += 1
        self.counts["eval_issued"] += len(lease.prompt_ids)
        log.info(
            "eval lease %d: set %s (%d prompts) of version %d to generator %d (at version %d)",
            lease.lease_id,
            name,
            len(lease.prompt_ids),
            version,
            generator_id,
            policy_version,
        )
        return EvalGrant(
            lease_id=lease.lease_id,
            deadline=lease.deadline,
            set_name=name,
            min_version=version,
            greedy=lease.greedy,
            samples=lease.samples,
            temperature=self.config.temperature,
            max_tokens=self.max_tokens,
            prompts=[PromptItem(pid, 0, records[pid].messages, records[pid].metadata) for pid in lease.prompt_ids],
        )

    def renew(self, generator_id: int, lease_ids: Sequence[int], now: float) -> None:
        """A heartbeat of `generator_id` lists these eval leases as being sampled: its own active ones get a new
        deadline, now + lease_timeout_s (a live generator's evaluation is never cut by its length)."""
        for lease_id in lease_ids:
            lease = self.leases.get(lease_id)
            if lease is not None and lease.state == ACTIVE and lease.generator_id == generator_id:
                lease.deadline = max(lease.deadline, now + self.lease_timeout_s)

    def _end(self, lease: EvalLease, state: str, now: float) -> None:
        """End an active lease; an expired or rejected one sends its round back (it may be superseded)."""
        lease.state, lease.ended_at = state, now
        if state == DONE:
            self.counts["eval_done"] += len(lease.prompt_ids)
            return
        self.counts["eval_requeued"] += len(lease.prompt_ids)
        if lease.set_name in self.sets:
            self._make_due(lease.set_name, lease.round_version, requeued=True)

    def expire(self, now: float, dead_generators: Iterable[int]) -> list[int]:
        """Expire the active eval leases whose deadline passed or whose generator is dead (the dispenser's
        heartbeat view); returns their ids."""
        dead = set(dead_generators)
        due = [
            lease
            for lease in self.leases.values()
            if lease.state == ACTIVE and (lease.deadline < now or lease.generator_id in dead)
        ]
        for lease in due:
            why = f"generator {lease.generator_id} silent" if lease.generator_id in dead else "deadline passed"
            log.warning(
                "eval lease %d (set %s) expired (%s): the set is due again", lease.lease_id, lease.set_name, why
            )
            self.counts["eval_leases_expired"] += 1
            self._end(lease, EXPIRED, now)
        return [lease.lease_id for lease in due]

    def forget(self, now: float) -> bool:
        """Drop ended leases older than retain_s; returns whether any was dropped."""
        old = [i for i, lease in self.leases.items() if lease.state != ACTIVE and now - lease.ended_at > self.retain_s]
        for lease_id in old:
            del self.leases[lease_id]
        return bool(old)

    # ------------------------------------------------------------------------------------------ results
    def receive(
        self, result: EvalResult, now: float, learner_version: int, newest_version: int, sender: str = ""
    ) -> EvalAck:
        """Check a result against its lease (module docstring) and answer it; an accepted one adds a row.
        `sender`: the connection it came on, checked against the lease's holder."""
        lease = self.leases.get(result.lease_id)
        problem = self._lease_problem(result, lease, sender)
        if problem is None and lease.state == DONE:
            self.counts["eval_duplicates"] += 1
            return EvalAck(result.lease_id, "duplicate")
        if problem is None:
            problem = self._content_problem(result, lease, newest_version)
            if problem is not None:
                self._end(lease, REJECTED, now)
        if problem is not None:
            kind, reason = problem
            self.counts[f"rejected_eval_{kind}"] += 1
            log.warning(
                "rejected eval result (lease %d, generator %d): %s", result.lease_id, result.generator_id, reason
            )
            return EvalAck(result.lease_id, "rejected", reason)
        self._end(lease, DONE, now)
        self.counts["eval_results_accepted"] += 1
        self.done[lease.set_name] = max(self.done[lease.set_name], lease.round_version)
        self.rows.append((result.policy_version, self._row(result, lease, learner_version)))
        if self.final_version is not None and lease.round_version >= self.final_version and not self.final_pending:
            log.info("final evaluation of version %d: every set done", self.final_version)
        return EvalAck(result.lease_id, "accepted")

    def _lease_problem(self, result: EvalResult, lease: EvalLease | None, sender: str) -> tuple[str, str] | None:
        if lease is None:
            return "unknown_lease", (
                f"eval lease {result.lease_id} is unknown (never issued, or ended more than {self.retain_s:.0f}s ago)"
            )
        if lease.generator_id != result.generator_id:
            return "wrong_generator", f"eval lease {lease.lease_id} belongs to generator {lease.generator_id}"
        if lease.holder and sender != lease.holder:
            return "wrong_holder", (
                f"eval lease {lease.lease_id} was granted on another connection: a result comes from the connection "
                "its grant went to"
            )
        if lease.state in (EXPIRED, REJECTED):
            return "lease_ended", (
                f"eval lease {lease.lease_id} {lease.state} before this result came: its set was handed out again"
            )
        return None

    def _content_problem(self, result: EvalResult, lease: EvalLease, newest_version: int) -> tuple[str, str] | None:
        if list(result.prompt_ids) != lease.prompt_ids:
            return "wrong_prompts", (
                f"prompt_ids must be the lease's {len(lease.prompt_ids)} prompts in its order "
                f"(got {len(result.prompt_ids)}, first {list(result.prompt_ids)[:4]})"
            )
        expected = len(lease.prompt_ids) * lease.per_prompt
        if len(result.rewards) != expected:
            return "wrong_layout", (
                f"{len(result.rewards)} completions, the lease asks {len(lease.prompt_ids)} prompts x "
                f"{lease.per_prompt} (greedy {lease.greedy}, samples {lease.samples}) = {expected}"
            )
        if result.policy_version < lease.round_version:
            return "old_version", (
                f"policy_version {result.policy_version} < {lease.round_version}, the version this round evaluates: "
                "sample with weights of at least that version"
            )
        if result.policy_version > newest_version:
            return "future_version", (
                f"policy_version {result.policy_version} > {newest_version}, the newest the learner can have published"
            )
        return None

    def _row(self, result: EvalResult, lease: EvalLease, learner_version: int) -> dict[str, Any]:
        """`eval/<label>/<metric>` of an accepted result; metrics not defined for the set (None) are left out."""
        prefix = f"eval/{set_label(lease.set_name)}/"
        metrics = result_metrics(result, lease.greedy, lease.samples)
        row = {prefix + key: value for key, value in metrics.items() if value is not None}
        row[prefix + "learner_version"] = learner_version
        row[prefix + "wall_s"] = max(0.0, result.finished_at - result.started_at)
        return row

    def take_rows(self) -> list[tuple[int, dict[str, Any]]]:
        """The rows of results accepted since the last call, as (policy_version, row), oldest first."""
        rows, self.rows = self.rows, []
        return rows

    # ------------------------------------------------------------------------------------------ accounting
    def counters(self) -> dict[str, int]:
        """The eval counters (module docstring), eval_outstanding and eval_final_pending included."""
        out = {key: int(value) for key, value in self.counts.items()}
        out["eval_outstanding"] = sum(len(x.prompt_ids) for x in self.leases.values() if x.state == ACTIVE)
        out["eval_final_pending"] = self.final_pending
        return out

    # ------------------------------------------------------------------------------------------ persistence
    def snapshot(self) -> dict[str, Any]:
        """The whole state as plain values (for the journal; the sets themselves come from the config)."""
        return {
            "due": dict(self.due),
            "done": dict(self.done),
            "opened": self.opened,
            "final_version": self.final_version,
            "final_deadline": self.final_deadline,
            "final_timed_out": self.final_timed_out,
            "next_lease_id": self.next_lease_id,
            "leases": [lease.to_record() for lease in self.leases.values()],
            "counts": dict(self.counts),
        }

    def restore(self, snapshot: Mapping[str, Any], now: float) -> None:
        """Replace the state by a snapshot. A set no longer in eval.sets is dropped: its due round goes, and its
        active leases end as expired (requeued, so the accounting still adds up)."""
        self.opened, self.next_lease_id = snapshot["opened"], snapshot["next_lease_id"]
        self.final_version, self.final_deadline = snapshot["final_version"], snapshot["final_deadline"]
        self.final_timed_out = snapshot["final_timed_out"]
        self.counts = Counter({key: 0 for key in COUNTERS})
        self.counts.update({key: int(value) for key, value in snapshot["counts"].items()})
        self.due = {name: v for name, v in snapshot["due"].items() if name in self.sets}
        self.done = {name: snapshot["done"].get(name, -1) for name in self.sets}
        self.leases = {record[0]: EvalLease.from_record(record) for record in snapshot["leases"]}
        gone = sorted({*snapshot["due"], *snapshot["done"]} - set(self.sets))
        for lease in self.leases.values():
            if lease.state == ACTIVE and lease.set_name not in self.sets:
                self._end(lease, EXPIRED, now)
        if gone:
            log.warning("journal: eval sets %s are no longer in eval.sets: their rounds are dropped", gone)
