#!/usr/bin/env bash
# Set up, then run the main job on the built-in tiny assets and print what it learned:
# SFT of a 0.4M-parameter Llama on string reversal, 2 ranks under torchrun, DeepSpeed ZeRO-2, CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
export TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1
PY=.venv/bin/python
DATA=assets/data/reverse
echo "== before training"
$PY -m common.tiny --report assets/llama-0.5m $DATA/sft_test.jsonl 2>/dev/null
echo "== SFT (torchrun, 2 ranks)"
$PY -m torch.distributed.run --standalone --nproc_per_node 2 algos/sft.py \
  --pretrain assets/llama-0.5m --dataset $DATA/sft_train.jsonl --eval_dataset $DATA/sft_test.jsonl \
  --input_key prompt --output_key response --apply_chat_template --max_len 64 \
  --train_batch_size 32 --micro_train_batch_size 8 --max_epochs 2 --learning_rate 3e-3 \
  --zero_stage 2 --save_path outputs/demo_sft --use_tensorboard outputs/demo_tb 2>&1 | grep -E "^step|^saved|error" || true
echo "== after training"
$PY -m common.tiny --report outputs/demo_sft $DATA/sft_test.jsonl 2>/dev/null
