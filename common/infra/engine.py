"""Trust tier: read the faces, trust the body.

DeepSpeed mechanism: distributed init, batch arithmetic, model loading (LoRA / QLoRA / ZeRO-3),
engine creation, resumable checkpoints and Hugging Face export.

Plain functions over three small option groups (ModelArgs, TrainArgs, CkptArgs) that every
training script nests into its own `Args`.
"""

import atexit
import ctypes
import datetime
import fcntl
import os
import random
import re
import shutil
import signal
import socket
import sys
import threading
import typing
import warnings
from dataclasses import dataclass, fields, is_dataclass, replace
from typing import Literal, Optional

import numpy as np
import torch
import torch.distributed as dist
import tyro

from common.data import DataArgs, PromptArgs
from common.infra.datasets import split_specs


# ----------------------------------------------------------------------------------------------
# Option groups (flat on the command line: --zero_stage, --lora_rank, ...)
# ----------------------------------------------------------------------------------------------
@dataclass
class ModelArgs:
    pretrain: str = tyro.MISSING
    """Hugging Face model directory (or hub name) to start from (required)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    attn_implementation: Optional[str] = None
    """Attention kernel; default varlen_sdpa (per packed sample: torch's flash kernels on CUDA in bf16, per-sample
    sdpa in fp32, a fused CPU kernel on CPU); flash_attention_2 needs flash_attn, CUDA and bf16."""
    lora_rank: int = 0
    """LoRA rank; 0 trains all weights."""
    lora_alpha: int = 16
    """LoRA scaling alpha."""
    lora_dropout: float = 0.0
    """LoRA dropout."""
    target_modules: str = "all-linear"
    """Comma list of module names LoRA adapts ('all-linear' for every linear layer but the head)."""
    load_in_4bit: bool = False
    """Load the base model in 4-bit NF4 (QLoRA; needs --lora_rank > 0)."""
    aux_loss_coef: float = 0.0
    """Coefficient of the MoE router load-balancing loss (0: off)."""
    logps_chunk_tokens: int = 1024
    """Tokens per chunk of the chunked LM head (common.kernels.chunked_head): a causal LM's per-token log-probs
    without the whole (tokens x vocab) logits; 0: whole logits. Reward and value heads have no vocabulary and do
    not use it; common.kernels.chunked_head.head_chunk_tokens says where it falls back to whole logits."""


@dataclass
class TrainArgs:
    train_batch_size: int = 32
    """Global samples per optimizer step, across all data-parallel ranks."""
    micro_train_batch_size: int = 8
    """Samples per forward pass on one rank; accumulation steps are derived."""
    max_epochs: int = 1
    """Passes over the training data."""
    learning_rate: float = 1e-5
    """Peak learning rate (AdamW)."""
    lr_warmup_ratio: float = 0.03
    """Fraction of steps with linear warmup."""
    lr_scheduler: str = "cosine_with_min_lr"
    """Any transformers scheduler name (constant_with_warmup, linear, cosine_with_min_lr, ...)."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak (cosine_with_min_lr only)."""
    weight_decay: float = 0.0
    """AdamW weight decay (not applied to biases and norms)."""
    adam_betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    max_norm: float = 1.0
    """Gradient clipping norm (0: off)."""
    zero_stage: Optional[int] = None
    """DeepSpeed ZeRO stage: 0, 1, 2 or 3 (default: 0 in a world of one rank, where ZeRO would partition nothing
    and only add its gradient copies; 2 in a larger world or with --adam_offload)."""
    adam_offload: bool = False
    """Keep optimizer states on the CPU (DeepSpeedCPUAdam)."""
    param_offload: bool = False
    """Keep parameters on the CPU (ZeRO-3 only)."""
    seed: int = 42
    """Seed for data order and initialisation."""
    param_dtype: Optional[Literal["bf16", "fp32"]] = None
    """Compute precision: bf16 (CUDA: bf16 weights, fp32 master weights and optimizer states; CPU: fp32 weights,
    bf16 matmuls under autocast, ~2x the fp32 speed where the CPU multiplies bf16 natively) or fp32; losses
    in fp32 either way; vLLM engines follow it. Default bf16 on CUDA, fp32 on CPU (bf16 cost the tiny test models
    accuracy)."""


@dataclass
class CkptArgs:
    save_path: str = "outputs/model"
    """Final Hugging Face export directory."""
    save_steps: int = -1
    """Save a resumable DeepSpeed checkpoint to --ckpt_path every N optimizer steps and at the end (-1: never)."""
    ckpt_path: str = "outputs/checkpoints"
    """Directory of resumable checkpoints."""
    load_checkpoint: bool = False
    """Resume from the latest checkpoint in --ckpt_path if there is one."""
    max_ckpt_num: int = 3
    """Keep only the newest N checkpoints."""
    merge_lora: bool = False
    """With LoRA, export base weights merged with the adapter (the adapter also goes to save_path/adapter)."""


