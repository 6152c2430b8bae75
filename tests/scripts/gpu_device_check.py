"""The device check of one GPU (launch/gpu_device_check.sh, docs/gpu.md): a probe line first, then one line per step,
`PASS|FAIL <step> <figure> | bar: <bar> (<seconds> s)`; in a rehearsal, `CUDA ONLY <step>: <what>` names what a
step could not judge on CPU (none of it counts as passed). Results:
<out>/steps/<step>.json, <out>/summary.json, <out>/device_check.log, and all of them in <out>/device_check.tar.gz
(rewritten after every step, so a run stopped at its time limit still leaves its archive).

Steps: env (versions, driver floor, the carried packages imported from the install target); torch's varlen kernel
against per-sample fp32 sdpa; packed = padded log-probs and gradients; the ring's flash-attn contract; the chunked
LM head at a real vocabulary (values, gradients, peak memory); CUDA IPC of a tensor into a second process; sft.py
(one-GPU default, ZeRO-2, ZeRO-3) and dpo.py (ZeRO-2, ZeRO-3) in bf16 against the same run in fp32 on CPU;
DeepSpeed offload_states; bench_mfu (a figure, not a gate); the sampler-trainer log-prob gap (Hugging Face generate
against the trainer's packed row, chunked head and whole logits).

--rehearse (CPU, CI): every step on CPU where it has a CPU meaning, at the smallest shapes (fp32 kernels, bf16
training against fp32, IPC through CPU shared memory); what has none (the driver, torch's flash kernels, peak device
memory, the freed bytes, MFU against the GPU's peak) is named by step.
--dry-run (CPU): the wheel list pins every package the steps need, and every step's modules import.
"""

import argparse
import concurrent.futures
import hashlib
import importlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WHEELS = os.path.join(ROOT, "launch", "gpu_wheels.txt")
CARRIED = {"deepspeed": "deepspeed", "tyro": "tyro", "datasets": "datasets", "pydantic": "pydantic",
           "pydantic-core": "pydantic_core", "ring-flash-attn": "ring_flash_attn"}  # wheel: module, not on the image
NEEDED_WHEELS = set(CARRIED)
DRIVER_FLOOR = 580  # CUDA 13 wheels (torch 2.13 cu130)
TOLERANCE_BF16 = 2e-2  # bf16 keeps 8 mantissa bits: relative error ~4e-3 a rounding, a few roundings deep
TOLERANCE_FP32 = 1e-4
TRAIN_STEPS = {"cuda": 20, "cpu": 2}  # optimizer steps a training step runs (batch 8)
DPO_JUDGED_STEP = 5  # a few steps in: the policy has moved off the reference, bf16 has had little room to drift
ARCHIVE = "device_check.tar.gz"
REFERENCES = concurrent.futures.ThreadPoolExecutor(1)  # the fp32 CPU runs, beside the steps' own

STEP_MODULES = {  # imported before the step runs, so a step run alone has what it loads by name (varlen_sdpa)
    "env": ["torch", "transformers"],
    "varlen_kernel": ["common.kernels.varlen_attention", "common.infra.gpu"],
    "packed_vs_padded": ["common.kernels.varlen_attention", "common.packing", "launch.tiny"],
    "ring_contract": ["common.ring_attention"],
    "chunked_head": ["common.kernels.varlen_attention", "common.kernels.chunked_head", "benchmarks.bench_mfu"],
    "cuda_ipc": ["torch.multiprocessing.reductions"],
    "sft_default": ["algos.sft", "deepspeed", "tyro", "datasets"],
    "sft_zero2": ["algos.sft"],
    "sft_zero3": ["algos.sft"],
    "dpo_zero2": ["algos.dpo"],
    "dpo_zero3": ["algos.dpo"],
    "offload_states": ["common.infra.engine", "deepspeed"],
    "bench_mfu": ["benchmarks.bench_mfu"],
    "logp_gap": ["tests.scripts.logp_gap_check", "common.kernels.varlen_attention", "common.infra.vllm_engine",
                 "launch.tiny"],
}
CUDA_ONLY = {  # step: what of it a rehearsal cannot judge on CPU
    "env": "the driver floor, torch's varlen flash kernel present",
    "varlen_kernel": "torch's varlen flash kernel in bf16 (CPU: the fused CPU kernel in fp32)",
    "packed_vs_padded": "bf16 through torch's varlen flash kernel (CPU: fp32, the CPU kernel)",
    "ring_contract": "torch's aten flash ops in bf16 (CPU: the CPU kernel in fp32)",
    "chunked_head": "the 151,936 vocabulary at 8k tokens in bf16, peak device memory (CPU: 4,096 vocabulary, fp32)",
    "cuda_ipc": "CUDA IPC handles (CPU: shared memory through the same reduce_tensor)",
    "offload_states": "ZeRO-3 (its offload takes DeepSpeed's FusedAdam, CUDA only; CPU: ZeRO-2), device memory freed",
    "bench_mfu": "MFU against the GPU's bf16 peak at the full shape (CPU: one layer, 64 tokens)",
    "logp_gap": "bf16 at the 2-layer Qwen2.5-0.5B shape and 151,936 vocabulary (CPU: the tiny Llama in fp32)",
}

