"""algos/grpo.py: advantage estimators, KL estimators and the policy loss against hand-computed
values; the step's loss does not depend on how samples are split into micro-batches and ranks;
and end-to-end runs (real Ray, vLLM, DeepSpeed on CPU) that learn, resume, and reject bad input."""

import dataclasses
import math
import os
import subprocess

import pytest
import torch

from common.logprobs import token_logps
from common.packing import unpack
from common.rollout import ActorTrainArgs, make_batch
from conftest import ROOT, load_algo, max_weight_diff, read_jsonl, run_script, training_sample

grpo = load_algo("grpo")
REWARD = os.path.join(ROOT, "launch", "rewards", "exact_match.py")


# ----------------------------------------------------------------------------------------------
# Pure functions
# ----------------------------------------------------------------------------------------------
REWARDS = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0]])


@pytest.mark.quick
def test_group_baselines_by_hand():
    s3 = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    expected = {
        "group_norm": [[0.5 / s3, -0.5 / s3, -0.5 / s3, 0.5 / s3], [-0.5, -0.5, -0.5, 1.5]],  # std of [0,0,0,1] = 0.5
        "dr_grpo": [[0.5, -0.5, -0.5, 0.5], [-0.25, -0.25, -0.25, 0.75]],
        "reinforce_baseline": [[0.5, -0.5, -0.5, 0.5], [-0.25, -0.25, -0.25, 0.75]],
        "rloo": [[1 - 1 / 3, -2 / 3, -2 / 3, 1 - 1 / 3], [-1 / 3, -1 / 3, -1 / 3, 1.0]],
        "reinforce": REWARDS.tolist(),
    }
    for estimator, want in expected.items():
        got = grpo.group_baseline(REWARDS, estimator)
        assert torch.allclose(got, torch.tensor(want), atol=1e-6), estimator


@pytest.mark.quick
def test_token_advantages_kl_in_reward_return_to_go_and_whitening():
    kls = [torch.tensor([0.1, 0.2, 0.3])] + [torch.zeros(2)] * 7
    # dr_grpo, gamma ignored: token rewards [-0.1, -0.2, -0.3 + 0.5] -> returns [-0.1, 0.0, 0.2]
    adv = grpo.compute_advantages(REWARDS, kls, "dr_grpo", gamma=0.5)
    assert torch.allclose(adv[0], torch.tensor([-0.1, 0.0, 0.2]), atol=1e-6)
    assert torch.allclose(adv[1], torch.tensor([-0.5, -0.5]))
    # reinforce, gamma 0.5: token rewards [-0.1, -0.2, 0.7]: G2 = 0.7, G1 = -0.2 + 0.35, G0 = -0.1 + 0.075
    raw = [torch.tensor([-0.025, 0.15, 0.7])] + [torch.tensor([r, r]) * torch.tensor([0.5, 1.0])
                                               for r in REWARDS.flatten()[1:].tolist()]
    flat = torch.cat(raw)
    adv = grpo.compute_advantages(REWARDS, kls, "reinforce", gamma=0.5)
    assert torch.allclose(torch.cat(adv), (flat - flat.mean()) / flat.std(), atol=1e-5)
    assert abs(torch.cat(adv).mean().item()) < 1e-6 and abs(torch.cat(adv).std().item() - 1) < 1e-5