def script_ckpt_args(script):
    """CkptArgs whose --save_path / --ckpt_path default to outputs/<script name> and outputs/<script name>_ckpt
    (CleanRL's exp_name from __file__), so a copy (my_dpo.py) never writes to, or resumes, its parent's run."""
    name = os.path.splitext(os.path.basename(script))[0]
    return CkptArgs(save_path=f"outputs/{name}", ckpt_path=f"outputs/{name}_ckpt")


# ----------------------------------------------------------------------------------------------
# Command line: one flat flag per field (--zero_stage, not --train.zero_stage)
# ----------------------------------------------------------------------------------------------
def parse_cli(cls, argv, description):
    """`tyro.cli(cls)` with the option groups' prefixes omitted. Two fields that would get the same flag
    (a field a fork adds under a name a shared option group already uses) raise ValueError naming both,
    where tyro would stop with a bare `AssertionError: Name conflict`."""
    owners = {}
    for flag, owner in cli_flags(cls, cls.__name__):
        if flag in owners:
            raise ValueError(f"{flag} is defined twice: by {owners[flag]} and by {owner}; rename the new field")
        owners[flag] = owner
    return tyro.cli(cls, args=argv, config=(tyro.conf.OmitArgPrefixes,), use_underscores=True, description=description)


def cli_flags(cls, path):
    """(flag, owner) for every flag of the dataclass `cls`, nested option groups and aliases included."""
    hints = typing.get_type_hints(cls, include_extras=True)
    for f in fields(cls):
        hint, marks = hints[f.name], ()
        if typing.get_origin(hint) is typing.Annotated:
            hint, *marks = typing.get_args(hint)
        owner = f"{path}.{f.name}" + (f" (option group {cls.__name__})" if "." in path else "")
        if is_dataclass(hint):
            yield from cli_flags(hint, f"{path}.{f.name}")
        elif tyro.conf.Suppress not in marks:
            config = next((m for m in marks if hasattr(m, "aliases") and hasattr(m, "name")), None)
            yield f"--{(config and config.name) or f.name}", owner
            for alias in (config and config.aliases) or ():
                yield alias, owner


def validate_common_args(model: ModelArgs, train: TrainArgs, ckpt: CkptArgs, world_size: int):
    """Argument checks that need no model: raise ValueError naming the flag."""
    if train.zero_stage not in (None, 0, 1, 2, 3):
        raise ValueError(f"--zero_stage must be 0, 1, 2 or 3, got {train.zero_stage}")
    if train.param_offload and train.zero_stage != 3:
        raise ValueError("--param_offload needs --zero_stage 3")
    if train.adam_offload and train.zero_stage == 0:  # DeepSpeedCPUAdam steps ZeRO's CPU partitions, not the module's
        raise ValueError("--adam_offload needs --zero_stage 1-3 (unset: 2), got --zero_stage 0")
    if model.load_in_4bit and model.lora_rank <= 0:
        raise ValueError("--load_in_4bit (QLoRA) trains LoRA adapters: set --lora_rank > 0")
    if ckpt.merge_lora and model.lora_rank <= 0:
        raise ValueError("--merge_lora needs --lora_rank > 0")
    if ckpt.max_ckpt_num < 1:
        raise ValueError(f"--max_ckpt_num must be >= 1, got {ckpt.max_ckpt_num}")
    accumulation_steps(train.train_batch_size, train.micro_train_batch_size, world_size)
    if model.attn_implementation is not None:  # flash-attn in fp32, or off CUDA, fails at the first forward
        from common.infra.gpu import attention_implementation

        cuda = torch.cuda.is_available()
        attention_implementation("cuda" if cuda else "cpu", "bfloat16" if cuda and uses_bf16(train) else "float32",
                                 flash_attn_installed(), model.attn_implementation)


def validate_data_args(args: DataArgs, attn_implementation=None):
    """Checks that need no data or model: raise ValueError naming the flag. attn_implementation is
    --attn_implementation as given (None: the device's default)."""
    specs = split_specs(args.dataset)
    if not specs:
        raise ValueError("--dataset is empty")
    if args.dataset_probs is not None:
        probs = [float(p) for p in args.dataset_probs.split(",")]
        if len(probs) != len(specs):
            raise ValueError(f"--dataset_probs has {len(probs)} values but --dataset names {len(specs)} datasets")
        if any(p < 0 for p in probs) or abs(sum(probs) - 1) > 1e-6:
            raise ValueError(f"--dataset_probs must be non-negative and sum to 1, got {args.dataset_probs}")
    validate_prompt_args(args)
    if args.max_len < 2:
        raise ValueError(f"--max_len must be >= 2, got {args.max_len}")
    if args.pack_max_tokens and args.pack_max_tokens < args.max_len:
        raise ValueError(f"--pack_max_tokens {args.pack_max_tokens} must be >= --max_len {args.max_len}")
    from common.packing import one_row_per_batch
    if args.pack_max_tokens and one_row_per_batch(attn_implementation):
        kernel = attn_implementation or "the default kernel (varlen_sdpa on CPU)"
        raise ValueError(f"--pack_max_tokens bounds packed rows for masked attention (--attn_implementation sdpa or "
                         f"eager); {kernel} packs each micro-batch as one row (size it with --micro_train_batch_size)")


