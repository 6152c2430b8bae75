"""common/data.py against real `datasets`: loading every spec kind, error messages, argument checks,
row preparation with sft_row (bad rows, skipping, mixing, caching), prompt formatting and loss masks.

Everything is built into pytest's tmp dirs (tiny tokenizer, small data files); nothing reads assets/.
"""

import glob
import json
import os
import uuid

import datasets
import pytest
from conftest import load_algo

from common.data import BadRow, DataArgs, format_prompt, format_response
from common.infra.engine import validate_data_args

from common.infra.datasets import load_one, prepare_dataset

pytestmark = pytest.mark.quick  # the quick tier (launch/test.sh --quick)

sft = load_algo("sft")

ROWS = [{"prompt": f"reverse: {a} {b}", "response": f"{b} {a}", "n": i} for i, (a, b) in
        enumerate(["ab", "cd", "ef", "gh", "ba"])]


# ----------------------------------------------------------------------------------------------
# Fixtures: an isolated datasets cache, the tiny tokenizer, helpers to write data
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="session", autouse=True)
def isolated_datasets_cache(tmp_path_factory):
    """Keep `datasets`' cache of this module out of ~/.cache (and free of earlier runs)."""
    cache = str(tmp_path_factory.mktemp("hf_datasets_cache"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
        mp.setenv("HF_DATASETS_CACHE", cache)
        mp.setenv("TOKENIZERS_PARALLELISM", "false")
        yield cache


@pytest.fixture(scope="session")
def tok():
    from launch.tiny import build_tokenizer

    return build_tokenizer()


def write_jsonl(path, rows):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


def sft_args(**data):
    args = sft.Args()
    args.data.input_key = "prompt"
    args.output_key = "response"
    for k, v in data.items():
        setattr(args.data, k, v)
    return args


def row_fn_for(tok, args, calls=None):
    def row_fn(row):
        if calls is not None:
            calls.append(1)
        return sft.sft_row(row, tok, args)

    return row_fn


def ids(tok, text, special=False):
    return tok(text, add_special_tokens=special)["input_ids"]


# ----------------------------------------------------------------------------------------------
# 1. load_one on every spec kind
# ----------------------------------------------------------------------------------------------
def test_load_json_file(tmp_path):
    path = str(tmp_path / "d.json")
    datasets.Dataset.from_list(ROWS).to_json(path, lines=False)
    ds = load_one(path, "train")
    assert len(ds) == 5
    assert ds[1]["prompt"] == "reverse: c d" and ds[1]["response"] == "d c"


def test_load_jsonl_file(tmp_path):
    path = str(tmp_path / "d.jsonl")
    datasets.Dataset.from_list(ROWS).to_json(path)  # JSON lines by default
    ds = load_one(path, "train")
    assert len(ds) == 5
    assert ds[4]["prompt"] == "reverse: b a" and ds[4]["n"] == 4


def test_load_csv_file(tmp_path):
    path = str(tmp_path / "d.csv")
    datasets.Dataset.from_list(ROWS).to_csv(path, index=False)
    ds = load_one(path, "train")
    assert len(ds) == 5
    assert ds.column_names == ["prompt", "response", "n"]
    assert ds[2]["response"] == "f e" and ds[2]["n"] == 2


def test_load_parquet_file(tmp_path):
    path = str(tmp_path / "d.parquet")
    datasets.Dataset.from_list(ROWS).to_parquet(path)
    ds = load_one(path, "train")
    assert len(ds) == 5
    assert ds[3]["prompt"] == "reverse: g h"


def test_load_arrow_file(tmp_path):
    folder = str(tmp_path / "saved")
    datasets.Dataset.from_list(ROWS).save_to_disk(folder)
    (arrow,) = glob.glob(os.path.join(folder, "data-*.arrow"))
    ds = load_one(arrow, "train")
    assert len(ds) == 5
    assert ds[0]["prompt"] == "reverse: a b" and ds[0]["response"] == "b a"


def test_load_folder_of_jsonl(tmp_path):
    folder = tmp_path / "jsonl_dir"
    write_jsonl(str(folder / "part0.jsonl"), ROWS[:3])
    write_jsonl(str(folder / "part1.jsonl"), ROWS[3:])
    ds = load_one(str(folder), "train")
    assert len(ds) == 5
    assert sorted(ds["n"]) == [0, 1, 2, 3, 4]
    assert sorted(ds["prompt"])[0] == "reverse: a b"


def test_load_save_to_disk_dataset(tmp_path):
    folder = str(tmp_path / "saved_ds")
    datasets.Dataset.from_list(ROWS).save_to_disk(folder)
    ds = load_one(folder, "train")  # a plain Dataset has no splits: the split is ignored
    assert isinstance(ds, datasets.Dataset)
    assert len(ds) == 5
    assert ds[1]["response"] == "d c"


def test_load_save_to_disk_dataset_dict(tmp_path):
    folder = str(tmp_path / "saved_dd")
    datasets.DatasetDict({
        "train": datasets.Dataset.from_list(ROWS),
        "test": datasets.Dataset.from_list(ROWS[:2]),
    }).save_to_disk(folder)
    train, test = load_one(folder, "train"), load_one(folder, "test")
    assert (len(train), len(test)) == (5, 2)
    assert test[1]["prompt"] == "reverse: c d"


def test_load_openrlhf_type_at_dir(tmp_path):
    folder = tmp_path / "typed"
    write_jsonl(str(folder / "a.json"), ROWS[:2])
    write_jsonl(str(folder / "b.json"), ROWS[2:])
    ds = load_one(f"json@{folder}", "train")
    assert len(ds) == 5
    assert sorted(ds["response"]) == ["a b", "b a", "d c", "f e", "h g"]


# ----------------------------------------------------------------------------------------------
# 2. load_one errors
# ----------------------------------------------------------------------------------------------
def test_error_unknown_path(tmp_path):
    path = str(tmp_path / "no_such_file.jsonl")
    with pytest.raises(ValueError) as e:
        load_one(path, "train")
    assert path in str(e.value)


def test_error_unknown_split_in_file(tmp_path):
    path = write_jsonl(str(tmp_path / "d.jsonl"), ROWS)
    with pytest.raises(ValueError) as e:
        load_one(path, "test")
    msg = str(e.value)
    assert path in msg and "'test'" in msg and "no split" in msg


def test_error_unknown_split_in_dataset_dict(tmp_path):
    folder = str(tmp_path / "saved_dd")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(folder)
    with pytest.raises(ValueError) as e:
        load_one(folder, "validation")
    msg = str(e.value)
    assert folder in msg and "'validation'" in msg and "no split" in msg


def test_error_unsupported_extension(tmp_path):
    path = tmp_path / "d.txt"
    path.write_text("hello\n")
    with pytest.raises(ValueError) as e:
        load_one(str(path), "train")
    msg = str(e.value)
    assert str(path) in msg and "unsupported file type '.txt'" in msg


def test_error_malformed_local_file_gives_the_reason(tmp_path):
    """A local file that exists but does not parse: the message names the file, the first bad line
    and the parse error, and does not claim the file is not local."""
    path = tmp_path / "broken.jsonl"
    path.write_text('{"prompt": "a", "response": "b"}\n\n{"prompt": "a" "response": "b"}\n{not json\n')
    with pytest.raises(ValueError) as e:
        load_one(str(path), "train")
    msg = str(e.value)
    assert msg == f"dataset {path}: line 3 is not valid JSON: Expecting ',' delimiter (column 16)"
    assert "not a local file" not in msg


def test_error_jsonl_line_that_is_not_an_object(tmp_path):
    path = tmp_path / "numbers.jsonl"
    path.write_text('{"prompt": "a"}\n5\n')
    with pytest.raises(ValueError, match=r"numbers.jsonl: line 2 is not a JSON object \(one row per line\): '5'$"):
        load_one(str(path), "train")


def test_error_json_document_names_line_and_column(tmp_path):
    """A .json file holding one document (an array over many lines): the document's own position."""
    path = tmp_path / "rows.json"
    path.write_text('[\n  {"prompt": "a"},\n  {"prompt" "b"}\n]\n')
    with pytest.raises(ValueError) as e:
        load_one(str(path), "train")
    assert str(e.value) == f"dataset {path}: not valid JSON at line 3, column 13: Expecting ':' delimiter"


@pytest.mark.parametrize("name, text", [("empty.jsonl", ""), ("blank.jsonl", "\n  \n"), ("empty.json", ""),
                                        ("empty.csv", "")])
def test_error_empty_file_says_empty(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError) as e:
        load_one(str(path), "train")
    assert str(e.value) == f"dataset {path}: the file is empty (no rows)"


def test_rank0_first_in_a_world_of_one():
    """Without a process group, rank0_first is prepare() itself; its data error keeps its message."""
    from common.infra.datasets import rank0_first

    assert rank0_first(lambda: (1, None)) == (1, None)

    def bad():
        raise ValueError("a.jsonl: 1 bad row(s) of 2")

    with pytest.raises(ValueError, match=r"^a.jsonl: 1 bad row\(s\) of 2$"):
        rank0_first(bad)


def test_error_unreachable_hub_name(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    # both libraries read the variable at import time; set their copies too so this fails fast
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True, raising=False)
    name = "minrlhf-test-nobody/no-such-dataset"
    with pytest.raises(ValueError) as e:
        load_one(name, "train")
    msg = str(e.value)
    assert name in msg and "could not be loaded" in msg


# ----------------------------------------------------------------------------------------------
# 3. validate_data_args
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, flag", [
    (dict(dataset="a.jsonl,b.jsonl", dataset_probs="1.0"), "--dataset_probs"),
    (dict(dataset="a.jsonl,b.jsonl", dataset_probs="0.5,0.6"), "--dataset_probs"),
    (dict(dataset="a.jsonl", input_template="User: <prompt>\nAssistant: "), "--input_template"),
    (dict(dataset=""), "--dataset"),
    (dict(dataset=" , "), "--dataset"),
])
def test_validate_data_args_errors(kwargs, flag):
    with pytest.raises(ValueError) as e:
        validate_data_args(DataArgs(**kwargs))
    assert flag in str(e.value)


