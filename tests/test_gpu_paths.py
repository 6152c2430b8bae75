"""The CUDA decisions of common/infra/gpu.py, pinned on CPU: the attention implementation and packed-row kernel per
(device, dtype, installed kernels, request), torch varlen_attn's arguments across its versions, the optimizer
(no DeepSpeed JIT build on CUDA unless ZeRO-3 offload_states needs it), the IPC engine's environment, the
colocated engine's memory share and placement, QLoRA + weight sync; and what of the CUDA paths runs on CPU:
the per-sample sdpa kernel (fp32 on CUDA) and VarlenPlan's packed-row arguments against the CPU kernel, the
ring's flash-attn stand-in dispatching by device, and the argument checks failing before a model loads."""

import inspect

import pytest
import torch

from common.infra.gpu import (
    attention_implementation, check_colocation, check_weight_sync_model, colocated_memory_share, engine_environment,
    optimizer_kind,
)
from common.kernels.varlen_attention import packed_kernel, torch_varlen_kwargs
from common.ring_attention import ring_kernel

pytestmark = pytest.mark.quick  # the quick tier (launch/test.sh --quick)


# ----------------------------------------------------------------------------------------------
# Attention choice
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", ["cuda", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("flash", [True, False])
def test_default_attention_is_varlen_sdpa_everywhere(device, dtype, flash):
    assert attention_implementation(device, dtype, flash) == "varlen_sdpa"


def test_fp32_on_cuda_never_picks_flash_attention():
    """flash-attn installed, fp32 on CUDA: flash_attention_2 is refused, naming the flag (transformers would only
    warn and flash-attn raise at the first forward)."""
    with pytest.raises(ValueError, match="--attn_implementation flash_attention_2 takes bf16.*--param_dtype bf16"):
        attention_implementation("cuda", torch.float32, True, "flash_attention_2")
    with pytest.raises(ValueError, match="runs on CUDA only"):
        attention_implementation("cpu", torch.bfloat16, True, "flash_attention_2")
    with pytest.raises(ValueError, match="flash_attn is not installed"):
        attention_implementation("cuda", torch.bfloat16, False, "flash_attention_2")
    assert attention_implementation("cuda", torch.bfloat16, True, "flash_attention_2") == "flash_attention_2"
    assert attention_implementation("cuda", torch.float32, True, "sdpa") == "sdpa"


def test_packed_kernel_per_device_and_dtype():
    assert packed_kernel("cuda", torch.bfloat16, True) == "torch_varlen"
    assert packed_kernel("cuda", torch.float16, True) == "torch_varlen"
    assert packed_kernel("cuda", torch.float32, True) == "sdpa_groups"  # fp32 on CUDA: no flash kernel
    assert packed_kernel("cuda", torch.bfloat16, False) == "sdpa_groups"  # torch < 2.10
    assert packed_kernel("cpu", torch.bfloat16, True) == "cpu_fused"
    assert packed_kernel("cpu", torch.float32, False) == "cpu_fused"


def test_ring_kernel_per_device_and_dtype():
    assert ring_kernel("cpu", torch.float32, False) == "cpu"
    assert ring_kernel("cuda", torch.bfloat16, False) == "torch_flash"  # no flash-attn: torch's flash kernels
    assert ring_kernel("cuda", torch.bfloat16, True) == "flash_attn"
    with pytest.raises(ValueError, match="--ring_attn_size > 1 on CUDA.*--param_dtype bf16"):
        ring_kernel("cuda", torch.float32, True)


def test_torch_varlen_kwargs_across_versions():
    """torch 2.13 (this venv): window_size=(-1, 0) is causal, enable_gqa for grouped heads; torch 2.10 took
    is_causal and had no enable_gqa (heads repeated before the call)."""
    from torch.nn.attention.varlen import varlen_attn

    now = tuple(inspect.signature(varlen_attn).parameters)
    assert torch_varlen_kwargs(now, 4, 4) == ({"window_size": (-1, 0)}, False)
    assert torch_varlen_kwargs(now, 4, 2) == ({"window_size": (-1, 0), "enable_gqa": True}, False)
    old = ("query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k", "is_causal", "return_aux", "scale")
    assert torch_varlen_kwargs(old, 4, 2) == ({"is_causal": True}, True)


