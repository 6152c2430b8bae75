"""Throughput side by side with TRL on this machine: our sft.py, dpo.py and grpo.py against TRL's
SFTTrainer (packing=bfd), DPOTrainer and GRPOTrainer, same model, same data, same shapes, one trainer
process each, the two sides alternating round by round so that other load slows both alike.

    python -m benchmarks.vs_trl --model assets/llama-10m             # TRL goes to --trl_dir, not .venv
    python -m benchmarks.vs_trl --model_shape smollm2-135m --algos sft,dpo   # a published model's shape

--model_shape builds a model of a published shape (random init) with a tokenizer of its vocabulary size (the
tiny BPE filled up with unused tokens, launch/tiny.py's build_tokenizer), once, into the temp folder, and trains
it instead of --model on the same data.

TRL is an optional benchmark dependency: it is installed with --no-deps into --trl_dir (a scratch
folder put on PYTHONPATH for TRL's runs only; its dependencies are the project's own transformers,
accelerate and datasets), never into the project's environment. Without network or PyPI access the
script says so and stops.

Each side runs in its fastest mode on one CPU process. Ours: ZeRO-0 (one rank: ZeRO-2 would partition nothing
and only add its gradient copies), a whole step's samples in one padding-free row (--micro_train_batch_size =
--train_batch_size), the chunked LM head at its default. TRL: SFT packing=bfd (padding-free rows); DPO padded
rows, its padding_free being switched off by TRL 1.16 itself (a warning: "temporarily unavailable").
Both sides compute in the same precision, the best one on this machine: bf16 (ours --param_dtype bf16,
TRL bf16=True, both CPU autocast) where the CPU multiplies bf16 natively, fp32 elsewhere (--param_dtype
overrides both). TRL's own default, bf16=True, is ~100x slower on a CPU without native bf16 (AVX2: a
2048x384x1024 matmul at 1.1 GFLOP/s in bf16 against 115 in fp32), so it is always set explicitly.
Measured: training steps after the first (start-up, data preparation and the first step excluded
on both sides). SFT: tokens/s (all tokens of the samples trained, prompt and response); ours from
sft.py's perf/samples_per_s x the data's mean tokens per sample, TRL's from per-step times (a callback)
x the tokens of its packed rows. DPO: pairs/s; ours perf/pairs_per_s, TRL's from its per-step times. Both
sides compute the reference log-probs in one pass before training (ours --ref_cache, the default; TRL
precompute_ref_log_probs=True, faster than its default live reference), and that pass is not timed on
either side.
GRPO: seconds per step of --grpo_prompts x --grpo_samples responses of at most --grpo_max_len tokens
(one optimizer step per rollout, no reference model); ours generates with vLLM (--grpo_vllm_engines
engines, one trainer rank), TRL with transformers' generate (its vLLM modes need CUDA). Ours trains
with ZeRO-0, as in SFT and DPO.
Both sides train on --grpo_micro samples per micro-batch (default all 128 of a step: fastest for ours,
no slower for TRL).

A second table gives each algorithm's arithmetic floor on this machine: the throughput (GRPO: the step
time) ours would reach if every matmul ran at this machine's matmul rate (a 2048-token matmul at the
model's MLP shape, in the benchmark's precision; the faster of one measurement before the rounds and one
after, since a shared machine's other load only slows it) and nothing else cost anything. The work counted is
6 FLOP per matmul weight per trained token (forward and backward; the embedding is a lookup, attention
scores are left out) and, in GRPO, 2 per weight per generated token; our tokens, as our scripts lay them
out (one prompt per DPO pair or GRPO group). Beside it: where each side stands (its throughput as a share of
that floor; TRL's padded DPO rows and repeated prompts are work the floor does not count) and the share of
the floor a speed target (--target_*) needs; a target needing ~100 % cannot be met by a faster
implementation of the same arithmetic on this machine.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from typing import Literal, Optional

import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TRL_VERSION = "1.16.0"

# Published shapes (config.json of the released model), built with random weights by build_shape_model.
MODEL_SHAPES = {
    "smollm2-135m": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         head_dim=64, intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
                         max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5),
}


@dataclass
class Args:
    model: str = "assets/llama-10m"
    """Hugging Face causal-LM directory both sides train."""
    model_shape: Optional[Literal["smollm2-135m"]] = None
    """Train a Llama of this published shape instead of --model: random init, a tokenizer of its vocabulary size,
    built once into the temp folder."""
    assets: str = "assets"
    """Tiny assets folder (its data/reverse/ holds the SFT and preference data)."""
    trl_dir: str = os.path.join(tempfile.gettempdir(), f"minrlhf-trl-{TRL_VERSION}")
    """Scratch folder TRL is installed into (with --no-deps), put on PYTHONPATH for TRL's runs only."""
    samples: int = 1024
    """Training samples (SFT) or pairs (DPO) per run."""
    sft_batch: int = 64
    """SFT samples per optimizer step (ours); TRL gets as many packed rows as carry the same tokens."""
    dpo_batch: int = 16
    """DPO pairs per optimizer step, both sides."""
    max_len: int = 1024
    """TRL's packed row length (max_length) and our --max_len (our micro-batch is one padding-free row)."""
    grpo_prompts: int = 16
    """GRPO prompts per step."""
    grpo_samples: int = 8
    """GRPO responses per prompt."""
    grpo_max_len: int = 32
    """GRPO longest response in tokens."""
    grpo_micro: int = 128
    """GRPO samples per training micro-batch, both sides (TRL's per_device_train_batch_size, with gradient
    accumulation making up --grpo_prompts x --grpo_samples per optimizer step); all 128 of a step is the
    fastest for ours and no slower for TRL than 32."""
    grpo_steps: int = 6
    """GRPO steps per run (the first is not counted)."""
    grpo_vllm_engines: int = 2
    """Our vLLM engines in GRPO (--vllm_num_engines): vLLM's CPU decode loop keeps one core busy, so one
    engine per core of a 2-core machine generates in ~0.65x the time of one."""
    param_dtype: Optional[Literal["bf16", "fp32"]] = None
    """Both sides' precision: our --param_dtype and TRL's bf16 (default: bf16 where the CPU multiplies bf16
    natively, else fp32)."""
    rounds: int = 2
    """Alternating rounds per algorithm; reported: each side's best round, and the median over rounds of
    each round's own ratio (steadier where the machine's speed drifts between rounds)."""
    algos: str = "sft,dpo,grpo"
    """Comma list of the algorithms to compare (sft, dpo, grpo)."""
    target_sft: float = 2.0
    """SFT speed target: ours / TRL tokens/s (the floor table says what share of the floor it needs)."""
    target_dpo: float = 3.0
    """DPO speed target: ours / TRL pairs/s."""
    target_grpo: float = 0.6
    """GRPO speed target: ours / TRL seconds per step."""