def test_validate_data_args_accepts_good_args():
    validate_data_args(DataArgs(dataset="a.jsonl, b.jsonl", dataset_probs="0.25,0.75", input_template="Q: {}\nA: "))


def test_input_template_with_chat_template_is_refused_in_every_script():
    from conftest import load_algo

    message = "--input_template and --apply_chat_template exclude each other"
    with pytest.raises(ValueError, match=message):
        validate_data_args(DataArgs(dataset="a.jsonl", input_template="Q: {}", apply_chat_template=True))
    flags = ["--input_template", "Q: {}", "--apply_chat_template"]
    with pytest.raises(ValueError, match=message):  # generate.py has its own prompt flags
        load_algo("generate").parse_args(["--pretrain", "m", "--dataset", "d.jsonl", "--output_path", "o.jsonl",
                                          *flags])
    with pytest.raises(ValueError, match=message):
        load_algo("sft").parse_args(["--pretrain", "m", "--dataset", "d.jsonl", *flags])


def test_validate_data_args_probs_messages():
    with pytest.raises(ValueError, match=r"--dataset_probs has 1 values but --dataset names 2 datasets"):
        validate_data_args(DataArgs(dataset="a.jsonl,b.jsonl", dataset_probs="1.0"))
    with pytest.raises(ValueError, match=r"--dataset_probs must be non-negative and sum to 1, got 0.5,0.6"):
        validate_data_args(DataArgs(dataset="a.jsonl,b.jsonl", dataset_probs="0.5,0.6"))


