"""The device check of one GPU (launch/gpu_device_check.sh, docs/gpu.md): each step prints one line,
`PASS <step> <figure>` or `FAIL <step> <figure or error>`, and writes <out>/<step>.json; <out>/summary.json holds
them all. Steps: the environment; torch's varlen kernel (forward, backward) against per-sample sdpa with grouped
KV heads and shared-prefix branches; packed = padded log-probs and gradients through a bf16 model; the ring's
flash-attn contract over torch's kernels; sft.py and dpo.py in bf16 under ZeRO-2 and ZeRO-3 for 20 steps (a
falling loss, the first loss near the CPU fp32 value); DeepSpeed offload_states round trip in bf16; bench_mfu.

--dry-run (CPU, CI): the wheel list names every package the steps need, pinned, and every step's modules import.
"""

import argparse
import importlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
WHEELS = os.path.join(ROOT, "launch", "gpu_wheels.txt")
NEEDED_WHEELS = {"deepspeed", "tyro", "datasets", "pydantic", "ring-flash-attn"}  # missing on the GPU image
TOLERANCE_BF16 = 2e-2  # bf16 keeps 8 mantissa bits: relative error ~4e-3 a rounding, a few roundings deep

STEP_MODULES = {
    "env": ["torch", "transformers"],
    "varlen_kernel": ["common.kernels.varlen_attention", "common.infra.gpu"],
    "packed_vs_padded": ["common.packing", "launch.tiny"],
    "ring_contract": ["common.ring_attention"],
    "sft_zero2": ["algos.sft", "deepspeed", "tyro", "datasets"],
    "sft_zero3": ["algos.sft"],
    "dpo_zero2": ["algos.dpo"],
    "dpo_zero3": ["algos.dpo"],
    "offload_states": ["common.infra.engine", "deepspeed"],
    "bench_mfu": ["benchmarks.bench_mfu"],
}


def _assets(cache={}):
    if "path" not in cache:
        from launch.tiny import build_assets

        cache["path"] = build_assets(tempfile.mkdtemp(prefix="minrlhf_assets_"), models=("llama-0.5m",))
    return cache["path"]


def step_env():
    import torch
    import transformers

    name = torch.cuda.get_device_name(0)
    have = {m: importlib.util.find_spec(m) is not None for m in ("deepspeed", "vllm", "ray", "flash_attn",
                                                                  "ring_flash_attn", "tyro", "datasets")}
    from common.kernels.varlen_attention import _TORCH_VARLEN

    ok = torch.cuda.is_available() and _TORCH_VARLEN and have["deepspeed"]
    return ok, f"{name} torch {torch.__version__} varlen_attn={_TORCH_VARLEN}", {
        "torch": torch.__version__, "transformers": transformers.__version__, "device": name, "packages": have}


def _case(heads, kv_heads, dtype, seed=0):
    import torch

    from common.kernels.varlen_attention import VarlenPlan

    torch.manual_seed(seed)
    positions = ([list(range(300)) + list(range(77)) + list(range(512)) + list(range(40, 140)) + list(range(1))])
    position_ids = torch.tensor(positions, device="cuda")  # a branch of the 512-token sample at position 40
    n = position_ids.numel()
    q = torch.randn(n, heads, 64, device="cuda", dtype=dtype)
    k, v = (torch.randn(n, kv_heads, 64, device="cuda", dtype=dtype) for _ in range(2))
    return position_ids, VarlenPlan(position_ids), q, k, v


def step_varlen_kernel():
    import torch

    from common.kernels.varlen_attention import _groups, grouped_sdpa, torch_varlen_attention

    worst = {}
    for heads, kv_heads in ((8, 8), (8, 2)):
        position_ids, plan, q, k, v = _case(heads, kv_heads, torch.bfloat16)
        outs = []
        for run in ("torch_varlen", "sdpa_fp32"):
            qq, kk, vv = (t.detach().clone().float().requires_grad_() if run == "sdpa_fp32"
                          else t.detach().clone().requires_grad_() for t in (q, k, v))
            if run == "torch_varlen":
                out = torch_varlen_attention(qq, kk, vv, plan, 0.125)
            else:
                out = grouped_sdpa(qq, kk, vv, _groups(position_ids), 0.125)
            out.float().square().sum().backward()
            outs.append([out.float(), qq.grad.float(), kk.grad.float(), vv.grad.float()])
        for name, a, b in zip(("out", "dq", "dk", "dv"), *outs):
            rel = ((a - b).abs().max() / b.abs().max().clamp(min=1e-6)).item()
            worst[f"{name}_gqa{heads // kv_heads}"] = rel
    top = max(worst.values())
    return top <= TOLERANCE_BF16, f"max_rel_diff={top:.2e}", worst


