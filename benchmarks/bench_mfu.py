"""Model FLOP utilisation of an SFT step: a Qwen2.5-0.5B-shaped model (random weights) on 4,096 packed tokens, as
8 samples x 512 and 1 x 4,096, through varlen_sdpa (torch's varlen flash kernel on CUDA in bf16), loss on every
token, AdamW(fused). FLOP per step: dense 6 x N x T (N: every Linear weight, the LM head included; T tokens) plus
causal attention per packed sample, 6 x layers x heads x head_dim x sum of l(l + 1) over samples of l tokens.
MFU is over the H200's dense bf16 peak (989.4 TFLOP/s) on CUDA and over the matmul rate measured here, with the
optimizer step included and excluded. On CPU the same, against the CPU's measured matmul rate (fp32, or bf16
where the CPU multiplies it natively); --layers and --tokens shrink the run for a quick check.

    python -m benchmarks.bench_mfu                          # H200: the full model, 4,096 tokens
    python -m benchmarks.bench_mfu --layers 2 --tokens 256  # a quick CPU check
"""

import argparse
import time

import torch


H200_BF16_PEAK = 989.4e12
QWEN25_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                  tie_word_embeddings=True)


def step_flop(model, lengths):
    """6 N T (every Linear weight, the head included even when tied to the embeddings) + causal attention."""
    c = model.config
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    if c.tie_word_embeddings and not any(m is model.lm_head for m in model.modules()
                                         if isinstance(m, torch.nn.Linear)):
        linear += model.lm_head.weight.numel()
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    attention = 6 * c.num_hidden_layers * c.num_attention_heads * head_dim * sum(n * (n + 1) for n in lengths)
    return 6 * linear * sum(lengths) + attention, linear


def matmul_rate(device, dtype):
    """FLOP/s of a large matmul in `dtype` on `device` (CUDA: 8192^3; CPU: 2048 x 896 x 4864)."""
    m, k, n = (8192, 8192, 8192) if device.type == "cuda" else (2048, 896, 4864)
    a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    _sync(device)
    reps = 10 if device.type == "cuda" else 3
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    _sync(device)
    return 2 * m * k * n * reps / (time.perf_counter() - t)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def run(layers=None, tokens=None, warmup=2, steps=5):
    """One row per (layout, optimizer included / excluded): seconds a step, TFLOP/s, MFU over the peak (CUDA) and
    over the measured matmul rate."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    import common.kernels.varlen_attention  # noqa: F401  (registers varlen_sdpa)
    from common.infra.engine import cpu_has_native_bf16
    from common.logprobs import token_logps
    from common.packing import collate, to_device

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda or cpu_has_native_bf16() else torch.float32
    config = Qwen2Config(**{**QWEN25_05B, "num_hidden_layers": layers or QWEN25_05B["num_hidden_layers"]})
    total = tokens or 4096
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="varlen_sdpa").to(device)
    model.config.use_cache = False
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    rate = matmul_rate(device, dtype)
    rows = []
    for layout, lengths in ((f"8x{total // 8}", [total // 8] * 8), (f"1x{total}", [total])):
        samples = [{"input_ids": torch.randint(0, config.vocab_size, (n,)).tolist(), "loss_mask": [1] * n}
                   for n in lengths]
        batch = to_device(collate(samples, 0, one_row=True, max_tokens=total), device)
        flop, linear = step_flop(model, lengths)
        for optimizer_step in (True, False):
            times = []
            for i in range(warmup + steps):
                _sync(device)
                t = time.perf_counter()
                logps, _ = token_logps(model, batch)
                loss = -(logps * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
                loss.backward()
                if optimizer_step:
                    optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                _sync(device)
                if i >= warmup:
                    times.append(time.perf_counter() - t)
            seconds = sorted(times)[len(times) // 2]
            rows.append({"layout": layout, "optimizer": "included" if optimizer_step else "excluded",
                         "seconds": seconds, "tflops": flop / seconds / 1e12, "linear_params": linear,
                         "step_tflop": flop / 1e12, "matmul_tflops": rate / 1e12,
                         "mfu_peak": flop / seconds / H200_BF16_PEAK if cuda else None,
                         "mfu_matmul": flop / seconds / rate, "device": str(device), "dtype": str(dtype)})
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default 24, Qwen2.5-0.5B's)")
    parser.add_argument("--tokens", type=int, default=None, help="packed tokens a step (default 4096)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="timed steps (the median is reported)")
    args = parser.parse_args(argv)
    rows = run(args.layers, args.tokens, args.warmup, args.steps)
    print(f"{rows[0]['device']} {rows[0]['dtype']}: matmul {rows[0]['matmul_tflops']:.2f} TFLOP/s measured; "
          f"{rows[0]['linear_params'] / 1e6:.1f}M Linear weights; {rows[0]['step_tflop']:.3f} TFLOP a step "
          f"({rows[0]['layout']})")
    print(f"{'layout':>10} {'optimizer':>9} {'s/step':>8} {'TFLOP/s':>8} {'MFU peak':>9} {'MFU matmul':>11}")
    for r in rows:
        peak = f"{r['mfu_peak']:.1%}" if r["mfu_peak"] is not None else "-"
        print(f"{r['layout']:>10} {r['optimizer']:>9} {r['seconds']:8.3f} {r['tflops']:8.2f} {peak:>9} "
              f"{r['mfu_matmul']:11.1%}")
    return rows


if __name__ == "__main__":
    main()
