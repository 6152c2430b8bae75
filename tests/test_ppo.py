"""algos/ppo.py: GAE (several gamma / lambda, decoupled lambda, masked tokens skipped) and the clipped
value loss against hand-computed values; the critic's per-token values packed = padded = the
exported AutoModelForSequenceClassification; argument errors before Ray starts; one end-to-end run
(real Ray, vLLM, DeepSpeed on CPU: 2 actor ranks, 1 critic rank, 1 engine), shared by the tests that
it learns, warms the critic up with the actor frozen, exports both models, and resumes actor and
critic exactly; and one colocated run with a LoRA actor, a reference, a reward model and PPO-ptx."""

import os

import pytest
import torch

from common.packing import collate, unpack
from common.rollout import make_batch, token_sample
from conftest import ROOT, load_algo, max_weight_diff, read_jsonl, run_script, training_sample

ppo = load_algo("ppo")
REWARD = os.path.join(ROOT, "launch", "rewards", "exact_match.py")


# ----------------------------------------------------------------------------------------------
# Pure functions
# ----------------------------------------------------------------------------------------------
@pytest.mark.quick
def test_gae_by_hand():
    rewards, values, mask = torch.tensor([0.0, 0.0, 1.0]), torch.tensor([0.5, 0.6, 0.7]), torch.ones(3)
    # gamma = lambda = 1: A_t = R - V_t
    assert torch.allclose(ppo.gae(rewards, values, mask, 1.0, 1.0), torch.tensor([0.5, 0.4, 0.3]), atol=1e-6)
    # gamma 0.9, lambda 0.5: delta = [0.9 x 0.6 - 0.5, 0.9 x 0.7 - 0.6, 1 - 0.7] = [0.04, 0.03, 0.3];
    # A_2 = 0.3, A_1 = 0.03 + 0.45 x 0.3 = 0.165, A_0 = 0.04 + 0.45 x 0.165 = 0.11425
    assert torch.allclose(ppo.gae(rewards, values, mask, 0.9, 0.5), torch.tensor([0.11425, 0.165, 0.3]), atol=1e-6)
    # lambda 0: one-step TD errors
    assert torch.allclose(ppo.gae(rewards, values, mask, 0.9, 0.0), torch.tensor([0.04, 0.03, 0.3]), atol=1e-6)


@pytest.mark.quick
def test_gae_skips_tokens_that_are_not_the_models():
    """Masked tokens (tool output inside a response) are not steps: the advantages of the model's tokens
    are those of GAE over the model's tokens alone, whatever the values and rewards at masked tokens."""
    torch.manual_seed(0)
    mask = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    rewards, values = torch.randn(6), torch.randn(6)
    for gamma, lambd in ((1.0, 1.0), (0.9, 0.5), (0.99, 0.95)):
        adv = ppo.gae(rewards, values, mask, gamma, lambd)
        alone = ppo.gae(rewards[[0, 1, 4]], values[[0, 1, 4]], torch.ones(3), gamma, lambd)
        assert torch.allclose(adv[[0, 1, 4]], alone, atol=1e-6), (gamma, lambd)
        assert adv[[2, 3, 5]].abs().max() == 0
        other_values, other_rewards = values.clone(), rewards.clone()
        other_values[[2, 3, 5]] += torch.tensor([5.0, -3.0, 7.0])
        other_rewards[[2, 3, 5]] -= 2.0
        assert torch.equal(ppo.gae(other_rewards, other_values, mask, gamma, lambd), adv)
    # the scalar reward goes on the last model token, the KL only on model tokens
    tr = ppo.token_rewards(1.0, torch.tensor([0.1, 0.2, 0.3, 0.4]), torch.tensor([1.0, 1.0, 0.0, 0.0]))
    assert torch.allclose(tr, torch.tensor([-0.1, 0.8, 0.0, 0.0]), atol=1e-6)


