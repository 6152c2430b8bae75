"""Packing: bin-packing, and packed rows giving the same logits and log-probs as padded rows."""

import random

import pytest
import torch

from common.kernels.bins import pack_sequences
from common.logprobs import token_logps
from common.packing import collate, per_sample_sum, unpack

pytestmark = pytest.mark.quick  # the quick tier (launch/test.sh --quick)


def test_pack_sequences_is_first_fit_decreasing():
    lengths = [7, 5, 5, 4, 3, 3, 2, 1]  # 30 tokens: FFD fills 3 rows of 10 exactly
    rows = pack_sequences(lengths, 10)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert [sum(lengths[i] for i in row) for row in rows] == [10, 10, 10]
    # plain concatenation in order would need 4 rows: [7], [5, 5], [4, 3, 3], [2, 1]
    with pytest.raises(ValueError, match="sample 0 has 7 tokens, more than the row limit 6"):
        pack_sequences(lengths, 6)


def test_collate_layout_and_unpack():
    samples = [{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}, {"input_ids": [8, 9], "loss_mask": [1, 1]}]
    packed = collate(samples, pad_token_id=0, packing=True, max_tokens=8)
    assert packed["input_ids"].tolist() == [[5, 6, 7, 8, 9]]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert packed["attention_mask"] is None
    assert packed["loss_mask"].tolist() == [[0, 1, 1, 0, 1]]  # a sample's first token is never a target
    padded = collate(samples, pad_token_id=0, packing=False)
    assert padded["input_ids"].tolist() == [[5, 6, 7], [8, 9, 0]]
    assert padded["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    values = torch.arange(5.0).view(1, 5)
    assert [v.tolist() for v in unpack(values, packed)] == [[0.0, 1.0, 2.0], [3.0, 4.0]]
    assert per_sample_sum(values * packed["loss_mask"], packed).tolist() == [3.0, 4.0]


@pytest.mark.parametrize("name", ["llama-0.5m", "qwen2-0.5m"])
def test_packed_equals_padded(assets, name):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(f"{assets}/{name}", attn_implementation="sdpa").eval()
    rng = random.Random(0)
    samples = []
    for _ in range(11):
        n = rng.randint(3, 60)
        samples.append({"input_ids": [rng.randrange(5, 290) for _ in range(n)], "loss_mask": [1] * n})
    with torch.no_grad():
        packed = collate(samples, 0, packing=True, max_tokens=80)
        padded = collate(samples, 0, packing=False)
        assert packed["input_ids"].numel() < padded["input_ids"].numel()
        packed_logps, packed_out = token_logps(model, packed)
        padded_logps, padded_out = token_logps(model, padded)
    logit_diff = max(
        (packed_out.logits[r1, s1 : s1 + n] - padded_out.logits[r2, s2 : s2 + n]).abs().max().item()
        for (r1, s1, n), (r2, s2, _) in zip(packed["spans"], padded["spans"])
    )
    logp_diff = max((a - b).abs().max().item() for a, b in zip(unpack(packed_logps, packed),
                                                               unpack(padded_logps, padded)))
    assert logit_diff <= 1e-4 and logp_diff <= 1e-4, (logit_diff, logp_diff)
    # the log-probs are real: equal to a plain forward of each sample alone
    alone = model(input_ids=torch.tensor([samples[3]["input_ids"]]), use_cache=False).logits[0, :-1].log_softmax(-1)
    expected = alone.gather(-1, torch.tensor(samples[3]["input_ids"][1:]).unsqueeze(-1)).squeeze(-1)
    assert (unpack(packed_logps, packed)[3][1:] - expected).abs().max().item() <= 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash-attention's varlen kernel needs CUDA")
def test_flash_attention_one_row_packing_equals_padded_sdpa(assets):
    """On CUDA, packing puts every sample in one row for flash_attn_varlen_func; bf16 tolerance."""
    pytest.importorskip("flash_attn")
    from transformers import AutoModelForCausalLM

    def load(attn):
        return AutoModelForCausalLM.from_pretrained(f"{assets}/llama-0.5m", attn_implementation=attn,
                                                    dtype=torch.bfloat16).cuda().eval()

    rng = random.Random(1)
    samples = [{"input_ids": [rng.randrange(5, 290) for _ in range(n)], "loss_mask": [1] * n}
               for n in (rng.randint(3, 200) for _ in range(16))]
    with torch.no_grad():
        packed = {k: v.cuda() if torch.is_tensor(v) else v for k, v in collate(samples, 0, one_row=True).items()}
        padded = {k: v.cuda() if torch.is_tensor(v) else v for k, v in collate(samples, 0, packing=False).items()}
        flash_logps, _ = token_logps(load("flash_attention_2"), packed)
        sdpa_logps, _ = token_logps(load("sdpa"), padded)
    assert packed["input_ids"].shape[0] == 1
    diff = max((a - b).abs().max().item() for a, b in zip(unpack(flash_logps, packed), unpack(sdpa_logps, padded)))
    assert diff <= 5e-2, diff


def test_collate_lays_out_shared_prefix_branches():
    """A branch sample drops the tokens it shares with its root, follows it, and keeps its own positions."""
    samples = [{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}, {"input_ids": [3, 4], "loss_mask": [0, 1]},
               {"input_ids": [5, 6, 9, 9], "loss_mask": [0, 1, 1, 1], "prefix_of": 0, "prefix_len": 2}]
    batch = collate(samples, 0, one_row=True, share_prefixes=True)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 9, 9, 3, 4]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 2, 3, 0, 1]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1, 1, 1, 0, 1]]  # the branch's first token is a target
    assert batch["sample_index"].tolist() == [[0, 0, 0, 2, 2, 1, 1]]
    assert batch["branch_starts"] == [(0, 3, 1)]  # token 3 is predicted from the root's token 1
    assert collate(samples, 0, one_row=True)["input_ids"].shape == (1, 9)  # ignored unless asked for
    samples[2]["input_ids"][1] = 8
    with pytest.raises(ValueError, match="sample 2 does not extend the first 2 tokens of sample 0"):
        collate(samples, 0, one_row=True, share_prefixes=True)


