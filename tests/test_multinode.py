"""Two "nodes" on one machine against one: torchrun --nnodes 2 (c10d rendezvous on localhost) for sft.py, and
grpo.py on a 2-node Ray cluster (two `ray start --block`, each with its own temp dir, ports and 2 CPUs) with the
trainer group spanning both nodes. The first steps' numbers equal the one-node runs' to the stated tolerances."""

import contextlib
import glob
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import pytest
from conftest import ROOT, read_jsonl

pytestmark = pytest.mark.multinode


def free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def start(name, cmd, tmp_path, env):
    """Start a run in the background, its output in tmp_path/<name>.log (the runs of a test overlap: the
    one-node reference beside the two "nodes")."""
    log = open(tmp_path / f"{name}.log", "w")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **env}
    return name, subprocess.Popen([str(c) for c in cmd], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def wait_all(runs, tmp_path, timeout=600):
    """Wait for every run (together bounded by `timeout`); fail with the logs of those that failed."""
    deadline = time.time() + timeout
    try:
        codes = {name: proc.wait(timeout=max(deadline - time.time(), 1)) for name, proc in runs}
    finally:
        for _, proc in runs:
            proc.kill()
    failed = {name: (tmp_path / f"{name}.log").read_text()[-3000:] for name, code in codes.items() if code}
    assert not failed, failed


def test_sft_on_two_nodes_equals_one_node(assets, tmp_path):
    """1 node x 1 rank (2 accumulation steps) vs 2 nodes x 1 rank: the same global batch of 32."""
    args = ["--pretrain", f"{assets}/llama-0.5m", "--dataset", f"{assets}/data/reverse/sft_train.jsonl",
            "--input_key", "prompt", "--output_key", "response", "--apply_chat_template", "--max_len", 64,
            "--max_samples", 256, "--train_batch_size", 32, "--micro_train_batch_size", 16, "--learning_rate", 3e-3,
            "--zero_stage", 2]
    port = free_port()
    node = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
            "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "multinode-test",
            "--rdzv_conf", "join_timeout=120", f"{ROOT}/algos/sft.py", *args,
            "--metrics_file", tmp_path / "two.jsonl", "--save_path", tmp_path / "two"]
    wait_all([start("one", [sys.executable, f"{ROOT}/algos/sft.py", *args, "--metrics_file", tmp_path / "one.jsonl",
                            "--save_path", tmp_path / "one"], tmp_path, {}),
              start("node0", node, tmp_path, {}), start("node1", node, tmp_path, {})], tmp_path)
    one = [m["train/loss"] for m in read_jsonl(tmp_path / "one.jsonl") if "train/loss" in m]
    two = [m["train/loss"] for m in read_jsonl(tmp_path / "two.jsonl") if "train/loss" in m]
    assert len(one) == len(two) == 8  # 256 samples / 32
    diff = max(abs(a - b) for a, b in zip(one, two))
    assert diff <= 1e-5, (one, two)  # measured 0 to 2.9e-7
    assert one[-1] < one[0] - 1.0, one  # and it is training
    print(f"sft 2 nodes vs 1: max |loss diff| over {len(one)} steps {diff:.2e}")


