"""One CPU vLLM engine's process memory as RL starts it (common.infra.vllm_engine.create_vllm_actor: a Ray actor,
tensor parallelism 1, the engine in-process), after one generation call, beside a bare Ray actor that imported
torch: RSS, PSS and USS in bytes, and the model's fp32 weights and KV cache, which the engine's share of
common.infra.cluster.ENGINE_PROCESS_BYTES leaves out.

    python -m benchmarks.bench_engine_memory --model assets/llama-0.5m
"""

import json
import os
from dataclasses import dataclass

import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Args:
    model: str = "assets/llama-0.5m"
    """Hugging Face causal-LM directory the engine serves (a tiny one: what is measured is the process)."""
    max_model_len: int = 64
    """The engine's --max_model_len."""
    max_num_seqs: int = 16
    """Sequences the engine holds at once (its KV cache)."""


def memory(process):
    info = process.memory_full_info()
    return {"rss": info.rss, "pss": info.pss, "uss": info.uss}


def is_engine(process):
    try:
        return any("VLLMActor" in c for c in process.cmdline())
    except Exception:  # psutil.NoSuchProcess: a short-lived helper process that has ended
        return False


def main(args: Args):
    import psutil
    import ray

    from common.infra.vllm_engine import EngineArgs, SamplingArgs, create_vllm_actor, kv_cache_bytes, weight_bytes

    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": ROOT}})

    @ray.remote(num_cpus=0)
    class Bare:
        def pid(self):
            import torch  # noqa: F401

            return os.getpid()

    bare_actor = Bare.remote()  # kept: Ray ends an actor whose handles are gone
    bare = psutil.Process(ray.get(bare_actor.pid.remote()))
    engine = create_vllm_actor(args.model, EngineArgs(max_model_len=args.max_model_len), num_cpus=1,
                               max_num_seqs=args.max_num_seqs)
    ray.get(engine.generate.remote([[5, 6, 7, 8]] * args.max_num_seqs, SamplingArgs(max_new_tokens=16)))
    (process,) = [p for p in psutil.Process().children(recursive=True) if is_engine(p)]  # this driver's Ray
    kv_cache = kv_cache_bytes(args.model, args.max_model_len, args.max_num_seqs)
    print(json.dumps({"engine": memory(process), "bare_actor_with_torch": memory(bare),
                      "fp32_weights": 2 * weight_bytes(args.model), "kv_cache": kv_cache}))


if __name__ == "__main__":
    main(tyro.cli(Args))
