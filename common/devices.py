"""What the roles decide about devices before they start an engine: pure rules, tested on CPU. For example:

    eager = vllm_eager(config.generator.enforce_eager, cuda=current_platform.is_cuda_alike())

No function here imports torch or vLLM: the callers pass what they found.
"""

from __future__ import annotations

from typing import Literal


def vllm_eager(setting: bool | Literal["auto"], cuda: bool) -> bool:
    """Whether vLLM runs its model eagerly (`enforce_eager`): as written when true or false; "auto" = eagerly on
    CPU (compiling costs ~100 s of start for ~20% of speed on 2 cores) and with CUDA graphs on a GPU, where eager
    decode at a generator's batch sizes is bound by kernel launches (vLLM's own default there)."""
    return not cuda if setting == "auto" else setting