@pytest.mark.quick
def test_decoupled_lambda_returns_and_whitened_advantages():
    rewards = torch.tensor([1.0, 0.0])
    kls = [torch.tensor([0.1, 0.2, 0.3]), torch.zeros(2)]
    values = [torch.tensor([0.5, 0.6, 0.7]), torch.tensor([0.2, 0.4])]
    masks = [torch.ones(3), torch.ones(2)]
    adv, ret = ppo.advantages_and_returns(rewards, kls, values, masks, 1.0, 0.5, 1.0)
    # lambda_critic 1, gamma 1: returns are the rewards-to-go of [-0.1, -0.2, 0.7] and of [0, 0]
    assert torch.allclose(ret[0], torch.tensor([0.4, 0.5, 0.7]), atol=1e-6)
    assert torch.allclose(ret[1], torch.zeros(2), atol=1e-6)
    # advantages: lambda 0.5 GAE, whitened over all five model tokens
    raw = torch.cat([ppo.gae(torch.tensor([-0.1, -0.2, 0.7]), values[0], masks[0], 1.0, 0.5),
                     ppo.gae(torch.zeros(2), values[1], masks[1], 1.0, 0.5)])
    assert torch.allclose(torch.cat(adv), (raw - raw.mean()) / raw.std(), atol=1e-6)
    # returns with lambda_critic 0.5 differ (they bootstrap from the values): R = A(0.5) + V
    _, ret_half = ppo.advantages_and_returns(rewards, kls, values, masks, 1.0, 0.5, 0.5)
    assert torch.allclose(ret_half[0], raw[:3] + values[0], atol=1e-6)
    # gamma 0.9, lambda_critic 1: discounted returns, independent of the values
    _, ret_g = ppo.advantages_and_returns(torch.tensor([1.0]), [torch.zeros(3)], [torch.tensor([9.0, -9.0, 3.0])],
                                          [torch.ones(3)], 0.9, 0.95, 1.0)
    assert torch.allclose(ret_g[0], torch.tensor([0.81, 0.9, 1.0]), atol=1e-6)


@pytest.mark.quick
def test_whitening_floors_the_variance():
    """A critic that already predicts the returns leaves raw advantages of ~1e-7: whitening must not scale them up
    to unit size (std + 1e-8 as the divisor gave 2.6); the variance is floored at 1e-8, as OpenRLHF floors it."""
    values = [torch.tensor([0.5, 0.5, 0.5]), torch.tensor([0.25, 0.25])]
    rewards = torch.tensor([0.5 + 2e-7, 0.25 - 1e-7])
    adv, _ = ppo.advantages_and_returns(rewards, [torch.zeros(3), torch.zeros(2)], values,
                                        [torch.ones(3), torch.ones(2)], 1.0, 1.0, 1.0)
    assert torch.cat(adv).abs().max().item() <= 1e-2


@pytest.mark.quick
def test_kl_loss_refuses_k1(assets):
    required = ["--pretrain", f"{assets}/llama-0.5m", "--prompt_data", "d.jsonl", "--remote_rm_url", REWARD,
                "--prompt_max_len", "48", "--generate_max_len", "16", "--rollout_batch_size", "16",
                "--train_batch_size", "16", "--micro_train_batch_size", "8", "--init_kl_coef", "0.01", "--use_kl_loss"]
    with pytest.raises(ValueError, match=r"--use_kl_loss with --kl_estimator k1 regularises nothing"):
        ppo.parse_args(required)
    assert ppo.parse_args([*required, "--kl_estimator", "k2"]).kl_estimator == "k2"


@pytest.mark.quick
def test_value_loss_clipped_by_hand():
    values, old, returns = torch.tensor([1.0, 0.0, 1.0]), torch.zeros(3), torch.tensor([2.0, 1.0, 0.0])
    loss, clipped = ppo.value_loss(values, old, returns, 0.5)
    # token 0: plain (1 - 2)^2 = 1, clipped (0.5 - 2)^2 = 2.25 -> 1.125; token 1: both 1 -> 0.5;
    # token 2: plain 1, clipped 0.25 -> the max is the plain one, 0.5
    assert torch.allclose(loss, torch.tensor([1.125, 0.5, 0.5]), atol=1e-6)
    assert clipped.tolist() == [1.0, 0.0, 0.0]
    loss, clipped = ppo.value_loss(values, old, returns, 0.0)
    assert torch.allclose(loss, torch.tensor([0.5, 0.5, 0.5])) and clipped.sum() == 0
    assert ppo.explained_variance(returns, returns) == pytest.approx(1.0)
    assert ppo.explained_variance(torch.full((3,), 0.3), returns) == pytest.approx(0.0, abs=1e-6)