def step_packed_vs_padded():
    import torch
    from transformers import AutoModelForCausalLM

    from common.packing import collate, to_device, token_logps

    path = f"{_assets()}/llama-0.5m"
    samples = [{"input_ids": list(range(3, 3 + n)), "loss_mask": [1] * n} for n in (17, 40, 9, 64, 33)]
    figures = {}
    results = []
    for attn, packing in (("varlen_sdpa", True), ("sdpa", False)):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation=attn).cuda()
        batch = to_device(collate(samples, 0, packing=packing, max_tokens=256, one_row=packing), "cuda")
        logps, _ = token_logps(model, batch)
        per_sample = [logps[r, s + 1: s + n].float() for r, s, n in batch["spans"]]
        torch.cat(per_sample).sum().backward()
        grads = torch.cat([p.grad.float().flatten() for p in model.parameters()])
        results.append((per_sample, grads))
    (a_logps, a_grads), (b_logps, b_grads) = results
    figures["logp_max_abs_diff"] = max((x - y).abs().max().item() for x, y in zip(a_logps, b_logps))
    figures["grad_rel_diff"] = ((a_grads - b_grads).norm() / b_grads.norm()).item()
    ok = figures["logp_max_abs_diff"] <= 0.05 and figures["grad_rel_diff"] <= TOLERANCE_BF16
    return ok, f"logp_diff={figures['logp_max_abs_diff']:.2e} grad_rel={figures['grad_rel_diff']:.2e}", figures


def step_ring_contract():
    """ring-flash-attn's flash_attn contract over torch's kernels (the stand-in a ring uses without flash-attn):
    out and lse (heads, total_q) and the gradients written into dq, dk, dv, with key blocks longer than query
    blocks (bottom-right), against per-sample fp32 sdpa."""
    import torch

    from common.ring_attention import _torch_flash_varlen_backward, _torch_flash_varlen_forward
    from common.kernels.varlen_attention import SampleGroups, grouped_sdpa

    torch.manual_seed(0)
    cu_q, cu_k = [0, 100, 164, 420], [0, 300, 364, 620]  # each query block the last lq of its keys
    q = torch.randn(cu_q[-1], 8, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(cu_k[-1], 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    tq, tk = (torch.tensor(c, dtype=torch.int32, device="cuda") for c in (cu_q, cu_k))
    out, lse, _, _ = _torch_flash_varlen_forward(q, k, v, tq, tk, 256, 300, 0.0, 0.125, True)
    dout = torch.randn_like(out)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _torch_flash_varlen_backward(dout, q, k, v, out, lse, dq, dk, dv, tq, tk, 256, 300, 0.0, 0.125, True)
    rq, rk, rv = (t.float().requires_grad_() for t in (q, k, v))
    ref = grouped_sdpa(rq, rk, rv, SampleGroups(cu_q, cu_k, "cuda"), 0.125)
    ref.backward(dout.float())
    figures = {name: ((a.float() - b).abs().max() / b.abs().max()).item()
               for name, a, b in (("out", out, ref), ("dq", dq, rq.grad), ("dk", dk, rk.grad), ("dv", dv, rv.grad))}
    figures["lse_shape_ok"] = float(tuple(lse.shape) == (8, cu_q[-1]))
    top = max(v for n, v in figures.items() if n != "lse_shape_ok")
    return top <= TOLERANCE_BF16 and figures["lse_shape_ok"] == 1.0, f"max_rel_diff={top:.2e}", figures


def _run(script, args, env=None, timeout=150):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "algos", script)] + [str(a) for a in args], cwd=ROOT,
                          env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        raise RuntimeError(f"{script} exit {proc.returncode}: {proc.stderr[-1500:]}")


def _losses(path):
    with open(path) as f:
        return [json.loads(line)["train/loss"] for line in f if "train/loss" in line]