def validate_prompt_args(args: PromptArgs):
    """The prompt format flags: one '{}' in --input_template, which the chat template would ignore."""
    if args.input_template is not None and "{}" not in args.input_template:
        raise ValueError(f"--input_template must contain '{{}}' where the prompt goes, got {args.input_template!r}")
    if args.input_template is not None and args.apply_chat_template:
        raise ValueError("--input_template and --apply_chat_template exclude each other (the chat template "
                         "formats the prompt; put any wording into --tokenizer_chat_template)")


def flash_attn_installed():
    """Whether the flash_attn package is importable (found, not imported: it loads CUDA kernels)."""
    import importlib.util

    return importlib.util.find_spec("flash_attn") is not None


def accumulation_steps(train_batch_size, micro_train_batch_size, world_size):
    """Gradient accumulation steps so that micro x accumulation x world = global batch."""
    per_step = micro_train_batch_size * world_size
    if micro_train_batch_size < 1 or train_batch_size % per_step:
        raise ValueError(
            f"--train_batch_size {train_batch_size} must be a multiple of --micro_train_batch_size "
            f"{micro_train_batch_size} x world size {world_size} = {per_step}"
        )
    return train_batch_size // per_step


# ----------------------------------------------------------------------------------------------
# Distributed setup
# ----------------------------------------------------------------------------------------------
def world_size_from_env():
    return int(os.environ.get("WORLD_SIZE", "1"))


_PARENT_AT_IMPORT = os.getppid()  # a torchrun worker's launcher, unless it died before this import


def free_port(host="127.0.0.1"):
    """A port free on `host` now, for a rendezvous another process binds later. Taken below the kernel's
    ephemeral range where there is room: ports there are handed to every outgoing connection (Ray's and
    vLLM's many), which could take this one before its owner binds it (EADDRINUSE seen once in a 2-node Ray
    test); below it only another explicit pick can. From 20000 up: Ray's workers take 10002-19999."""
    try:
        low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    rng = random.Random()  # not the run's seeded generator: concurrent runs must not pick alike
    for port in ([rng.randrange(20000, low) for _ in range(64)] if low > 20000 else []) + [0]:
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return s.getsockname()[1]


def init_distributed(timeout_s=None):
    """Join the torchrun group (NCCL on CUDA, gloo on CPU); a plain `python` run is a world of one.
    timeout_s bounds the rendezvous and every collective (default: torch's 30 minutes).
    A torchrun worker dies with its launcher (see die_with_launcher)."""
    import deepspeed

    if dist.is_initialized():
        return
    if "TORCHELASTIC_RUN_ID" in os.environ:
        die_with_launcher()
    # ZeRO-3 calls deprecated collectives on every gather; one warning per call floods the log
    warnings.filterwarnings("ignore", message=r".*(all_gather_into_tensor|reduce_scatter_tensor).*is deprecated")
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = {"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s else {}
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo", verbose=False, **timeout)


def die_with_launcher():
    """Have the kernel SIGKILL this torchrun worker when its launcher dies (torchrun puts workers in sessions of
    their own, so a launcher lost to the OOM killer would leave them training). Linux only; not for Ray actors."""
    if not sys.platform.startswith("linux"):
        return
    PR_SET_PDEATHSIG = 1
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        warnings.warn(
            f"prctl(PR_SET_PDEATHSIG): {os.strerror(ctypes.get_errno())}; this worker would outlive its launcher")
    elif os.getppid() != _PARENT_AT_IMPORT:  # the launcher died before prctl: we were handed to a reaper
        print(f"rank {os.environ.get('RANK')}: the torchrun launcher (pid {_PARENT_AT_IMPORT}) has died; exiting",
              file=sys.stderr)
        os._exit(1)


def run(main, parse_args, errors=(ValueError,), parse_errors=(ValueError,), holds_ckpt=True):
    """Every script's entry point and its one exit path. parse_args(): an argument mistake (one of `parse_errors`)
    prints `error: <what to fix>` and exits 1 before any model loads; then, unless holds_ckpt is False, the run takes
    --ckpt_path's lock (a second run on the same path stops here). main(args): one of `errors` (a data mistake
    raised alike on every rank; in the Ray drivers a role or engine that died, raised or did not start, named with
    its root cause) prints `error: <message>` once, on its own line, and the process exits 1; otherwise it exits 0.
    Either way through finish()."""
    try:
        args = parse_args()
        if holds_ckpt:
            hold_ckpt_path(args.ckpt)
    except parse_errors as e:
        sys.exit(f"error: {e}")
    try:
        main(args)
    except errors as e:
        finish(error=e)
    finish()


def finish(error=None):
    """End a script whose main() returned: run what a normal exit runs first (join non-daemon threads, atexit
    hooks: vLLM and Ray shutdown, W&B, temporary directories), flush, then os._exit. Why: C++ threads (DeepSpeed's
    gloo groups, a weight-sync TCPStore, vLLM's zmq) occasionally aborted the interpreter's teardown with SIGABRT
    after all work was done. Only from `if __name__ == "__main__":` (run does it), so a test calling main() is
    never exited. With `error` (raised alike on every rank, e.g. a data error), rank 0 closes the progress bars
    still drawn and prints `error: <message>` on a line of its own, and every rank exits 1."""
    if error is not None and is_rank0():
        from tqdm import tqdm

        bars = list(getattr(tqdm, "_instances", ()))
        for bar in bars:
            bar.close()
        # closing a nested bar leaves the cursor up on the outer bar's line: start the error on a new one
        print(("\n" if bars else "") + f"error: {error}", file=sys.stderr)
    threading._shutdown()  # what the interpreter runs before the atexit hooks
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if error is None else 1)