# ----------------------------------------------------------------------------------------------
# 4. prepare_dataset with sft_row
# ----------------------------------------------------------------------------------------------
GOOD = [{"prompt": f"reverse: {a} {b} {c}", "response": f"{c} {b} {a}"} for a, b, c in
        ["abc", "bcd", "cde", "def", "efg", "fgh"]]


def prepare(path, tok, args, cache_key=None, calls=None, **kw):
    return prepare_dataset(path, "train", row_fn_for(tok, args, calls), ("input_ids", "loss_mask"), args.data,
                           cache_key if cache_key is not None else ["test", uuid.uuid4().hex], **kw)


def test_prepare_missing_input_key_names_file_row_field(tmp_path, tok):
    rows = GOOD[:2] + [{"question": "reverse: a b", "response": "b a"}] + GOOD[2:]
    path = write_jsonl(str(tmp_path / "missing.jsonl"), rows)
    with pytest.raises(ValueError) as e:
        prepare(path, tok, sft_args(apply_chat_template=True))
    msg = str(e.value)
    assert path in msg
    assert "row 2:" in msg
    assert "missing field 'prompt'" in msg
    assert "1 bad row(s) of 7" in msg
    assert "--skip_bad_rows" in msg


def test_prepare_empty_response_names_field(tmp_path, tok):
    rows = GOOD[:3] + [{"prompt": "reverse: a b", "response": "  "}]
    path = write_jsonl(str(tmp_path / "empty.jsonl"), rows)
    with pytest.raises(ValueError) as e:
        prepare(path, tok, sft_args(apply_chat_template=True))
    msg = str(e.value)
    assert path in msg and "row 3:" in msg and "field 'response' is empty" in msg