DEV = {"device": "cuda", "dtype": "bfloat16", "tol": TOLERANCE_BF16}  # --rehearse: cpu, float32, TOLERANCE_FP32


def _torch_dtype():
    import torch

    return getattr(torch, DEV["dtype"])


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-6)).item()


def _assets(cache={}):
    if "path" not in cache:
        from launch.tiny import build_assets

        cache["path"] = build_assets(tempfile.mkdtemp(prefix="minrlhf_assets_"), models=("llama-0.5m",),
                                     tasks=("reverse",))
    return cache["path"]


def probe():
    """The facts a failure is read against: GPU, driver, CUDA, torch, transformers, Python, Python.h, nvcc."""
    import torch
    import transformers

    driver = None
    if shutil.which("nvidia-smi"):
        proc = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True)
        driver = proc.stdout.strip().splitlines()[0] if proc.returncode == 0 and proc.stdout.strip() else None
    python_h = os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
    return {"gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, "driver": driver,
            "cuda": torch.version.cuda, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": sys.version.split()[0], "python_h": python_h, "nvcc": shutil.which("nvcc")}


def carried_files():
    """{wheel: the file its module imports from} for each carried package (ring_flash_attn through
    common.ring_attention, which stands in a flash_attn where none is installed)."""
    from common.ring_attention import import_ring_flash_attn

    import_ring_flash_attn()
    return {name: importlib.import_module(module).__file__ for name, module in CARRIED.items()}


def step_env():
    """The probe's facts judged: CUDA there, the driver at the floor, torch's varlen kernel, and each carried package
    imported from the install target (MINRLHF_SITE) rather than whatever the image holds."""
    import torch

    from common.kernels.varlen_attention import _TORCH_VARLEN

    facts = probe()
    site = os.environ.get("MINRLHF_SITE")
    files = carried_files()
    foreign = [n for n, f in files.items() if site and not os.path.realpath(f).startswith(os.path.realpath(site))]
    ok = not foreign
    if DEV["device"] == "cuda":
        major = int((facts["driver"] or "0").split(".")[0])
        ok = ok and torch.cuda.is_available() and _TORCH_VARLEN and major >= DRIVER_FLOOR
    figure = f"carried from {site or 'the image'}: {len(files) - len(foreign)}/{len(files)}, driver {facts['driver']}"
    bar = f"every carried package from the target, driver >= {DRIVER_FLOOR}, torch varlen_attn (CUDA)"
    return ok, figure, bar, {**facts, "files": files, "foreign": foreign, "torch_varlen": _TORCH_VARLEN}


def _case(heads, kv_heads, dtype, device, seed=0):
    import torch

    torch.manual_seed(seed)
    lengths, branch = ((300, 77, 512), range(40, 140)) if device == "cuda" else ((30, 7, 51), range(4, 14))
    # a branch of the last sample at its position 40 (4), then a 1-token sample
    positions = [p for n in lengths for p in range(n)] + list(branch) + [0]
    position_ids = torch.tensor([positions], device=device)
    n = position_ids.numel()
    q = torch.randn(n, heads, 64, device=device, dtype=dtype)
    k, v = (torch.randn(n, kv_heads, 64, device=device, dtype=dtype) for _ in range(2))
    return position_ids, q, k, v


def step_varlen_kernel():
    """varlen_sdpa's packed-row kernel (CUDA bf16: torch's varlen flash kernel; CPU: the fused CPU kernel) against
    per-sample fp32 sdpa, forward and backward, with grouped KV heads and a shared-prefix branch."""
    from common.kernels.varlen_attention import _groups, grouped_sdpa, varlen_attention_forward

    worst = {}
    for heads, kv_heads in ((8, 8), (8, 2)):
        position_ids, q, k, v = _case(heads, kv_heads, _torch_dtype(), DEV["device"])
        outs = []
        for run in ("kernel", "sdpa_fp32"):
            qq, kk, vv = (t.detach().clone().float().requires_grad_() if run == "sdpa_fp32"
                          else t.detach().clone().requires_grad_() for t in (q, k, v))
            if run == "kernel":
                out = varlen_attention_forward(None, qq.transpose(0, 1)[None], kk.transpose(0, 1)[None],
                                               vv.transpose(0, 1)[None], None, 0.125, position_ids=position_ids)[0][0]
            else:
                out = grouped_sdpa(qq, kk, vv, _groups(position_ids), 0.125)
            out.float().square().sum().backward()
            outs.append([out, qq.grad, kk.grad, vv.grad])
        for name, a, b in zip(("out", "dq", "dk", "dv"), *outs):
            worst[f"{name}_gqa{heads // kv_heads}"] = _rel(a, b)
    top = max(worst.values())
    return top <= DEV["tol"], f"max_rel_diff={top:.2e}", f"<= {DEV['tol']:.0e}", worst


def step_packed_vs_padded():
    """The tiny Llama in the step's dtype: one packed row (varlen_sdpa) against padded rows (sdpa)."""
    import torch
    from transformers import AutoModelForCausalLM

    from common.logprobs import token_logps
    from common.packing import collate, to_device

    path = f"{_assets()}/llama-0.5m"
    samples = [{"input_ids": list(range(3, 3 + n)), "loss_mask": [1] * n} for n in (17, 40, 9, 64, 33)]
    results = []
    for attn, packing in (("varlen_sdpa", True), ("sdpa", False)):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=_torch_dtype(), attn_implementation=attn)
        model = model.to(DEV["device"])
        batch = to_device(collate(samples, 0, packing=packing, max_tokens=256, one_row=packing), DEV["device"])
        logps, _ = token_logps(model, batch)
        per_sample = [logps[r, s + 1: s + n].float() for r, s, n in batch["spans"]]
        torch.cat(per_sample).sum().backward()
        results.append((per_sample, torch.cat([p.grad.float().flatten() for p in model.parameters()])))
    (a_logps, a_grads), (b_logps, b_grads) = results
    logp = max((x - y).abs().max().item() for x, y in zip(a_logps, b_logps))
    grad = ((a_grads - b_grads).norm() / b_grads.norm()).item()
    logp_bar = 0.05 if DEV["device"] == "cuda" else 1e-4
    ok = logp <= logp_bar and grad <= DEV["tol"]
    return ok, f"logp_diff={logp:.2e} grad_rel={grad:.2e}", f"<= {logp_bar:.0e}, <= {DEV['tol']:.0e}", {
        "logp_max_abs_diff": logp, "grad_rel_diff": grad}


