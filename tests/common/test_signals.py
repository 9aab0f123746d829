"""common.signals.caught_signals: signals noted in order during the body, the previous handlers back after it."""

from __future__ import annotations

import os
import signal

import pytest

from common.signals import caught_signals


def test_signals_are_recorded_in_order_and_the_handlers_come_back() -> None:
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    with caught_signals() as received:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        assert received == [signal.SIGTERM, signal.SIGINT]  # noted, not obeyed: this process is still here
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_the_handlers_come_back_when_the_body_raises() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    with pytest.raises(RuntimeError), caught_signals(signal.SIGUSR1) as received:
        os.kill(os.getpid(), signal.SIGUSR1)
        raise RuntimeError("the body failed")
    assert received == [signal.SIGUSR1] and signal.getsignal(signal.SIGUSR1) == before