@pytest.mark.parametrize("plan", ["blocks", "groups"])
@pytest.mark.parametrize("name", ["llama-0.5m", "qwen2-0.5m"])
def test_shared_prefix_branches_equal_separate_samples(assets, name, plan, monkeypatch):
    """DPO's layout: each rejected response as a branch of its chosen sample's prompt gives the per-token
    log-probs, per-sample sums, argmax hits and gradients of the two samples laid out whole (fp32), by
    either plan of the CPU kernel (common.kernels.varlen_attention: one masked call over blocks, or per-length
    groups)."""
    from transformers import AutoModelForCausalLM

    from common.kernels import varlen_attention
    from common.kernels.varlen_attention import NAME  # registers varlen_sdpa

    monkeypatch.setattr(varlen_attention, "CALL_COST_IN_SCORES", 1e15 if plan == "blocks" else 0.0)

    model = AutoModelForCausalLM.from_pretrained(f"{assets}/{name}", attn_implementation=NAME)
    rng = random.Random(1)
    chosen, rejected = [], []
    for k in range(5):
        prompt = [rng.randrange(5, 290) for _ in range(rng.randint(2, 20))]
        for side in (chosen, rejected):
            response = [rng.randrange(5, 290) for _ in range(rng.randint(1, 15))]
            side.append({"input_ids": prompt + response, "loss_mask": [0] * len(prompt) + [1] * len(response)})
        rejected[-1].update(prefix_of=k, prefix_len=len(prompt))
    samples = chosen + rejected
    weights = torch.linspace(0.5, 1.5, len(samples))
    results = []
    for share in (False, True):
        model.zero_grad()
        batch = collate(samples, 0, one_row=True, share_prefixes=share)
        logps, _, hits = token_logps(model, batch, return_argmax=True)
        expected = varlen_attention.SampleBlocks if plan == "blocks" else varlen_attention.SampleGroups
        assert isinstance(varlen_attention._last_batch["plan"], expected)
        mask = batch["loss_mask"].bool()
        sums = per_sample_sum(logps * batch["loss_mask"], batch)
        (sums * weights).sum().backward()
        per_sample = [(v[m.bool()], h[m.bool()]) for v, h, m in zip(unpack(logps, batch), unpack(hits, batch),
                                                                     unpack(batch["loss_mask"], batch))]
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results.append((batch["input_ids"].numel(), int(mask.sum()), sums.detach(), per_sample, grads))
    (whole_tokens, whole_targets, whole_sums, whole_tok, whole_grads), (tokens, targets, sums, tok, grads) = results
    assert tokens == whole_tokens - sum(s["prefix_len"] for s in rejected)  # each prompt once per pair
    assert targets == whole_targets
    assert (sums - whole_sums).abs().max().item() <= 1e-5
    for (a, ha), (b, hb) in zip(tok, whole_tok):
        assert a.shape == b.shape and (a - b).abs().max().item() <= 1e-5 and torch.equal(ha, hb)
    for n, g in grads.items():
        assert (g - whole_grads[n]).abs().max().item() <= 1e-5 * whole_grads[n].abs().max().item() + 1e-8, n
    # negative control: the rejected tails as samples of their own (no prefix) give other log-probs
    tails = chosen + [{"input_ids": s["input_ids"][s["prefix_len"]:], "loss_mask": [1] * (len(s["input_ids"]) -
                                                                                           s["prefix_len"])}
                      for s in rejected]
    with torch.no_grad():
        batch = collate(tails, 0, one_row=True)
        tail_sums = per_sample_sum(token_logps(model, batch)[0] * batch["loss_mask"], batch)
    assert (tail_sums[5:] - whole_sums[5:]).abs().max().item() > 1e-2
