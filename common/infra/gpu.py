"""Trust tier: read the faces, trust the body.

Device decisions, each a pure function of the facts it names (device, dtype, installed kernels, flags), so that
a CPU test pins what a CUDA run does: which attention implementation (the kernels pick theirs:
common.kernels.varlen_attention.packed_kernel), which optimizer, what vLLM's engine process needs in its
environment, which placements and memory shares a colocated engine is refused, and whether a model's weights can
be synced into vLLM. The callers gather the facts (torch.cuda.is_available(), what imports) and raise the
ValueError these return or raise before any model loads."""

import math

from common.kernels import VARLEN_SDPA as PACKED

FLASH = ("flash_attention_2", "flash_attention_3")
HALF = ("bfloat16", "float16")


def dtype_name(dtype):
    """'bfloat16' for torch.bfloat16 or 'bfloat16'."""
    return str(dtype).split(".")[-1]


# ----------------------------------------------------------------------------------------------
# Attention
# ----------------------------------------------------------------------------------------------
def attention_implementation(device_type, dtype, flash_attn_installed, requested=None):
    """The attention implementation a model is loaded with: `requested` (--attn_implementation) if it can run,
    else ValueError naming the flag; by default varlen_sdpa everywhere (it picks its kernel per call:
    common.kernels.varlen_attention.packed_kernel). flash-attn's kernels take bf16 / fp16 on CUDA only: fp32 on
    CUDA with flash_attention_2 would load (transformers only warns) and fail at the first forward."""
    if requested is None:
        return PACKED
    if requested in FLASH:
        if device_type != "cuda":
            raise ValueError(f"--attn_implementation {requested} runs on CUDA only (drop it: {PACKED} is the default)")
        if dtype_name(dtype) not in HALF:
            raise ValueError(f"--attn_implementation {requested} takes bf16 / fp16, and this run computes in "
                             f"{dtype_name(dtype)}: drop --attn_implementation ({PACKED} runs fp32 on CUDA) or "
                             "set --param_dtype bf16")
        if not flash_attn_installed:
            raise ValueError(f"--attn_implementation {requested}: flash_attn is not installed (drop the flag: "
                             f"{PACKED} runs torch's own flash kernels)")
    return requested


# ----------------------------------------------------------------------------------------------
# Optimizer
# ----------------------------------------------------------------------------------------------
def optimizer_kind(cuda, adam_offload, zero_stage, offload_states=False):
    """'cpu_adam' (DeepSpeedCPUAdam, --adam_offload), 'deepspeed_fused' (DeepSpeed's FusedAdam: JIT-built on first
    use, needs nvcc matching torch's CUDA; only where DeepSpeed requires it: ZeRO-3 offload_states on CUDA) or
    'torch_fused' (torch.optim.AdamW(fused=True): no build, CPU and CUDA)."""
    if adam_offload:
        return "cpu_adam"
    if cuda and zero_stage == 3 and offload_states:
        return "deepspeed_fused"
    return "torch_fused"


# ----------------------------------------------------------------------------------------------
# vLLM engines beside trainers
# ----------------------------------------------------------------------------------------------
def engine_environment(backend):
    """Variables vLLM's engine processes need for weight-transfer `backend`, set before the engine starts (they
    inherit them): the CUDA-IPC backend passes torch's reduce_tensor handles through vLLM's msgpack RPC, which
    refuses them unless VLLM_ALLOW_INSECURE_SERIALIZATION=1 (vLLM's own IPC example sets it). Nothing for others."""
    return {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"} if backend == "ipc" else {}


def check_colocation(colocate_all_models, memory_share, tp_size, cuda):
    """ValueError naming the flags for colocated engines a CUDA run cannot start: a share of 0.9 of each device
    (vLLM's own default; by default a colocated engine's share is sized by `colocated_memory_share`) or more
    would leave the trainers ~10 % of it; engines of tensor parallelism > 1 would get one device from Ray, not
    tp devices."""
    if not (colocate_all_models and cuda):
        return
    if memory_share is not None and memory_share >= 0.9:
        raise ValueError(f"--colocate_all_models shares each GPU between the trainers and a vLLM engine, which "
                         f"would take --vllm_gpu_memory_utilization {memory_share} of it: give a share below 0.9 "
                         "(e.g. 0.4), or drop the flag to size it from the engine's weights and KV cache")
    if tp_size > 1:
        raise ValueError(f"--colocate_all_models with --vllm_tensor_parallel_size {tp_size}: a colocated engine is "
                         "placed in one trainer's bundle, one device; use --vllm_tensor_parallel_size 1 with "
                         "colocation, or drop --colocate_all_models")


def colocated_memory_share(weight_bytes, kv_bytes, total_bytes, overhead_bytes=3 << 30):
    """vLLM's gpu_memory_utilization for an engine that shares its device with a trainer and was given none: its
    weights, the KV cache it needs (passed as kv_cache_memory_bytes too) and a margin for activations and the
    CUDA context, as a share of the device (at least 0.05, at most 0.9), rounded up to 0.01."""
    need = (weight_bytes + kv_bytes + overhead_bytes) / total_bytes
    return min(0.9, max(0.05, math.ceil(need * 100) / 100))


def check_weight_sync_model(load_in_4bit, syncs_weights, script_flag):
    """ValueError when a 4-bit (QLoRA) model would be synced into vLLM: its base weights are packed 4-bit
    tensors, not weights an engine can load."""
    if load_in_4bit and syncs_weights:
        raise ValueError(f"--load_in_4bit (QLoRA) with {script_flag}: the vLLM engines are fed the trainer's "
                         "weights, and a 4-bit base holds packed NF4 blocks, not weights; train LoRA on a bf16 "
                         "base (drop --load_in_4bit)")
