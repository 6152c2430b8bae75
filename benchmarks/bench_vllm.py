"""Where a vLLM rollout's time goes on this machine: engine start-up, and one GRPO-shaped generation call
(--prompts x --n samples of exactly --tokens tokens, ignore_eos) per decode step, for each engine setting.
Each setting runs in a fresh process (vLLM reads its environment once).

    python -m benchmarks.bench_vllm --model assets/llama-10m

Settings: `mp` is vLLM's own default (VLLM_ENABLE_V1_MULTIPROCESSING=1: the engine core in a process of its
own, requests and outputs over ZMQ; what common.infra.vllm_engine uses); `inproc` sets
VLLM_ENABLE_V1_MULTIPROCESSING=0 (the engine core runs in the caller's process).
"""

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SETTINGS = {"mp": {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}, "inproc": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}}


@dataclass
class Args:
    model: str = "assets/llama-10m"
    """Hugging Face causal-LM directory the engine serves."""
    prompts: int = 16
    """Prompts per generation call."""
    n: int = 8
    """Samples per prompt."""
    tokens: int = 32
    """Tokens generated per sample (ignore_eos: every sample runs to this length)."""
    calls: int = 4
    """Generation calls timed after one warm-up call; the median is reported."""
    settings: str = "mp,inproc"
    """Comma list of the settings to run (mp, inproc)."""


def probe(args: Args):
    """One setting, in this process: start-up seconds and the median generation call."""
    from common.infra.vllm_engine import EngineArgs, SamplingArgs, create_vllm_engine, vllm_generate

    start = time.perf_counter()
    llm = create_vllm_engine(args.model, EngineArgs(max_model_len=128), max_num_seqs=args.prompts * args.n)
    startup = time.perf_counter() - start
    prompts = [[1] + [10 + (7 * i + k) % 200 for k in range(12)] for i in range(args.prompts)]
    sampling = SamplingArgs(n=args.n, max_new_tokens=args.tokens, ignore_eos=True)
    times = []
    for _ in range(args.calls + 1):
        t = time.perf_counter()
        out = vllm_generate(llm, prompts, sampling, seeds=list(range(args.prompts)))
        times.append(time.perf_counter() - t)
        assert all(len(s.output_ids) == args.tokens for group in out for s in group)
    call = sorted(times[1:])[len(times[1:]) // 2]
    print("result:", json.dumps({"startup_s": startup, "call_s": call, "step_ms": 1000 * call / args.tokens}))


def main(args: Args):
    print(f"{args.model}: {args.prompts} prompts x {args.n} samples x {args.tokens} tokens per call, CPU")
    print(f"{'setting':<8} {'start-up s':>10} {'call s':>8} {'ms/decode step':>15}")
    for name in [s.strip() for s in args.settings.split(",") if s.strip()]:
        if name not in SETTINGS:
            sys.exit(f"error: --settings takes a comma list of {', '.join(SETTINGS)}; got {name!r}")
        cmd = [sys.executable, "-m", "benchmarks.bench_vllm", "--model", args.model, "--prompts", str(args.prompts),
               "--n", str(args.n), "--tokens", str(args.tokens), "--calls", str(args.calls)]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                              env={**os.environ, "MINRLHF_BENCH_VLLM_CHILD": "1", **SETTINGS[name]})
        if proc.returncode != 0:
            sys.exit(f"error: setting {name} failed:\n{proc.stderr[-3000:]}")
        r = json.loads([line for line in proc.stdout.splitlines() if line.startswith("result:")][-1][7:])
        print(f"{name:<8} {r['startup_s']:>10.1f} {r['call_s']:>8.2f} {r['step_ms']:>15.1f}", flush=True)


if __name__ == "__main__":
    parsed = tyro.cli(Args)
    probe(parsed) if os.environ.get("MINRLHF_BENCH_VLLM_CHILD") else main(parsed)
