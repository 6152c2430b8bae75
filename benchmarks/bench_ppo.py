"""PPO step time split by phase (critic forward and critic update included), and s/step, through the
real script (Ray driver, DeepSpeed actor and critic ranks, vLLM engines) on the built-in tiny models.

    python -m benchmarks.bench_ppo --models llama-0.5m llama-10m

For each model: builds it (launch/tiny.py) if missing, runs `algos/ppo.py` for --steps rollout steps
on the reversal prompts (critic from the same model, a fresh value head), and prints the mean seconds
of each phase over the steps after the first (start-up excluded): generate, reward, logprobs_values
(actor old / reference log-probs and critic values, side by side), train (actor and critic updates,
side by side; actor_train and critic_train are each role's own time), sync. Run it on an idle
machine: on CPU every role shares the cores.
"""

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import tyro

from launch.tiny import build_assets

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PHASES = ("generate", "reward", "logprobs_values", "actor_train", "critic_train", "train", "sync")


@dataclass
class Args:
    models: tuple[str, ...] = ("llama-0.5m", "llama-10m")
    """Tiny models to time (names from launch/tiny.py)."""
    assets: str = "assets"
    """Where the tiny models and data are (built if missing)."""
    steps: int = 6
    """Rollout steps per model (the first is not counted)."""
    rollout_batch_size: int = 64
    """Prompts per step."""
    n_samples_per_prompt: int = 4
    """Samples per prompt."""
    generate_max_len: int = 32
    """Tokens per response."""
    actor_ranks: int = 2
    """Actor trainer ranks (Ray actors)."""
    critic_ranks: int = 1
    """Critic trainer ranks (Ray actors)."""
    vllm_engines: int = 1
    """vLLM engines (--vllm_num_engines)."""


def main(args: Args):
    build_assets(args.assets, models=args.models, tasks=("reverse",))
    samples = args.rollout_batch_size * args.n_samples_per_prompt
    print(f"{samples} samples per step ({args.rollout_batch_size} prompts x {args.n_samples_per_prompt}), "
          f"{args.actor_ranks} actor ranks, {args.critic_ranks} critic rank(s), {args.vllm_engines} vLLM engine(s), "
          f"responses <= {args.generate_max_len} tokens")
    print(f"{'model':<12}" + "".join(f"{p + ' s':>18}" for p in PHASES) + f"{'step s':>9}{'samples/s':>11}")
    for model in args.models:
        with tempfile.TemporaryDirectory() as tmp:
            metrics_file = os.path.join(tmp, "metrics.jsonl")
            cmd = [sys.executable, os.path.join(ROOT, "algos", "ppo.py"), "--pretrain",
                   os.path.join(args.assets, model),
                   "--prompt_data", os.path.join(args.assets, "data", "reverse", "rl_train.jsonl"),
                   "--input_key", "prompt", "--label_key", "answer", "--apply_chat_template",
                   "--remote_rm_url", os.path.join(ROOT, "launch", "rewards", "exact_match.py"),
                   "--n_samples_per_prompt", str(args.n_samples_per_prompt),
                   "--rollout_batch_size", str(args.rollout_batch_size), "--train_batch_size", str(samples),
                   "--micro_train_batch_size", "16", "--micro_rollout_batch_size", "16",
                   "--actor_num_gpus_per_node", str(args.actor_ranks), "--vllm_num_engines", str(args.vllm_engines),
                   "--critic_num_gpus_per_node", str(args.critic_ranks), "--prompt_max_len", "64",
                   "--generate_max_len", str(args.generate_max_len), "--max_steps", str(args.steps),
                   "--save_path", os.path.join(tmp, "out"), "--metrics_file", metrics_file]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                sys.exit(f"ppo.py failed for {model}:\n{proc.stderr[-3000:]}")
            with open(metrics_file) as f:
                steps = [m for m in map(json.loads, f) if "train/reward" in m][1:]
        mean = {p: sum(m[f"time/{p}"] for m in steps) / len(steps) for p in PHASES}
        step_s = sum(samples / m["perf/samples_per_s"] for m in steps) / len(steps)
        print(f"{model:<12}" + "".join(f"{mean[p]:>18.3f}" for p in PHASES)
              + f"{step_s:>9.2f}{samples / step_s:>11.1f}")


if __name__ == "__main__":
    main(tyro.cli(Args, config=(tyro.conf.OmitArgPrefixes,), use_underscores=True, description=__doc__))
