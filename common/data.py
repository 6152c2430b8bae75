"""Datasets: load any spec `datasets` supports, mix with probabilities, format prompts with chat or
plain templates, and tokenize in parallel workers (cached by `datasets`) with row-level errors.

What a row turns into (which fields, which tokens carry loss) is decided by each algorithm script;
this module only runs that function over the data and reports bad rows by file and row.
"""

import hashlib
import json
import os
from dataclasses import dataclass, fields, is_dataclass
from typing import Callable, Optional

import tyro

from common.packing import one_row_per_batch

FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}


@dataclass
class DataArgs:
    dataset: str = tyro.MISSING
    """Comma list of datasets: local json/jsonl/csv/parquet/arrow files or folders, save_to_disk folders, `type@dir`,
    or hub names."""
    dataset_probs: Optional[str] = None
    """Comma list of mixing probabilities, one per dataset (default: concatenate)."""
    dataset_split: str = "train"
    """Split of --dataset to train on (local files have only 'train')."""
    eval_dataset: Optional[str] = None
    """Comma list of held-out datasets for periodic evaluation."""
    eval_split: str = "train"
    """Split of --eval_dataset."""
    max_samples: int = 100_000_000
    """Use at most this many training samples (after mixing)."""
    max_len: int = 2048
    """Longest sample in tokens; longer samples are an error (or skipped with --skip_bad_rows)."""
    input_key: str = "input"
    """Field holding the prompt (a string, or a list of chat messages)."""
    input_template: Optional[str] = None
    """Plain prompt template with one '{}' for the prompt, e.g. 'User: {}\\nAssistant: ' (no chat template)."""
    apply_chat_template: bool = False
    """Format prompts with the tokenizer's chat template."""
    tokenizer_chat_template: Optional[str] = None
    """A Jinja chat template that replaces the tokenizer's own."""
    skip_bad_rows: bool = False
    """Skip and count malformed or too-long rows instead of stopping with an error."""
    preprocess_num_workers: int = 1
    """Processes that tokenize the data."""
    packing_samples: bool = True
    """Bin-pack samples into rows without padding (--no_packing_samples: one padded sample per row)."""
    pack_max_tokens: int = 0
    """Longest packed row in tokens, for masked attention (sdpa, eager; 0: --max_len). Per-sample kernels
    (flash-attention, varlen_sdpa: the defaults) take each micro-batch as one row, padding-free."""


class BadRow(ValueError):
    """Raised by a row function for a row that cannot be used; the message names the field."""


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
    validate_prompt_args(args.input_template, args.apply_chat_template)
    if args.max_len < 2:
        raise ValueError(f"--max_len must be >= 2, got {args.max_len}")
    if args.pack_max_tokens and args.pack_max_tokens < args.max_len:
        raise ValueError(f"--pack_max_tokens {args.pack_max_tokens} must be >= --max_len {args.max_len}")
    if args.pack_max_tokens and one_row_per_batch(attn_implementation):
        kernel = attn_implementation or "the default kernel (varlen_sdpa on CPU)"
        raise ValueError(f"--pack_max_tokens bounds packed rows for masked attention (--attn_implementation sdpa or "
                         f"eager); {kernel} packs each micro-batch as one row (size it with --micro_train_batch_size)")


def validate_prompt_args(input_template, apply_chat_template):
    """The prompt format flags: one '{}' in --input_template, which the chat template would ignore."""
    if input_template is not None and "{}" not in input_template:
        raise ValueError(f"--input_template must contain '{{}}' where the prompt goes, got {input_template!r}")
    if input_template is not None and apply_chat_template:
        raise ValueError("--input_template and --apply_chat_template exclude each other (the chat template "
                         "formats the prompt; put any wording into --tokenizer_chat_template)")


def split_specs(specs):
    return [s.strip() for s in (specs or "").split(",") if s.strip()]


