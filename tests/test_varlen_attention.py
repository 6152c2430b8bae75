"""common/kernels/varlen_attention.py: the per-sample kernel against masked attention computed by hand
(equal-length and bottom-right-aligned query blocks, grouped KV heads, forward and backward), and
the `varlen_sdpa` attention implementation against transformers' sdpa on Llama and Qwen2: a packed
batch gives the logits, per-token log-probs and gradients of each sample run alone."""

import math

import pytest
import torch

from common.logprobs import token_logps
from common.packing import collate
from common.kernels import varlen_attention
from common.kernels.varlen_attention import (
    NAME, SampleBlocks, batch_plan, cu_seqlens_from_position_ids, varlen_backward, varlen_forward,
)

pytestmark = pytest.mark.quick  # the quick tier (launch/test.sh --quick)


def reference_attention(q, k, v, cu_q, cu_k, scale):
    """Masked softmax attention per sample, bottom-right causal, in float64 (autograd gives the gradients)."""
    outs, lses = [], []
    for i in range(len(cu_q) - 1):
        qi, ki, vi = q[cu_q[i]:cu_q[i + 1]], k[cu_k[i]:cu_k[i + 1]], v[cu_k[i]:cu_k[i + 1]]
        group = qi.shape[1] // ki.shape[1]
        ki, vi = ki.repeat_interleave(group, 1), vi.repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", qi, ki) * scale
        lq, lk = qi.shape[0], ki.shape[0]
        s = s.masked_fill(~torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq), -math.inf)
        lses.append(torch.logsumexp(s, -1))
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vi))
    return torch.cat(outs), torch.cat(lses, 1)


def reference_case(cu_q, cu_k, heads, kv_heads):
    """Random float64 q, k, v, the reference output and log-sum-exp, an upstream gradient and the reference
    gradients of q, k, v."""
    q = torch.randn(cu_q[-1], heads, 16, dtype=torch.float64)
    k, v = (torch.randn(cu_k[-1], kv_heads, 16, dtype=torch.float64) for _ in range(2))
    ref_q, ref_k, ref_v = (t.clone().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = reference_attention(ref_q, ref_k, ref_v, cu_q, cu_k, 0.25)
    dout = torch.randn_like(ref_out)
    ref_out.backward(dout)
    return (q, k, v), ref_out.detach(), ref_lse.detach(), dout, (ref_q.grad, ref_k.grad, ref_v.grad)


@pytest.mark.parametrize("heads,kv_heads,query_block", [(4, 4, False), (4, 2, False), (4, 1, True)])
def test_kernel_matches_masked_attention(heads, kv_heads, query_block):
    torch.manual_seed(0)
    lengths_k = [5, 1, 12, 7, 5, 12, 5]  # repeated lengths: samples of one length run as one batched call
    lengths_q = [3, 1, 4, 7, 3, 4, 2] if query_block else lengths_k  # a query block at the end of each sample's keys
    cu_k = [0] + torch.tensor(lengths_k).cumsum(0).tolist()
    cu_q = [0] + torch.tensor(lengths_q).cumsum(0).tolist()
    (q, k, v), ref_out, ref_lse, dout, ref_grads = reference_case(cu_q, cu_k, heads, kv_heads)
    q32, k32, v32 = q.float(), k.float(), v.float()
    out, lse = varlen_forward(q32, k32, v32, cu_q, cu_k, 0.25)
    assert (out.double() - ref_out).abs().max().item() <= 1e-5
    assert (lse.double() - ref_lse).abs().max().item() <= 1e-5
    dq, dk, dv = varlen_backward(dout.float(), q32, k32, v32, out, lse, cu_q, cu_k, 0.25)
    for got, want in zip((dq, dk, dv), ref_grads):
        assert (got.double() - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1)])
def test_block_plan_matches_masked_attention(heads, kv_heads):
    """The blocks plan (one masked call over padded blocks) against the same reference, grouped KV heads
    included: output and gradients of q, k, v (fp32 against float64)."""
    torch.manual_seed(0)
    lengths = [5, 1, 12, 7, 5, 3]
    cu = [0] + torch.tensor(lengths).cumsum(0).tolist()
    blocks = SampleBlocks(torch.cat([torch.arange(n) for n in lengths]))
    assert blocks.count > 1 and blocks.count * blocks.size > cu[-1]  # several blocks, some padding
    (q, k, v), ref_out, _, dout, ref_grads = reference_case(cu, cu, heads, kv_heads)
    q32, k32, v32 = (t.float().requires_grad_() for t in (q, k, v))
    out = varlen_attention._BlockAttention.apply(q32, k32, v32, blocks, 0.25)
    out.backward(dout.float())
    assert (out.double() - ref_out).abs().max().item() <= 1e-5
    for got, want in zip((q32.grad, k32.grad, v32.grad), ref_grads):
        assert got.shape == want.shape
        assert (got.double() - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())