TRL_SFT = r"""
import json, os, sys, time
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import SFTConfig, SFTTrainer
model_path, data_path, samples, rows, max_len, out = sys.argv[1:7]
raw = [json.loads(line) for line in open(data_path)][: int(samples)]
ds = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}],
                         "completion": [{"role": "assistant", "content": r["response"]}]} for r in raw])
times = []
class Timer(TrainerCallback):
    def on_step_end(self, *a, **k):
        times.append(time.perf_counter())
config = SFTConfig(output_dir=out, per_device_train_batch_size=int(rows), max_length=int(max_len), packing=True,
                   packing_strategy="bfd", num_train_epochs=1, learning_rate=1e-5, logging_steps=10**6,
                   save_strategy="no", report_to=[], use_cpu=True, bf16=os.environ["TRL_BF16"] == "1", seed=0,
                   dataloader_num_workers=0)
tok = AutoTokenizer.from_pretrained(model_path)
trainer = SFTTrainer(model=AutoModelForCausalLM.from_pretrained(model_path), args=config, train_dataset=ds,
                     processing_class=tok, callbacks=[Timer()])
tokens = sum(len(x) for x in trainer.train_dataset["input_ids"])
start = time.perf_counter()
trainer.train()
steps = len(times)
print(json.dumps({"tokens_per_s": tokens * (steps - 1) / steps / (times[-1] - times[0]), "steps": steps}))
"""

