"""Shared test rig: tiny assets built once per session, and a runner for the real scripts."""

import glob
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

# the suite's time budget (launch/test.sh sets it): a session past it fails, naming its slowest tests
from suite_budget import pytest_runtest_logreport, pytest_sessionfinish, pytest_sessionstart  # noqa: F401

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# pytest.ini's pythonpath, for a test file that runs itself as a worker process (python tests/test_x.py, torchrun)
PYTHONPATH = os.pathsep.join([ROOT, os.path.join(ROOT, "tests", "scripts")])
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


STALE_BUILD_LOCK_S = 300  # a JIT build of DeepSpeed's ops (shm comm, CPU Adam) takes ~1 min on 2 busy cores


@pytest.fixture(scope="session", autouse=True)
def stale_build_locks_removed():
    """torch's JIT loader takes a lock file in the op's build directory on every load (even of a built op) and
    waits, without a bound, while one exists; a test process killed inside that window (the failure tests kill
    ranks and actors on purpose) leaves it, and every later DeepSpeed start on this venv would wait forever. A
    daemon thread removes lock files under TORCH_EXTENSIONS_DIR older than any build takes."""
    import threading
    import time

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    stop = threading.Event()

    def sweep():
        while not stop.wait(30):
            for lock in glob.glob(os.path.join(root, "*", "lock")):
                try:
                    if time.time() - os.path.getmtime(lock) > STALE_BUILD_LOCK_S:
                        os.remove(lock)
                        print(f"removed a stale build lock {lock}", file=sys.stderr)
                except OSError:
                    pass

    if root:
        threading.Thread(target=sweep, daemon=True).start()
    yield
    stop.set()


def built_once(tmp_path_factory, name, build):
    """The folder `name` that build(folder) fills, built once per suite, not once per xdist worker: the first
    worker to ask builds it under a lock in the workers' shared temporary folder, the others wait and reuse it."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    out, done = root / name, root / f"{name}.done"
    with FileLock(str(root / f"{name}.lock"), timeout=900):  # the longest build, an SFT run, takes ~1 min
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            build(str(out))
            done.touch()
    return str(out)


@pytest.fixture(scope="session")
def assets(tmp_path_factory):
    """Tiny models (llama-0.5m, qwen2-0.5m) and synthetic data, built deterministically offline."""
    from launch.tiny import build_assets

    return built_once(tmp_path_factory, "assets", lambda out: build_assets(out, models=("llama-0.5m", "qwen2-0.5m")))


def sft_reversal(assets, train_batch_size):
    """build(folder) for built_once: one epoch of sft.py on string reversal from the tiny Llama into the folder."""
    return lambda out: run_script("sft.py", [
        "--pretrain", f"{assets}/llama-0.5m", "--dataset", f"{assets}/data/reverse/sft_train.jsonl",
        "--input_key", "prompt", "--output_key", "response", "--apply_chat_template", "--max_len", 64,
        "--train_batch_size", train_batch_size, "--micro_train_batch_size", 16, "--learning_rate", 3e-3,
        "--save_path", out,
    ])


@pytest.fixture(scope="session")
def tiny_reward_model(assets, tmp_path_factory):
    """llama-0.5m as a reward model (AutoModelForSequenceClassification) with a seeded value head, saved with its
    tokenizer: rewards that differ by sequence, in a second."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = str(tmp_path_factory.mktemp("tiny_rm"))
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(f"{assets}/llama-0.5m", num_labels=1)
    with torch.no_grad():
        model.score.weight.normal_(0, 0.5)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(f"{assets}/llama-0.5m").save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def sft_model(assets, tmp_path_factory):
    """The tiny Llama after one epoch of SFT on string reversal (the start point of RM / DPO / KTO tests)."""
    return built_once(tmp_path_factory, "sft_model", sft_reversal(assets, 32))


@pytest.fixture(scope="session")
def rl_start_model(assets, tmp_path_factory):
    """The tiny Llama after one epoch of SFT on reversal with small batches: greedy exact match ~0.66,
    right often enough that sampled groups carry a learning signal (the start of the RL and loop tests)."""
    return built_once(tmp_path_factory, "rl_start_model", sft_reversal(assets, 16))


def load_algo(name):
    """Import algos/<name>.py as a module (algos/ is a folder of scripts, not a package)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "algos", f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # tyro and inspect look classes up by module
        spec.loader.exec_module(module)
    return sys.modules[name]


def training_sample(prompt_ids, response_ids, model_tokens=None, **values):
    """A common.rollout.TrainingSample written as lists: every response token the model's unless `model_tokens`
    (0/1 per token) says otherwise, vLLM's log-probs 0 unless given; per-token lists become float32 tensors."""
    import torch

    from common.rollout import TrainingSample

    n = len(response_ids)
    tokens = torch.tensor(model_tokens if model_tokens is not None else [1] * n, dtype=torch.bool)
    per_token = {k: torch.as_tensor(v, dtype=torch.float32) for k, v in values.items()
                 if k not in ("reward", "masked", "rejected")}
    flags = {k: v for k, v in values.items() if k in ("reward", "masked", "rejected")}
    per_token.setdefault("vllm_logps", torch.zeros(n))
    return TrainingSample(list(prompt_ids), list(response_ids), tokens, **per_token, **flags)


def run_script(script, args, nproc=1, timeout=600, expect_ok=True, env=None):
    """Run algos/<script> through its real CLI (torchrun for nproc > 1); returns the completed process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "offline",
           **(env or {})}
    path = os.path.join(ROOT, "algos", script)
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), path]
    else:
        cmd = [sys.executable, path]
    proc = subprocess.run(cmd + [str(a) for a in args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    if expect_ok and proc.returncode != 0:
        raise AssertionError(f"{script} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def run_scripts(runs, workers=2):
    """run_script(script, args, **options) for each (script, args, options) of `runs`, `workers` at a time:
    independent runs a test compares overlap their start-up (imports, rendezvous, engine start, mostly one core
    each); the completed processes in the order given."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(workers) as pool:
        futures = [pool.submit(run_script, script, args, **options) for script, args, options in runs]
        return [f.result() for f in futures]


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def weights(path):
    """Every tensor of the safetensors files in a saved model directory."""
    from safetensors.torch import load_file

    return {k: v for f in sorted(glob.glob(f"{path}/*.safetensors")) for k, v in load_file(f).items()}


def max_weight_diff(a, b):
    """Largest absolute difference between two saved models' weights (same names required)."""
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    return max((wa[k] - wb[k]).abs().max().item() for k in wa)