def test_prepare_too_long_names_length_and_flag(tmp_path, tok):
    long_row = {"prompt": "reverse: " + " ".join("abcdefgh" * 4), "response": "a"}
    args = sft_args(apply_chat_template=True, max_len=40)
    expected_len = len(sft.sft_row(long_row, tok, sft_args(apply_chat_template=True))["input_ids"])
    assert expected_len > 40
    # computed by hand: templated prompt tokens + templated response tokens
    prompt_text = "<|user|>\n" + long_row["prompt"] + "<|end|>\n<|assistant|>\n"
    assert expected_len == len(ids(tok, prompt_text)) + len(ids(tok, "a<|end|>\n"))
    path = write_jsonl(str(tmp_path / "long.jsonl"), [GOOD[0], long_row, GOOD[1]])
    with pytest.raises(ValueError) as e:
        prepare(path, tok, args)
    msg = str(e.value)
    assert path in msg and "row 1:" in msg
    assert f"{expected_len} tokens, more than --max_len 40" in msg


def test_prepare_skip_bad_rows_keeps_the_rest(tmp_path, tok, capsys):
    long_row = {"prompt": "reverse: " + " ".join("abcdefgh" * 4), "response": "a"}
    rows = [GOOD[0], {"question": "x"}, GOOD[1], {"prompt": "reverse: a b", "response": ""}, GOOD[2], long_row,
            GOOD[3]]
    path = write_jsonl(str(tmp_path / "mixed_bad.jsonl"), rows)
    args = sft_args(apply_chat_template=True, max_len=40, skip_bad_rows=True)
    ds = prepare(path, tok, args)
    assert len(ds) == 4
    assert ds.column_names == ["input_ids", "loss_mask"]
    expected = [sft.sft_row(r, tok, args) for r in GOOD[:4]]
    assert ds["input_ids"] == [e["input_ids"] for e in expected]
    assert ds["loss_mask"] == [e["loss_mask"] for e in expected]
    out = capsys.readouterr().out
    assert "skipped 3 bad row(s) of 7" in out and "row 1:" in out


def _tagged_rows(tag, n):
    return [{"prompt": f"{tag} {i}", "response": f"{tag}"} for i in range(n)]


def _decoded_prompts(tok, ds):
    """The raw prompt of each prepared row (plain text, no template, response = tag + EOS)."""
    out = []
    for row_ids, mask in zip(ds["input_ids"], ds["loss_mask"]):
        out.append(tok.decode([t for t, m in zip(row_ids, mask) if m == 0]))
    return out


def test_prepare_mix_with_probs(tmp_path, tok):
    a = write_jsonl(str(tmp_path / "mix_a.jsonl"), _tagged_rows("add", 100))
    b = write_jsonl(str(tmp_path / "mix_b.jsonl"), _tagged_rows("reverse", 100))
    args = sft_args()
    ds = prepare(f"{a},{b}", tok, args, probs="0.25,0.75", seed=0)
    prompts = _decoded_prompts(tok, ds)
    assert all(p.startswith(("add ", "reverse ")) for p in prompts)
    from_a = sum(p.startswith("add ") for p in prompts)
    # all_exhausted: every row of the first dataset is seen, the second is oversampled to ~3x
    assert len({p for p in prompts if p.startswith("add ")}) == 100
    assert len({p for p in prompts if p.startswith("reverse ")}) == 100
    assert len(ds) > 300
    assert abs(from_a / len(ds) - 0.25) < 0.06
    # a different seed gives a different order, with the same proportion
    ds2 = prepare(f"{a},{b}", tok, args, probs="0.25,0.75", seed=1)
    assert _decoded_prompts(tok, ds2) != prompts
    assert abs(sum(p.startswith("add ") for p in _decoded_prompts(tok, ds2)) / len(ds2) - 0.25) < 0.06