# ----------------------------------------------------------------------------------------------
# Optimizer, vLLM engines, weight sync
# ----------------------------------------------------------------------------------------------
def test_optimizer_needs_no_jit_build_on_cuda():
    assert optimizer_kind(cuda=True, adam_offload=False, zero_stage=2) == "torch_fused"
    assert optimizer_kind(cuda=True, adam_offload=False, zero_stage=3) == "torch_fused"
    assert optimizer_kind(cuda=True, adam_offload=False, zero_stage=2, offload_states=True) == "torch_fused"
    # DeepSpeed's ZeRO-3 offload_states asserts its own FusedAdam
    assert optimizer_kind(cuda=True, adam_offload=False, zero_stage=3, offload_states=True) == "deepspeed_fused"
    assert optimizer_kind(cuda=False, adam_offload=False, zero_stage=3, offload_states=True) == "torch_fused"
    assert optimizer_kind(cuda=True, adam_offload=True, zero_stage=3) == "cpu_adam"


def test_ipc_environment_only_for_the_ipc_backend():
    assert engine_environment("ipc") == {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    assert engine_environment("nccl") == {} and engine_environment("minrlhf_gloo") == {}


def test_create_vllm_engine_sets_the_environment_before_the_engine():
    """The variable goes into os.environ before vllm.LLM(...) in create_vllm_engine (the engine-core process
    inherits the environment it starts with)."""
    from common.infra.vllm_engine import create_vllm_engine

    source = inspect.getsource(create_vllm_engine)
    assert 0 < source.index("engine_environment(weight_transfer_backend(colocated))") < source.index("LLM(\n")


def test_colocation_refusals_name_the_flags():
    check_colocation(True, None, 1, cuda=True)  # sized from the engine's needs
    check_colocation(True, 0.4, 1, cuda=True)
    check_colocation(True, 0.9, 2, cuda=False)  # CPU: a KV cache in bytes, no devices to share
    check_colocation(False, 0.9, 4, cuda=True)
    with pytest.raises(ValueError, match="--colocate_all_models.*--vllm_gpu_memory_utilization 0.9"):
        check_colocation(True, 0.9, 1, cuda=True)
    with pytest.raises(ValueError, match="--colocate_all_models with --vllm_tensor_parallel_size 2"):
        check_colocation(True, 0.4, 2, cuda=True)


def test_colocated_memory_share_is_what_the_engine_needs():
    """Qwen2.5-0.5B-sized bf16 weights (~1 GB) and a 2 GB KV cache on a 141 GB H200: ~0.05, not 0.9."""
    gib = 1 << 30
    assert colocated_memory_share(1 * gib, 2 * gib, 141 * gib) == 0.05
    assert colocated_memory_share(16 * gib, 20 * gib, 141 * gib) == 0.28  # (16 + 20 + 3) / 141, rounded up
    assert colocated_memory_share(140 * gib, 20 * gib, 141 * gib) == 0.9


@pytest.mark.parametrize("name", ["llama-0.5m", "qwen2-0.5m"])
def test_weight_bytes_of_the_tiny_models(assets, name):
    """The bf16 weight bytes estimated from the config equal the model's parameters x 2."""
    from transformers import AutoModelForCausalLM

    from common.infra.vllm_engine import weight_bytes

    model = AutoModelForCausalLM.from_pretrained(f"{assets}/{name}")
    assert weight_bytes(f"{assets}/{name}") == 2 * sum(p.numel() for p in model.parameters())


def test_qlora_weight_sync_refused():
    check_weight_sync_model(False, True, "grpo.py")
    check_weight_sync_model(True, False, "--lmbda > 0")
    with pytest.raises(ValueError, match="--load_in_4bit .*drop --load_in_4bit"):
        check_weight_sync_model(True, True, "grpo.py")


def test_qlora_refused_by_grpo_before_any_model_loads(assets):
    """grpo.py's argument checks refuse --load_in_4bit, naming it, before Ray or a model starts."""
    import os

    import algos.grpo as grpo
    from conftest import ROOT

    with pytest.raises(ValueError, match="--load_in_4bit"):
        grpo.parse_args(["--pretrain", f"{assets}/llama-0.5m", "--prompt_data", "d.jsonl", "--remote_rm_url",
                         os.path.join(ROOT, "launch", "rewards", "exact_match.py"), "--prompt_max_len", "48",
                         "--generate_max_len", "16", "--lora_rank", "4", "--load_in_4bit"])


def test_flash_attention_refused_on_cpu_before_any_model_loads():
    from common.infra.engine import CkptArgs, ModelArgs, TrainArgs, validate_common_args

    with pytest.raises(ValueError, match="--attn_implementation flash_attention_2 runs on CUDA only"):
        validate_common_args(ModelArgs(pretrain="x", attn_implementation="flash_attention_2"), TrainArgs(),
                             CkptArgs(), 1)


# ----------------------------------------------------------------------------------------------
# Kernels of the CUDA paths that run on CPU
# ----------------------------------------------------------------------------------------------
POSITIONS = [list(range(5)) + list(range(3)) + list(range(7)) + list(range(2, 6)) + list(range(3))]  # a branch at 2


def test_grouped_sdpa_equals_the_cpu_kernel():
    """grouped_sdpa (the packed-row kernel of fp32 on CUDA) gives the CPU kernel's output and gradients on a row
    with samples, a shared-prefix branch and grouped KV heads."""
    from common.kernels.varlen_attention import _BlockAttention, _VarlenAttention, _groups, batch_plan, grouped_sdpa

    torch.manual_seed(0)
    position_ids = torch.tensor(POSITIONS)
    n = position_ids.numel()
    q, k, v = torch.randn(n, 4, 16), torch.randn(n, 2, 16), torch.randn(n, 2, 16)
    results = []
    for run in ("sdpa", "cpu"):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        if run == "sdpa":
            out = grouped_sdpa(qq, kk, vv, _groups(position_ids), 0.25)
        else:
            plan = batch_plan(position_ids, 64)
            out = (_VarlenAttention if hasattr(plan, "shapes") else _BlockAttention).apply(qq, kk, vv, plan, 0.25)
        out.backward(torch.ones_like(out))
        results.append((out, qq.grad, kk.grad, vv.grad))
    for a, b in zip(*results):
        assert (a - b).abs().max().item() <= 1e-5


def test_varlen_plan_holds_flash_arguments_once_per_batch():
    """VarlenPlan: int32 cu_seqlens (keys longer where a branch reuses its root's prefix), max lengths, key index;
    one plan per position_ids tensor."""
    from common.kernels.varlen_attention import VarlenPlan, _plan_for

    position_ids = torch.tensor(POSITIONS)
    plan = VarlenPlan(position_ids)
    assert plan.cu_q.dtype == torch.int32 and plan.cu_q.tolist() == [0, 5, 8, 15, 19, 22]
    assert plan.cu_k.tolist() == [0, 5, 8, 15, 21, 24]  # the branch (4 tokens at position 2) sees 2 + 4 keys
    assert (plan.max_q, plan.max_k) == (7, 7)
    assert plan.key_index.tolist()[15:21] == [8, 9, 15, 16, 17, 18]
    first = _plan_for(position_ids, "torch_varlen", VarlenPlan)
    assert _plan_for(position_ids, "torch_varlen", VarlenPlan) is first  # every layer of the batch reuses it


def test_ring_stand_in_runs_cpu_kernels_on_cpu_and_torch_flash_on_cuda():
    """The ring's flash_attn stand-in picks its kernel per tensor: never the CPU stand-in for CUDA tensors."""
    from common import ring_attention

    class CudaTensor:  # what the dispatch reads of a CUDA tensor
        is_cuda = True

    calls = []
    kernel = ring_attention._by_device(lambda *a, **k: calls.append("cpu"), lambda *a, **k: calls.append("cuda"))
    kernel(torch.zeros(1))
    kernel(CudaTensor())
    kernel(dout=CudaTensor(), q=torch.zeros(1))  # ring-flash-attn passes the backward's arguments by name
    assert calls == ["cpu", "cuda", "cuda"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the reward models' device is the GPU only with CUDA")
def test_reward_models_score_on_the_gpu(tiny_reward_model):
    """RL's reward-model actor (and generate.py, through the same load_reward_models) scores on the GPU the process
    has, as the CPU model scores (fp32, 1e-4)."""
    from transformers import AutoModelForSequenceClassification

    from common.infra.cluster import RewardModels
    from common.infra.reward import score

    from common.data import reward_model_ids

    actor = RewardModels([tiny_reward_model], False, False)
    assert {p.device.type for p in actor.models[0].parameters()} == {"cuda"}
    prompts, responses = ["reverse: abc", "reverse: hello", "reverse: xy"], ["cba", "olleh", "yx"]
    ids = [reward_model_ids(actor.tokenizer, p, r, False) for p, r in zip(prompts, responses)]
    cpu = score(AutoModelForSequenceClassification.from_pretrained(tiny_reward_model).eval(), ids)
    assert cpu.std() > 0.01 and actor.score(prompts, responses) == pytest.approx(cpu.tolist(), abs=1e-4)
