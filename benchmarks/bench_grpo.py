"""GRPO step time split by phase, and samples/s, through the real script (Ray driver, DeepSpeed
trainer ranks, vLLM engines) on the built-in tiny models: synchronous, with --async_train, and without skipping
the samples whose advantages are all 0.

    python -m benchmarks.bench_grpo --models llama-0.5m llama-10m --modes sync async
    python -m benchmarks.bench_grpo --models llama-10m --modes sync noskip --signal_share 0.25

For each model and mode: builds the model (launch/tiny.py) if missing, runs `algos/grpo.py` for
--steps rollout steps on the reversal prompts, and prints the mean seconds of each phase (generate,
reward, logprobs, train, sync; with --async_train generate and reward ran during the previous
step's update), the driver's wait for the rollout, the step time, samples/s, and the idle fraction
of the engine (1 - generate / step, at least 0) and of the trainer (1 - (logprobs + train + sync) / step), over
the steps after the first (start-up excluded). The untrained models mostly run to
--generate_max_len. With --signal_share S the reward is benchmarks/signal_share_reward.py's: a share S of the
groups carry a signal and the rest are all 0, whose samples the sync mode skips in the update (the `skipped`
column: their share of the samples) and the noskip mode (--no_skip_zero_advantage) computes.
Run it on an idle machine: on CPU every role shares the cores, so the phases
that async overlaps also compete for them.
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

PHASES = ("generate", "reward", "logprobs", "train", "sync", "rollout_wait")


@dataclass
class Args:
    models: tuple[str, ...] = ("llama-0.5m", "llama-10m")
    """Tiny models to time (names from launch/tiny.py)."""
    assets: str = "assets"
    """Where the tiny models and data are (built if missing)."""
    steps: int = 6
    """Rollout steps per model (the first is not counted)."""
    rollout_batch_size: int = 32
    """Prompts per step."""
    n_samples_per_prompt: int = 8
    """Samples per prompt."""
    generate_max_len: int = 32
    """Tokens per response."""
    trainer_ranks: int = 2
    """Trainer ranks (Ray actors)."""
    vllm_engines: int = 1
    """vLLM engines (--vllm_num_engines)."""
    modes: tuple[str, ...] = ("sync", "async")
    """sync, async (--async_train --max_staleness 1), and/or noskip (sync with --no_skip_zero_advantage)."""
    signal_share: float = -1.0
    """Share of the groups whose rewards differ (benchmarks/signal_share_reward.py); -1: the exact-match reward."""


def main(args: Args):
    build_assets(args.assets, models=args.models, tasks=("reverse",))
    samples = args.rollout_batch_size * args.n_samples_per_prompt
    reward = (os.path.join(ROOT, "benchmarks", "signal_share_reward.py") if args.signal_share >= 0 else
              os.path.join(ROOT, "launch", "rewards", "exact_match.py"))
    print(f"{samples} samples per step ({args.rollout_batch_size} prompts x {args.n_samples_per_prompt}), "
          f"{args.trainer_ranks} trainer ranks, {args.vllm_engines} vLLM engine(s), "
          f"responses <= {args.generate_max_len} tokens")
    print(f"{'model':<12}{'mode':<7}" + "".join(f"{p.replace('rollout_', '') + ' s':>11}" for p in PHASES)
          + f"{'step s':>9}{'samples/s':>11}{'engine idle':>13}{'trainer idle':>14}{'skipped':>9}")
    for model in args.models:
        for mode in args.modes:
            with tempfile.TemporaryDirectory() as tmp:
                metrics_file = os.path.join(tmp, "metrics.jsonl")
                cmd = [sys.executable, os.path.join(ROOT, "algos", "grpo.py"), "--pretrain",
                       os.path.join(args.assets, model),
                       "--prompt_data", os.path.join(args.assets, "data", "reverse", "rl_train.jsonl"),
                       "--input_key", "prompt", "--label_key", "answer", "--apply_chat_template",
                       "--remote_rm_url", reward,
                       "--n_samples_per_prompt", str(args.n_samples_per_prompt),
                       "--rollout_batch_size", str(args.rollout_batch_size), "--train_batch_size", str(samples),
                       "--micro_train_batch_size", "16", "--micro_rollout_batch_size", "16",
                       "--actor_num_gpus_per_node", str(args.trainer_ranks), "--prompt_max_len", "64",
                       "--vllm_num_engines", str(args.vllm_engines),
                       "--generate_max_len", str(args.generate_max_len), "--max_steps", str(args.steps),
                       "--save_path", os.path.join(tmp, "out"), "--metrics_file", metrics_file]
                if mode == "async":
                    cmd += ["--async_train", "--max_staleness", "1"]
                if mode == "noskip":
                    cmd += ["--no_skip_zero_advantage"]
                env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                       "MINRLHF_SIGNAL_SHARE": str(args.signal_share)}
                proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
                if proc.returncode != 0:
                    sys.exit(f"grpo.py failed for {model} ({mode}):\n{proc.stderr[-3000:]}")
                with open(metrics_file) as f:
                    steps = [m for m in map(json.loads, f) if "train/reward" in m][1:]
            mean = {p: sum(m[f"time/{p}"] for m in steps) / len(steps) for p in PHASES}
            step_s = sum(samples / m["perf/samples_per_s"] for m in steps) / len(steps)
            engine_idle = max(0.0, 1 - mean["generate"] / step_s)  # async: generation slowed by the update it overlaps
            trainer_idle = 1 - (mean["logprobs"] + mean["train"] + mean["sync"]) / step_s
            skipped = sum(m["train/skipped_samples"] for m in steps) / len(steps) / samples
            print(f"{model:<12}{mode:<7}" + "".join(f"{mean[p]:>11.3f}" for p in PHASES)
                  + f"{step_s:>9.2f}{samples / step_s:>11.1f}{engine_idle:>13.2f}{trainer_idle:>14.2f}{skipped:>9.2f}")


if __name__ == "__main__":
    main(tyro.cli(Args, config=(tyro.conf.OmitArgPrefixes,), use_underscores=True, description=__doc__))