def test_prepare_concatenates_in_order_and_caps(tmp_path, tok):
    a_rows, b_rows = _tagged_rows("add", 4), _tagged_rows("reverse", 3)
    a = write_jsonl(str(tmp_path / "cat_a.jsonl"), a_rows)
    b = write_jsonl(str(tmp_path / "cat_b.jsonl"), b_rows)
    args = sft_args()
    ds = prepare(f"{a}, {b}", tok, args)
    assert _decoded_prompts(tok, ds) == [r["prompt"] for r in a_rows + b_rows]
    # no template: loss on the response and the EOS appended to it
    assert tok.decode([t for t, m in zip(ds[0]["input_ids"], ds[0]["loss_mask"]) if m]) == "add<|end|>"
    capped = prepare(f"{a},{b}", tok, args, max_samples=5)
    assert _decoded_prompts(tok, capped) == [r["prompt"] for r in (a_rows + b_rows)[:5]]
    mixed_capped = prepare(f"{a},{b}", tok, args, probs="0.5,0.5", max_samples=3)
    assert len(mixed_capped) == 3


def test_prepare_cache_reuses_rows(tmp_path, tok):
    path = write_jsonl(str(tmp_path / "cache.jsonl"), GOOD)
    args = sft_args(apply_chat_template=True, preprocess_num_workers=1)
    key = ["cache-test", uuid.uuid4().hex]
    calls = []
    first = prepare(path, tok, args, cache_key=key, calls=calls)
    assert len(calls) == len(GOOD)
    second = prepare(path, tok, args, cache_key=list(key), calls=calls)
    assert len(calls) == len(GOOD), "same cache_key: the row function must not run again"
    assert second["input_ids"] == first["input_ids"] and second["loss_mask"] == first["loss_mask"]
    third = prepare(path, tok, args, cache_key=key + ["changed"], calls=calls)
    assert len(calls) == 2 * len(GOOD), "a different cache_key must re-run the row function"
    assert third["input_ids"] == first["input_ids"]


def test_prepare_parallel_workers_match_one_worker(tmp_path, tok):
    path = write_jsonl(str(tmp_path / "par.jsonl"), GOOD + _tagged_rows("add", 6))
    one = prepare(path, tok, sft_args(apply_chat_template=True, preprocess_num_workers=1))
    two = prepare(path, tok, sft_args(apply_chat_template=True, preprocess_num_workers=2))
    assert len(one) == len(two) == 12
    assert two["input_ids"] == one["input_ids"] and two["loss_mask"] == one["loss_mask"]


# ----------------------------------------------------------------------------------------------
# 5. format_prompt / format_response
# ----------------------------------------------------------------------------------------------
def test_format_prompt_chat_template(tok):
    args = DataArgs(apply_chat_template=True)
    assert format_prompt("reverse: a b", tok, args) == "<|user|>\nreverse: a b<|end|>\n<|assistant|>\n"
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert format_prompt(messages, tok, args) == "<|system|>\nbe brief<|end|>\n<|user|>\nhi<|end|>\n<|assistant|>\n"


def test_format_response_chat_template(tok):
    args = DataArgs(apply_chat_template=True)
    assert format_response("reverse: a b", "b a", tok, args) == "b a<|end|>\n"
    prompt = "reverse: a b"
    full = tok.apply_chat_template([{"role": "user", "content": prompt}, {"role": "assistant", "content": "b a"}],
                                   tokenize=False)
    assert format_prompt(prompt, tok, args) + format_response(prompt, "b a", tok, args) == full


def test_format_prompt_input_template_and_raw(tok):
    assert format_prompt("reverse: a b", tok, DataArgs(input_template="User: {}\nAssistant: ")) == \
        "User: reverse: a b\nAssistant: "
    assert format_prompt("reverse: a b", tok, DataArgs()) == "reverse: a b"
    with pytest.raises(BadRow, match="apply_chat_template"):
        format_prompt([{"role": "user", "content": "hi"}], tok, DataArgs())


