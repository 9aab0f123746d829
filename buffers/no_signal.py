"""Dynamic sampling in the buffer's message handling (buffer.filter = "no_signal"; the rule, the window and the quota
are `buffers.filtering`'s): `BufferCore` holds one `NoSignalFilter` and asks it at admission and at arrival.

    admission = core.no_signal.admission(request, admit(...), admitted)  # widened while the filter is on
    if core.no_signal.drop_if_no_signal(group, now): ack "accepted"       # counted dropped_no_signal, not stored
    state.accept(group, now); core.no_signal.warn_if_mostly_filtered()
    values.update(core.no_signal.metrics())                               # buffer/filtered_share, no_signal_reward_sum

A group that passed its checks but whose rewards carry no signal is acked "accepted" (its prompt is done), counted as
dropped_no_signal and not stored; admission then counts each outstanding prompt at the share of recent arrivals that
carried signal. The filter's state (the filtered-share window, the reward sum of filtered samples) lives in
`BufferState`, which journals and restores it; this class holds none of its own.
"""

from __future__ import annotations

import logging

from buffers.filtering import mostly_filtered_warning, no_signal, signal_quota
from buffers.staleness import Admission
from buffers.state import BufferState
from common.types import LeaseRequest, RolloutGroup

log = logging.getLogger("tandem.buffer")


class NoSignalFilter:
    """Dynamic sampling's decisions over a `BufferState`; with buffer.filter = "none" every call is a no-op."""

    def __init__(self, state: BufferState) -> None:
        self.state = state
        self.settings = state.settings

    def admission(self, request: LeaseRequest, admission: Admission, admitted: int) -> Admission:
        """`admission` (from `buffers.staleness.admit`, `admitted` groups counted); with buffer.filter on, a quota
        that counts each outstanding prompt at the share of arrivals expected to carry signal
        (`buffers.filtering.signal_quota`; the stale refusal is unchanged)."""
        settings = self.settings
        if settings.filter == "none" or admission.refusal == "stale":
            return admission
        v, eta, b = request.policy_version, settings.max_staleness, settings.groups_per_step
        outstanding = self.state.dispenser.outstanding
        keep = self.state.filter_window.keep(settings.max_filtered_share)
        granted = min(request.max_prompts, signal_quota(v, eta, b, admitted - outstanding, outstanding, keep))
        return Admission(max(granted, 0), "" if granted > 0 else "full", admission.min_version)

    def drop_if_no_signal(self, group: RolloutGroup, now: float) -> bool:
        """With buffer.filter = "no_signal", drop a checked group whose rewards carry no signal
        (`BufferState.filter_out`: its prompt is done, it counts as arrived and dropped_no_signal); True if dropped."""
        if self.settings.filter != "no_signal" or not no_signal(group.rewards, self.settings.min_reward_spread):
            return False
        self.state.filter_out(group, now)
        log.debug("group (lease %d, prompt %d): no reward spread, dropped", group.lease_id, group.prompt_id)
        self.warn_if_mostly_filtered()
        return True

    def warn_if_mostly_filtered(self) -> None:
        """At most once per buffer.filter_window arrivals, when more than buffer.max_filtered_share of them were
        filtered (`buffers.filtering.FilterWindow.warn_due`)."""
        window, cap = self.state.filter_window, self.settings.max_filtered_share
        if self.settings.filter == "none" or not window.warn_due(cap):
            return
        log.warning(mostly_filtered_warning(window.share, window.size, cap))

    def metrics(self) -> dict[str, float]:
        """`buffer/filtered_share` (of the window) and `buffer/no_signal_reward_sum`; none with the filter off."""
        if self.settings.filter == "none":
            return {}
        return {
            "buffer/filtered_share": self.state.filter_window.share,
            "buffer/no_signal_reward_sum": self.state.no_signal_reward_sum,
        }