@pytest.mark.quick
def test_critic_values_packed_padded_and_as_sequence_classification(assets, tmp_path):
    """token_values on packed rows = on padded rows, and the value before token t is what
    AutoModelForSequenceClassification gives for the prefix ids[:t] (the critic export's own forward), both to
    2e-5 of the values' scale: fp32 attention sums in another order on each path, and the order differs by CPU
    (3e-6 on an AMX Xeon, 2e-5 on another machine, with values up to 7.5)."""
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(f"{assets}/llama-0.5m", num_labels=1, pad_token_id=0,
                                                               dtype=torch.float32).eval()
    torch.nn.init.normal_(model.score.weight, std=0.5)
    model.save_pretrained(tmp_path / "critic")
    exported = AutoModelForSequenceClassification.from_pretrained(tmp_path / "critic", dtype=torch.float32).eval()
    samples = [training_sample([3, 20 + i, 21], [30 + (i * k) % 50 for k in range(2 + i)]) for i in range(5)]
    packed = make_batch(samples, 0, 64, False)
    padded = collate([token_sample(s) for s in samples], 0, packing=False)
    with torch.no_grad():
        vp = unpack(ppo.token_values(exported, packed), packed)
        vq = unpack(ppo.token_values(exported, padded), padded)
        tolerance = 2e-5 * max(v.abs().max().item() for v in vp)
        assert max((a - b).abs().max().item() for a, b in zip(vp, vq)) <= tolerance
        for s, v in zip(samples, vp):
            ids = s.prompt_ids + s.response_ids
            for t in range(len(s.prompt_ids), len(ids)):
                want = exported(input_ids=torch.tensor([ids[:t]])).logits[0, 0].item()
                assert abs(v[t].item() - want) <= tolerance
    assert max(v.abs().max().item() for v in vp) > 1e-2  # a real head, not zeros