def _train_step(script, zero_stage):
    assets = _assets()
    data = f"{assets}/data/reverse"
    work = tempfile.mkdtemp(prefix=f"{script[:-3]}_z{zero_stage}_")
    if script == "sft.py":
        task = ["--dataset", f"{data}/sft_train.jsonl", "--input_key", "prompt", "--output_key", "response",
                "--learning_rate", 3e-3]
    else:
        task = ["--dataset", f"{data}/pref_train.jsonl", "--learning_rate", 3e-4, "--beta", 0.1]
    common = ["--pretrain", f"{assets}/llama-0.5m", *task, "--apply_chat_template", "--max_len", 64,
              "--train_batch_size", 8, "--micro_train_batch_size", 8, "--zero_stage", zero_stage]
    _run(script, [*common, "--max_samples", 160, "--param_dtype", "bf16", "--save_path", f"{work}/out",
                  "--metrics_file", f"{work}/gpu.jsonl"])
    losses = _losses(f"{work}/gpu.jsonl")
    if script == "sft.py":  # the same first step on this machine's CPU in fp32
        _run(script, [*common, "--max_samples", 8, "--param_dtype", "fp32", "--save_path", f"{work}/cpu_out",
                      "--metrics_file", f"{work}/cpu.jsonl"], env={"CUDA_VISIBLE_DEVICES": ""})
        reference = _losses(f"{work}/cpu.jsonl")[0]
    else:
        reference = math.log(2)  # policy = reference at step 1
    first_off = abs(losses[0] - reference) / reference
    falling = sum(losses[-5:]) / 5 < sum(losses[:5]) / 5
    ok = len(losses) == 20 and falling and first_off <= 0.02
    figure = f"steps={len(losses)} first={losses[0]:.4f} cpu_fp32={reference:.4f} last={losses[-1]:.4f}"
    return ok, figure, {"losses": losses, "cpu_fp32_first": reference, "first_rel_diff": first_off}


def step_offload_states():
    from common.infra.engine import free_port

    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "scripts", "offload_check.py"),
                           f"{_assets()}/llama-0.5m", "3", "bf16"], cwd=ROOT, capture_output=True, text=True,
                          timeout=150, env={**os.environ, "MASTER_PORT": str(free_port())})
    if proc.returncode:
        raise RuntimeError(proc.stderr[-1500:])
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    ok = result["max_diff"] <= 1e-2 and result["freed_bytes"] >= 2 * 400_000
    return ok, f"freed={result['freed_bytes'] / 2**20:.1f}MiB max_diff={result['max_diff']:.1e}", result


def step_bench_mfu():
    from benchmarks.bench_mfu import run

    rows = run(layers=None, tokens=None, warmup=2, steps=5)
    packed = next(r for r in rows if r["layout"] == "8x512" and r["optimizer"] == "included")
    return packed["mfu_peak"] >= 0.40, f"mfu_8x512={packed['mfu_peak']:.1%} (target 40%)", {"rows": rows}


STEPS = {"env": step_env, "varlen_kernel": step_varlen_kernel, "packed_vs_padded": step_packed_vs_padded,
         "ring_contract": step_ring_contract, "sft_zero2": lambda: _train_step("sft.py", 2),
         "sft_zero3": lambda: _train_step("sft.py", 3), "dpo_zero2": lambda: _train_step("dpo.py", 2),
         "dpo_zero3": lambda: _train_step("dpo.py", 3), "offload_states": step_offload_states,
         "bench_mfu": step_bench_mfu}


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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="folder for <step>.json and summary.json")
    parser.add_argument("--dry-run", action="store_true", help="check the wheel list and the imports only")
    parser.add_argument("--steps", default=",".join(STEPS), help="comma list of steps to run")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.dry_run:
        ok = dry_run()
        with open(os.path.join(args.out, "summary.json"), "w") as f:
            json.dump({"dry_run": ok}, f)
        return 0 if ok else 1
    summary, start = {}, time.time()
    for step in args.steps.split(","):
        t = time.time()
        try:
            ok, figure, data = STEPS[step]()
        except Exception as e:  # noqa: BLE001  (a failed step is a FAIL line; the others still run)
            ok, figure, data = False, f"{type(e).__name__}: {' '.join(str(e).split())[:300]}", {
                "traceback": traceback.format_exc()}
        seconds = time.time() - t
        print(f"{'PASS' if ok else 'FAIL'} {step} {figure} ({seconds:.0f} s)", flush=True)
        summary[step] = {"ok": ok, "figure": figure, "seconds": seconds}
        with open(os.path.join(args.out, f"{step}.json"), "w") as f:
            json.dump({"ok": ok, "figure": figure, "seconds": seconds, **data}, f, indent=1, default=str)
    summary["total_seconds"] = time.time() - start
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return 0 if all(s["ok"] for k, s in summary.items() if k != "total_seconds") else 1


if __name__ == "__main__":
    sys.exit(main())
