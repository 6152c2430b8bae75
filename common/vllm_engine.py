"""Rollout engines and weight sync: vLLM engines (in-process or as Ray actors), a Hugging Face
`generate` backend with the same call shape, and a bucketed push of the trainer's weights into
every engine (ZeRO-3 gathered, LoRA merged on the fly, prefix cache reset after).

On CPU the weights travel over a gloo process group between trainer rank 0 and each engine's
worker, which receives them through `WeightSyncWorker` (mixed into vLLM's worker) and reloads
the whole model with `reload_weights`.
"""

import contextlib
import dataclasses
import datetime
import socket
import threading
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

DTYPES = {str(t): t for t in (torch.float32, torch.bfloat16, torch.float16)}


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
    """Tensor-parallel size of each vLLM engine."""
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
def create_vllm_engine(model_path, args: EngineArgs, enable_sleep=False):
    """A vllm.LLM that can receive weights (call from under `if __name__ == "__main__":`);
    enable_sleep lets sleep_engine free its memory on CUDA."""
    from vllm import LLM

    try:
        return LLM(
            model=model_path, tensor_parallel_size=args.tp_size, dtype="bfloat16" if torch.cuda.is_available() else "float32",
            gpu_memory_utilization=args.vllm_gpu_memory_utilization or (0.9 if torch.cuda.is_available() else 0.1),
            max_model_len=args.max_model_len,
            enable_prefix_caching=args.enable_prefix_caching, enforce_eager=args.enforce_eager, seed=args.seed,
            worker_extension_cls="common.vllm_engine.WeightSyncWorker",
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
# Weight sync: the vLLM side
# ----------------------------------------------------------------------------------------------
class WeightSyncWorker:
    """Mixed into vLLM's worker (worker_extension_cls): joins a process group with the trainer
    and reloads the model from tensors broadcast in buckets."""

    def init_weight_sync(self, host, port, world_size, rank):
        timeout = datetime.timedelta(minutes=10)
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
        self._sync_group = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        return True

    def receive_weights(self, buckets):
        """buckets: [[(name, dtype, shape), ...], ...] in the order the trainer broadcasts them."""
        weights = []
        for bucket in buckets:
            dtype = DTYPES[bucket[0][1]]
            flat = torch.empty(sum(_numel(shape) for _, _, shape in bucket), dtype=dtype)
            _broadcast_from_0(self._sync_group, flat)
            offset = 0
            for name, _, shape in bucket:
                n = _numel(shape)
                weights.append((name, flat[offset : offset + n].view(shape)))
                offset += n
        self.reload_weights(weights_iterator=weights)  # the whole model per reload (per-tensor reloads gave NaNs)
        return len(weights)

    def receive_raw(self, numel, repeats):
        """For benchmarks/bench_sync.py: receive `repeats` raw float32 broadcasts of `numel` elements."""
        flat = torch.empty(numel, dtype=torch.float32)
        for _ in range(repeats):
            _broadcast_from_0(self._sync_group, flat)
        return numel


def _broadcast_from_0(group, tensor):
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


# ----------------------------------------------------------------------------------------------
# Weight sync: the trainer side
# ----------------------------------------------------------------------------------------------
def _hf_name(name):
    """Parameter name as a plain HF checkpoint has it (peft wrappers stripped)."""
    if name.startswith("base_model.model."):
        name = name[len("base_model.model."):]
    return name.replace(".base_layer.", ".")


def _gather(params):
    """Context that gathers ZeRO-3 partitioned parameters on every rank (a no-op otherwise)."""
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=None)
    return contextlib.nullcontext()


def gathered_hf_weights(model, keep=True):
    """[(hf_name, cpu tensor)] for every weight of `model` (a DeepSpeed engine or a module), gathered
    one layer at a time under ZeRO-3 (every rank must call), LoRA adapters folded into their base
    weights (W + scaling * B @ A). Ranks with keep=False gather but keep nothing."""
    module = getattr(model, "module", model)
    out, done = [], set()
    for name, layer in module.named_modules():
        if name in done or "lora_" in name:
            continue
        adapters = []
        if hasattr(layer, "lora_A") and hasattr(layer, "base_layer"):  # a peft LoRA layer
            done.add(f"{name}.base_layer")
            adapters = [(layer.lora_A[a].weight, layer.lora_B[a].weight, layer.scaling[a]) for a in layer.active_adapters]
            layer = layer.base_layer
        params = dict(layer.named_parameters(recurse=False))
        if not params:
            continue
        with _gather(list(params.values()) + [w for a, b, _ in adapters for w in (a, b)]):
            if keep:
                for param_name, p in params.items():
                    t = p.data.detach()
                    if param_name == "weight" and adapters:
                        t = (t.float() + sum(s * (b.data.float() @ a.data.float()) for a, b, s in adapters)).to(p.dtype)
                    out.append((_hf_name(f"{name}.{param_name}"), t.to("cpu", copy=True)))
    return out