def is_rank0():
    return not dist.is_initialized() or dist.get_rank() == 0


def device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def all_reduce_sum(values):
    """Sum a list of floats over all ranks (float64, so token counts stay exact)."""
    t = torch.tensor(values, dtype=torch.float64, device=device())
    if dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


# ----------------------------------------------------------------------------------------------
# DeepSpeed config and model loading
# ----------------------------------------------------------------------------------------------
def cpu_has_native_bf16():
    """Whether this CPU multiplies bf16 in hardware (x86 AVX512-BF16 or AMX-BF16, Arm BF16): there bf16
    matmuls run ~4x faster than fp32; elsewhere oneDNN emulates them, slower than fp32."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(f.read().split())
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def uses_bf16(train: TrainArgs):
    """--param_dtype, resolved: bf16 on CUDA, fp32 on CPU unless asked for."""
    if train.param_dtype is None:
        return torch.cuda.is_available()
    if train.param_dtype == "bf16" and not torch.cuda.is_available() and not cpu_has_native_bf16():
        warnings.warn("--param_dtype bf16: this CPU has no native bf16 matmul (AVX512-BF16, AMX, Arm BF16); "
                      "emulated bf16 is slower than fp32")
    return train.param_dtype == "bf16"


def precision_config(train: TrainArgs):
    """DeepSpeed's precision settings for --param_dtype. bf16 on CUDA: DeepSpeed's bf16 mode (bf16 weights, fp32
    master weights and optimizer states). bf16 on CPU: fp32 weights, linear layers under torch.autocast (DeepSpeed's
    torch_autocast), 2.3x fp32's tokens per CPU-second on the 8.5M Llama. Log-softmax and losses stay fp32."""
    bf16, cuda = uses_bf16(train), torch.cuda.is_available()
    autocast = {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}} if bf16 and not cuda else {}
    return {"bf16": {"enabled": bf16 and cuda}, **autocast}


def zero_stage(train: TrainArgs, world_size):
    """--zero_stage, resolved for `world_size` trainer ranks (every rank of a ring counts): 0 in a world of one,
    2 in a larger one or with --adam_offload (its CPU optimizer steps ZeRO's partitions), unless set."""
    if train.zero_stage is not None:
        return train.zero_stage
    return 0 if world_size == 1 and not train.adam_offload else 2


def deepspeed_config(train: TrainArgs, world_size, ring_size=1):
    """DeepSpeed training config: --param_dtype's precision, batch sizes checked against the world. DeepSpeed counts
    every rank of an attention ring (common.ring_attention) as data-parallel, so it gets --train_batch_size x
    ring_size, and the accumulation steps come from the data-parallel size."""
    train = replace(train, train_batch_size=train.train_batch_size * ring_size)
    zero = {"stage": zero_stage(train, world_size), "stage3_gather_16bit_weights_on_model_save": True}
    if zero["stage"] == 3:
        zero.update(stage3_param_persistence_threshold=1e4, stage3_prefetch_bucket_size=5e7)
    if train.adam_offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if train.param_offload:
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    return {
        "train_micro_batch_size_per_gpu": train.micro_train_batch_size,
        "gradient_accumulation_steps": accumulation_steps(train.train_batch_size, train.micro_train_batch_size,
                                                          world_size),
        "train_batch_size": train.train_batch_size,
        "gradient_clipping": train.max_norm,
        "zero_optimization": zero,
        **precision_config(train),
        "zero_allow_untested_optimizer": True,  # torch AdamW
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**12,
        "wall_clock_breakdown": False,
    }


def deepspeed_eval_config(train: TrainArgs, world_size, offload=False):
    """Config for a frozen model (reference, teacher, reward model): ZeRO-3 partitioned when the
    trainer uses ZeRO-3, else a plain replica; parameters on the CPU with `offload` (ZeRO-3)."""
    stage = 3 if zero_stage(train, world_size) == 3 or offload else 0
    zero = {"stage": stage}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=1e4, stage3_prefetch_bucket_size=5e7)
    if offload:
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    return {
        "train_micro_batch_size_per_gpu": train.micro_train_batch_size,
        "train_batch_size": train.micro_train_batch_size * world_size,
        "zero_optimization": zero,
        **precision_config(train),
        "steps_per_print": 10**12,
    }