def step_ring_contract():
    """ring-flash-attn's flash_attn contract as the ring calls it (common.ring_attention's per-device pair: torch's
    flash ops on CUDA, the CPU kernel on CPU): out and lse (heads, total_q) and the gradients written into dq, dk,
    dv, with key blocks longer than query blocks (bottom-right), against per-sample fp32 sdpa."""
    import torch

    from common.kernels.varlen_attention import SampleGroups, grouped_sdpa
    from common.ring_attention import (
        _by_device, _cpu_varlen_backward, _cpu_varlen_forward, _torch_flash_varlen_backward,
        _torch_flash_varlen_forward,
    )

    forward = _by_device(_cpu_varlen_forward, _torch_flash_varlen_forward)
    backward = _by_device(_cpu_varlen_backward, _torch_flash_varlen_backward)
    device, dtype = DEV["device"], _torch_dtype()
    torch.manual_seed(0)
    cu_q, cu_k = [0, 100, 164, 420], [0, 300, 364, 620]  # each query block the last lq of its keys
    q = torch.randn(cu_q[-1], 8, 64, device=device, dtype=dtype)
    k, v = (torch.randn(cu_k[-1], 2, 64, device=device, dtype=dtype) for _ in range(2))
    tq, tk = (torch.tensor(c, dtype=torch.int32, device=device) for c in (cu_q, cu_k))
    out, lse, _, _ = forward(q, k, v, tq, tk, 256, 300, 0.0, 0.125, True)
    dout = torch.randn_like(out)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    backward(dout, q, k, v, out, lse, dq, dk, dv, tq, tk, 256, 300, 0.0, 0.125, True)
    rq, rk, rv = (t.float().requires_grad_() for t in (q, k, v))
    ref = grouped_sdpa(rq, rk, rv, SampleGroups(cu_q, cu_k, device), 0.125)
    ref.backward(dout.float())
    figures = {name: _rel(a, b) for name, a, b in (("out", out, ref), ("dq", dq, rq.grad), ("dk", dk, rk.grad),
                                                    ("dv", dv, rv.grad))}
    figures["lse_shape_ok"] = float(tuple(lse.shape) == (8, cu_q[-1]))
    top = max(v for n, v in figures.items() if n != "lse_shape_ok")
    ok = top <= DEV["tol"] and figures["lse_shape_ok"] == 1.0
    return ok, f"max_rel_diff={top:.2e}", f"<= {DEV['tol']:.0e}, lse (heads, tokens)", figures