TRL_DPO = r"""
import json, os, sys, time
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import DPOConfig, DPOTrainer
model_path, data_path, samples, batch, max_len, out = sys.argv[1:7]
raw = [json.loads(line) for line in open(data_path)][: int(samples)]
ds = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}],
                         "chosen": [{"role": "assistant", "content": r["chosen"]}],
                         "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in raw
                        if r["chosen"] != r["rejected"]])
times = []
class Timer(TrainerCallback):
    def on_step_end(self, *a, **k):
        times.append(time.perf_counter())
config = DPOConfig(output_dir=out, per_device_train_batch_size=int(batch), max_length=int(max_len), beta=0.1,
                   num_train_epochs=1, learning_rate=5e-7, logging_steps=10**6, save_strategy="no", report_to=[],
                   use_cpu=True, bf16=os.environ["TRL_BF16"] == "1", seed=0, dataloader_num_workers=0,
                   precompute_ref_log_probs=True)
tok = AutoTokenizer.from_pretrained(model_path)
trainer = DPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_path), args=config, train_dataset=ds,
                     processing_class=tok, callbacks=[Timer()])
trainer.train()
steps = len(times)
print(json.dumps({"pairs_per_s": int(batch) * (steps - 1) / (times[-1] - times[0]), "steps": steps}))
"""


TRL_GRPO = r"""
import json, os, sys, time
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer
model_path, data_path, prompts, samples, max_len, steps, micro, out = sys.argv[1:9]
prompts, samples, steps, micro = int(prompts), int(samples), int(steps), int(micro)
raw = [json.loads(line) for line in open(data_path)][: prompts * steps]
ds = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in raw])
def exact_match(completions, answer, **kwargs):
    return [float(c[0]["content"].strip() == a.strip()) for c, a in zip(completions, answer)]
times = []
class Timer(TrainerCallback):
    def on_step_end(self, *a, **k):
        times.append(time.perf_counter())
config = GRPOConfig(output_dir=out, per_device_train_batch_size=micro,
                    gradient_accumulation_steps=prompts * samples // micro, num_generations=samples,
                    max_completion_length=int(max_len), max_steps=steps, learning_rate=1e-6, beta=0.0,
                    temperature=1.0, logging_steps=10**6, save_strategy="no", report_to=[], use_cpu=True,
                    bf16=os.environ["TRL_BF16"] == "1", seed=0,
                    dataloader_num_workers=0)
tok = AutoTokenizer.from_pretrained(model_path)
trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_path), reward_funcs=exact_match, args=config,
                      train_dataset=ds, processing_class=tok, callbacks=[Timer()])
trainer.train()
print(json.dumps({"step_s": (times[-1] - times[0]) / (len(times) - 1), "steps": len(times)}))
"""


