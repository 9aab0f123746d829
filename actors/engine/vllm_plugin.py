"""The vLLM general plugin Tandem registers (pyproject.toml: entry point `vllm.general_plugins` `tandem`).

vLLM calls `register` in every process it starts (the engine core and its workers: vllm/plugins/__init__.py,
`load_general_plugins`), before the engine is built, and again wherever a plugin load is asked for (it must be
harmless to call twice). It makes those processes exit without automatic garbage collections
(`common.teardown.skip_exit_gc`: an engine shutdown on a CPU went from vLLM's 5 s grace and a forced kill to 4 s
and a clean exit). Imports nothing heavy: it runs in every process that imports vLLM in an environment where Tandem
is installed; `VLLM_PLUGINS` (a list of the plugin names to load) can leave it out.
"""

from __future__ import annotations

from common.teardown import skip_exit_gc


def register() -> None:
    skip_exit_gc()