_HF_DS_CONFIGS = []  # transformers reads ZeRO-3 settings from a live HfDeepSpeedConfig at from_pretrained


def load_causal_lm(model_args: ModelArgs, ds_config=None, path=None, model_cls=None, ring=None, **kwargs):
    """Load a causal LM for training or inference, in the dtype `ds_config` trains in (without one: bf16 on
    CUDA, fp32 on CPU), partitioned at load time under ZeRO-3, with LoRA / QLoRA adapters and gradient
    checkpointing as asked. The model keeps this project's settings of it (common.logprobs.ModelSettings: the
    LM head's chunk, `ring` where its rows are split over one, the KV-cache setting to export, the batch layout
    its attention kernel takes); with a ring, the model must run it exactly (ValueError naming the flags)."""
    from transformers import AutoModelForCausalLM

    import common.kernels.varlen_attention  # noqa: F401  (registers varlen_sdpa by name)
    from common.infra.gpu import attention_implementation
    from common.logprobs import ModelSettings
    from common.packing import batch_layout

    model_cls = model_cls or AutoModelForCausalLM
    if ds_config is not None and ds_config["zero_optimization"]["stage"] == 3:
        from transformers.integrations import HfDeepSpeedConfig

        _HF_DS_CONFIGS.append(HfDeepSpeedConfig(ds_config))
    bf16 = ds_config["bf16"]["enabled"] if ds_config is not None else torch.cuda.is_available()
    dtype = torch.bfloat16 if bf16 else torch.float32
    if model_args.load_in_4bit:
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype
        )
    model = model_cls.from_pretrained(
        path or model_args.pretrain, dtype=dtype,
        attn_implementation=attention_implementation("cuda" if torch.cuda.is_available() else "cpu", dtype,
                                                     flash_attn_installed(), model_args.attn_implementation),
        **kwargs,
    )
    _HF_DS_CONFIGS.clear()
    if ring is not None:
        from common.ring_attention import check_ring_model

        check_ring_model(model, ring)
    # packed rows give wrong logits with the KV cache on; save_hf_model exports the model's own setting
    model.minrlhf = ModelSettings(logps_chunk_tokens=model_args.logps_chunk_tokens, ring=ring,
                                  export_use_cache=model.config.use_cache,
                                  layout=batch_layout(model.config._attn_implementation, ring))
    model.config.use_cache = False
    if model_args.aux_loss_coef > 0:
        if not hasattr(model.config, "output_router_logits"):
            raise ValueError(f"--aux_loss_coef is set but {model.config.model_type} is not a mixture-of-experts model")
        model.config.output_router_logits = True
    if ds_config is not None and ds_config["zero_optimization"]["stage"] == 3:
        moe_blocks = {type(m) for m in model.modules() if type(m).__name__.endswith("SparseMoeBlock")}
        if moe_blocks:  # ZeRO-3 hangs when experts are gathered one by one; gather each MoE block whole
            from deepspeed.utils import set_z3_leaf_modules

            set_z3_leaf_modules(model, list(moe_blocks))
    if model_args.load_in_4bit:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=model_args.gradient_checkpointing)
    if model_args.lora_rank > 0:
        from peft import LoraConfig, get_peft_model

        targets = model_args.target_modules
        model = get_peft_model(model, LoraConfig(
            r=model_args.lora_rank, lora_alpha=model_args.lora_alpha, lora_dropout=model_args.lora_dropout,
            target_modules=targets if targets == "all-linear" else targets.split(","),
            task_type="SEQ_CLS" if type(model).__name__.endswith("ForSequenceClassification") else "CAUSAL_LM",
        ))
    if model_args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if model_args.lora_rank > 0:
            model.enable_input_require_grads()
    return model