def build_shape_model(name):
    """The folder of a random-init Llama of MODEL_SHAPES[name] and its tokenizer, built on the first call."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from launch.tiny import build_tokenizer

    path = os.path.join(tempfile.gettempdir(), f"minrlhf-{name}")
    if os.path.exists(os.path.join(path, "tokenizer.json")):
        return path
    shape = MODEL_SHAPES[name]
    tokenizer = build_tokenizer(pad_to=shape["vocab_size"])
    config = LlamaConfig(**shape, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=None)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    tokenizer.save_pretrained(path)  # last: its tokenizer.json marks a finished build
    return path


def ensure_trl(trl_dir):
    if os.path.exists(os.path.join(trl_dir, "trl", "__init__.py")):
        return
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", trl_dir,
                           f"trl=={TRL_VERSION}"], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"error: could not install trl=={TRL_VERSION} into {trl_dir} (needs PyPI): {proc.stderr[-500:]}")


def run(cmd, env=None):
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        sys.exit(f"error: {' '.join(cmd[:3])} failed:\n{proc.stderr[-3000:]}")
    return proc.stdout


def after_first(path, key):
    values = [m[key] for m in map(json.loads, open(path)) if key in m]
    return sum(values[1:]) / len(values[1:])


def read_rows(path, n):
    return [json.loads(line) for line in open(path)][:n]


def token_counter(args):
    """Token counts of a chat-templated prompt, and of a response to it, as our scripts tokenize them."""
    from common.data import PromptArgs, format_prompt, format_response
    from common.infra.datasets import load_tokenizer

    data_args = PromptArgs(apply_chat_template=True)
    tok = load_tokenizer(args.model, data_args)

    def count(text):
        return len(tok(text, add_special_tokens=False)["input_ids"])

    return (lambda prompt: count(format_prompt(prompt, tok, data_args)),
            lambda prompt, response: count(format_response(prompt, response, tok, data_args)))


def mean_sft_tokens(args, data):
    """Tokens per SFT sample as sft.py builds them (chat-templated prompt + response)."""
    prompt_len, response_len = token_counter(args)
    return statistics.mean(prompt_len(r["prompt"]) + response_len(r["prompt"], r["response"])
                           for r in read_rows(data, args.samples))


def mean_dpo_tokens(args, data):
    """Tokens per DPO pair as dpo.py lays a pair out: the prompt once, then both responses."""
    prompt_len, response_len = token_counter(args)
    return statistics.mean(prompt_len(r["prompt"]) + response_len(r["prompt"], r["chosen"])
                           + response_len(r["prompt"], r["rejected"])
                           for r in read_rows(data, args.samples) if r["chosen"] != r["rejected"])


def matmul_rate(model, dtype):
    """FLOP/s of a 2048-token matmul at the model's MLP shape (hidden x intermediate) in `dtype`, best of 10."""
    import torch
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model).get_text_config()
    hidden, inner = config.hidden_size, getattr(config, "intermediate_size", None) or 4 * config.hidden_size
    kind = torch.bfloat16 if dtype == "bf16" else torch.float32
    a, b = torch.randn(2048, hidden, dtype=kind), torch.randn(hidden, inner, dtype=kind)
    times = []
    for _ in range(13):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * 2048 * hidden * inner / min(times[3:]), (hidden, inner)