# ----------------------------------------------------------------------------------------------
# Arguments: refused before Ray starts
# ----------------------------------------------------------------------------------------------
@pytest.mark.quick
def test_argument_errors_and_critic_default(assets, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    required = ["--pretrain", f"{assets}/llama-0.5m", "--prompt_data", "d.jsonl", "--remote_rm_url", REWARD,
                "--prompt_max_len", "48", "--generate_max_len", "16", "--rollout_batch_size", "16",
                "--train_batch_size", "16", "--micro_train_batch_size", "8"]
    args = ppo.parse_args(required)
    assert args.critic_pretrain == f"{assets}/llama-0.5m" and args.critic_learning_rate == 9e-6
    assert "a freshly initialised value head" in ppo.critic_source(args)
    rm = AutoModelForSequenceClassification.from_pretrained(f"{assets}/llama-0.5m", num_labels=1)
    rm.save_pretrained(tmp_path / "rm")
    AutoTokenizer.from_pretrained(f"{assets}/llama-0.5m").save_pretrained(tmp_path / "rm")
    args = ppo.parse_args([*required, "--reward_pretrain", f"{tmp_path / 'rm'},{assets}/qwen2-0.5m"])
    assert args.critic_pretrain == str(tmp_path / "rm")  # the first reward model
    assert "a reward model: its score head is the value head" in ppo.critic_source(args)
    with pytest.raises(ValueError, match="--advantage_estimator group_norm: ppo.py learns a critic"):
        ppo.parse_args([*required, "--advantage_estimator", "group_norm"])
    with pytest.raises(ValueError, match=r"--critic_pretrain .*/nowhere: not a model directory"):
        ppo.parse_args([*required, "--critic_pretrain", str(tmp_path / "nowhere")])
    other = AutoTokenizer.from_pretrained(f"{assets}/llama-0.5m")
    other.add_tokens(["<tool_output>"])
    rm.save_pretrained(tmp_path / "other_tok")
    other.save_pretrained(tmp_path / "other_tok")
    with pytest.raises(ValueError, match="has another tokenizer than --pretrain"):
        ppo.parse_args([*required, "--critic_pretrain", str(tmp_path / "other_tok")])
    with pytest.raises(ValueError, match="--dynamic_filtering drops prompts"):
        ppo.parse_args([*required, "--dynamic_filtering"])
    with pytest.raises(ValueError, match=r"--lambd_critic must be in \[0, 1\]"):
        ppo.parse_args([*required, "--lambd_critic", "1.5"])
    with pytest.raises(ValueError, match="critic ranks"):
        ppo.parse_args([*required, "--critic_num_gpus_per_node", "2"])
    # a placement flag with nothing to place is refused, naming it
    with pytest.raises(ValueError, match=r"--colocate_actor_ref needs --init_kl_coef > 0"):
        ppo.parse_args([*required, "--colocate_actor_ref"])
    with pytest.raises(ValueError, match="--colocate_critic_reward needs --reward_pretrain"):
        ppo.parse_args([*required, "--colocate_critic_reward"])
    with pytest.raises(ValueError, match="--deepspeed_enable_sleep moves ZeRO states off the device"):
        ppo.parse_args([*required, "--deepspeed_enable_sleep"])
    # the states it moves are ZeRO's: --zero_stage unset resolves to 2 with it (a world of one would take 0)
    sleep = [*required, "--colocate_all_models", "--deepspeed_enable_sleep"]
    assert ppo.parse_args(sleep).train.zero_stage == 2 and ppo.parse_args(required).train.zero_stage is None
    with pytest.raises(ValueError, match=r"--zero_stage 1-3 \(unset: 2\)"):
        ppo.parse_args([*sleep, "--zero_stage", "0"])
    with pytest.raises(ValueError, match="--ring_attn_size 2 must divide the world size 3"):
        ppo.parse_args([*required, "--ring_attn_size", "2", "--actor_num_gpus_per_node", "2",
                        "--critic_num_gpus_per_node", "3"])
    with pytest.raises(ValueError, match="--colocate_all_models puts each critic rank on an actor device"):
        ppo.parse_args([*required, "--colocate_all_models", "--critic_num_gpus_per_node", "2", "--rollout_batch_size",
                        "32", "--train_batch_size", "32"])
    parsed = ppo.parse_args([*required, "--init_kl_coef", "0.01", "--colocate_actor_ref", "--actor_num_nodes", "2",
                             "--critic_num_nodes", "2", "--rollout_batch_size", "64", "--train_batch_size", "32"])
    assert parsed.colocate_actor_ref and parsed.actor_num_nodes == parsed.critic_num_nodes == 2
    # through the real CLI: one `error:` line, before Ray starts
    proc = run_script("ppo.py", [*required, "--advantage_estimator", "rloo"], expect_ok=False)
    assert proc.returncode != 0 and "error: --advantage_estimator rloo" in proc.stderr
    assert "Ray" not in proc.stdout + proc.stderr.split("error:")[0]


# ----------------------------------------------------------------------------------------------
# End to end: python algos/ppo.py (Ray driver), 1 or 2 actor ranks, 1 critic rank, 1 vLLM engine
# ----------------------------------------------------------------------------------------------
def ppo_args(assets, model, tmp, *extra):
    """One actor and one critic rank (a launch's cost is mostly its processes' start-up); the learning run and its
    resume pass --actor_num_gpus_per_node 2."""
    return ["--pretrain", model, "--prompt_data", f"{assets}/data/reverse/rl_train.jsonl",
            "--eval_dataset", f"{assets}/data/reverse/rl_test.jsonl", "--input_key", "prompt", "--label_key", "answer",
            "--apply_chat_template", "--remote_rm_url", REWARD, "--n_samples_per_prompt", 4,
            "--rollout_batch_size", 32, "--train_batch_size", 64, "--micro_train_batch_size", 16,
            "--micro_rollout_batch_size", 16, "--actor_num_gpus_per_node", 1, "--critic_num_gpus_per_node", 1,
            "--vllm_num_engines", 1,
            "--max_epochs", 2, "--actor_learning_rate", 1e-4, "--critic_learning_rate", 1e-3,
            "--prompt_max_len", 48, "--generate_max_len", 16, "--max_model_len", 128,
            "--eval_temperature", 0, "--eval_n_samples_per_prompt", 1, "--eval_steps", 10,
            "--save_path", tmp / "out", "--metrics_file", tmp / "metrics.jsonl", *extra]


def without_eval(args):
    i = args.index("--eval_dataset")
    return args[:i] + args[i + 2 :]


@pytest.fixture(scope="module")
def run(assets, rl_start_model, tmp_path_factory):
    """One 20-step run shared by the end-to-end tests: the critic warms up for 2 steps (actor frozen),
    checkpoints at steps 18 and 20; (tmp, {step: metrics}, [eval pass@1])."""
    tmp = tmp_path_factory.mktemp("ppo_run")
    run_script("ppo.py", ppo_args(assets, rl_start_model, tmp, "--max_steps", 20, "--freezing_actor_steps", 2,
                                  "--actor_num_gpus_per_node", 2, "--save_steps", 18, "--ckpt_path", tmp / "ckpt"),
               timeout=900)
    metrics = read_jsonl(tmp / "metrics.jsonl")
    return tmp, {m["step"]: m for m in metrics if "train/reward" in m}, [m["eval/pass@1"] for m in metrics
                                                                        if "eval/pass@1" in m]


def test_ppo_learns_reversal_and_the_critic_explains_the_returns(run):
    tmp, steps, evals = run
    assert len(steps) == 20 and len(evals) == 3
    # greedy exact match on 200 held-out prompts; measured 0.66 -> 0.76 / 0.73 / 0.745 (seeds 42 / 1 / 2)
    assert evals[-1] - evals[0] >= 0.04, evals
    # the critic learns to predict the returns (explained variance starts below 0: a fresh head)
    ev = [steps[s]["critic/explained_variance"] for s in sorted(steps)]
    assert sum(ev[-5:]) / 5 > 0.05 and sum(ev[-5:]) / 5 > ev[0], ev
    diffs = [m["rollout/logp_abs_diff_max"] for m in steps.values()]
    assert len(diffs) == 20 and max(diffs) <= 1e-4, diffs  # every step: the engines hold the actor's weights
    phases = ("generate", "reward", "logprobs_values", "critic_train", "train", "sync")
    assert all(steps[s][f"time/{p}"] > 0 for s in steps for p in phases)
    assert all(steps[s]["time/actor_train"] > 0 for s in steps if s > 2)
    # exports: the actor a causal LM, the critic an AutoModelForSequenceClassification, the best actor
    from transformers import AutoModelForSequenceClassification

    critic = AutoModelForSequenceClassification.from_pretrained(tmp / "out" / "critic")
    assert critic.config.num_labels == 1 and critic.score.weight.shape[0] == 1
    assert os.path.exists(tmp / "out" / "config.json") and os.path.exists(tmp / "out" / "best" / "config.json")


def test_freezing_actor_steps_train_only_the_critic(run):
    """--freezing_actor_steps 2: steps 1-2 update the critic only and sync nothing; the actor's log-probs
    before step 3's update still equal vLLM's (which holds the start weights), so the actor did not move."""
    _, steps, _ = run
    for s in (1, 2):
        assert steps[s]["train/actor_frozen"] == 1.0 and "train/policy_loss" not in steps[s]
        assert steps[s]["critic/grad_norm"] > 0 and steps[s]["perf/sync_mb"] == 0
    assert steps[1]["rollout/logp_abs_diff_max"] <= 1e-4 and steps[2]["rollout/logp_abs_diff_max"] <= 1e-4
    assert steps[3]["train/actor_frozen"] == 0.0 and "train/policy_loss" in steps[3]
    assert steps[3]["rollout/logp_abs_diff_max"] <= 1e-4 and steps[3]["perf/sync_mb"] > 0
    # the critic moved: the values of step 1's samples and of step 2's differ by more than noise
    assert abs(steps[2]["critic/values"] - steps[1]["critic/values"]) > 1e-3


def test_resume_reproduces_actor_and_critic(run, assets, rl_start_model):
    """Resume at step 18 (as if the run had died after saving it): steps 19-20 and the final actor and
    critic weights equal the uninterrupted run's."""
    tmp, steps, _ = run
    for role in ("actor", "critic"):
        (tmp / "ckpt" / role / "latest").write_text("global_step18")
    proc = run_script("ppo.py", without_eval(ppo_args(assets, rl_start_model, tmp / "resumed", "--max_steps", 20,
                                                      "--freezing_actor_steps", 2, "--actor_num_gpus_per_node", 2,
                                                      "--load_checkpoint",
                                                      "--ckpt_path", tmp / "ckpt")), timeout=900)
    assert "resumed from" in proc.stdout and "at step 18" in proc.stdout
    resumed = {m["step"]: m for m in read_jsonl(tmp / "resumed" / "metrics.jsonl") if "train/reward" in m}
    assert sorted(resumed) == [19, 20]
    for s in (19, 20):
        assert resumed[s]["train/reward"] == steps[s]["train/reward"]
        for key in ("train/policy_loss", "critic/value_loss", "critic/explained_variance"):
            assert abs(resumed[s][key] - steps[s][key]) <= 1e-5, (s, key)
    assert max(m["rollout/logp_abs_diff_max"] for m in resumed.values()) <= 1e-4  # engines got the resumed actor
    assert max_weight_diff(tmp / "out", tmp / "resumed" / "out") <= 1e-5
    assert max_weight_diff(tmp / "out" / "critic", tmp / "resumed" / "out" / "critic") <= 1e-5


def test_colocated_lora_actor_with_reference_reward_model_and_ptx(assets, rl_start_model, tmp_path):
    """Everything on one device (--colocate_all_models: actor, reference, critic, engine, reward model; the
    actor's and critic's DeepSpeed states moved off the device while idle, --deepspeed_enable_sleep),
    a LoRA actor, the KL to a reference in the reward, two reward models summed with the rule (the critic
    starts from the first: its score head is the value head), and PPO-ptx: it runs, the engine tracks the merged LoRA
    actor, the policy moves away from the reference, and the pretraining loss falls."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    for seed in (0, 1):  # two reward models (fresh score heads), summed
        torch.manual_seed(seed)
        AutoModelForSequenceClassification.from_pretrained(rl_start_model, num_labels=1).save_pretrained(
            tmp_path / f"rm{seed}")
        AutoTokenizer.from_pretrained(rl_start_model).save_pretrained(tmp_path / f"rm{seed}")
    args = without_eval(ppo_args(
        assets, rl_start_model, tmp_path, "--colocate_all_models", "--lora_rank", 8,
        "--actor_learning_rate", 1e-3, "--init_kl_coef", 0.01, "--reward_pretrain", f"{tmp_path}/rm0,{tmp_path}/rm1",
        "--pretrain_data", f"{assets}/data/reverse/pretrain_train.jsonl", "--ptx_coef", 0.5, "--max_steps", 4,
        "--deepspeed_enable_sleep"))
    proc = run_script("ppo.py", args, timeout=900)
    assert "a reward model: its score head is the value head" in proc.stdout
    steps = [m for m in read_jsonl(tmp_path / "metrics.jsonl") if "train/reward" in m]
    assert len(steps) == 4 and max(m["rollout/logp_abs_diff_max"] for m in steps) <= 1e-4
    assert abs(steps[0]["train/kl"]) < 1e-5 < abs(steps[-1]["train/kl"])  # the reference is the start policy
    assert steps[-1]["train/ptx_loss"] < steps[0]["train/ptx_loss"], [m["train/ptx_loss"] for m in steps]
    assert os.path.exists(tmp_path / "out" / "critic" / "config.json")


def offload_check(assets, zero_stage):
    """tests/scripts/offload_check.py in a process of its own; its JSON result."""
    import json
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    proc = subprocess.run([sys.executable, "-m", "tests.scripts.offload_check",
                           f"{assets}/llama-0.5m", str(zero_stage)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": port})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("zero_stage", [1, 2])
def test_deepspeed_sleep_round_trip_keeps_training_exact(assets, zero_stage):
    """--deepspeed_enable_sleep's offload_states / reload_states between optimizer steps: 3 steps give the weights
    of 3 steps without (exactly; on CPU the states stay in place, so this checks the round trip leaves them
    intact; the memory it frees is the gpu test below)."""
    result = offload_check(assets, zero_stage)
    assert result["max_diff"] == 0.0 and result["moved"] > 1e-3, result


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the states leave a CUDA device")
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_deepspeed_sleep_frees_device_memory(assets, zero_stage):
    """On CUDA the offload frees at least the fp32 weights and the two Adam moments of the 0.4M model (3 x 4 bytes
    a parameter), and training matches the run without it to rounding: two CUDA runs of one program need not be
    bit-equal (cuBLAS and the attention backward pick kernels and reduction orders per run), so the weights after
    3 steps agree to 1e-4, far below the ~1e-2 each step moves them."""
    result = offload_check(assets, zero_stage)
    assert result["max_diff"] <= 1e-4 and result["freed_bytes"] >= 3 * 4 * 400_000, result


@pytest.mark.quick
def test_ptx_loss_mixed_into_the_actor_step(assets):
    """PPO-ptx: with --ptx_coef 0 the step (loss, gradients) is the step without pretraining data; with a
    coefficient the loss is PPO + coef x the LM loss of the ptx micro-batch; optimising it lowers that loss."""
    import dataclasses

    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(f"{assets}/llama-0.5m", dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(f"{assets}/llama-0.5m")
    base = ppo.Args(pretrain_data=f"{assets}/data/reverse/pretrain_train.jsonl", prompt_max_len=24,
                    generate_max_len=8)
    rows = ppo.load_ptx(base, tokenizer)
    assert len(rows) > 100 and max(len(r["input_ids"]) for r in rows) <= 32
    assert rows[0]["input_ids"][-1] == tokenizer.eos_token_id and all(m == 1 for m in rows[0]["loss_mask"])
    # each rank's step gets as many rows as samples, in a seeded stream that a resume continues
    steps, position = ppo.ptx_steps_for(rows, [[[0] * 4, [0] * 4], [[0] * 4, [0] * 4]], 0, 42)
    again, _ = ppo.ptx_steps_for(rows, [[[0] * 4, [0] * 4]], 8, 42)
    assert position == 16 and [len(s) for s in steps[0]] == [4, 4] and again[0] == steps[1]
    samples = [training_sample([3, 20 + i, 21], [30 + (i * k) % 50 for k in range(2 + i)],
                               advantages=torch.randn(2 + i), old_logps=-torch.rand(2 + i) * 3) for i in range(4)]
    batch = make_batch(samples, 0, 64, False, ["advantages", "old_logps", "vllm_logps"])
    pb = collate(steps[0][0], 0, max_tokens=64)  # as TrainerRank.train builds it

    def step(args, ptx):  # the step's loss as backward_step makes it: the sum / 20 + coef x the LM loss
        model.zero_grad()
        loss_sum, _ = ppo.micro_batch_loss(model, batch, args)
        term, lm = ppo.ptx_term(model, ptx, args) if ptx else (0.0, None)
        loss = loss_sum / 20.0 + term
        loss.backward()
        return loss.item(), torch.cat([p.grad.flatten() for p in model.parameters()]), lm

    plain_loss, plain_grad, no_lm = step(base, None)
    zero_loss, zero_grad, zero_lm = step(dataclasses.replace(base, ptx_coef=0.0), pb)
    assert no_lm is None and zero_loss == plain_loss and torch.equal(zero_grad, plain_grad)
    with torch.no_grad():
        lm = ppo.ptx_loss(model, pb).item()
    assert zero_lm["ptx_loss"] == pytest.approx(lm, rel=1e-6) and lm > 1.0
    mixed_loss, mixed_grad, _ = step(dataclasses.replace(base, ptx_coef=0.5), pb)
    assert mixed_loss == pytest.approx(plain_loss + 0.5 * lm, abs=1e-5)
    assert (mixed_grad - plain_grad).abs().max().item() > 1e-4
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(10):
        step(dataclasses.replace(base, ptx_coef=1.0), pb)
        optimizer.step()
    with torch.no_grad():
        assert ppo.ptx_loss(model, pb).item() < lm - 0.5
