#!/usr/bin/env bash
# RLHF from preference data on the embedded model, start to end (README: "RLHF from preference data"):
#   1. tandem sft  : SmolLM2-135M-Instruct fine-tuned on arithmetic chats        -> ROOT/rlhf-sft/model
#   2. tandem rm   : a reward model trained on preference pairs (Bradley-Terry)   -> ROOT/rlhf-rm/model
#   3. tandem run  : PPO (GAE, critic, KL to the SFT model) on the learned reward -> ROOT/rlhf-ppo/checkpoints
#   4. tandem dpo  : DPO from the same SFT model on the same pairs (the offline path) -> ROOT/rlhf-dpo/model
#   5. tandem eval : the verifier's accuracy on held-out prompts, and the reward model's score, for each model
#
#   bash examples/rlhf/chain.sh                 # from the repository root; ROOT = runs
#   bash examples/rlhf/chain.sh /tmp/rlhf       # another root (each stage refuses a run directory in use)
#   STAGES="eval" bash examples/rlhf/chain.sh   # some stages only (of: sft rm ppo dpo eval)
set -euo pipefail
ROOT="${1:-runs}"
STAGES="${STAGES:-sft rm ppo dpo eval}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
TANDEM="${TANDEM:-tandem}"
SFT="$ROOT/rlhf-sft/model"
RM="$ROOT/rlhf-rm/model"

stage() {  # stage NAME COMMAND...: run it when NAME is in STAGES, and say how long it took
    local name="$1"
    shift
    [[ " $STAGES " == *" $name "* ]] || return 0
    local start=$SECONDS
    echo "== $name: $*"
    "$@"
    echo "== $name: done in $(((SECONDS - start) / 60)) min $(((SECONDS - start) % 60)) s"
}

stage sft "$TANDEM" sft "$HERE/sft.toml" --run.root "$ROOT"
stage rm "$TANDEM" rm "$HERE/rm.toml" --run.root "$ROOT" --model.path "$SFT"
stage ppo "$TANDEM" run "$HERE/ppo.toml" --run.root "$ROOT" --model.path "$SFT" \
    --env.reward_model "$RM" --learner.critic_path "$RM"
stage dpo "$TANDEM" dpo "$HERE/dpo.toml" --run.root "$ROOT" --model.path "$SFT"
stage eval "$TANDEM" eval smollm2 "$SFT" "$ROOT/rlhf-ppo" "$ROOT/rlhf-dpo" \
    --sets arithmetic,arithmetic-reworded --samples 8 --temperature 1.0 --max-tokens 48 \
    --reward-model "$RM" --out "$ROOT/rlhf-eval.json"