@pytest.mark.quick
@pytest.mark.parametrize("n", [8, 16])
def test_groups_of_equal_rewards_carry_no_signal(n):
    """float32 round-off of equal rewards is not divided up to full-size advantages: eight rewards of 0.1 gave
    -0.83 each with std + 1e-9 as the divisor. Every reward k / 10 (k = -10..10), and sums of reward sources that
    equal up to round-off, give 0 in every group estimator; a real spread still gives unit-scale values."""
    rewards = torch.tensor([[k / 10] * n for k in range(-10, 11)])
    summed = torch.tensor([[0.1] * n]) + torch.tensor([[0.2] * (n // 2) + [0.0] * (n // 2)]) \
        + torch.tensor([[0.0] * (n // 2) + [0.2] * (n // 2)])  # 0.1 + 0.2 + 0 vs 0.1 + 0 + 0.2: one ulp apart
    for estimator in ("group_norm", "dr_grpo", "rloo", "reinforce_baseline"):
        assert grpo.group_baseline(rewards, estimator).abs().max().item() == 0.0, estimator
        assert grpo.group_baseline(summed, estimator).abs().max().item() <= 1e-7, estimator
    spread = grpo.group_baseline(torch.tensor([[0.1] * (n - 1) + [0.2]]), "group_norm")
    assert spread.abs().max().item() > 1.0


@pytest.mark.quick
def test_whitening_does_not_amplify_a_rollout_without_signal():
    """reinforce_baseline over groups that are each all 0.1 or all 1.1 (no signal anywhere) gives 0, not +-0.79;
    whitening a real spread still gives mean 0, std 1."""
    rewards = torch.tensor([[0.1] * 4, [1.1] * 4])
    adv = grpo.compute_advantages(rewards, [torch.zeros(3)] * 8, "reinforce_baseline")
    assert torch.cat(adv).abs().max().item() <= 1e-6
    adv = torch.cat(grpo.compute_advantages(torch.tensor([[0.0, 1.0, 0.1, 0.1]]), [torch.zeros(2)] * 4,
                                            "reinforce_baseline"))
    assert abs(adv.mean().item()) < 1e-6 and abs(adv.std().item() - 1) < 1e-5
    assert grpo.whiten(torch.full((5,), 3e-7)).abs().max().item() == 0.0
    tiny = grpo.whiten(torch.tensor([1e-7, -1e-7, 2e-7, 0.0]))
    assert tiny.abs().max().item() <= 2e-3  # the variance floor 1e-8: scaled by at most 1e4


@pytest.mark.quick
def test_masked_samples_set_no_baseline_and_no_whitening():
    """Three right answers and one rejected episode (reward 0 by construction): the kept three get 0, as a group
    of three equal rewards does, not +0.5; the rejected one gets 0. Whitening ignores masked samples too."""
    rewards, valid = torch.tensor([[1.0, 1.0, 1.0, 0.0]]), torch.tensor([[True, True, True, False]])
    for estimator in ("group_norm", "dr_grpo", "rloo", "reinforce_baseline"):
        assert grpo.group_baseline(rewards, estimator, valid).abs().max().item() == 0.0, estimator
    rewards, valid = torch.tensor([[1.0, 0.0, 1.0, 7.0]]), torch.tensor([[True, True, True, False]])
    want = grpo.group_baseline(rewards[:, :3], "group_norm")
    got = grpo.group_baseline(rewards, "group_norm", valid)
    assert torch.allclose(got[:, :3], want) and got[0, 3] == 0
    kls = [torch.zeros(2)] * 4
    for estimator in ("reinforce", "reinforce_baseline"):
        alone = grpo.compute_advantages(rewards[:, :3], kls[:3], estimator)
        with_masked = grpo.compute_advantages(rewards, kls, estimator, valid=valid)
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(alone, with_masked[:3])), estimator
        assert with_masked[3].abs().max().item() == 0.0
    samples = [training_sample([], [5, 6], old_logps=[0.0] * 2, masked=m, rejected=m)
               for m in (False, False, False, True)]
    adv = grpo.sample_advantages(samples, torch.tensor([[1.0, 1.0, 1.0, 0.0]]), grpo.Args())
    assert torch.cat(adv).abs().max().item() == 0.0


@pytest.mark.quick
def test_dynamic_filtering_judges_a_group_by_the_samples_in_its_baseline():
    from common.rollout import carries_loss, no_signal
    from common.infra.vllm_engine import Sample

    assert no_signal(torch.tensor([1.0, 1.0, 1.0, 0.0]), torch.tensor([True, True, True, False]))
    assert not no_signal(torch.tensor([1.0, 1.0, 0.0, 0.0]), torch.tensor([True, True, True, False]))
    assert no_signal(torch.tensor([0.3, 0.1]) + torch.tensor([0.0, 0.2]), torch.tensor([True, True]))  # round-off
    assert no_signal(torch.tensor([1.0, 0.0]), torch.tensor([True, False]))  # one live sample: nothing to compare
    finished, cut = Sample([0], [1], "", [0.0], "stop"), Sample([0], [1], "", [0.0], "length")
    assert carries_loss(finished, True) and carries_loss(cut, False) and not carries_loss(cut, True)


@pytest.mark.quick
def test_dynamic_filtering_judges_the_rewards_the_advantages_read():
    """The filter reads each reward less the overlong penalty, clipped by --reward_clip_range, as the advantages
    do: four raw 1s with penalties 0, 0.5, 1, 1 carry signal and stay; reward-model scores that all clip to the
    bound carry none and go. Its verdict is whether the group baseline gives any sample a non-zero advantage."""
    from common.infra.vllm_engine import Sample
    from common.rollout import advantage_rewards, carries_signal

    args = grpo.Args(generate_max_len=10, overlong_buffer_len=4, overlong_penalty_factor=1.0,
                     reward_clip_range=(-10.0, 10.0))

    def group(*lengths, finish="stop"):
        return [Sample([0], [1] * k, "", [0.0] * k, finish) for k in lengths]

    lengths = group(6, 8, 10, 10)  # 0, 2 and 4 tokens into the buffer of 4
    shaped = advantage_rewards(lengths, torch.tensor([1.0, 1.0, 1.0, 1.0]), args)
    assert shaped.tolist() == [1.0, 0.5, 0.0, 0.0] and carries_signal(lengths, torch.ones(4), args)
    clipped = advantage_rewards(group(3, 3, 3), torch.tensor([12.0, 15.0, 30.0]), args)
    assert clipped.tolist() == [10.0, 10.0, 10.0] and not carries_signal(group(3, 3, 3), torch.tensor([12.0, 15, 30]),
                                                                         args)
    for g, raw in ((lengths, torch.ones(4)), (group(3, 3, 3), torch.tensor([12.0, 15, 30])),
                   (group(3, 3), torch.tensor([9.0, 11.0])), (group(3, 10), torch.tensor([1.0, 2.0]))):
        advantages = grpo.group_baseline(advantage_rewards(g, raw, args).view(1, -1), "group_norm")
        assert carries_signal(g, raw, args) == bool(advantages.abs().max() > 0), raw


@pytest.mark.quick
def test_truncated_responses_keep_their_rewards_in_the_group():
    """DAPO's overlong filtering under --mask_truncated_responses: a truncated response carries no loss, but its
    reward stays in the group's statistics. One finished right answer and seven truncated wrong ones: the right one
    gets (1 - 1/8) / std = +2.47 (not 0) and the group is kept; only rejected episodes leave the statistics."""
    from common.infra.vllm_engine import Sample

    args = grpo.Args(mask_truncated_responses=True, generate_max_len=4)
    group = [Sample([0], [1, 2], "", [0.0] * 2, "stop")] + [Sample([0], [1] * 4, "", [0.0] * 4, "length")] * 7
    rewards = torch.tensor([1.0] + [0.0] * 7)
    samples = [training_sample([], s.output_ids, old_logps=[0.0] * len(s.output_ids),
                               masked=s.finish_reason == "length") for s in group]
    adv = grpo.sample_advantages(samples, rewards.view(1, -1), args)
    want = (1 - 1 / 8) / torch.tensor([1.0] + [0.0] * 7).std().item()
    assert abs(adv[0][-1].item() - want) < 1e-5 and abs(want - 2.4749) < 1e-4
    assert all(a.abs().max().item() == 0.0 for a in adv[1:])  # no loss on the truncated ones
    from common.rollout import carries_signal

    assert carries_signal(group, rewards, args)
    assert not carries_signal(group[1:], rewards[1:], args)  # seven truncated equal rewards: nothing to learn


@pytest.mark.quick
def test_zero_advantage_samples_leave_the_micro_batches():
    """Samples whose advantages are all 0 (or masked) are left out and the rest spread over as many micro-batches
    as before, each keeping at least one sample; nothing is skipped when a KL loss or entropy bonus reads them."""
    def sample(a, masked=False):
        return training_sample([0], [1, 2], advantages=[a, a], masked=masked)

    samples = [sample(0.0), sample(1.0), sample(0.0), sample(0.0), sample(-1.0), sample(0.5, True), sample(0.0),
               sample(2.0)]
    chunks, skipped = grpo.micro_batches(samples, 2, grpo.Args())
    assert [len(c) for c in chunks] == [1, 1, 1, 1] and skipped == 4
    assert [c[0].advantages[0].item() for c in chunks] == [0.0, 1.0, -1.0, 2.0]  # the first idle one fills in, in order
    assert grpo.micro_batches(samples, 2, grpo.Args(skip_zero_advantage=False)) == ([samples[i : i + 2]
                                                                                    for i in range(0, 8, 2)], 0)
    assert grpo.micro_batches(samples, 4, grpo.Args(entropy_loss_coef=0.01))[1] == 0
    assert grpo.micro_batches(samples, 4, grpo.Args(use_kl_loss=True, init_kl_coef=0.1, kl_estimator="k3"))[1] == 0


@pytest.mark.quick
def test_kl_estimators_by_hand():
    logps, ref = torch.tensor([-1.0]), torch.tensor([-1.5])  # log ratio 0.5
    assert grpo.approx_kl(logps, ref, "k1").item() == pytest.approx(0.5)
    assert grpo.approx_kl(logps, ref, "k2").item() == pytest.approx(0.125)
    assert grpo.approx_kl(logps, ref, "k3").item() == pytest.approx(math.exp(-0.5) - 1 + 0.5)
    assert grpo.approx_kl(torch.tensor([0.0]), torch.tensor([-30.0]), "k1").item() == 10.0  # clamped


@pytest.mark.quick
def test_policy_loss_clip_clip_higher_dual_clip_by_hand():
    old = torch.zeros(4)
    logps = torch.log(torch.tensor([1.5, 0.5, 1.25, 5.0]))
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0])
    loss, clipped = grpo.policy_loss(logps, old, adv, 0.2, 0.2)
    assert torch.allclose(loss, torch.tensor([-1.2, -0.5, -1.2, 5.0]), atol=1e-6)
    assert clipped.tolist() == [1.0, 0.0, 1.0, 0.0]
    loss, clipped = grpo.policy_loss(logps, old, adv, 0.2, 0.28)  # clip-higher: 1.25 is inside [0.8, 1.28]
    assert torch.allclose(loss, torch.tensor([-1.28, -0.5, -1.25, 5.0]), atol=1e-6)
    loss, _ = grpo.policy_loss(logps, old, adv, 0.2, 0.2, dual_clip=3.0)  # -A x ratio = 5 capped at -c x A = 3
    assert torch.allclose(loss, torch.tensor([-1.2, -0.5, -1.2, 3.0]), atol=1e-6)


@pytest.mark.quick
def test_gspo_and_cispo_losses_by_hand():
    """GSPO: one ratio per sample, s = exp(mean of its token log-ratios), clipped; each token carries -min(sA, clip(s)A)
    and a sample's token mean has the gradient of that sequence term. CISPO: -sg(clip(r)) A logp, so a clipped token
    keeps the gradient -clip(r) A."""
    logps = torch.tensor([-1.0, -2.0, -0.5, -1.0, -1.5, -0.7], requires_grad=True)
    old = torch.tensor([-1.1, -2.3, 0.0, -1.05, -1.45, -0.79])
    sample_index = torch.tensor([0, 0, 1, 2, 2, 2])
    adv = torch.tensor([1.0, 1.0, -1.0, 2.0, 2.0, 2.0])
    mask = torch.ones(6)
    loss, clipped = grpo.gspo_loss(logps, old, adv, mask, sample_index, 3, 0.2, 0.2)
    s = [math.exp(0.2), math.exp(-0.5), math.exp(0.03)]  # the samples' mean log-ratios: (0.1 + 0.3) / 2, -0.5, 0.03
    # sample 0: s 1.2214 clipped to 1.2 (A > 0); sample 1: s 0.6065, clip 0.8, A < 0 -> 0.8; sample 2 unclipped
    want = [-1.2, -1.2, 0.8, -2 * s[2], -2 * s[2], -2 * s[2]]
    assert max(abs(a - b) for a, b in zip(loss.tolist(), want)) <= 1e-6, loss
    assert clipped.tolist() == [1, 1, 1, 0, 0, 0]
    per_sample_mean = loss[:2].mean() + loss[2:3].mean() + loss[3:].mean()
    per_sample_mean.backward()
    # only sample 2 is unclipped: d(-2 s)/d logp_t = -2 s / 3 per token
    want_grad = [0, 0, 0] + [-2 * s[2] / 3] * 3
    assert max(abs(a - b) for a, b in zip(logps.grad.tolist(), want_grad)) <= 1e-6, logps.grad

    logps = torch.tensor([-1.0, -0.5], requires_grad=True)
    loss, clipped = grpo.cispo_loss(logps, torch.tensor([-1.5, -0.55]), torch.tensor([1.0, -2.0]), 0.2, 0.2)
    # token 0: r = e^0.5 = 1.649 -> weight 1.2: 1.2 x 1 x 1.0; token 1: r = e^0.05 = 1.051, unclipped
    assert max(abs(a - b) for a, b in zip(loss.tolist(), [1.2 * 1.0, -math.exp(0.05) * 2.0 * 0.5])) <= 1e-6, loss
    assert clipped.tolist() == [1, 0]
    loss.sum().backward()
    assert max(abs(a - b) for a, b in zip(logps.grad.tolist(), [-1.2, 2.0 * math.exp(0.05)])) <= 1e-6, logps.grad


@pytest.mark.quick
def test_rollout_correction_modes_by_hand():
    """Weights of the trainer/vLLM ratio: truncated to the bounds (TIS), tokens outside masked (IcePop), samples whose
    geometric-mean ratio leaves the bounds masked whole; none weighs 1."""
    log_ratio = torch.tensor([1.0, -1.0, 0.1, 0.5, 0.6, 0.0])
    sample_index = torch.tensor([0, 0, 0, 1, 1, -1])  # the last position is padding
    mask = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 0.0])
    w, corrected, dropped = grpo.rollout_correction(log_ratio, mask, sample_index, 2, "token_truncate", (0.0, 2.0))
    assert torch.allclose(w[:5], torch.tensor([2.0, math.exp(-1), math.exp(0.1), math.exp(0.5), math.exp(0.6)]))
    assert corrected.tolist() == [1, 0, 0, 0, 0, 0] and dropped.sum() == 0
    w, corrected, _ = grpo.rollout_correction(log_ratio, mask, sample_index, 2, "token_mask", (0.5, 2.0))
    assert w.tolist()[:5] == [0, 0, 1, 1, 1] and corrected.tolist() == [1, 1, 0, 0, 0, 0]
    # geometric means: sample 0 exp(0.1 / 3) = 1.034 kept; sample 1 exp(0.55) = 1.733 dropped by [0, 1.5]
    w, corrected, dropped = grpo.rollout_correction(log_ratio, mask, sample_index, 2, "sequence_mask", (0.0, 1.5))
    assert w.tolist()[:5] == [1, 1, 1, 0, 0] and dropped.tolist() == [0, 0, 0, 1, 1, 0]
    w, corrected, dropped = grpo.rollout_correction(log_ratio, mask, sample_index, 2, "none", (0.0, 3.0))
    assert w.tolist() == [1] * 6 and corrected.sum() == 0 and dropped.sum() == 0
    args = grpo.Args()
    assert args.rollout_correction == "sequence_mask" and grpo.correction_bounds(args) == (0.0, 3.0)
    assert grpo.correction_bounds(dataclasses.replace(args, rollout_correction="token_mask")) == (0.5, 2.0)


@pytest.mark.quick
def test_mismatch_metrics_and_the_broken_sync_stop(assets):
    """The step's gap from numbers micro_batch_loss already has: vLLM's log-probs 0.1 below the trainer's on every
    token give mismatch KL e^0.1 - 1 - 0.1 (k3 of KL(vLLM || trainer)) and |difference| 0.1; past --max_mismatch_kl
    the driver stops naming the step and the flag; an off-policy step logs none."""
    from transformers import AutoModelForCausalLM

    from common.rollout import mismatch_metrics

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(f"{assets}/llama-0.5m", dtype=torch.float32)
    samples = [training_sample([3, 20 + i, 21], [30 + (i * k) % 50 for k in range(2 + i)],
                               advantages=torch.randn(2 + i)) for i in range(3)]
    with torch.no_grad():
        batch = make_batch(samples, 0, 64, False, ["advantages"])
        logps, _ = token_logps(model, batch)
    for s, t in zip(samples, unpack(logps, batch)):
        s.old_logps = t[len(s.prompt_ids):]
        s.vllm_logps = t[len(s.prompt_ids):] - 0.1
    args = grpo.Args(rollout_correction="none")
    with torch.no_grad():
        _, metrics = grpo.micro_batch_loss(model, make_batch(samples, 0, 64, False,
                                                             ["advantages", "vllm_logps", "old_logps"]), args)
    tokens = sum(len(s.response_ids) for s in samples)
    assert abs(metrics["mismatch_kl"] / tokens - (math.exp(0.1) - 1.1)) <= 1e-6, metrics
    assert abs(metrics["logp_abs_diff_mean"] / tokens - 0.1) <= 1e-5 and abs(metrics["logp_abs_diff_max"] - 0.1) <= 1e-5
    assert metrics["corrected_token_share"] == 0 and metrics["corrected_sequences"] == 0
    healthy = {"mismatch_kl": 1e-4, "logp_abs_diff_mean": 0.01, "logp_abs_diff_max": 0.1,
               "corrected_token_share": 0.0, "corrected_sequences": 0.25}
    assert mismatch_metrics(dict(healthy), False, 3, 0.1) == {
        "rollout/mismatch_kl": 1e-4, "rollout/logp_abs_diff_mean": 0.01, "rollout/logp_abs_diff_max": 0.1,
        "rollout/corrected_token_share": 0.0, "rollout/corrected_sequence_share": 0.25}
    assert mismatch_metrics(dict(healthy), True, 3, 0.1) == {}
    with pytest.raises(ValueError, match=r"step 3: vLLM sampled from other weights than the trainer's \(a broken "
                                         r"weight sync or model load\): mismatch KL 0.5 > --max_mismatch_kl 0.1"):
        mismatch_metrics({**healthy, "mismatch_kl": 0.5}, False, 3, 0.1)


@pytest.mark.quick
def test_step_normalisers():
    assert grpo.step_normaliser("token", 37, 8, 64, 16) == 37
    assert grpo.step_normaliser("sequence", 37, 8, 64, 16) == 8
    assert grpo.step_normaliser("constant", 37, 8, 64, 16) == 64 * 16  # Dr. GRPO: independent of lengths


@pytest.mark.parametrize("estimator,loss_agg", [("group_norm", "token"), ("group_norm", "sequence"),
                                                ("dr_grpo", "token")])
@pytest.mark.quick
def test_step_loss_is_invariant_to_micro_batches_and_ranks(assets, estimator, loss_agg):
    """One optimizer step of 8 samples: all in one micro-batch = 4 micro-batches (2 ranks x 2) summed,
    with the step normaliser over all of them (what train() all-reduces)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(f"{assets}/llama-0.5m", dtype=torch.float32)
    args = dataclasses.replace(grpo.Args(), advantage_estimator=estimator, loss_agg=loss_agg, use_kl_loss=True,
                               init_kl_coef=0.1, kl_estimator="k3", entropy_loss_coef=0.01, generate_max_len=16)
    samples = []
    for i in range(8):
        n = 2 + (5 * i) % 9  # responses of 2..10 tokens
        samples.append(training_sample([3, 20 + i, 21], [30 + (i * k) % 50 for k in range(n)],
                                       advantages=torch.randn(n), old_logps=-torch.rand(n) * 3,
                                       ref_logps=-torch.rand(n) * 3, masked=i == 5))
    values = ["advantages", "old_logps", "vllm_logps", "ref_logps"]
    tokens = sum(len(s.response_ids) for s in samples if not s.masked)
    normaliser = grpo.step_normaliser(grpo.loss_mode(args), tokens, 7, 8, args.generate_max_len)

    def grads(splits):
        model.zero_grad()
        total = 0.0
        for part in splits:
            loss, _ = grpo.micro_batch_loss(model, make_batch(part, 0, 64, False, values), args)
            loss = loss / normaliser
            loss.backward()
            total += loss.item()
        return total, torch.cat([p.grad.flatten() for p in model.parameters()])

    whole_loss, whole = grads([samples])
    split_loss, split = grads([samples[0:2], samples[4:6], samples[2:4], samples[6:8]])  # rank 0: 0-3, rank 1: 4-7
    assert abs(whole_loss - split_loss) <= 1e-5
    assert (whole - split).abs().max().item() <= 1e-5 * max(1.0, whole.abs().max().item())
    assert whole.abs().max().item() > 1e-4  # the step has a real gradient


@pytest.mark.quick
def test_skipped_old_logprob_pass_equals_the_plain_path(assets):
    """single_update: one optimizer step per rollout and no KL in the reward. Then the loss computed
    with the current log-probs standing in for the old ones (no separate forward) equals the loss with
    old log-probs from that forward (same weights): loss, gradients and the vLLM check (1e-6)."""
    from transformers import AutoModelForCausalLM

    base = grpo.Args(rollout_batch_size=4, n_samples_per_prompt=4, train=ActorTrainArgs(train_batch_size=16))
    assert grpo.single_update(base)
    assert not grpo.single_update(dataclasses.replace(base, train=ActorTrainArgs(train_batch_size=8)))
    two_epochs = ActorTrainArgs(train_batch_size=16, max_epochs=2)
    assert not grpo.single_update(dataclasses.replace(base, train=two_epochs))
    assert not grpo.single_update(dataclasses.replace(base, init_kl_coef=0.1))  # the KL in the reward needs them
    assert grpo.single_update(dataclasses.replace(base, init_kl_coef=0.1, use_kl_loss=True))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(f"{assets}/llama-0.5m", dtype=torch.float32)
    args = dataclasses.replace(base, rollout_correction="token_truncate", rollout_correction_bounds=(0.0, 2.0),
                               entropy_loss_coef=0.01, generate_max_len=16)
    samples = [training_sample([3, 20 + i, 21], [30 + (i * k) % 50 for k in range(2 + i)],
                               advantages=torch.randn(2 + i), vllm_logps=-torch.rand(2 + i) * 3) for i in range(6)]
    with torch.no_grad():
        batch = make_batch(samples, 0, 64, False, ["advantages", "vllm_logps"])
        logps, _ = token_logps(model, batch)
    for s, t in zip(samples, unpack(logps, batch)):
        s.old_logps = t[len(s.prompt_ids):]
    results = []
    two_steps = dataclasses.replace(args, train=ActorTrainArgs(train_batch_size=8))  # the loss reads old_logps
    for run_args in (two_steps, args):
        model.zero_grad()
        batch = make_batch(samples, 0, 64, False, grpo.batch_values(run_args))
        loss, metrics = grpo.micro_batch_loss(model, batch, run_args)
        loss = loss / 30.0  # a step normaliser
        loss.backward()
        results.append((loss.item(), torch.cat([p.grad.flatten() for p in model.parameters()]), metrics))
    (plain_loss, plain_grad, plain_metrics), (skip_loss, skip_grad, skip_metrics) = results
    assert abs(plain_loss - skip_loss) <= 1e-6 and plain_grad.abs().max().item() > 1e-4
    assert (plain_grad - skip_grad).abs().max().item() <= 1e-6 * plain_grad.abs().max().item()
    for key in plain_metrics:
        assert abs(plain_metrics[key] - skip_metrics[key]) <= 1e-6, key
    assert plain_metrics["logp_abs_diff_max"] > 0.1  # made-up vLLM log-probs: the check sees the gap


@pytest.mark.quick
def test_shared_prompt_batch_equals_whole_samples(assets):
    """The CPU kernel's layout: a group's samples after its first are branches of its prompt (each prompt once
    in the row). Loss (with KL and entropy terms), every metric and the gradients equal those of whole samples
    (1e-5, fp32), and the log-probs the trainer hands back per response token are the same."""
    from transformers import AutoModelForCausalLM

    from common.kernels.varlen_attention import NAME

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(f"{assets}/llama-0.5m", dtype=torch.float32, attn_implementation=NAME)
    args = dataclasses.replace(grpo.Args(), use_kl_loss=True, init_kl_coef=0.1, kl_estimator="k3",
                               entropy_loss_coef=0.01, generate_max_len=16)
    samples = []
    for g in range(3):  # 3 prompts x 4 samples, one of them with an empty response (it stays a sample of its own)
        prompt = [3] + [20 + (g * k) % 200 for k in range(4 + 3 * g)]
        for i in range(4):
            n = 0 if (g, i) == (1, 2) else 1 + (3 * i + g) % 7
            samples.append(training_sample(prompt, [30 + (i * k + g) % 50 for k in range(n)],
                                           advantages=torch.randn(n), old_logps=-torch.rand(n) * 3,
                                           ref_logps=-torch.rand(n) * 3, vllm_logps=-torch.rand(n)))
    values = ["advantages", "old_logps", "vllm_logps", "ref_logps"]
    results = []
    for share in (False, True):
        model.zero_grad()
        batch = make_batch(samples, 0, 256, True, values, share_prompt=share)
        loss, metrics = grpo.micro_batch_loss(model, batch, args)
        loss = loss / 30.0  # a step normaliser
        loss.backward()
        with torch.no_grad():
            logps, _ = token_logps(model, batch)
        per_response = [t[p:] for p, t in zip(batch["response_offsets"], unpack(logps, batch))]
        results.append((batch["input_ids"].numel(), loss.item(), metrics, per_response,
                        torch.cat([p.grad.flatten() for p in model.parameters()])))
    (whole_tokens, whole_loss, whole_metrics, whole_logps, whole_grad), (tokens, loss, metrics, logps, grad) = results
    branches = [s for i, s in enumerate(samples) if i % 4 and s.response_ids]  # not a group's first, not empty
    assert len(branches) == 8 and tokens == whole_tokens - sum(len(s.prompt_ids) for s in branches)
    assert abs(loss - whole_loss) <= 1e-5 and whole_grad.abs().max().item() > 1e-4
    assert (grad - whole_grad).abs().max().item() <= 1e-5 * whole_grad.abs().max().item()
    for key in whole_metrics:  # sums over tokens: relative
        assert abs(metrics[key] - whole_metrics[key]) <= 1e-5 * max(1.0, abs(whole_metrics[key])), key
    for a, b in zip(logps, whole_logps):
        assert a.shape == b.shape and ((a - b).abs() <= 1e-5).all()


# ----------------------------------------------------------------------------------------------
# End to end: python algos/grpo.py (Ray driver) with one or two trainer ranks and one vLLM engine
# ----------------------------------------------------------------------------------------------
def grpo_args(assets, model, tmp, *extra, reward=REWARD):
    """One trainer rank (a launch's cost is mostly its processes' start-up); the runs about ranks and the
    learning run pass --actor_num_gpus_per_node 2."""
    return ["--pretrain", model, "--prompt_data", f"{assets}/data/reverse/rl_train.jsonl",
            "--eval_dataset", f"{assets}/data/reverse/rl_test.jsonl", "--input_key", "prompt", "--label_key", "answer",
            "--apply_chat_template", "--remote_rm_url", reward, "--n_samples_per_prompt", 8,
            "--micro_train_batch_size", 16, "--micro_rollout_batch_size", 16, "--actor_num_gpus_per_node", 1,
            "--vllm_num_engines", 1, "--prompt_max_len", 48, "--generate_max_len", 16, "--max_model_len", 128,
            "--eval_temperature", 0, "--eval_n_samples_per_prompt", 1,
            "--save_path", tmp / "out", "--metrics_file", tmp / "metrics.jsonl", *extra]


def check_vllm_matches_trainer(metrics, tolerance=1e-4):
    """After every sync vLLM's log-probs of the sampled tokens equal the trainer's (checked in the run)."""
    diffs = [m["rollout/logp_abs_diff_max"] for m in metrics if "rollout/logp_abs_diff_max" in m]
    assert diffs and max(diffs) <= tolerance, diffs


RESUME_AT = 28


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """launch/demo.sh end to end (set-up, SFT of the tiny Llama on 2 ranks, then 30 GRPO steps of 64 prompts x 8
    samples, two optimizer steps per epoch over 2 epochs), its GRPO run also checkpointing at step 28 (the demo's
    extra arguments go to grpo.py); (tmp, the demo's output, the GRPO command it ran, {step: metrics},
    [eval pass@1])."""
    tmp = tmp_path_factory.mktemp("demo")
    proc = subprocess.run(["bash", os.path.join(ROOT, "launch", "demo.sh"), "--save_steps", str(RESUME_AT),
                           "--ckpt_path", str(tmp / "ckpt")], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    (command,) = [line.split()[2:] for line in proc.stdout.splitlines() if line.startswith("$ algos/grpo.py ")]
    metrics = read_jsonl(os.path.join(ROOT, "outputs", "demo_grpo_metrics.jsonl"))
    return (tmp, proc.stdout, command, {m["step"]: m for m in metrics if "train/reward" in m},
            [m["eval/pass@1"] for m in metrics if "eval/pass@1" in m])


def test_demo_learns(demo_run):
    """The demo's three reports (greedy exact match on 200 held-out prompts): 0 before training, past 0.5 after SFT,
    0.10 higher after GRPO (measured 0.000, 0.660, 0.795); GRPO's own held-out evaluation rises by 0.10 too
    (measured 0.66 -> 0.795), and vLLM's log-probs equal the trainer's after every sync."""
    _, out, _, steps, evals = demo_run
    reports = [float(line.split("exact match ")[1].split()[0]) for line in out.splitlines() if "exact match" in line]
    assert len(reports) == 3 and reports[0] == 0.0 and reports[1] >= 0.5, out[-3000:]
    assert reports[2] - reports[1] >= 0.10, reports
    assert evals[-1] - evals[0] >= 0.10, evals
    check_vllm_matches_trainer(list(steps.values()))
    assert len(steps) == 30 and all(m[f"time/{p}"] > 0 for m in steps.values()
                                    for p in ("generate", "reward", "logprobs", "train", "sync"))
    assert os.path.exists(os.path.join(ROOT, "outputs", "demo_grpo", "config.json"))
    assert os.path.exists(os.path.join(ROOT, "outputs", "demo_grpo", "best", "config.json"))


def test_resume_continues_the_same_run_from_a_copied_script(demo_run):
    """The demo's GRPO run resumed at step 28 (as if it had died after saving it) reproduces steps 29-30. The
    resumed run is grpo.py copied out of the checkout and started from a third folder (README: Forking a script),
    so its Ray workers import common/ from PYTHONPATH."""
    from test_copied_scripts import copy_and_run

    tmp, _, command, steps, _ = demo_run
    help_proc = copy_and_run(tmp, "grpo.py", ["--help"])
    assert help_proc.returncode == 0 and "--n_samples_per_prompt" in help_proc.stdout, help_proc.stderr[-3000:]
    (tmp / "ckpt" / "latest").write_text(f"global_step{RESUME_AT}")
    args = [os.path.join(ROOT, a) if os.path.exists(os.path.join(ROOT, a)) else a for a in command]
    for flag, value in (("--save_path", tmp / "resumed" / "out"), ("--metrics_file", tmp / "resumed" / "m.jsonl")):
        args[args.index(flag) + 1] = str(value)
    args[args.index("--eval_dataset"): args.index("--eval_dataset") + 2] = []
    proc = copy_and_run(tmp, "grpo.py", [*args, "--load_checkpoint"], timeout=900)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert "resumed from" in proc.stdout and f"at step {RESUME_AT}" in proc.stdout
    resumed = {m["step"]: m for m in read_jsonl(tmp / "resumed" / "m.jsonl") if "train/reward" in m}
    assert sorted(resumed) == [29, 30]
    for step in (29, 30):  # same prompts, same samples (seeded per prompt), same weights and optimizer state
        assert resumed[step]["train/reward"] == steps[step]["train/reward"]
        assert abs(resumed[step]["train/policy_loss"] - steps[step]["train/policy_loss"]) <= 1e-5
    check_vllm_matches_trainer(list(resumed.values()))  # the engine got the resumed weights before step 29
    assert max_weight_diff(os.path.join(ROOT, "outputs", "demo_grpo"), tmp / "resumed" / "out") <= 1e-5


ESTIMATOR_RUNS = {
    # each estimator once, each run also covering a placement / model / KL / reward-source variant; CISPO and GSPO
    # (--policy_loss) meet the bar the PPO-clip runs meet, on the same budget
    "dr_grpo_colocated_two_engines": ["--advantage_estimator", "dr_grpo", "--colocate_all_models", "--vllm_num_engines",
                                      2, "--vllm_enable_sleep", "--actor_num_gpus_per_node", 2],
    "rloo_lora_cispo": ["--advantage_estimator", "rloo", "--lora_rank", 8, "--actor_learning_rate", 1e-3,
                        "--policy_loss", "cispo"],
    "reinforce_kl_in_reward_http_reward_bf16": ["--advantage_estimator", "reinforce", "--init_kl_coef", 0.01,
                                                "--param_dtype", "bf16"],
    "reinforce_baseline_kl_loss_zero3_gspo": ["--advantage_estimator", "reinforce_baseline", "--init_kl_coef", 0.01,
                                              "--use_kl_loss", "--kl_estimator", "k3", "--zero_stage", 3,
                                              "--policy_loss", "gspo", "--actor_num_gpus_per_node", 2],
}


@pytest.mark.parametrize("name", list(ESTIMATOR_RUNS))
def test_estimators_raise_reward(assets, rl_start_model, tmp_path, name):
    extra, reward, server = list(ESTIMATOR_RUNS[name]), REWARD, None
    if "http_reward" in name:  # the reward served over loopback with a token, as a remote verifier would be
        from common.infra.remote_reward import make_reward_fn
        from launch.reward_server import serve_rewards

        server = serve_rewards(make_reward_fn(REWARD), token="secret-token")
        reward, extra = server.url, extra + ["--remote_rm_token", "secret-token"]
    args = grpo_args(assets, rl_start_model, tmp_path, "--rollout_batch_size", 32, "--train_batch_size", 128,
                     "--max_epochs", 2, "--actor_learning_rate", 1e-4, "--max_steps", 12, "--eval_steps", 12, *extra,
                     reward=reward)
    try:
        proc = run_script("grpo.py", args, timeout=900)
    finally:
        if server is not None:
            server.shutdown()
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    # bf16: vLLM computes in bf16 too, and rounds differently from the trainer's autocast (measured 0.08-0.23)
    check_vllm_matches_trainer(metrics, 0.4 if "bf16" in name else 1e-4)
    if "bf16" in name:  # the engine follows the trainer's precision
        assert "dtype=torch.bfloat16" in proc.stdout + proc.stderr
    from transformers import AutoModelForCausalLM

    from common.infra.weight_sync import HFWeightSource

    weights = sum(math.prod(m.shape) for m in HFWeightSource(AutoModelForCausalLM.from_pretrained(rl_start_model))
                  .metadata())
    sent = {round(m["perf/sync_mb"] * 2**20) for m in metrics if m.get("perf/sync_mb")}
    assert sent == {weights * (2 if "bf16" in name else 4)}, sent  # fp32 weights go to bf16 engines as bf16
    rewards = [m["train/reward"] for m in metrics if "train/reward" in m]
    evals = [m["eval/pass@1"] for m in metrics if "eval/pass@1" in m]
    assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4, rewards  # the sampled reward rises
    assert evals[-1] > evals[0], evals  # and the held-out greedy accuracy
    if "--vllm_enable_sleep" in extra:  # vLLM has no sleep mode on CPU: the engines say so
        assert "sleep skipped" in proc.stdout + proc.stderr


def test_skipped_zero_advantage_samples_leave_the_update_unchanged(assets, rl_start_model, tmp_path):
    """Samples whose advantages are all 0 (groups of equal rewards) are left out of the forward and backward
    (--skip_zero_advantage, the default): 3 steps of dr_grpo on 2 ranks (4 micro-batches each per optimizer step)
    end at the weights of the run that computes them (1e-6, fp32). Metrics are token means in every loss mode:
    dr_grpo's train/entropy at step 1 (the start weights, the same samples) equals group_norm's, where dividing by
    Dr. GRPO's constant normaliser (train_batch_size x generate_max_len) gave a fraction of it. 16 prompts x 4
    samples are one optimizer step per rollout (single_update end to end): the old-log-prob forward is skipped and
    the vLLM check runs on the update's own forward."""
    def args(name, *extra):
        return ["--pretrain", rl_start_model, "--prompt_data", f"{assets}/data/reverse/rl_train.jsonl",
                "--input_key", "prompt", "--label_key", "answer", "--apply_chat_template", "--remote_rm_url", REWARD,
                "--n_samples_per_prompt", 4, "--rollout_batch_size", 16, "--train_batch_size", 64,
                "--micro_train_batch_size", 8, "--micro_rollout_batch_size", 16, "--actor_num_gpus_per_node", 2,
                "--vllm_num_engines", 1,
                "--prompt_max_len", 48, "--generate_max_len", 16, "--max_model_len", 128, "--max_steps", 3,
                "--actor_learning_rate", 3e-5, "--param_dtype", "fp32", "--save_path", tmp_path / name,
                "--metrics_file", tmp_path / f"{name}.jsonl", *extra]

    from conftest import run_scripts

    run_scripts([("grpo.py", args("skip", "--advantage_estimator", "dr_grpo"), {"timeout": 900}),
                 ("grpo.py", args("plain", "--advantage_estimator", "dr_grpo", "--no_skip_zero_advantage"),
                  {"timeout": 900}),
                 ("grpo.py", args("group_norm", "--max_steps", 1, "--actor_num_gpus_per_node", 1), {"timeout": 900})])
    runs = {name: [m for m in read_jsonl(tmp_path / f"{name}.jsonl") if "train/reward" in m]
            for name in ("skip", "plain", "group_norm")}
    for name in ("skip", "plain"):
        check_vllm_matches_trainer(runs[name])
    skipped = [m["train/skipped_samples"] for m in runs["skip"]]
    assert sum(skipped) > 0 and all(m["train/skipped_samples"] == 0 for m in runs["plain"]), skipped
    assert [m["train/reward"] for m in runs["skip"]] == [m["train/reward"] for m in runs["plain"]]
    diff = max_weight_diff(tmp_path / "skip", tmp_path / "plain")
    print(f"\nskipped samples per step {skipped}; weights skip vs plain max |diff| {diff:.2e}")
    assert diff <= 1e-6 and max_weight_diff(tmp_path / "plain", rl_start_model) > 2e-5  # 3 Adam steps of ~3e-5
    first = runs["skip"][0], runs["group_norm"][0]
    assert first[0]["train/reward"] == first[1]["train/reward"]
    assert abs(first[0]["train/entropy"] - first[1]["train/entropy"]) <= 1e-5, first
    assert 0 <= first[0]["train/clip_ratio"] <= 1


def test_bad_input(assets, rl_start_model, tmp_path):
    """Bad arguments and rows fail before Ray starts; a reward file that raises ends a started run naming the file
    and the exception (one trainer rank: the reward runs in the driver). The two early failures run beside the
    started one."""
    from conftest import run_scripts

    base = grpo_args(assets, rl_start_model, tmp_path, "--rollout_batch_size", 16, "--train_batch_size", 64,
                     "--max_steps", 1)
    raising = tmp_path / "raising_reward.py"
    raising.write_text("def reward_func(queries, prompts, labels):\n"
                       "    return [1.0 / (len(label) - 7) for label in labels]  # a 7-character label divides by 0\n")
    started, n_samples, label = run_scripts([
        ("grpo.py", grpo_args(assets, rl_start_model, tmp_path, "--rollout_batch_size", 16, "--train_batch_size", 64,
                              "--max_steps", 1, reward=raising),
         {"expect_ok": False, "timeout": 900}),
        ("grpo.py", base + ["--n_samples_per_prompt", 1], {"expect_ok": False}),
        ("grpo.py", base + ["--label_key", "solution"], {"expect_ok": False})])
    assert n_samples.returncode != 0 and "set --n_samples_per_prompt >= 2" in n_samples.stderr
    assert "Ray" not in n_samples.stdout + n_samples.stderr.split("error:")[0]  # refused before Ray started
    assert label.returncode != 0 and "rl_train.jsonl: row 0: missing field 'solution' (--label_key)" in label.stderr
    assert started.returncode != 0 and str(raising) in started.stderr and "ZeroDivisionError" in started.stderr
    assert "sample" in started.stderr


@pytest.mark.quick
def test_defaults_resolve_to_the_best_mode_on_one_box(assets):
    """--zero_stage unset: ZeRO-0 in a world of one rank, 2 in a larger one. --vllm_num_engines unset: on CPU one
    engine per core, at most one per prompt and as many as the memory holds beside the trainers; with
    --async_train the cores beside the trainer ranks; with --colocate_all_models one per trainer device."""
    import dataclasses
    import math

    from common.infra.cluster import ENGINE_PROCESS_BYTES, default_num_engines
    from common.infra.engine import TrainArgs, deepspeed_config, zero_stage
    from common.infra.vllm_engine import kv_cache_bytes, weight_bytes

    assert [zero_stage(TrainArgs(), n) for n in (1, 2, 8)] == [0, 2, 2] and zero_stage(TrainArgs(zero_stage=3), 1) == 3
    assert deepspeed_config(TrainArgs(train_batch_size=8, micro_train_batch_size=8), 1)["zero_optimization"] == {
        "stage": 0, "stage3_gather_16bit_weights_on_model_save": True}
    model = f"{assets}/llama-0.5m"
    required = ["--pretrain", model, "--prompt_data", "d.jsonl", "--remote_rm_url", REWARD, "--prompt_max_len", "48",
                "--generate_max_len", "16", "--rollout_batch_size", "4", "--n_samples_per_prompt", "2",
                "--train_batch_size", "8", "--micro_rollout_batch_size", "8", "--micro_train_batch_size", "8"]
    args = grpo.parse_args(required)
    assert args.cluster.vllm_num_engines == min(len(os.sched_getaffinity(0)), 4)  # a 0.5M model: memory never binds
    assert grpo.parse_args([*required, "--vllm_num_engines", "3"]).cluster.vllm_num_engines == 3
    with pytest.raises(ValueError, match="--vllm_num_engines must be >= 1, got 0"):
        grpo.parse_args([*required, "--vllm_num_engines", "0"])
    trainers = 2 * weight_bytes(model) * 4  # one rank's fp32 weights, gradients and AdamW moments

    def engines(n):  # n engines: fp32 weights, the KV cache of a share of the 4 prompts x 4 evaluation samples and
        return n * (2 * weight_bytes(model) + kv_cache_bytes(model, 64, math.ceil(4 / n) * 4) + ENGINE_PROCESS_BYTES)

    plenty = 2**40  # (its process)
    assert default_num_engines(args, 1, 4, 1, 2, plenty) == (2, None)  # one per core
    assert default_num_engines(args, 1, 4, 1, 16, plenty) == (4, None)  # one per prompt
    assert default_num_engines(args, 1, 4, 1, 8, trainers + engines(3)) == (3, None)  # as many as the memory holds
    assert default_num_engines(args, 1, 4, 1, 8, trainers + engines(3) - 1) == (2, None)
    assert default_num_engines(args, 1, 4, 1, 8, 0)[0] == 1
    overlapped = dataclasses.replace(args, async_rollout=dataclasses.replace(args.async_rollout, async_train=True))
    assert default_num_engines(overlapped, 1, 4, 1, 4, plenty) == (3, None)  # the trainer rank keeps its core
    colocated = dataclasses.replace(args, cluster=dataclasses.replace(args.cluster, colocate_all_models=True))
    assert default_num_engines(colocated, 2, 8, 2, 16, plenty) == (2, None)


def test_default_num_engines_counts_every_process_and_frozen_model(assets):
    """The CPU memory model of --vllm_num_engines unset, by hand: each engine holds its fp32 weights, its KV cache
    and its own process (a Ray actor with torch and vLLM loaded: ENGINE_PROCESS_BYTES, measured); the trainers hold
    their fp32 copies and every --reward_pretrain model one of its own; with --async_train every rank that computes
    beside the engines keeps a core (ppo.py: actor, critic and reference ranks); with --ray_address the driver's
    cores and memory say nothing of the cluster (1 engine, and a note); where even one engine does not fit, a
    warning names the sizes before anything starts."""
    from common.infra.cluster import ENGINE_PROCESS_BYTES, default_num_engines
    from common.infra.vllm_engine import kv_cache_bytes, weight_bytes

    model = f"{assets}/llama-0.5m"
    args = grpo.parse_args(["--pretrain", model, "--prompt_data", "d.jsonl", "--remote_rm_url", REWARD,
                            "--prompt_max_len", "48", "--generate_max_len", "16", "--rollout_batch_size", "4",
                            "--n_samples_per_prompt", "2", "--train_batch_size", "8", "--micro_rollout_batch_size",
                            "8", "--micro_train_batch_size", "8", "--vllm_num_engines", "1"])
    args = dataclasses.replace(args, cluster=dataclasses.replace(args.cluster, vllm_num_engines=None))
    weights, trainers = 2 * weight_bytes(model), 4 * 2 * weight_bytes(model)  # fp32: one engine's, 4 trainer copies

    def engines(n):  # n engines: fp32 weights, the KV cache of a share of 4 prompts x 4 evaluation samples, process
        return n * (weights + kv_cache_bytes(model, 64, math.ceil(4 / n) * 4) + ENGINE_PROCESS_BYTES)

    assert 0.3 * 2**30 < ENGINE_PROCESS_BYTES < 4 * 2**30
    assert default_num_engines(args, 1, 4, 1, 8, trainers + engines(3)) == (3, None)
    assert default_num_engines(args, 1, 4, 1, 8, trainers + engines(3) - 1) == (2, None)
    # without their processes 3 would fit: they must be counted
    assert default_num_engines(args, 1, 4, 1, 8, trainers + engines(3) - ENGINE_PROCESS_BYTES) == (2, None)
    rm = dataclasses.replace(args, reward_pretrain=f"{model},{model}")  # two reward models: two fp32 copies more
    assert default_num_engines(rm, 1, 4, 1, 8, trainers + 2 * weights + engines(3)) == (3, None)
    assert default_num_engines(rm, 1, 4, 1, 8, trainers + 2 * weights + engines(3) - 1) == (2, None)
    plenty = 2**40
    overlapped = dataclasses.replace(args, async_rollout=dataclasses.replace(args.async_rollout, async_train=True))
    assert default_num_engines(overlapped, 1, 4, 1, 4, plenty) == (3, None)
    assert default_num_engines(overlapped, 1, 4, 3, 6, plenty) == (3, None)  # actor, critic, reference ranks
    assert default_num_engines(overlapped, 1, 4, 3, 3, plenty) == (1, None)
    remote = dataclasses.replace(args, cluster=dataclasses.replace(args.cluster, ray_address="10.0.0.1:6379"))
    assert default_num_engines(remote, 1, 4, 1, 64, plenty) == (
        1, "--vllm_num_engines unset with --ray_address: 1 engine (this driver's cores and memory say nothing of the "
           "cluster's nodes); set --vllm_num_engines to use more")
    one = engines(1) + trainers
    count, warning = default_num_engines(args, 1, 4, 1, 8, one - 1)
    assert count == 1 and warning == (
        f"one vLLM engine needs {engines(1) / 2**30:.2f} GiB (fp32 weights, the KV cache of 16 sequences of "
        f"--max_model_len 64, its process) beside the trainers' and frozen models' {trainers / 2**30:.2f} GiB, and "
        f"this machine has {(one - 1) / 2**30:.2f} GiB available: expect swapping or the OOM killer; lower "
        "--max_model_len or --rollout_batch_size, or run on a machine with more memory")


@pytest.mark.quick
def test_dynamic_filtering_needs_a_group_baseline(assets):
    """--dynamic_filtering drops groups of equal rewards, which carry no signal only beside a group baseline: with
    one sample per prompt or the reinforce estimator (whitened over the batch) it would drop every group or good
    ones. Refused at parsing, before the model, the reward file or the prompts are read (none of them exists)."""
    missing = ["--pretrain", "no/model", "--prompt_data", "no.jsonl", "--remote_rm_url", "no_reward.py",
               "--dynamic_filtering", "--rollout_batch_size", "4", "--micro_rollout_batch_size", "4",
               "--micro_train_batch_size", "4"]
    for extra in (["--n_samples_per_prompt", "1", "--train_batch_size", "4", "--advantage_estimator", "reinforce"],
                  ["--n_samples_per_prompt", "1", "--train_batch_size", "4"],
                  ["--n_samples_per_prompt", "2", "--train_batch_size", "8", "--advantage_estimator", "reinforce"]):
        with pytest.raises(ValueError, match=r"--dynamic_filtering drops .* group baseline: not with "
                                             r"--n_samples_per_prompt 1 nor --advantage_estimator reinforce"):
            grpo.parse_args([*missing, *extra])
    args = grpo.parse_args(["--pretrain", f"{assets}/llama-0.5m", "--prompt_data", "d.jsonl", "--remote_rm_url",
                            REWARD, *missing[6:], "--n_samples_per_prompt", "2", "--train_batch_size", "8",
                            "--advantage_estimator", "reinforce_baseline", "--prompt_max_len", "48",
                            "--generate_max_len", "16"])
    assert args.dynamic_filtering and args.n_samples_per_prompt == 2


@pytest.mark.quick
def test_argument_errors_and_reference_options(assets, capsys):
    required = ["--pretrain", f"{assets}/llama-0.5m", "--prompt_data", "d.jsonl", "--remote_rm_url", REWARD,
                "--prompt_max_len", "48", "--generate_max_len", "16"]
    with pytest.raises(ValueError, match=r"--aux_loss_coef \(MoE load balancing\) is not implemented in grpo.py"):
        grpo.parse_args([*required, "--aux_loss_coef", "0.01"])
    with pytest.raises(ValueError, match="--input_template and --apply_chat_template exclude each other"):
        grpo.parse_args([*required, "--input_template", "Q: {}", "--apply_chat_template"])
    # lengths are checked against the model: the default is what the run needs, more than it supports fails
    assert grpo.parse_args(required).engine.max_model_len == 64
    assert grpo.parse_args([*required, "--generate_max_len", "1000"]).engine.max_model_len == 512  # capped
    with pytest.raises(ValueError, match=r"--max_model_len 4096 is more than .* \(max_position_embeddings 512\)"):
        grpo.parse_args([*required, "--max_model_len", "4096"])
    # the reference model is loaded as the policy is
    parsed = grpo.parse_args([*required, "--init_kl_coef", "0.01", "--attn_implementation", "eager",
                              "--lora_rank", "8"])
    ref = grpo.reference_args(parsed)
    assert (ref.pretrain, ref.attn_implementation, ref.lora_rank) == (f"{assets}/llama-0.5m", "eager", 0)
    with pytest.raises(ValueError, match=r"--load_in_4bit \(QLoRA\) with grpo.py: the vLLM engines are fed"):
        grpo.parse_args([*required, "--lora_rank", "8", "--load_in_4bit"])
    # k1 as a loss has an expected gradient of 0: refused, naming both flags; k2 / k3 are the KL losses
    with pytest.raises(ValueError, match=r"--use_kl_loss with --kl_estimator k1 regularises nothing.*k3.*k2"):
        grpo.parse_args([*required, "--init_kl_coef", "0.01", "--use_kl_loss"])
    for estimator in ("k2", "k3"):
        grpo.parse_args([*required, "--init_kl_coef", "0.01", "--use_kl_loss", "--kl_estimator", estimator])
    grpo.parse_args([*required, "--init_kl_coef", "0.01"])  # k1 in the reward is fine
    capsys.readouterr()
    grpo.parse_args([*required, "--temperature", "0.7"])
    assert "warning: --temperature 0.7: the update reads the untempered policy" in capsys.readouterr().err
    grpo.parse_args([*required, "--top_p", "0.9"])  # nucleus sampling: vLLM's log-probs are the whole policy's
    assert "warning: --top_p 0.9: the update reads the whole policy's log-probs" in capsys.readouterr().err
    grpo.parse_args(required)
    assert "warning" not in capsys.readouterr().err
    with pytest.raises(SystemExit):
        grpo.parse_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "every N rollout steps" in help_text and "optimizer steps (-1" not in help_text
