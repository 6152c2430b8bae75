#!/usr/bin/env bash
# Iterative DPO: K rounds of (generate n samples per prompt -> score -> best vs worst pairs -> DPO),
# each round from the previous round's model, on a new slice of the prompts (--iter k).
# Defaults run on the tiny assets on CPU (bash launch/setup.sh first); override with env vars:
#   POLICY=outputs/sft PROMPTS=... REWARD_ARGS="--reward_pretrain outputs/rm" ITERS=3 bash launch/iterative_dpo.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
POLICY=${POLICY:-outputs/demo_sft}
PROMPTS=${PROMPTS:-assets/data/reverse/rl_train.jsonl}
REWARD_ARGS=${REWARD_ARGS:---reward_func launch/rewards/exact_match.py --label_key answer}
ITERS=${ITERS:-2}
PROMPTS_PER_ITER=${PROMPTS_PER_ITER:-128}
N=${N:-4}
OUT=${OUT:-outputs/iter_dpo}
GEN_ARGS=${GEN_ARGS:---input_key prompt --apply_chat_template --max_new_tokens 16 --temperature 1.0}
# DPO + NLL at lr 5e-5: plain DPO or lr 1e-3 is unreliable or collapses at the tiny assets' scale
# (the measurements: tests/test_generate.py)
DPO_ARGS=${DPO_ARGS:---apply_chat_template --max_len 128 --train_batch_size 8 --micro_train_batch_size 4 --learning_rate 5e-5 --nll_loss_coef 1.0 --max_epochs 2}
mkdir -p "$OUT"
for ((k = 0; k < ITERS; k++)); do
  echo "== iteration $k: generate from $POLICY"
  $PY algos/generate.py --pretrain "$POLICY" --dataset "$PROMPTS" $GEN_ARGS $REWARD_ARGS --best_of_n "$N" \
    --iter "$k" --rollout_batch_size "$PROMPTS_PER_ITER" --post_processor iter_dpo --output_path "$OUT/gen_$k.jsonl"
  echo "== iteration $k: DPO on $(wc -l < "$OUT/gen_$k.iter_dpo.jsonl") pairs"
  $PY algos/dpo.py --pretrain "$POLICY" --dataset "$OUT/gen_$k.iter_dpo.jsonl" $DPO_ARGS --save_path "$OUT/model_$k"
  POLICY="$OUT/model_$k"
done
echo "final policy: $POLICY"
