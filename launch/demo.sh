#!/usr/bin/env bash
# Set up, then run the main job on the built-in tiny assets and print what it learned:
# SFT of a 0.4M-parameter Llama on string reversal (2 ranks under torchrun, DeepSpeed ZeRO-2),
# then GRPO from that checkpoint (Ray driver, 2 DeepSpeed trainer ranks, 1 vLLM engine), all on CPU.
# Extra arguments go to grpo.py, after the demo's own (a flag given again overrides: --advantage_estimator rloo).
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
export TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1
# DeepSpeed JIT-builds C++ ops (shm comm, CPU Adam) for this venv's torch: a cache of this checkout's
# own, so another checkout's venv never rebuilds them under a running job
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.venv/torch_extensions}
PY=.venv/bin/python
DATA=assets/data/reverse
echo "== before training"
$PY -m launch.tiny --report assets/llama-0.5m $DATA/sft_test.jsonl 2>/dev/null
echo "== SFT (torchrun, 2 ranks, one epoch)"
$PY -m torch.distributed.run --standalone --nproc_per_node 2 algos/sft.py \
  --pretrain assets/llama-0.5m --dataset $DATA/sft_train.jsonl --eval_dataset $DATA/sft_test.jsonl \
  --input_key prompt --output_key response --apply_chat_template --max_len 64 \
  --train_batch_size 16 --micro_train_batch_size 8 --max_epochs 1 --learning_rate 3e-3 \
  --zero_stage 2 --save_path outputs/demo_sft --use_tensorboard outputs/demo_tb 2>&1 | grep -E "^step|^saved|error" || true
echo "== after SFT"
$PY -m launch.tiny --report outputs/demo_sft $DATA/sft_test.jsonl 2>/dev/null
mkdir -p outputs && rm -f outputs/demo_grpo_metrics.jsonl
echo "== GRPO from the SFT checkpoint (Ray: 2 trainer ranks + 1 vLLM engine; exact-match reward file)"
grpo=(algos/grpo.py --pretrain outputs/demo_sft --prompt_data $DATA/rl_train.jsonl --eval_dataset $DATA/rl_test.jsonl
  --input_key prompt --label_key answer --apply_chat_template --remote_rm_url launch/rewards/exact_match.py
  --n_samples_per_prompt 8 --rollout_batch_size 64 --train_batch_size 256 --max_epochs 2
  --micro_train_batch_size 16 --micro_rollout_batch_size 16 --actor_num_gpus_per_node 2 --vllm_num_engines 1
  --prompt_max_len 48 --generate_max_len 16
  --actor_learning_rate 1e-4 --max_steps 30 --eval_steps 10 --eval_temperature 0 --eval_n_samples_per_prompt 1
  --save_path outputs/demo_grpo --metrics_file outputs/demo_grpo_metrics.jsonl "$@")
echo "\$ ${grpo[*]}"
$PY "${grpo[@]}" 2>outputs/demo_grpo.log | grep -E "^step [0-9]+:|^saved" || { tail -20 outputs/demo_grpo.log; exit 1; }
echo "== after GRPO"
$PY -m launch.tiny --report outputs/demo_grpo $DATA/sft_test.jsonl 2>/dev/null