def load_one(spec, split):
    """Load one dataset spec as a `datasets.Dataset`; errors name the spec and the available splits,
    and for a local file that is empty or not valid JSON, that fact (and the first bad line)."""
    import datasets

    ext = os.path.splitext(spec)[1].lower()
    try:
        if os.path.isfile(spec):
            if ext not in FILE_BUILDERS:
                raise ValueError(f"unsupported file type {ext!r} (use one of {sorted(FILE_BUILDERS)})")
            return datasets.load_dataset(FILE_BUILDERS[ext], data_files=spec, split=split)
        if os.path.isdir(spec):
            if any(os.path.exists(os.path.join(spec, name)) for name in ("dataset_dict.json", "state.json")):
                ds = datasets.load_from_disk(spec)
                return ds[split] if isinstance(ds, datasets.DatasetDict) else ds
            return datasets.load_dataset(spec, split=split)
        if "@" in spec:  # OpenRLHF's type@dir: a builder (json, parquet, ...) over a folder
            builder, data_dir = spec.split("@", 1)
            return datasets.load_dataset(builder, data_dir=data_dir, split=split)
        if ext in FILE_BUILDERS:
            raise FileNotFoundError(f"no such file: {spec}")
        return datasets.load_dataset(spec, split=split)
    except Exception as e:
        # datasets' own messages for these say neither (StopIteration; a byte position in a chunk)
        problem = os.path.isfile(spec) and ext in FILE_BUILDERS and file_problem(spec, ext)
        if problem:
            raise ValueError(f"dataset {spec}: {problem}") from None
        if isinstance(e, KeyError):
            raise ValueError(f"dataset {spec}: no split {split!r} ({e})") from None
        if isinstance(e, ValueError):
            if "split" in str(e).lower():
                raise ValueError(f"dataset {spec}: no split {split!r}: {e}") from None
            raise ValueError(f"dataset {spec}: {e}") from None
        causes, cause = [], e
        while cause is not None and len(causes) < 4:  # datasets keeps the parse error in the cause chain
            causes.append(f"{type(cause).__name__}: {cause}")
            cause = cause.__cause__ or cause.__context__
        if os.path.exists(spec) or ("@" in spec and os.path.isdir(spec.split("@", 1)[1])):
            raise ValueError(f"dataset {spec} could not be loaded: {' <- '.join(causes)}") from None
        raise ValueError(f"dataset {spec} could not be loaded (not a local file or folder, and not reachable "
                         f"as a hub dataset): {' <- '.join(causes)}") from None


def file_problem(path, ext):
    """Why a local data file that failed to load is unusable, when that is plain to see: it holds
    nothing but white space, or (.json / .jsonl) the first line that is not a JSON object; else None.
    Read only after a failure, so a good file is never scanned twice."""
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            if chunk.strip():
                break
        else:
            return "the file is empty (no rows)"
    if FILE_BUILDERS[ext] != "json":
        return None
    with open(path, encoding="utf-8", errors="replace") as f:
        first = True
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row, error = json.loads(line), None
            except json.JSONDecodeError as e:
                row, error = None, e
            if first and not isinstance(row, dict):  # one JSON document (an array, an object over many lines)
                return whole_json_problem(path)
            if error:
                return f"line {number} is not valid JSON: {error.msg} (column {error.colno})"
            if not isinstance(row, dict):
                return f"line {number} is not a JSON object (one row per line): {line.strip()[:40]!r}"
            first = False
    return None


