"""A quicker interpreter exit for processes that hold torch, vLLM and transformers.

    skip_exit_gc()        # once, anywhere in the process (idempotent): exit runs without automatic collections

At exit CPython clears every module, and with the cyclic garbage collector enabled the allocations of that
teardown set off collection after collection over a heap of ~700k objects (what importing torch, vLLM and
transformers leaves). A vLLM engine process on a 2-core AVX2 EPYC spent over 3 s in `gc_collect_main` after its
work was done, past the 5 s vLLM's parent gives it, so every engine shutdown waited the whole 5 s and ended in
"force killing remaining process EngineCore". With the collector disabled from the last exit handler on, the same
shutdown took 4 s and its processes exited on their own (the engine and its worker ~2 s each after their exit
handlers). Nothing is left uncollected: the interpreter's own final collections at exit run whether the collector
is enabled or not (CPython's `_PyGC_CollectNoFail`); only the automatic ones in between are skipped.

vLLM's ROCm path freezes the heap at the end instead (`gc.freeze()` in vllm/v1/engine/core.py); here that made
triton's nanobind bindings report dozens of "leaked" objects on every exit, so the collector is disabled, not
frozen. vLLM starts its processes with spawn on a CPU (vllm/platforms/cpu.py), so each runs this teardown; with
fork (vLLM's default elsewhere) a child skips it altogether (`os._exit` after its work).

Used by `launch.cli.main` (every role process) and by the vLLM plugin `actors.engine.vllm_plugin` (the processes vLLM
starts). Imports nothing heavy.
"""

from __future__ import annotations

import atexit
import gc

_registered = False


def _disable_collector() -> None:
    gc.disable()


def skip_exit_gc() -> None:
    """From the exit handlers on (this one runs after those registered later), no automatic garbage collection."""
    global _registered
    if not _registered:
        _registered = True
        atexit.register(_disable_collector)
