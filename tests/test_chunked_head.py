"""The chunked LM head (common.kernels.chunked_head) equals the whole-logits path in fp32: the autograd function on
random tensors, and common.logprobs.token_logps through tiny Llama, Qwen2 (tied embeddings) and Mistral models,
with LoRA (on the attention, and on lm_head: the head-module path) and with shared-prefix branches: log-probs,
entropy, argmax hits and every gradient. ZeRO-3 and the ring run in tests/test_ring_attention.py's torchrun."""

import random

import pytest
import torch
import torch.nn.functional as F

from common.kernels.chunked_head import chunked_head
from common.logprobs import ModelSettings, logps_chunk_tokens, token_logps
from common.packing import collate

pytestmark = pytest.mark.quick  # the quick tier (launch/test.sh --quick)

TOL = 1e-5


def close(a, b, tol=TOL):
    diff = (a - b).abs().max().item()
    assert diff <= tol, diff
    return diff


@pytest.mark.parametrize("chunk", [7, 37, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_head_equals_whole_logits(chunk, bias):
    """37 tokens in chunks that divide them unevenly (7), exactly (37) or not at all (64)."""
    gen = torch.Generator().manual_seed(chunk)
    tokens, width, vocab = 37, 32, 300
    hidden = torch.randn(tokens, width, generator=gen, requires_grad=True)
    weight = (0.3 * torch.randn(vocab, width, generator=gen)).requires_grad_()
    b = (0.1 * torch.randn(vocab, generator=gen)).requires_grad_() if bias else None
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    targets[:5] = F.linear(hidden[:5], weight, b).argmax(-1)  # some argmax hits
    coefs = [torch.randn(tokens, generator=gen) for _ in range(3)]
    params = [hidden, weight] + ([b] if bias else [])

    out = chunked_head(hidden, weight, targets, chunk, bias=b, with_entropy=True, with_argmax=True)
    grads = torch.autograd.grad((out["logp"] * coefs[0] + out["lse"] * coefs[1] + out["entropy"] * coefs[2]).sum(),
                                params)
    logits = F.linear(hidden, weight, b).float()
    logp_all = logits.log_softmax(-1)
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    lse = logits.logsumexp(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    whole = torch.autograd.grad((logp * coefs[0] + lse * coefs[1] + entropy * coefs[2]).sum(), params,
                                retain_graph=True)

    close(out["logp"], logp)
    close(out["lse"], lse)
    close(out["entropy"], entropy)
    assert torch.equal(out["hit"], logits.argmax(-1) == targets) and out["hit"][:5].all()
    for g, w in zip(grads, whole):
        close(g, w)
    # without entropy or argmax: only what was asked, and log-prob gradients alone
    lean = chunked_head(hidden, weight, targets, chunk, bias=b)
    assert set(lean) == {"logp", "lse"}
    for g, w in zip(torch.autograd.grad(lean["logp"].sum(), params), torch.autograd.grad(logp.sum(), params)):
        close(g, w)


def tiny(kind, assets):
    from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config

    from common.kernels.varlen_attention import NAME  # registers varlen_sdpa

    torch.manual_seed(0)
    shape = dict(vocab_size=302, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=64, attn_implementation=NAME)
    if kind == "qwen2-tied":
        model = AutoModelForCausalLM.from_config(Qwen2Config(tie_word_embeddings=True, **shape))
        assert model.lm_head.weight is model.model.embed_tokens.weight
    elif kind == "mistral":
        model = AutoModelForCausalLM.from_config(MistralConfig(sliding_window=None, **shape))
    else:
        model = AutoModelForCausalLM.from_pretrained(f"{assets}/{kind.split('-lora')[0]}", attn_implementation=NAME)
    if "-lora" in kind:
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "v_proj"] + (["lm_head"] if kind.endswith("-head") else [])
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    return model


def batch_with_branches(seed=1):
    """Five prompts each with two responses, the second laid out as a branch of the first's prompt."""
    rng = random.Random(seed)
    chosen, rejected = [], []
    for k in range(5):
        prompt = [rng.randrange(5, 290) for _ in range(rng.randint(2, 20))]
        for side in (chosen, rejected):
            response = [rng.randrange(5, 290) for _ in range(rng.randint(1, 15))]
            side.append({"input_ids": prompt + response, "loss_mask": [0] * len(prompt) + [1] * len(response)})
        rejected[-1].update(prefix_of=k, prefix_len=len(prompt))
    return collate(chosen + rejected, 0, one_row=True, share_prefixes=True)


@pytest.mark.parametrize("scale", [30.0, 100.0])
def test_chunked_entropy_at_large_logits(scale):
    """At logits of scale 30-100 (peaked distributions, a real model late in training) the entropy is computed as
    -sum p log p, not lse - sum p z: that difference of two numbers near the logits' size cancels in float32 (errors
    of 1.7e-5 at scale 30, 2.4e-4 and an entropy of -9.9e-5 at scale 100). Against float64 on the same float32
    logits, both the autograd function and the head-module path stay within 2e-6 (the whole-logits path's
    1e-7 to 7e-7), no entropy below 0."""
    from common.kernels.chunked_head import module_chunked_head

    gen = torch.Generator().manual_seed(int(scale))
    tokens, width, vocab = 64, 32, 2000
    hidden = torch.randn(tokens, width, generator=gen)
    hidden = scale * hidden / hidden.norm(dim=-1, keepdim=True)
    weight = torch.randn(vocab, width, generator=gen)
    weight = weight / weight.norm(dim=-1, keepdim=True)  # logits up to `scale`
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    logits = F.linear(hidden, weight).double()  # the float32 logits every path computes, in float64
    want = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
    head = torch.nn.Linear(width, vocab, bias=False)
    head.weight.data.copy_(weight)
    for out in (chunked_head(hidden, weight, targets, tokens, with_entropy=True),
                module_chunked_head(head, hidden, targets, tokens, with_entropy=True)):
        assert out["entropy"].min().item() >= 0.0
        close(out["entropy"].double(), want, tol=2e-6)



@pytest.mark.parametrize("kind", ["llama-0.5m", "qwen2-0.5m", "qwen2-tied", "mistral", "llama-0.5m-lora",
                                  "llama-0.5m-lora-head"])
def test_token_logps_chunked_equals_whole(assets, kind):
    """token_logps with the chunked head (chunks of 16 over the 148 predictions of a
    144-token row with 5 branches) against whole logits:
    log-probs, argmax hits, entropy and every trainable parameter's gradient of a loss using all of them."""
    from common.packing import unwrap

    model = tiny(kind, assets)
    batch = batch_with_branches()
    assert batch["branch_starts"] and (batch["input_ids"].shape[1] - 1 + len(batch["branch_starts"])) % 16
    weights = torch.linspace(0.5, 1.5, batch["input_ids"].shape[1])
    results = []
    for chunk in (0, 16):
        unwrap(model).minrlhf = ModelSettings(logps_chunk_tokens=chunk)
        assert logps_chunk_tokens(model) == chunk
        model.zero_grad()
        logps, outputs, hits = token_logps(model, batch, return_argmax=True, return_entropy=True)
        mask = batch["loss_mask"]
        loss = -(logps * mask * weights).sum() / mask.sum() - 0.1 * (outputs.entropy * mask).sum() / mask.sum()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        results.append((logps.detach(), hits, outputs.entropy.detach(), grads, outputs))
    (logps, hits, entropy, grads, outputs), (c_logps, c_hits, c_entropy, c_grads, c_outputs) = results
    close(c_logps, logps)
    close(c_entropy, entropy)
    assert torch.equal(c_hits, hits)
    assert c_grads.keys() == grads.keys() and len(grads) > 2
    for n, g in grads.items():
        assert (c_grads[n] - g).abs().max().item() <= TOL, n
    assert c_outputs._outputs.logits.shape[1] == 0  # the model made no logits
    close(c_outputs.logits, outputs.logits)  # computed on read for callers that still want them


def test_where_the_chunked_head_applies(assets, tmp_path):
    """load_causal_lm sets the chunk size on the model object (not its config); LoRA on the head takes the
    head-module path; without the setting a model takes whole logits."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from common.infra.engine import ModelArgs, load_causal_lm
    from common.packing import unwrap
    from common.kernels.chunked_head import uses_head_module

    model = load_causal_lm(ModelArgs(pretrain=f"{assets}/llama-0.5m", logps_chunk_tokens=64))
    assert logps_chunk_tokens(model) == 64 and "logps_chunk_tokens" not in model.config.to_dict()
    model.save_pretrained(tmp_path)
    assert "logps_chunk_tokens" not in (tmp_path / "config.json").read_text()
    lora = load_causal_lm(ModelArgs(pretrain=f"{assets}/llama-0.5m", logps_chunk_tokens=64, lora_rank=4))
    assert logps_chunk_tokens(lora) == 64 and not uses_head_module(unwrap(lora).lm_head)
    bare = AutoModelForCausalLM.from_pretrained(f"{assets}/llama-0.5m")
    assert logps_chunk_tokens(bare) == 0
    bare.minrlhf = ModelSettings(logps_chunk_tokens=64)
    on_head = get_peft_model(bare, LoraConfig(r=4, target_modules=["lm_head", "q_proj"]))
    assert logps_chunk_tokens(on_head) == 64 and uses_head_module(unwrap(on_head).lm_head)