def whole_json_problem(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        try:
            json.load(f)
        except json.JSONDecodeError as e:
            return f"not valid JSON at line {e.lineno}, column {e.colno}: {e.msg}"
    return None


def format_prompt(prompt, tokenizer, args: DataArgs):
    """The prompt text the model sees: chat template (a string becomes one user turn), the
    plain --input_template, or the raw text."""
    if args.apply_chat_template:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if not isinstance(prompt, str):
        raise BadRow("is a list of messages: pass --apply_chat_template")
    return args.input_template.format(prompt) if args.input_template else prompt


def format_response(prompt, response, tokenizer, args: DataArgs):
    """The response text appended to format_prompt(prompt): under a chat template, what the
    template adds for the assistant turn (end-of-turn tokens included); otherwise response + EOS."""
    if args.apply_chat_template:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        prompt_text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": response}], tokenize=False)
        if not full.startswith(prompt_text):
            raise BadRow("chat template output does not start with the templated prompt")
        return full[len(prompt_text):]
    return response if response.endswith(tokenizer.eos_token) else response + tokenizer.eos_token


def get_field(row, key, kind=str):
    """row[key], checked: a missing key, None, wrong type or empty string raises BadRow naming it."""
    if key not in row or row[key] is None:
        raise BadRow(f"missing field {key!r} (fields: {sorted(k for k, v in row.items() if v is not None)})")
    value = row[key]
    if kind is str and isinstance(value, list) and value and isinstance(value[0], dict):
        return value  # chat messages
    if not isinstance(value, kind):
        raise BadRow(f"field {key!r} should be {kind.__name__}, got {type(value).__name__}")
    if isinstance(value, str) and not value.strip():
        raise BadRow(f"field {key!r} is empty")
    return value


def prepare_dataset(specs, split, row_fn: Callable, columns, args: DataArgs, cache_key, probs=None, seed=0,
                    max_samples=None):
    """Load each spec, run `row_fn(row) -> dict of columns` over it in parallel workers, stop with the
    first bad row (file, row, reason) or skip and count them, then mix or concatenate.

    Results are cached by `datasets` under a fingerprint of the raw data and `cache_key`, which must
    change whenever the row function's output would (pass tokenization_cache_key's).
    """
    import datasets
    from datasets.fingerprint import Hasher

    def safe_row_fn(row, index):
        try:
            out = row_fn(row)
            out["_error"] = ""
        except BadRow as e:
            out = {c: [] for c in columns}
            out["_error"] = f"row {index}: {e}"
        return out

    prepared = []
    for spec in split_specs(specs):
        raw = load_one(spec, split)
        ds = raw.map(
            safe_row_fn, with_indices=True, remove_columns=raw.column_names,
            num_proc=args.preprocess_num_workers if args.preprocess_num_workers > 1 else None,
            desc=f"Preparing {os.path.basename(spec)}",
            new_fingerprint=Hasher.hash([raw._fingerprint, cache_key, columns, args.max_len]),
        )
        errors = [e for e in ds["_error"] if e]
        if errors and not args.skip_bad_rows:
            raise ValueError(f"{spec}: {len(errors)} bad row(s) of {len(ds)}; first: {errors[0]}. "
                             f"Fix the data or pass --skip_bad_rows to skip and count them.")
        if errors:
            print(f"[data] {spec}: skipped {len(errors)} bad row(s) of {len(ds)}; first: {errors[0]}")
            ds = ds.filter(lambda e: not e, input_columns="_error")
        if len(ds) == 0:
            raise ValueError(f"{spec}: no usable rows")
        prepared.append(ds.remove_columns("_error"))
    if probs:
        mixed = datasets.interleave_datasets(
            prepared, probabilities=[float(p) for p in probs.split(",")], seed=seed, stopping_strategy="all_exhausted"
        )
    else:
        mixed = datasets.concatenate_datasets(prepared)
    if max_samples is not None and len(mixed) > max_samples:
        mixed = mixed.select(range(max_samples))
    return mixed


def rank0_first(prepare: Callable):
    """`prepare()` on rank 0, then on the other ranks, which read the `datasets` cache rank 0 filled;
    returns its result. A ValueError (a data error) on any rank is raised on every rank with that
    message, so all ranks stop together (the script prints it once) instead of waiting at a barrier
    for a rank that has died."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if world > 1 else 0
    result = error = None
    for turn in ("first", "rest"):
        if (turn == "first") == (rank == 0):
            try:
                result = prepare()
            except ValueError as e:
                error = str(e)
        if world > 1:
            errors = [None] * world
            dist.all_gather_object(errors, error)
            error = next((e for e in errors if e), None)
        if error:
            raise ValueError(error)
    return result


def load_tokenizer(path, args: DataArgs):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if args.tokenizer_chat_template:
        tokenizer.chat_template = args.tokenizer_chat_template
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if args.apply_chat_template and not tokenizer.chat_template:
        raise ValueError(f"--apply_chat_template: the tokenizer of {path} has no chat template; "
                         "give one with --tokenizer_chat_template")
    return tokenizer


def tokenizer_fingerprint(tokenizer):
    """What a cache of tokenized data depends on: vocabulary, merges, special tokens, chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return [backend.to_str() if backend is not None else tokenizer.name_or_path, len(tokenizer),
            tokenizer.chat_template, tokenizer.eos_token, tokenizer.pad_token]


def tokenization_cache_key(script, tokenizer, args):
    """What the rows a script tokenizes depend on, for prepare_dataset's cache: the whole script file (its
    row function and every helper that function calls, `tokenize` included), this module's source
    (format_prompt, format_response, get_field), the tokenizer, and the options: the data group and the
    script's own fields (the other groups, model / train / checkpoint / logging, shape no row: a row
    function that reads one of them must add it here)."""
    sources = [hashlib.sha256(open(path, "rb").read()).hexdigest() for path in (script, __file__)]
    values = {f.name: getattr(args, f.name) for f in fields(args)}
    options = {k: v for k, v in values.items() if isinstance(v, DataArgs) or not is_dataclass(v)}
    return [sources, repr(options), tokenizer_fingerprint(tokenizer)]