def create_train_engine(model, train: TrainArgs, ds_config, num_training_steps, offload_states=False):
    """Wrap `model` in a DeepSpeed engine with AdamW (no decay on biases / norms) and a warmup schedule;
    offload_states: the engine's states will leave the device (engine.offload_states), which DeepSpeed does
    under ZeRO-3 only with its own FusedAdam (common.infra.gpu.optimizer_kind)."""
    import deepspeed
    from transformers import get_scheduler

    from common.infra.gpu import optimizer_kind
    from common.kernels.chunked_head import hf_model
    from common.logprobs import model_settings

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 or "norm" in name.lower() else decay).append(p)
    groups = [{"params": decay, "weight_decay": train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    opt_kwargs = dict(lr=train.learning_rate, betas=train.adam_betas, eps=1e-8)
    stage = ds_config["zero_optimization"]["stage"]
    kind = optimizer_kind(torch.cuda.is_available(), train.adam_offload, stage, offload_states)
    if kind == "cpu_adam":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        optimizer = DeepSpeedCPUAdam(groups, adamw_mode=True, **opt_kwargs)
    elif kind == "deepspeed_fused":  # JIT-built on first use: needs nvcc matching torch's CUDA
        from deepspeed.ops.adam import FusedAdam

        optimizer = FusedAdam(groups, adam_w_mode=True, **opt_kwargs)
    else:  # torch's fused kernel (CPU and CUDA, no build): one pass over the weights, ~3x the per-op loop on CPU
        optimizer = torch.optim.AdamW(groups, fused=True, **opt_kwargs)
    extra = {"min_lr_rate": train.min_lr_ratio} if train.lr_scheduler == "cosine_with_min_lr" else None
    scheduler = get_scheduler(
        train.lr_scheduler, optimizer, num_warmup_steps=int(train.lr_warmup_ratio * num_training_steps),
        num_training_steps=num_training_steps, scheduler_specific_kwargs=extra,
    )
    # ZeRO-0 without DeepSpeed's bf16 / fp16 wrapper (fp32 gradients): optimizer_step clips, with the gradient
    # norm it computes for the log anyway (one foreach pass), instead of DeepSpeed computing it again tensor by
    # tensor (~6 ms of a DPO step of the 8.5M Llama)
    wrapped = ds_config.get("bf16", {}).get("enabled") or ds_config.get("fp16", {}).get("enabled")
    plain_zero0 = stage == 0 and not wrapped
    if plain_zero0:
        ds_config = {**ds_config, "gradient_clipping": 0.0}
    clip_in_step = train.max_norm if plain_zero0 else 0.0
    settings = replace(model_settings(model), clip_grad_norm_in_step=clip_in_step)
    hf_model(model).minrlhf = settings
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config)
    if dist.get_world_size() == 1 and plain_zero0:
        # a world of one has nothing to all-reduce, yet ZeRO-0 flattens every gradient, all-reduces the copy
        # in fp32 (here the gradients' own dtype: an exact identity) and copies it back: ~11 % of the CPU time
        # of a DPO step of the 8.5M model (tests/test_sft.py::test_loss_normalisation_across_accumulation_and_ranks)
        engine.enable_backward_allreduce = False
    return engine


def backward_step(engine, loss_sum, normaliser, averaged=0.0):
    """Backward of one micro-batch's part of its optimizer step's loss, then the optimizer step at an accumulation
    boundary; returns the global gradient norm there (else None). The step's loss is the sum of every micro-batch's
    `loss_sum` on every rank divided by `normaliser`, the step's loss units summed over the ranks the same way (the
    ranks of a ring each count the samples they share, as each computes their loss). DeepSpeed divides each
    micro-batch's loss by the accumulation steps and averages gradients over ranks: this is the one place that
    undoes both. `averaged`: a term DeepSpeed's averaging already makes right (a mean per micro-batch, such as a
    MoE router loss)."""
    scale = engine.gradient_accumulation_steps() * (dist.get_world_size() if dist.is_initialized() else 1)
    engine.backward(loss_sum * scale / normaliser + averaged)
    return optimizer_step(engine)


def optimizer_step(engine):
    """engine.step(); at an accumulation boundary returns the global gradient norm (before
    clipping), which DeepSpeed keeps for ZeRO 1-3 and which is computed here for ZeRO-0 (and the
    gradients clipped with it, where create_train_engine left the clipping to this step)."""
    from common.logprobs import model_settings

    boundary = engine.is_gradient_accumulation_boundary()
    norm = None
    if boundary and engine.zero_optimization_stage() == 0:  # gradients are all-reduced by now
        params = [p for p in engine.module.parameters() if p.grad is not None]
        total = torch.nn.utils.get_total_norm([p.grad.detach().float() for p in params]) if params else None
        norm = total.item() if params else 0.0  # foreach: one kernel, not one per tensor
        max_norm = model_settings(engine).clip_grad_norm_in_step
        if params and 0 < max_norm < norm + 1e-6:  # torch's and DeepSpeed's rule: scale by max_norm / (norm + 1e-6)
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    engine.step()
    if boundary and engine.get_global_grad_norm() is not None:
        norm = float(engine.get_global_grad_norm())
    return norm


def create_eval_engine(model, ds_config):
    """A frozen model under DeepSpeed (partitioned / offloaded as `ds_config` says), in eval mode."""
    import deepspeed

    model.requires_grad_(False)
    engine, *_ = deepspeed.initialize(model=model, config=ds_config)
    engine.eval()
    return engine


# ----------------------------------------------------------------------------------------------
# A script's main() in a few calls: setup, train_engine / frozen_engine, resume, maybe_save
# ----------------------------------------------------------------------------------------------
@dataclass
class World:
    """Where this rank stands in the run (what setup returns)."""
    size: int
    """Ranks in the run."""
    dp_rank: int
    """Which share of each global batch this rank takes (the ranks of a ring take the same one)."""
    dp_world: int
    """How many shares there are: ranks / ring size."""
    ring: Optional[object] = None
    """This rank's common.ring_attention.Ring with --ring_attn_size > 1, else None."""

    def shard(self, items):
        """This rank's share of a global batch's `items` (the ranks of a ring take the same one)."""
        n = len(items) // self.dp_world
        return items[self.dp_rank * n : (self.dp_rank + 1) * n]

    @property
    def copies(self):
        """Ranks holding each sample (a ring's; 1 without): a sum over all ranks counts each this many times."""
        return self.size // self.dp_world


def setup(ring_args, seed) -> World:
    """Join the torchrun group (a plain `python` run is a world of one; a rank already in a group, such as a Ray
    trainer rank after its rendezvous, stays in it), build the attention rings of `ring_args` (a
    common.infra.rings.RingArgs) and seed every generator."""
    init_distributed()
    set_seed(seed)
    size = dist.get_world_size()
    if ring_args.ring_attn_size <= 1:
        return World(size=size, dp_rank=dist.get_rank(), dp_world=size)
    from common.ring_attention import setup_ring

    ring = setup_ring(ring_args)
    return World(size=size, dp_rank=ring.dp_rank, dp_world=ring.dp_world, ring=ring)


def train_engine(model_args: ModelArgs, train: TrainArgs, num_training_steps, world: World, offload_states=False,
                 **load_kwargs):
    """load_causal_lm (`load_kwargs`: e.g. model_cls for a reward or value model) wrapped by create_train_engine,
    for the ring of `world` where there is one (the model keeps it: common.logprobs.token_logps splits its rows over
    it)."""
    ds_config = deepspeed_config(train, world.size, ring_size=world.ring.size if world.ring else 1)
    model = load_causal_lm(model_args, ds_config, ring=world.ring, **load_kwargs)
    return create_train_engine(model, train, ds_config, num_training_steps, offload_states)


def frozen_engine(model_args: ModelArgs, train: TrainArgs, world: World, offload=False, **load_kwargs):
    """A frozen model (reference, teacher, reward model) under DeepSpeed inference (deepspeed_eval_config: ZeRO-3
    partitioned when training is, parameters on the CPU with `offload`), over the ring of `world` as train_engine's."""
    ds_config = deepspeed_eval_config(train, world.size, offload=offload)
    model = load_causal_lm(model_args, ds_config, ring=world.ring, **load_kwargs)
    return create_eval_engine(model, ds_config)


def resume(engine, ckpt: CkptArgs):
    """With --load_checkpoint: load the newest checkpoint in --ckpt_path into `engine` and return its client state
    (None where there is none yet; rank 0 says which); without it, None."""
    if not ckpt.load_checkpoint:
        return None
    state = load_checkpoint(engine, ckpt.ckpt_path)
    if is_rank0():
        print(f"resumed from {ckpt.ckpt_path} at step {state['global_step']}" if state else
              f"no checkpoint in {ckpt.ckpt_path}: starting from step 0")
    return state


def maybe_save(engine, ckpt: CkptArgs, global_step, total_steps, client_state):
    """Every --save_steps optimizer steps and at the last step, save_checkpoint to --ckpt_path."""
    if ckpt.save_steps > 0 and (global_step % ckpt.save_steps == 0 or global_step == total_steps):
        save_checkpoint(engine, ckpt.ckpt_path, global_step, client_state, ckpt.max_ckpt_num)


# ----------------------------------------------------------------------------------------------
# Resumable checkpoints: DeepSpeed state + data position + per-rank RNG, `latest` written last
# ----------------------------------------------------------------------------------------------
def _rng_state():
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state):
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _step_of(tag):
    m = re.fullmatch(r"global_step(\d+)", tag)
    return int(m.group(1)) if m else -1