@contextlib.contextmanager
def two_node_ray():
    """A head and a worker node on this machine, 2 logical CPUs each, with a token of their own; stopped by
    signalling the two `ray start --block` processes (never `ray stop`, which would end other clusters here)."""
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
           "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("RAY_ADDRESS", None)
    dirs = [tempfile.mkdtemp(prefix="rn", dir="/tmp") for _ in range(2)]  # short: Ray's socket paths must fit
    port = free_port()
    common = ["--num-cpus=2", "--num-gpus=0", "--disable-usage-stats", "--block"]
    procs = []

    def start(i, *extra):
        log = open(f"{dirs[i]}/start.log", "w")
        procs.append(subprocess.Popen([ray_bin, "start", f"--temp-dir={dirs[i]}",
                                       f"--dashboard-agent-listen-port={free_port()}", *common, *extra],
                                      env=env, stdout=log, stderr=subprocess.STDOUT))

    def wait_for(check, what, timeout=120):
        deadline = time.time() + timeout
        while not check():
            dead = [d for p, d in zip(procs, dirs) if p.poll() is not None]
            if dead or time.time() > deadline:
                logs = "\n".join(open(f"{d}/start.log").read()[-2000:] for d in dirs[:len(procs)])
                pytest.fail(f"{what}: {'a node exited' if dead else f'not within {timeout} s'}\n{logs}")
            time.sleep(0.5)

    try:
        start(0, "--head", f"--port={port}", f"--ray-client-server-port={free_port()}", "--include-dashboard=false")

        def gcs_up():
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", port)) == 0

        wait_for(gcs_up, "the Ray head's GCS port")
        ip = open(f"{dirs[0]}/start.log").read().split("Local node IP: ")[1].split()[0]
        address = f"{ip}:{port}"
        start(1, f"--address={address}")
        count = ("import ray; ray.init(address='%s', logging_level='ERROR', log_to_driver=False); "
                 "print(sum(n['Alive'] for n in ray.nodes()))" % address)
        wait_for(lambda: subprocess.run([sys.executable, "-c", count], env=env, capture_output=True,
                                        text=True, timeout=60).stdout.strip().endswith("2"), "two Ray nodes")
        yield address, env, dirs
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)


def trainer_logs(temp_dir):
    """Worker logs on one node that belong to a grpo trainer rank."""
    return [f for f in glob.glob(f"{temp_dir}/session_latest/logs/worker-*.out")
            if ":actor_name:TrainerRank" in open(f, errors="replace").read()]


def test_grpo_trainer_group_across_two_ray_nodes_equals_one_node(assets, rl_start_model, tmp_path):
    args = ["--pretrain", rl_start_model, "--prompt_data", f"{assets}/data/reverse/rl_train.jsonl",
            "--input_key", "prompt", "--label_key", "answer", "--apply_chat_template", "--remote_rm_url",
            f"{ROOT}/launch/rewards/exact_match.py", "--n_samples_per_prompt", 4, "--rollout_batch_size", 8,
            "--train_batch_size", 16, "--micro_train_batch_size", 8, "--micro_rollout_batch_size", 8,
            "--prompt_max_len", 48, "--generate_max_len", 16, "--max_model_len", 128, "--max_steps", 2,
            "--actor_learning_rate", 1e-4]
    one = start("one", [sys.executable, f"{ROOT}/algos/grpo.py", *args, "--actor_num_gpus_per_node", 2,
                        "--metrics_file", tmp_path / "one.jsonl", "--save_path", tmp_path / "one"], tmp_path, {})
    try:
        with two_node_ray() as (address, env, dirs):  # comes up while the one-node run starts
            wait_all([one, start("two", [sys.executable, f"{ROOT}/algos/grpo.py", *args, "--actor_num_nodes", 2,
                                         "--actor_num_gpus_per_node", 1, "--ray_address", address, "--metrics_file",
                                         tmp_path / "two.jsonl", "--save_path", tmp_path / "two"], tmp_path, env)],
                     tmp_path)
            # each Ray node ran one trainer rank (its own temp dir holds its workers' logs)
            assert [len(trainer_logs(d)) for d in dirs] == [1, 1]
    finally:
        one[1].kill()
    assert "trainer group: 2 ranks on 2 nodes, 1 per node" in (tmp_path / "two.log").read_text()
    one = [m for m in read_jsonl(tmp_path / "one.jsonl") if "train/reward" in m]
    two = [m for m in read_jsonl(tmp_path / "two.jsonl") if "train/reward" in m]
    assert len(one) == len(two) == 2
    assert 0 < one[0]["train/reward"] < 1  # groups with a learning signal
    for a, b in zip(one, two):  # the same samples (seeded per prompt), then the same update
        assert a["train/reward"] == b["train/reward"], (a, b)
        assert abs(a["train/policy_loss"] - b["train/policy_loss"]) <= 1e-5, (a, b)
    diff = max(abs(a["train/policy_loss"] - b["train/policy_loss"]) for a, b in zip(one, two))
    print(f"grpo 2 Ray nodes vs 1: rewards {[m['train/reward'] for m in one]} equal, max |policy loss diff| "
          f"{diff:.2e}")