class WeightSync:
    """Pushes the trainer's weights into vLLM engines (in-process LLMs or VLLMActor handles) over a
    gloo group: trainer rank 0 is rank 0 of the group, engine i is rank i + 1. Create and call
    `sync(model)` on every trainer rank (ZeRO-3 gathers need them all); only rank 0 sends."""

    def __init__(self, engines, host="127.0.0.1", bucket_bytes=64 << 20):
        self.engines, self.bucket_bytes, self.group = engines, bucket_bytes, None
        self.is_sender = not dist.is_initialized() or dist.get_rank() == 0
        if not self.is_sender:
            return
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        world, timeout = len(engines) + 1, datetime.timedelta(minutes=10)
        # the engines must be waiting to join before the group can form: start their side first
        joins = [_in_thread(_rpc, e, "init_weight_sync", host, port, world, i + 1) for i, e in enumerate(engines)]
        store = dist.TCPStore(host, port, world, is_master=True, wait_for_workers=False, timeout=timeout)
        self.group = dist.ProcessGroupGloo(store, 0, world, timeout)
        for join in joins:
            join.result()

    def sync(self, model):
        """Gather, merge LoRA, broadcast in buckets, reload in every engine, reset its prefix cache.
        Returns {"tensors", "bytes", "seconds"} on the sending rank, None elsewhere."""
        start = time.time()
        weights = gathered_hf_weights(model, keep=self.is_sender)
        if not self.is_sender:
            return None
        buckets, size = [[]], 0
        for name, t in weights:
            nbytes = t.numel() * t.element_size()
            if buckets[-1] and (size + nbytes > self.bucket_bytes or t.dtype != buckets[-1][0][1].dtype):
                buckets.append([])
                size = 0
            buckets[-1].append((name, t))
            size += nbytes
        meta = [[(n, str(t.dtype), tuple(t.shape)) for n, t in bucket] for bucket in buckets]
        receives = [_in_thread(_rpc, e, "receive_weights", meta) for e in self.engines]
        for bucket in buckets:
            _broadcast_from_0(self.group, torch.cat([t.reshape(-1) for _, t in bucket]))
        received = [r.result() for r in receives]
        if any(n != len(weights) for n in received):
            raise RuntimeError(f"weight sync: sent {len(weights)} tensors, engines reloaded {received}")
        for e in self.engines:
            _reset_prefix_cache(e)
        return {"tensors": len(weights), "bytes": sum(t.numel() * t.element_size() for _, t in weights),
                "seconds": time.time() - start}


# ----------------------------------------------------------------------------------------------
# Engines in Ray actors, and calls that work on either kind
# ----------------------------------------------------------------------------------------------
def create_vllm_actor(model_path, args: EngineArgs, num_cpus=1, num_gpus=0, enable_sleep=False, options=None):
    """A Ray actor holding one vLLM engine (generate, sequence_logprobs, collective_rpc, sleep,
    wake_up); `options` go to Ray's .options() (e.g. a placement-group scheduling strategy)."""
    import ray

    @ray.remote
    class VLLMActor:
        def __init__(self, path, engine_args, enable_sleep):
            self.llm = create_vllm_engine(path, engine_args, enable_sleep)

        def generate(self, prompt_ids, sampling, seeds=None):
            return vllm_generate(self.llm, prompt_ids, sampling, seeds)

        def sleep(self):
            return sleep_engine(self.llm)

        def wake_up(self):
            return wake_engine(self.llm)

        def sequence_logprobs(self, sequences):
            return vllm_sequence_logprobs(self.llm, sequences)

        def collective_rpc(self, method, args):
            return self.llm.collective_rpc(method, args=args)

        def reset_prefix_cache(self):
            return self.llm.reset_prefix_cache()

    return VLLMActor.options(num_cpus=num_cpus, num_gpus=num_gpus, **(options or {})).remote(model_path, args, enable_sleep)


def _rpc(engine, method, *args):
    """Run `method` of WeightSyncWorker in the engine's (first) worker; in-process or Ray actor."""
    if hasattr(engine, "collective_rpc") and not hasattr(engine.collective_rpc, "remote"):
        return engine.collective_rpc(method, args=args)[0]
    import ray

    return ray.get(engine.collective_rpc.remote(method, args))[0]


def _reset_prefix_cache(engine):
    if hasattr(engine.reset_prefix_cache, "remote"):
        import ray

        return ray.get(engine.reset_prefix_cache.remote())
    return engine.reset_prefix_cache()


class _in_thread:
    """Run fn(*args) in a thread (a blocking RPC that must overlap the caller's collective)."""

    def __init__(self, fn, *args):
        self._result, self._error = None, None
        self._thread = threading.Thread(target=self._run, args=(fn, args), daemon=True)
        self._thread.start()

    def _run(self, fn, args):
        try:
            self._result = fn(*args)
        except BaseException as e:  # re-raised in result()
            self._error = e

    def result(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result