def test_format_response_appends_eos_without_chat_template(tok):
    assert tok.eos_token == "<|end|>"
    assert format_response("p", "b a", tok, DataArgs()) == "b a<|end|>"
    assert format_response("p", "b a<|end|>", tok, DataArgs()) == "b a<|end|>"
    assert format_response("p", "b a", tok, DataArgs(input_template="Q: {}\nA: ")) == "b a<|end|>"


# ----------------------------------------------------------------------------------------------
# 6. sft_row loss masks
# ----------------------------------------------------------------------------------------------
def test_sft_row_prompt_response_mask_chat(tok):
    args = sft_args(apply_chat_template=True)
    out = sft.sft_row({"prompt": "reverse: a b c", "response": "c b a"}, tok, args)
    prompt_ids = ids(tok, "<|user|>\nreverse: a b c<|end|>\n<|assistant|>\n")
    response_ids = ids(tok, "c b a<|end|>\n")
    assert out["input_ids"] == prompt_ids + response_ids
    assert out["loss_mask"] == [0] * len(prompt_ids) + [1] * len(response_ids)
    masked = [t for t, m in zip(out["input_ids"], out["loss_mask"]) if m]
    assert tok.decode(masked) == "c b a<|end|>\n"


def test_sft_row_prompt_response_mask_template(tok):
    args = sft_args(input_template="User: {}\nAssistant: ")
    out = sft.sft_row({"prompt": "reverse: a b c", "response": "c b a"}, tok, args)
    prompt_ids = ids(tok, "User: reverse: a b c\nAssistant: ", special=True)
    response_ids = ids(tok, "c b a<|end|>")
    assert out["input_ids"] == prompt_ids + response_ids
    assert out["loss_mask"] == [0] * len(prompt_ids) + [1] * len(response_ids)
    assert sum(out["loss_mask"]) == len(response_ids) > 0


def _masked_runs(ids_, mask):
    runs, cur = [], []
    for t, m in zip(ids_, mask):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return runs


def test_sft_row_multiturn_mask(tok):
    args = sft_args(apply_chat_template=True)
    args.multiturn = True
    args.data.input_key = "messages"
    messages = [
        {"role": "system", "content": "reverse the letters"},
        {"role": "user", "content": "reverse: a b c"}, {"role": "assistant", "content": "c b a"},
        {"role": "user", "content": "reverse: d e"}, {"role": "assistant", "content": "e d"},
    ]
    out = sft.sft_row({"messages": messages}, tok, args)
    assert len(out["input_ids"]) == len(out["loss_mask"])
    full = tok.apply_chat_template(messages, tokenize=False)
    assert tok.decode(out["input_ids"]) == full
    runs = [tok.decode(r) for r in _masked_runs(out["input_ids"], out["loss_mask"])]
    assert runs == ["c b a<|end|>\n", "e d<|end|>\n"]
    n_loss = len(ids(tok, "c b a<|end|>\n")) + len(ids(tok, "e d<|end|>\n"))
    assert sum(out["loss_mask"]) == n_loss
    # the generation prompt '<|assistant|>\n' stays out of the loss
    unmasked = tok.decode([t for t, m in zip(out["input_ids"], out["loss_mask"]) if not m])
    assert unmasked == ("<|system|>\nreverse the letters<|end|>\n<|user|>\nreverse: a b c<|end|>\n<|assistant|>\n"
                        "<|user|>\nreverse: d e<|end|>\n<|assistant|>\n")


def test_sft_row_multiturn_bad_rows(tok):
    args = sft_args(apply_chat_template=True)
    args.multiturn = True
    args.data.input_key = "messages"
    with pytest.raises(BadRow, match="no assistant turn"):
        sft.sft_row({"messages": [{"role": "user", "content": "hi"}]}, tok, args)
    with pytest.raises(BadRow, match=r"message 1 \(assistant\) is empty"):
        sft.sft_row({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]}, tok,
                    args)


def test_sft_row_pretrain_mode_all_ones(tok):
    args = sft_args()
    args.pretrain_mode = True
    args.data.input_key = "text"
    out = sft.sft_row({"text": "reverse: a b c = c b a"}, tok, args)
    expected = ids(tok, "reverse: a b c = c b a<|end|>", special=True)
    assert out["input_ids"] == expected
    assert out["loss_mask"] == [1] * len(expected)
    assert tok.decode(out["input_ids"]) == "reverse: a b c = c b a<|end|>"
