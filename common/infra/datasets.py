"""Trust tier: read the faces, trust the body.

Datasets: load any spec `datasets` supports, mix with probabilities, and run a script's row function over them
in parallel workers (cached by `datasets`) with row-level errors; the tokenizer a script loads. What a row turns
into (which fields, which tokens carry loss) is decided by each algorithm script with common/data.py's helpers.
"""

import hashlib
import json
import os
from dataclasses import fields, is_dataclass
from typing import Callable

import common.data
from common.data import BadRow, DataArgs, PromptArgs

FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}


def split_specs(specs):
    """The datasets of a comma list."""
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


def load_tokenizer(path, args: PromptArgs):
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
    sources = [hashlib.sha256(open(path, "rb").read()).hexdigest() for path in (script, common.data.__file__)]
    values = {f.name: getattr(args, f.name) for f in fields(args)}
    options = {k: v for k, v in values.items() if isinstance(v, DataArgs) or not is_dataclass(v)}
    return [sources, repr(options), tokenizer_fingerprint(tokenizer)]