_CKPT_LOCKS = []  # open lock files: a flock lasts as long as its file descriptor


def hold_ckpt_path(ckpt: CkptArgs):
    """Make this run the only writer of --ckpt_path when it saves or loads checkpoints: rank 0 holds an exclusive
    flock on --ckpt_path/run.lock (holding its pid and host) until it exits, and a second run raises ValueError
    naming it. The kernel drops a flock when its process dies, so a dead run's lock is taken over. Needs no
    process group: call it before anything loads."""
    if not (ckpt.save_steps > 0 or ckpt.load_checkpoint) or os.environ.get("RANK", "0") != "0":
        return
    os.makedirs(ckpt.ckpt_path, exist_ok=True)
    path = os.path.join(ckpt.ckpt_path, "run.lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "a run that has not written its pid yet"
        os.close(fd)
        raise ValueError(f"--ckpt_path {ckpt.ckpt_path} is held by another run ({holder}; lock file {path}): "
                         "wait for it to end, stop it, or pick another --ckpt_path") from None
    except OSError as e:  # a file system without flock: run unguarded rather than not at all
        warnings.warn(f"cannot lock {path} ({e}): a second run on --ckpt_path {ckpt.ckpt_path} would not be refused")
        os.close(fd)
        return
    stale = os.pread(fd, 4096, 0).decode(errors="replace").strip()
    if stale:
        print(f"[ckpt] {path}: took over the lock of a run that is no longer running ({stale})")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)
    _CKPT_LOCKS.append(fd)

    def release():  # empty the file rather than delete it: a run that opened it meanwhile would lock a ghost
        os.ftruncate(fd, 0)
        os.close(fd)
        _CKPT_LOCKS.remove(fd)

    atexit.register(release)


