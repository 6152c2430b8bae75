#!/usr/bin/env bash
# Rejection sampling: K rounds of (generate n samples per prompt -> score -> keep the best per prompt
# above a threshold -> SFT on them), each round from the previous round's model.
# Defaults run on the tiny assets on CPU (bash launch/setup.sh first); override with env vars as in
# launch/iterative_dpo.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
POLICY=${POLICY:-outputs/demo_sft}
PROMPTS=${PROMPTS:-assets/data/reverse/rl_train.jsonl}
REWARD_ARGS=${REWARD_ARGS:---reward_func launch/rewards/exact_match.py --label_key answer}
THRESHOLD=${THRESHOLD:-1.0}
ITERS=${ITERS:-2}
PROMPTS_PER_ITER=${PROMPTS_PER_ITER:-128}
N=${N:-4}
OUT=${OUT:-outputs/rejection_sampling}
GEN_ARGS=${GEN_ARGS:---input_key prompt --apply_chat_template --max_new_tokens 16 --temperature 1.0}
SFT_ARGS=${SFT_ARGS:---input_key prompt --output_key response --apply_chat_template --max_len 128 --train_batch_size 8 --micro_train_batch_size 8 --learning_rate 1e-3 --max_epochs 2}
mkdir -p "$OUT"
for ((k = 0; k < ITERS; k++)); do
  echo "== iteration $k: generate from $POLICY"
  $PY algos/generate.py --pretrain "$POLICY" --dataset "$PROMPTS" $GEN_ARGS $REWARD_ARGS --best_of_n "$N" \
    --iter "$k" --rollout_batch_size "$PROMPTS_PER_ITER" --post_processor rs --reward_threshold "$THRESHOLD" \
    --output_path "$OUT/gen_$k.jsonl"
  echo "== iteration $k: SFT on $(wc -l < "$OUT/gen_$k.rs.jsonl") selected responses"
  $PY algos/sft.py --pretrain "$POLICY" --dataset "$OUT/gen_$k.rs.jsonl" $SFT_ARGS --save_path "$OUT/model_$k"
  POLICY="$OUT/model_$k"
done
echo "final policy: $POLICY"