def step_chunked_head():
    """A 2-layer Qwen2.5-0.5B-shaped model (151,936 vocabulary, 8k packed tokens, bf16 on CUDA; 4,096 vocabulary,
    512 tokens, fp32 on CPU): token log-probs and gradients through the chunked head against the whole logits, and
    the chunked peak max_memory_allocated below the whole one (CUDA)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from benchmarks.bench_mfu import QWEN25_05B
    from common.logprobs import ModelSettings, token_logps
    from common.packing import collate, to_device

    cuda = DEV["device"] == "cuda"
    shape = {"num_hidden_layers": 2} if cuda else {"num_hidden_layers": 2, "vocab_size": 4096, "hidden_size": 128,
                                                   "intermediate_size": 256, "num_attention_heads": 2}
    config = Qwen2Config(**{**QWEN25_05B, **shape})
    tokens = 8192 if cuda else 512
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=_torch_dtype(), attn_implementation="varlen_sdpa")
    model = model.to(DEV["device"])
    samples = [{"input_ids": torch.randint(0, config.vocab_size, (tokens // 8,)).tolist(),
                "loss_mask": [1] * (tokens // 8)} for _ in range(8)]
    batch = to_device(collate(samples, 0, one_row=True, max_tokens=tokens), DEV["device"])
    results, peaks = [], {}
    chunked = 1024 if cuda else 128  # --logps_chunk_tokens' default; CPU: four chunks of its 512 tokens
    for chunk in (chunked, 0):  # then the whole logits
        model.minrlhf = ModelSettings(logps_chunk_tokens=chunk)
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        logps, _ = token_logps(model, batch)
        (-(logps * batch["loss_mask"]).sum()).backward()
        if cuda:
            torch.cuda.synchronize()
            peaks[chunk] = torch.cuda.max_memory_allocated() - base
        results.append((logps.detach().float(), model.lm_head.weight.grad.float()))
    (c_logps, c_grad), (w_logps, w_grad) = results
    logp, grad = (c_logps - w_logps).abs().max().item(), _rel(c_grad, w_grad)
    memory_ok = not cuda or peaks[chunked] < peaks[0]
    ok = logp <= (0.05 if cuda else 1e-4) and grad <= DEV["tol"] and memory_ok
    peak = (f" peak chunked {peaks[chunked] / 2**30:.2f} GiB, whole {peaks[0] / 2**30:.2f} GiB" if cuda
            else " (peak memory: CUDA only)")
    return ok, f"logp_diff={logp:.2e} grad_rel={grad:.2e}{peak}", f"<= {0.05 if cuda else 1e-4:.0e}, <= " \
        f"{DEV['tol']:.0e}, chunked peak < whole", {"logp_max_abs_diff": logp, "grad_rel_diff": grad,
                                                      "peak_bytes": peaks}


IPC_CHILD = """import hashlib, pickle, sys, torch
torch.multiprocessing.set_sharing_strategy("file_system")
rebuild, args = pickle.loads(sys.stdin.buffer.read())
x = rebuild(*args)
print(hashlib.sha256(x.cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest(), flush=True)
x[0] = 7.0  # written through the shared memory: the sender sees it
if x.is_cuda:
    torch.cuda.synchronize()
"""


def step_cuda_ipc():
    """The primitive colocated weight sync rests on: torch's reduce_tensor of a bf16 tensor, rebuilt in a second
    process (CUDA IPC on CUDA, shared memory on CPU), pickled as torch.multiprocessing pickles it (ForkingPickler,
    which shares a CPU storage rather than copying it): the bytes equal, and a write there seen here."""
    from multiprocessing.reduction import ForkingPickler

    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    torch.multiprocessing.set_sharing_strategy("file_system")  # a CPU storage travels as a file name
    torch.manual_seed(0)
    sent = torch.randn(4096, 896, dtype=torch.bfloat16, device=DEV["device"])
    if DEV["device"] == "cpu":
        sent.share_memory_()
    digest = hashlib.sha256(sent.cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
    proc = subprocess.run([sys.executable, "-c", IPC_CHILD], input=bytes(ForkingPickler.dumps(reduce_tensor(sent))),
                          capture_output=True, timeout=120)
    if proc.returncode:
        raise RuntimeError(proc.stderr.decode()[-1500:])
    received = proc.stdout.decode().split()[0]
    seen = bool((sent[0] == 7.0).all().item())
    ok = received == digest and seen
    return ok, f"sha256 equal={received == digest} write seen={seen}", "both", {"sent": digest, "received": received}


def _run(script, args, env=None, timeout=150):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "algos", script)] + [str(a) for a in args], cwd=ROOT,
                          env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        raise RuntimeError(f"{script} exit {proc.returncode}: {proc.stderr[-1500:]}")


def _metrics(path):
    with open(path) as f:
        return [row for row in map(json.loads, f) if "train/loss" in row]


def _train(script, zero_stage, dtype, work, reference=False):
    """The step's run of `script`: every run of a script sees the same rows in the same order (same samples, same
    seed), so bf16 on the device and fp32 on the CPU start from the same weights and the same first batch."""
    data = f"{_assets()}/data/reverse"
    if script == "sft.py":
        task = ["--dataset", f"{data}/sft_train.jsonl", "--input_key", "prompt", "--output_key", "response",
                "--learning_rate", 3e-3]
    else:
        task = ["--dataset", f"{data}/pref_train.jsonl", "--learning_rate", 3e-4, "--beta", 0.1]
    steps = TRAIN_STEPS[DEV["device"]]
    name = f"{script[:-3]}_{'ref' if reference else zero_stage}_{dtype or 'default'}"
    args = ["--pretrain", f"{_assets()}/llama-0.5m", *task, "--apply_chat_template", "--max_len", 64,
            "--train_batch_size", 8, "--micro_train_batch_size", 8, "--max_samples", 8 * steps,
            "--save_path", f"{work}/{name}", "--metrics_file", f"{work}/{name}.jsonl"]
    args += ["--zero_stage", zero_stage] if zero_stage is not None else []
    args += ["--param_dtype", dtype] if dtype else []
    _run(script, args, env={"CUDA_VISIBLE_DEVICES": ""} if reference else None)
    return _metrics(f"{work}/{name}.jsonl")


def _reference(script, cache={}):
    """The same run on this machine's CPU in fp32 (ZeRO-0), once per script, in the background (a future of its
    metrics)."""
    if script not in cache:
        cache[script] = REFERENCES.submit(_train, script, None, "fp32", tempfile.mkdtemp(prefix="minrlhf_ref_"),
                                          reference=True)
    return cache[script]


def _train_step(script, zero_stage):
    """bf16 (the one-GPU default where zero_stage is None: no --zero_stage, no --param_dtype on CUDA) against fp32
    on CPU. sft: the first step's loss within 2 % and gradient norm within 5 % (same batch, same weights). dpo:
    step 1's loss is ln 2 by construction, so step 5's loss (CPU: step 2's) within 2 % of fp32's, and off ln 2 (the
    policy moved from the reference)."""
    import math

    work = tempfile.mkdtemp(prefix=f"{script[:-3]}_z{zero_stage}_")
    dtype = "bf16" if zero_stage is not None or DEV["device"] == "cpu" else None  # CPU's default would be fp32
    reference = _reference(script)
    rows, ref = _train(script, zero_stage, dtype, work), reference.result()
    losses = [r["train/loss"] for r in rows]
    figures = {"losses": losses, "grad_norms": [r["train/grad_norm"] for r in rows],
               "fp32_losses": [r["train/loss"] for r in ref], "fp32_grad_norms": [r["train/grad_norm"] for r in ref]}
    n = TRAIN_STEPS[DEV["device"]]
    if script == "sft.py":
        loss_off = abs(losses[0] - ref[0]["train/loss"]) / ref[0]["train/loss"]
        norm_off = abs(rows[0]["train/grad_norm"] - ref[0]["train/grad_norm"]) / ref[0]["train/grad_norm"]
        ok = len(rows) == n and loss_off <= 0.02 and norm_off <= 0.05
        figure = f"steps={len(rows)} first loss {losses[0]:.4f} vs fp32 {ref[0]['train/loss']:.4f} ({loss_off:.2%})"\
            f", grad norm {rows[0]['train/grad_norm']:.4f} vs {ref[0]['train/grad_norm']:.4f} ({norm_off:.2%})"
        bar = f"{n} steps, loss within 2 %, grad norm within 5 %"
    else:
        k = min(DPO_JUDGED_STEP, n) - 1
        loss_off = abs(losses[k] - ref[k]["train/loss"]) / ref[k]["train/loss"]
        moved = abs(losses[k] - math.log(2))
        ok = len(rows) == n and loss_off <= 0.02 and moved >= 1e-3
        figure = f"steps={len(rows)} step {k + 1} loss {losses[k]:.4f} vs fp32 {ref[k]['train/loss']:.4f} " \
            f"({loss_off:.2%}), ln 2 {math.log(2):.4f}, last {losses[-1]:.4f}"
        bar = f"{n} steps, step {k + 1}'s loss within 2 % of fp32, >= 1e-3 off ln 2"
    return ok, figure, bar, figures


def step_offload_states():
    """ZeRO-3 bf16 offload_states / reload_states between steps (ppo.py --deepspeed_enable_sleep): the device memory
    the first offload frees is at least the optimizer state's 12 B a parameter (fp32 master + Adam), the reloaded
    partitions equal the offloaded ones bit for bit, and training matches the run without offloading. On CPU
    ZeRO-2: DeepSpeed offloads ZeRO-3 states only with its FusedAdam, which is CUDA's."""
    from common.infra.engine import free_port

    stage = "3" if DEV["device"] == "cuda" else "2"
    proc = subprocess.run([sys.executable, "-m", "tests.scripts.offload_check",
                           f"{_assets()}/llama-0.5m", stage, "bf16"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "MASTER_PORT": str(free_port())})
    if proc.returncode:
        raise RuntimeError(proc.stderr[-1500:])
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    need = 12 * result["params"]
    freed_ok = DEV["device"] == "cpu" or result["freed_bytes"] >= need
    ok = freed_ok and result["reload_equal"] and result["max_diff"] <= 1e-2
    freed = (f"freed {result['freed_bytes'] / 2**20:.2f} MiB of {need / 2**20:.2f} MiB" if DEV["device"] == "cuda"
             else "(freed memory: CUDA only)")
    figure = f"ZeRO-{stage} {freed} reload bit-identical={result['reload_equal']} max_diff={result['max_diff']:.1e}"
    return ok, figure, "freed >= 12 B/param, reload identical, max_diff <= 1e-2", result


def step_bench_mfu():
    """benchmarks/bench_mfu.py at its Qwen2.5-0.5B shape (CPU: one layer, 64 tokens): MFU is reported against its
    40 % target and does not fail the check until a real run sets the bar; the step fails only if it cannot run."""
    from benchmarks.bench_mfu import run

    cuda = DEV["device"] == "cuda"
    rows = run(layers=None, tokens=None, warmup=2, steps=5) if cuda else run(layers=1, tokens=64, warmup=0, steps=1)
    packed = next(r for r in rows if r["layout"].startswith("8x") and r["optimizer"] == "included")
    mfu = packed["mfu_peak"] if cuda else packed["mfu_matmul"]
    figure = f"mfu_{packed['layout']}={mfu:.1%} of {'the bf16 peak' if cuda else 'the CPU matmul rate'}"
    return mfu > 0, figure, "reported against 40 %, not a gate", {"rows": rows}


def step_logp_gap():
    """The sampler-trainer log-prob gap of tests/test_logp_gap.py's CPU gate (its logp_gap: mismatch KL, mean and max
    |logp difference| per sampled token), with Hugging Face `generate` as the sampler (no vLLM on the device): 4
    prompts x 24 tokens at temperature 1 with each sampled token's log-prob, scored by the trainer's model
    (load_causal_lm: varlen_sdpa, one packed row) through the chunked head and through whole logits. One process:
    no ZeRO-3 or ring here (the CPU gate covers them). CUDA: the gate's 2-layer Qwen2.5-0.5B shape in bf16; CPU: the
    tiny Llama in fp32."""
    import dataclasses

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from common.infra.engine import ModelArgs, load_causal_lm
    from common.infra.vllm_engine import HFGenerator, SamplingArgs
    from common.logprobs import logps_chunk_tokens, model_settings
    from common.packing import one_row_per_batch
    from tests.scripts.logp_gap_check import CHUNK_TOKENS, SEED, build_gap_model, logp_gap, scored

    device, dtype = DEV["device"], _torch_dtype()
    path = build_gap_model(tempfile.mkdtemp(prefix="minrlhf_gap_")) if device == "cuda" else f"{_assets()}/llama-0.5m"
    tokenizer = AutoTokenizer.from_pretrained(path)
    sampler = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    g = torch.Generator().manual_seed(SEED)
    prompts = [torch.randint(3, len(tokenizer), (8,), generator=g).tolist() for _ in range(4)]
    out = [HFGenerator(sampler, tokenizer).generate([p], SamplingArgs(temperature=1.0, max_new_tokens=24,
                                                                        ignore_eos=True, seed=SEED + i))[0][0]
           for i, p in enumerate(prompts)]
    samples, sampled = [(s.prompt_ids, s.output_ids) for s in out], [s.logprobs for s in out]
    del sampler
    model = load_causal_lm(ModelArgs(pretrain=path, logps_chunk_tokens=CHUNK_TOKENS)).to(device).eval()
    one_row = one_row_per_batch(model.config._attn_implementation)
    figures = {}
    for name, chunk in (("chunked_head", CHUNK_TOKENS), ("whole_logits", 0)):
        model.minrlhf = dataclasses.replace(model_settings(model), logps_chunk_tokens=chunk)
        trainer, entropy = scored(model, samples, one_row, device)
        with torch.no_grad():  # as scored computed them (where gradients flow the head can differ)
            used = logps_chunk_tokens(model)
        figures[name] = {**logp_gap(trainer, sampled), "entropy": entropy, "chunk_tokens": used}
    kl = max(f["mismatch_kl"] for f in figures.values())
    figure = " ".join(f"{n}: kl={f['mismatch_kl']:.2e} mean|dlogp|={f['logp_abs_diff_mean']:.2e}"
                      for n, f in figures.items()) + f" entropy={figures['whole_logits']['entropy']:.2f}"
    ok = kl <= 0.01 and figures["chunked_head"]["chunk_tokens"] == CHUNK_TOKENS  # the chunked head did run
    return ok, figure, "mismatch KL <= 0.01 (prime-rl's)", figures


STEPS = {"env": step_env, "varlen_kernel": step_varlen_kernel, "packed_vs_padded": step_packed_vs_padded,
         "ring_contract": step_ring_contract, "chunked_head": step_chunked_head, "cuda_ipc": step_cuda_ipc,
         "sft_default": lambda: _train_step("sft.py", None), "sft_zero2": lambda: _train_step("sft.py", 2),
         "sft_zero3": lambda: _train_step("sft.py", 3), "dpo_zero2": lambda: _train_step("dpo.py", 2),
         "dpo_zero3": lambda: _train_step("dpo.py", 3), "offload_states": step_offload_states,
         "bench_mfu": step_bench_mfu, "logp_gap": step_logp_gap}


def read_wheel_list(path=WHEELS):
    """{name: version} of the wheel list; ValueError for a line that is not `name==version`."""
    pins = {}
    with open(path) as f:
        for line in f:
            line = line.split("#")[0].strip()
            if not line:
                continue
            name, sep, version = line.partition("==")
            if not sep or not name or not version:
                raise ValueError(f"{path}: {line!r} is not name==version")
            pins[name.strip().lower().replace("_", "-")] = version.strip()
    return pins


def dry_run():
    """The wheel list pins every package the GPU image lacks; every step exists and its modules import."""
    problems = []
    pins = read_wheel_list()
    missing = NEEDED_WHEELS - set(pins)
    if missing:
        problems.append(f"wheel list lacks {sorted(missing)}")
    if set(STEP_MODULES) != set(STEPS):
        problems.append(f"steps without modules: {sorted(set(STEPS) ^ set(STEP_MODULES))}")
    for step, modules in STEP_MODULES.items():
        for module in modules:
            try:
                importlib.import_module(module)
            except Exception as e:  # noqa: BLE001  (reported, the dry run goes on)
                problems.append(f"{step}: import {module}: {type(e).__name__}: {e}")
    for p in problems:
        print(f"FAIL dry_run {p}")
    print(f"{'PASS' if not problems else 'FAIL'} dry_run wheels={len(pins)} steps={len(STEPS)}")
    return not problems


class Report:
    """Lines to stdout and <out>/device_check.log; step JSONs under <out>/steps; summary.json; the archive."""

    def __init__(self, out):
        self.out, self.summary = out, {}
        os.makedirs(os.path.join(out, "steps"), exist_ok=True)

    def say(self, line):
        print(line, flush=True)
        with open(os.path.join(self.out, "device_check.log"), "a") as f:
            f.write(line + "\n")

    def record(self, step, result):
        self.summary[step] = {k: result[k] for k in ("status", "figure", "bar", "seconds", "cuda_only")}
        with open(os.path.join(self.out, "steps", f"{step}.json"), "w") as f:
            json.dump(result, f, indent=1, default=str)
        self.write()

    def write(self):
        with open(os.path.join(self.out, "summary.json"), "w") as f:
            json.dump(self.summary, f, indent=1, default=str)
        with tarfile.open(os.path.join(self.out, ARCHIVE + ".part"), "w:gz") as tar:
            for name in ("summary.json", "device_check.log", "steps"):
                if os.path.exists(os.path.join(self.out, name)):
                    tar.add(os.path.join(self.out, name), arcname=f"device_check/{name}")
        os.replace(os.path.join(self.out, ARCHIVE + ".part"), os.path.join(self.out, ARCHIVE))


def build_fused_adam():
    """DeepSpeed's FusedAdam JIT build (the offload step's optimizer needs it), started at t = 0 in the background
    so it compiles while the other steps run."""
    code = "from deepspeed.ops.op_builder import FusedAdamBuilder; FusedAdamBuilder().load()"
    log = tempfile.TemporaryFile("w+")  # not a pipe: nobody reads it until the step, and a full pipe would stall
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT), log


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="folder for steps/<step>.json, summary.json, the log, the archive")
    parser.add_argument("--dry-run", action="store_true", help="check the wheel list and the imports only")
    parser.add_argument("--rehearse", action="store_true", help="every step on CPU where it has a CPU meaning")
    parser.add_argument("--steps", default=",".join(STEPS), help="comma list of steps to run")
    args = parser.parse_args(argv)
    steps = args.steps.split(",")
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        parser.error(f"--steps: unknown {unknown}; steps: {','.join(STEPS)}")
    os.makedirs(args.out, exist_ok=True)
    if args.dry_run:
        ok = dry_run()
        with open(os.path.join(args.out, "summary.json"), "w") as f:
            json.dump({"dry_run": ok}, f)
        return 0 if ok else 1
    if args.rehearse:
        DEV.update(device="cpu", dtype="float32", tol=TOLERANCE_FP32)
    report, start = Report(args.out), time.time()
    report.say("PROBE " + " ".join(f"{k}={v}" for k, v in probe().items()))
    if not args.rehearse and "offload_states" in steps:
        DEV["fused_adam"] = build_fused_adam()
    references = sorted({f"{s.split('_')[0]}.py" for s in steps if s.startswith(("sft_", "dpo_"))})
    if references:
        _assets()  # here, not in two threads at once: building the tiny models seeds torch's one global generator
    for script in references:
        _reference(script)  # the fp32 CPU runs start now, beside the first steps
    for step in steps:
        t = time.time()
        try:
            for module in STEP_MODULES[step]:
                importlib.import_module(module)
            if step == "offload_states" and "fused_adam" in DEV:
                build, log = DEV.pop("fused_adam")
                if build.wait() != 0:
                    log.seek(0)
                    raise RuntimeError(f"FusedAdam build: {log.read()[-1500:]}")
            ok, figure, bar, data = STEPS[step]()
        except Exception as e:  # noqa: BLE001  (a failed step is a FAIL line; the others still run)
            ok, figure, bar, data = False, f"{type(e).__name__}: {' '.join(str(e).split())[:300]}", "-", {
                "traceback": traceback.format_exc()}
        result = {"status": "PASS" if ok else "FAIL", "figure": figure, "bar": bar, "seconds": time.time() - t,
                  "cuda_only": CUDA_ONLY.get(step) if args.rehearse else None, **data}
        report.say(f"{result['status']} {step} {figure} | bar: {bar} ({result['seconds']:.0f} s)")
        if result["cuda_only"]:
            report.say(f"CUDA ONLY {step}: {result['cuda_only']}")
        report.record(step, result)
    failed = [s for s, r in report.summary.items() if r["status"] == "FAIL"]
    where = " on CPU (a rehearsal: no step ran on CUDA; CUDA ONLY lines name what was not judged)"
    report.say(f"DONE passed={len(report.summary) - len(failed)} failed={len(failed)} in {time.time() - start:.0f} s"
               f"{where if args.rehearse else ''}; archive {os.path.join(args.out, ARCHIVE)}")
    if failed:
        report.say(f"rerun the failed: bash launch/gpu_device_check.sh \"$OUT\" --steps {','.join(failed)}"
                   f"{' --rehearse' if args.rehearse else ''}; s=$?; rm -rf \"$OUT/steps\"; exit $s")
    report.write()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
