"""algos/grpo.py --async_train end to end (real Ray, vLLM, DeepSpeed on CPU): --max_staleness 0 is the
synchronous run exactly; --max_staleness 1 trains each step on samples of the weights one update old (the
versions are asserted), still learns, and refuses a loss without a trust region; --max_staleness 2 runs two
rollouts ahead."""

import pytest

from conftest import PYTHONPATH, ROOT, load_algo, max_weight_diff, read_jsonl, run_script, run_scripts
from test_grpo import REWARD, grpo_args

grpo = load_algo("grpo")


def steps_of(path):
    return [m for m in read_jsonl(path) if "train/reward" in m]


def test_staleness_zero_is_the_synchronous_run(assets, rl_start_model, tmp_path):
    """16 prompts x 8 samples in two optimizer steps: the old-log-prob forward runs, as off-policy runs need."""
    configs = {"sync": [], "async0": ["--async_train", "--max_staleness", 0]}
    cli = {}
    for name, extra in configs.items():
        cli[name] = grpo_args(assets, rl_start_model, tmp_path / name, "--rollout_batch_size", 16,
                              "--train_batch_size", 64, "--actor_learning_rate", 1e-4, "--max_steps", 3, *extra)
        cli[name][cli[name].index("--eval_dataset"): cli[name].index("--eval_dataset") + 2] = []
    run_scripts([("grpo.py", cli[name], {"timeout": 900}) for name in configs])
    runs = {name: steps_of(tmp_path / name / "metrics.jsonl") for name in configs}
    for sync, async0 in zip(runs["sync"], runs["async0"]):
        assert async0["async/staleness"] == 0 and async0["async/policy_version"] == sync["step"] - 1
        for key in ("train/reward", "train/policy_loss", "train/grad_norm", "rollout/logp_abs_diff_max"):
            assert async0[key] == sync[key], (key, sync["step"], sync[key], async0[key])
    assert len(runs["sync"]) == len(runs["async0"]) == 3
    assert max_weight_diff(tmp_path / "sync" / "out", tmp_path / "async0" / "out") == 0.0


def test_one_step_off_policy_learns(assets, rl_start_model, tmp_path):
    args = grpo_args(assets, rl_start_model, tmp_path, "--rollout_batch_size", 32, "--train_batch_size", 128,
                     "--max_epochs", 2, "--actor_learning_rate", 1e-4, "--max_steps", 12, "--eval_steps", 12,
                     "--async_train", "--max_staleness", 1)
    run_script("grpo.py", args, timeout=900)
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    steps = [m for m in metrics if "train/reward" in m]
    assert len(steps) == 12
    # step 1 trains on the start weights' samples; every later step on samples of the weights one update old
    assert [m["async/policy_version"] for m in steps] == [0] + list(range(11))
    assert [m["async/staleness"] for m in steps] == [0] + [1] * 11
    assert all("rollout/logp_abs_diff_max" not in m for m in steps)  # old policy = vLLM's: nothing to check
    rewards = [m["train/reward"] for m in steps]
    evals = [m["eval/pass@1"] for m in metrics if "eval/pass@1" in m]
    assert sum(rewards[-4:]) / 4 - sum(rewards[:4]) / 4 >= 0.03, rewards  # measured 0.530 -> 0.608 (first / last 4)
    assert evals[-1] - evals[0] >= 0.04, evals  # measured 0.66 -> 0.74 (greedy exact match, 200 held-out prompts)


@pytest.mark.quick
def test_rollouts_run_up_to_k_steps_ahead(assets, rl_start_model, tmp_path):
    """--max_staleness 2: the rollout thread runs two steps ahead; step j trains on the samples of the weights of
    update max(j - 2, 0) exactly (the weight sync waits for the rollouts due on the old weights)."""
    args = grpo_args(assets, rl_start_model, tmp_path, "--rollout_batch_size", 8, "--train_batch_size", 64,
                     "--actor_learning_rate", 1e-4, "--max_steps", 5, "--async_train", "--max_staleness", 2)
    args[args.index("--eval_dataset"): args.index("--eval_dataset") + 2] = []
    run_script("grpo.py", args, timeout=900)
    steps = steps_of(tmp_path / "metrics.jsonl")
    assert [m["async/policy_version"] for m in steps] == [0, 0, 0, 1, 2]
    assert [m["async/staleness"] for m in steps] == [0, 1, 2, 2, 2]


@pytest.mark.quick
def test_off_policy_needs_a_trust_region(assets):
    required = ["--pretrain", f"{assets}/llama-0.5m", "--prompt_data", "d.jsonl", "--remote_rm_url", REWARD,
                "--prompt_max_len", "48", "--generate_max_len", "16", "--async_train"]
    with pytest.raises(ValueError, match=r"needs a clipped ratio: --eps_clip / --eps_clip_low_high bounds in \(0, 1\)"):
        grpo.parse_args([*required, "--eps_clip", "1e9"])
    with pytest.raises(ValueError, match="the engines cannot sleep"):
        grpo.parse_args([*required, "--colocate_all_models", "--vllm_enable_sleep"])
    assert not grpo.single_update(grpo.parse_args([*required, "--rollout_batch_size", "8", "--train_batch_size", "64"]))
    # staleness 0 is the synchronous run, shortcut included
    assert grpo.single_update(grpo.parse_args([*required, "--max_staleness", "0", "--rollout_batch_size", "8",
                                               "--train_batch_size", "64"]))


class Slow:
    def wait(self, seconds):
        import time

        time.sleep(seconds)
        return seconds


def test_a_wait_past_its_timeout_names_the_role():
    """The driver's bounded waits (rollout, weight sync) end with the name of who is late, not a silent hang."""
    import os
    import time

    import ray

    from common.infra.roles import RoleFailed, Roles, actor_class

    ray.init(num_cpus=1, include_dashboard=False,  # the actor's class is this module's
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([PYTHONPATH, os.path.join(ROOT, "tests")])}})
    try:
        roles = Roles(poll_s=0.2)
        slow = roles.add("vLLM engine 0", actor_class(Slow).remote())
        roles.ready(120)
        t0 = time.time()
        with pytest.raises(RoleFailed, match=r"^vLLM engines \(generating\): no answer within 1 s$"):
            roles.get([slow.wait.remote(60)], 1, "vLLM engines (generating)")
        assert time.time() - t0 < 30
    finally:
        ray.shutdown()
        os.environ.pop("RAY_ADDRESS", None)