def matmul_weights(model):
    """Weights a token meets in matmuls: every Linear, the LM head included (the embedding is a lookup)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        net = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model))
    return sum(m.weight.numel() for m in net.modules() if isinstance(m, torch.nn.Linear))


def ours_grpo(args, data, tmp, r, dtype):
    """Seconds per step of grpo.py at the benchmark's shape, and its mean response length in tokens (steps
    after the first)."""
    metrics, samples = os.path.join(tmp, f"grpo{r}.jsonl"), args.grpo_prompts * args.grpo_samples
    run([sys.executable, "algos/grpo.py", "--pretrain", args.model,
         "--prompt_data", os.path.join(data, "rl_train.jsonl"), "--input_key", "prompt", "--label_key", "answer",
         "--apply_chat_template",
         "--remote_rm_url", "launch/rewards/exact_match.py", "--n_samples_per_prompt", str(args.grpo_samples),
         "--rollout_batch_size", str(args.grpo_prompts), "--train_batch_size", str(samples),
         "--micro_train_batch_size", str(args.grpo_micro), "--micro_rollout_batch_size", str(args.grpo_micro),
         "--actor_num_gpus_per_node", "1",
         "--vllm_num_engines", str(args.grpo_vllm_engines), "--zero_stage", "0",
         "--prompt_max_len", "64", "--generate_max_len", str(args.grpo_max_len), "--max_steps", str(args.grpo_steps),
         "--param_dtype", dtype, "--save_path", os.path.join(tmp, "grpo"), "--metrics_file", metrics],
        env={"TOKENIZERS_PARALLELISM": "false"})
    steps = [m for m in map(json.loads, open(metrics)) if "perf/samples_per_s" in m][1:]
    return (statistics.mean(samples / m["perf/samples_per_s"] for m in steps),
            statistics.mean(m["train/response_length"] for m in steps))


def main(args: Args):
    from common.infra.engine import cpu_has_native_bf16

    chosen = [a.strip() for a in args.algos.split(",") if a.strip()]
    if not chosen or set(chosen) - {"sft", "dpo", "grpo"}:
        sys.exit(f"error: --algos takes a comma list of sft, dpo, grpo; got {args.algos!r}")
    ensure_trl(args.trl_dir)
    if args.model_shape:
        args = replace(args, model=build_shape_model(args.model_shape))
    dtype = args.param_dtype or ("bf16" if cpu_has_native_bf16() else "fp32")
    trl_env = {"PYTHONPATH": args.trl_dir, "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled",
               "TRL_BF16": "1" if dtype == "bf16" else "0"}
    ours_env = {"TOKENIZERS_PARALLELISM": "false"}
    data = os.path.join(args.assets, "data", "reverse")
    sft_data, pref_data = os.path.join(data, "sft_train.jsonl"), os.path.join(data, "pref_train.jsonl")
    results = {a: {"ours": [], "trl": []} for a in chosen}
    grpo_response_lens = []
    per_sample = mean_sft_tokens(args, sft_data) if "sft" in chosen else None  # the same data every round
    rate, (hidden, inner) = matmul_rate(args.model, dtype)  # before the rounds, and again after them
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            if "sft" in chosen:
                trl_rows = max(1, round(args.sft_batch * per_sample / args.max_len))  # rows carrying as many tokens
                metrics = os.path.join(tmp, f"sft{r}.jsonl")
                run([sys.executable, "algos/sft.py", "--pretrain", args.model, "--dataset", sft_data,
                     "--input_key", "prompt", "--output_key", "response", "--apply_chat_template",
                     "--max_len", str(args.max_len), "--max_samples", str(args.samples),
                     "--train_batch_size", str(args.sft_batch), "--micro_train_batch_size", str(args.sft_batch),
                     "--zero_stage", "0", "--param_dtype", dtype, "--save_path", os.path.join(tmp, "sft"),
                     "--metrics_file", metrics], env=ours_env)
                results["sft"]["ours"].append(after_first(metrics, "perf/samples_per_s") * per_sample)
                out = run([sys.executable, "-c", TRL_SFT, args.model, sft_data, str(args.samples), str(trl_rows),
                           str(args.max_len), os.path.join(tmp, "trl_sft")], env=trl_env)
                results["sft"]["trl"].append(json.loads(out.strip().splitlines()[-1])["tokens_per_s"])
            if "dpo" in chosen:
                metrics = os.path.join(tmp, f"dpo{r}.jsonl")
                run([sys.executable, "algos/dpo.py", "--pretrain", args.model, "--dataset", pref_data,
                     "--input_key", "prompt", "--apply_chat_template", "--skip_bad_rows", "--max_len",
                     str(args.max_len), "--max_samples", str(args.samples), "--train_batch_size", str(args.dpo_batch),
                     "--micro_train_batch_size", str(args.dpo_batch), "--zero_stage", "0", "--param_dtype", dtype,
                     "--save_path", os.path.join(tmp, "dpo"), "--metrics_file", metrics], env=ours_env)
                results["dpo"]["ours"].append(after_first(metrics, "perf/pairs_per_s"))
                out = run([sys.executable, "-c", TRL_DPO, args.model, pref_data, str(args.samples),
                           str(args.dpo_batch), str(args.max_len), os.path.join(tmp, "trl_dpo")], env=trl_env)
                results["dpo"]["trl"].append(json.loads(out.strip().splitlines()[-1])["pairs_per_s"])
            if "grpo" in chosen:
                step_s, response_len = ours_grpo(args, data, tmp, r, dtype)
                results["grpo"]["ours"].append(step_s)
                grpo_response_lens.append(response_len)
                out = run([sys.executable, "-c", TRL_GRPO, args.model, os.path.join(data, "rl_train.jsonl"),
                           str(args.grpo_prompts), str(args.grpo_samples), str(args.grpo_max_len),
                           str(args.grpo_steps), str(args.grpo_micro), os.path.join(tmp, "trl_grpo")], env=trl_env)
                results["grpo"]["trl"].append(json.loads(out.strip().splitlines()[-1])["step_s"])
            print(f"round {r + 1}: " + json.dumps({a: {s: round(v[-1], 1) for s, v in sides.items()}
                                                   for a, sides in results.items()}), flush=True)
    print(f"\nmodel {args.model_shape or args.model}, {args.samples} samples per run, {args.rounds} alternating "
          f"rounds, CPU, both sides {dtype}; best: each side's best round; per round: the median of the rounds' "
          "own ratios")
    print(f"{'algorithm':<10} {'unit':<14} {'minrlhf':>10} {'TRL ' + TRL_VERSION:>10} {'best':>7} {'per round':>10}")
    for algo, unit in (("sft", "tokens/s"), ("dpo", "pairs/s"), ("grpo", "s/step")):
        if algo in chosen:
            pick = min if algo == "grpo" else max  # GRPO: time, lower is better
            ours, trl = results[algo]["ours"], results[algo]["trl"]
            per_round = statistics.median(o / t for o, t in zip(ours, trl))
            print(f"{algo:<10} {unit:<14} {pick(ours):>10.2f} {pick(trl):>10.2f} {pick(ours) / pick(trl):>6.2f}x "
                  f"{per_round:>9.2f}x" + ("  (time: lower is better)" if algo == "grpo" else ""))

    rate = max(rate, matmul_rate(args.model, dtype)[0])  # other load only slows a matmul: the faster is the floor's
    weights = matmul_weights(args.model)
    train_flop = 6 * weights  # per trained token, forward and backward
    print(f"\narithmetic floor: every matmul at {rate / 1e9:.0f} GFLOP/s ({dtype}, 2048 x {hidden} x {inner} on this "
          f"machine) and nothing else; {weights / 1e6:.2f}M matmul weights")
    print(f"{'algorithm':<10} {'floor':>24} {'ours at':>8} {'TRL at':>7} {'target':>7} {'needs':>6}")
    for algo in chosen:
        ours, trl = results[algo]["ours"], results[algo]["trl"]
        if algo == "grpo":
            prompt_len, _ = token_counter(args)
            prompt_tokens = statistics.mean(prompt_len(r["prompt"]) for r in read_rows(
                os.path.join(data, "rl_train.jsonl"), args.grpo_prompts * args.grpo_steps))
            responses = args.grpo_prompts * args.grpo_samples * statistics.mean(grpo_response_lens)
            floor = (train_flop * (args.grpo_prompts * prompt_tokens + responses) + 2 * weights * responses) / rate
            shown, at, trl_at, target = f"{floor:.2f} s/step", floor / min(ours), floor / min(trl), args.target_grpo
            needs = floor / (target * min(trl))
        else:
            per_item = 1 if algo == "sft" else mean_dpo_tokens(args, pref_data)
            floor = rate / (train_flop * per_item)
            shown, at, trl_at = (f"{floor:,.1f} {'tokens/s' if algo == 'sft' else 'pairs/s'}", max(ours) / floor,
                                 max(trl) / floor)
            target = args.target_sft if algo == "sft" else args.target_dpo
            needs = target * max(trl) / floor
        print(f"{algo:<10} {shown:>24} {at:>7.0%} {trl_at:>7.0%} {target:>6.2f}x {needs:>6.0%}")


if __name__ == "__main__":
    main(tyro.cli(Args, use_underscores=True, description=__doc__))