def save_checkpoint(engine, ckpt_path, global_step, client_state, max_ckpt_num):
    """Save `global_step{N}`; point `latest` at it only after every rank finished (atomic rename),
    then drop the oldest checkpoints. A crash mid-save leaves the previous good one in place."""
    tag = f"global_step{global_step}"
    engine.save_checkpoint(ckpt_path, tag=tag, client_state=client_state, save_latest=False)
    torch.save(_rng_state(), os.path.join(ckpt_path, tag, f"rng_state_rank{dist.get_rank()}.pt"))
    dist.barrier()
    if dist.get_rank() == 0:
        tmp = os.path.join(ckpt_path, f"latest.tmp.{os.getpid()}")  # private to this writer
        with open(tmp, "w") as f:
            f.write(tag)
        os.replace(tmp, os.path.join(ckpt_path, "latest"))
        tags = sorted((d for d in os.listdir(ckpt_path) if 0 <= _step_of(d) < global_step), key=_step_of)
        for old in tags[: max(0, len(tags) - (max_ckpt_num - 1))]:
            shutil.rmtree(os.path.join(ckpt_path, old), ignore_errors=True)
    dist.barrier()


def load_checkpoint(engine, ckpt_path):
    """Load the checkpoint `latest` points to; returns its client_state, or None when there is none."""
    latest = os.path.join(ckpt_path, "latest")
    if not os.path.exists(latest):
        return None
    with open(latest) as f:
        tag = f.read().strip()
    check_resume_layout(os.path.join(ckpt_path, tag), checkpoint_layout(os.path.join(ckpt_path, tag)),
                        (engine.zero_optimization_stage(), engine.seq_dp_world_size))
    _, client_state = engine.load_checkpoint(ckpt_path, tag=tag)
    if client_state is None:
        raise RuntimeError(f"checkpoint {ckpt_path}/{tag} could not be loaded")
    rng_file = os.path.join(ckpt_path, tag, f"rng_state_rank{dist.get_rank()}.pt")
    if os.path.exists(rng_file):
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return client_state


def checkpoint_layout(tag_dir):
    """(ZeRO stage, ranks) a DeepSpeed checkpoint was saved under, as DeepSpeed records them in its model states
    (the config it ran and its data-parallel world size), read without loading the tensors (mmap)."""
    name = min(f for f in os.listdir(tag_dir) if f.endswith("model_states.pt"))
    state = torch.load(os.path.join(tag_dir, name), map_location="cpu", mmap=True, weights_only=False)
    return state["ds_config"].get("zero_optimization", {}).get("stage", 0), state["dp_world_size"]


def check_resume_layout(where, saved, resumed):
    """ValueError unless the checkpoint `where`, saved as (ZeRO stage, ranks) `saved`, resumes as the same: each
    stage keeps the optimizer states in its own files, partitioned by rank, and DeepSpeed loading another's fails
    inside DeepSpeed or restarts the Adam moments."""
    if saved != resumed:
        raise ValueError(f"{where} was saved under ZeRO-{saved[0]} by {saved[1]} rank(s); this run is "
                         f"ZeRO-{resumed[0]} with {resumed[1]}: resume with --zero_stage {saved[0]} on {saved[1]} "
                         "rank(s), or pick another --ckpt_path")


# ----------------------------------------------------------------------------------------------
# Hugging Face export
# ----------------------------------------------------------------------------------------------
def gathered_state_dict(engine):
    """Full state dict on rank 0 (gathered layer by layer under ZeRO-3); None on other ranks."""
    if engine.zero_optimization_stage() == 3:
        return engine._zero3_consolidated_16bit_state_dict()
    return engine.module.state_dict() if is_rank0() else None


def save_hf_model(engine, tokenizer, save_path, merge_lora=False, base_path=None):
    """`save_pretrained` the trained model (or its LoRA adapter, or base + adapter merged) and the
    tokenizer, so transformers, vLLM and peft load it with no conversion."""
    from common.logprobs import model_settings

    state_dict = gathered_state_dict(engine)
    if is_rank0():
        model = engine.module
        config = model.config  # shared by a LoRA model and its base
        export = model_settings(model).export_use_cache
        training_use_cache, config.use_cache = config.use_cache, config.use_cache if export is None else export
        is_peft = hasattr(model, "peft_config")
        out = os.path.join(save_path, "adapter") if is_peft and merge_lora else save_path
        os.makedirs(out, exist_ok=True)
        model.save_pretrained(out, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(out)
        if is_peft and merge_lora:
            from peft import PeftModel

            trained = model.get_base_model()  # same class and config (a reward head, its mean / std) as trained
            base = type(trained).from_pretrained(base_path, config=trained.config, dtype=trained.dtype)
            merged = PeftModel.from_pretrained(base, out).merge_and_unload()
            merged.save_pretrained(save_path, safe_serialization=True)
            tokenizer.save_pretrained(save_path)
        config.use_cache = training_use_cache
    if dist.is_initialized():
        dist.barrier()