def test_cu_seqlens_from_position_ids():
    rows = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]])
    assert cu_seqlens_from_position_ids(rows) == [0, 3, 5, 6, 10, 12]


def force_plan(monkeypatch, plan):
    """Make varlen_sdpa take SampleBlocks or SampleGroups whatever their costs."""
    monkeypatch.setattr(varlen_attention, "CALL_COST_IN_SCORES", 1e15 if plan == "blocks" else 0.0)


def used_plan():
    return "blocks" if isinstance(varlen_attention._last_batch["plan"], varlen_attention.SampleBlocks) else "groups"


@pytest.mark.parametrize("plan", ["blocks", "groups"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_packed_batch_equals_each_sample_alone_under_sdpa(assets, arch, plan, monkeypatch):
    """Packed rows through varlen_sdpa, by either plan = every sample alone through transformers' sdpa
    (fp32): logits and per-token log-probs within 1e-5, gradients of a summed log-prob loss within 1e-5
    (relative to the largest)."""
    from transformers import AutoModelForCausalLM

    force_plan(monkeypatch, plan)
    torch.manual_seed(0)
    path = f"{assets}/{arch}-0.5m"
    lengths = [9, 17, 4, 30, 12, 21, 9, 17, 9]
    samples = [{"input_ids": torch.randint(3, 250, (n,)).tolist(), "loss_mask": [1] * n} for n in lengths]
    grads, logps = {}, {}
    for impl in (NAME, "sdpa"):
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=impl, dtype=torch.float32)
        model.config.use_cache = False
        if impl == NAME:  # two packed rows of several samples each, the second with a padding tail
            batch = collate(samples, 0, packing=True, max_tokens=48)
            assert batch["input_ids"].shape[0] >= 2 and (batch["sample_index"] < 0).any()
            values, _ = token_logps(model, batch)
            assert used_plan() == plan
            per_sample = [values[r, s:s + n] for r, s, n in batch["spans"]]
        else:
            per_sample = [token_logps(model, collate([s], 0, packing=True))[0][0] for s in samples]
        total = sum(p.sum() for p in per_sample)
        total.backward()
        logps[impl] = torch.cat(per_sample)
        grads[impl] = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert (logps[NAME] - logps["sdpa"]).abs().max().item() <= 1e-5
    scale = grads["sdpa"].abs().max().item()
    assert (grads[NAME] - grads["sdpa"]).abs().max().item() <= 1e-5 * scale and scale > 1e-3


def test_sample_blocks_layout_and_mask():
    """A sample with a branch (its last two tokens continue the first two), then samples of 3 and 2 tokens:
    blocks as long as the longest unit (the sample and its branch, 6 tokens), first-fit decreasing, each
    query seeing its own segment's earlier tokens and a branch its root's prefix; padding sees itself."""
    blocks = SampleBlocks(torch.tensor([0, 1, 2, 3, 2, 3, 0, 1, 0, 1, 2]))
    assert (blocks.count, blocks.size) == (2, 6)
    assert blocks.slot_token.tolist() == [0, 1, 2, 3, 4, 5, 8, 9, 10, 6, 7, 0]
    assert blocks.token_slot.tolist() == [0, 1, 2, 3, 4, 5, 9, 10, 6, 7, 8]
    visible = (blocks.mask(torch.zeros(1)) == 0).int()[:, 0].tolist()
    assert visible[0] == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0],
                          [1, 1, 0, 0, 1, 0], [1, 1, 0, 0, 1, 1]]
    assert visible[1] == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0], [0, 0, 0, 1, 0, 0],
                          [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 1]]


def test_plan_takes_blocks_for_short_samples_and_groups_for_a_long_tail():
    """batch_plan at the 8.5M Llama's 4 x 64 head-dims: 16 DPO pairs (prompt 8-16, responses 4-12 tokens,
    rejected as branches) go to one masked call; 60 short samples beside three of 300-500 tokens keep
    per-length groups (blocks of 500 would attend ~3x the scores)."""
    rng = torch.Generator().manual_seed(0)

    def lengths(n, low, high):
        return torch.randint(low, high + 1, (n,), generator=rng).tolist()

    pairs = []
    for prompt, chosen, rejected in zip(lengths(16, 8, 16), lengths(16, 4, 12), lengths(16, 4, 12)):
        pairs += list(range(prompt + chosen)) + list(range(prompt, prompt + rejected))
    assert isinstance(batch_plan(torch.tensor([pairs]), 256), SampleBlocks)
    tail = [p for n in lengths(60, 10, 35) + [300, 420, 500] for p in range(n)]
    assert isinstance(batch_plan(torch.tensor([tail]), 256), varlen_attention.SampleGroups)
