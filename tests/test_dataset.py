"""workbench.tasks.dataset: every source becomes the same rows, and bad input fails at once with cause and fix."""
from __future__ import annotations

import json
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from workbench.tasks import rewards
from workbench.tasks.dataset import load_rows, max_prompt_tokens
from workbench.tasks.task import Task
from workbench.errors import WorkbenchError

GSM8K = [
    {"question": "Ann has 1,000 apples and buys 234 more. How many?", "answer": "1000 + 234 = 1,234\n#### 1,234"},
    {"question": "What is 6 times 7?", "answer": "6*7=42 #### 42"},
    {"question": "Bob pays $5 and then #### again $3. Total?", "answer": "5+3=8\n#### 8 "},
]
MATH = [
    {"problem": "What is $1/2$ as a fraction?", "answer": "\\frac{1}{2}", "solution": "It is \\boxed{\\frac{1}{2}}."},
    {"problem": "Compute $2+2$.", "answer": " 4 ", "solution": "\\boxed{4}"},
]
AIME = [
    {"id": 60, "problem": "Find the remainder.", "answer": "204", "url": "x"},
    {"id": 61, "problem": "Find the sum.", "answer": 113, "url": "y"},
]


def write_jsonl(path, records, blank_first=False):
    lines = ([""] if blank_first else []) + [json.dumps(r) for r in records]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def write_parquet(path, records):
    pq.write_table(pa.Table.from_pylist(records), path)
    return str(path)


def write_json(path, records):
    path.write_text(json.dumps(records))
    return str(path)


def user_text(row):
    return row["prompt"][-1]["content"]


# --- each source, one row shape ------------------------------------------------------------------------------

def test_gsm8k_jsonl_answers_are_reduced_to_the_final_number(tmp_path):
    rows = load_rows("gsm8k", "train", path=write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K))
    assert [r["answer"] for r in rows] == ["1234", "42", "8"]
    assert user_text(rows[0]) == GSM8K[0]["question"]
    assert rows[0]["prompt"] == [{"role": "user", "content": GSM8K[0]["question"]}]
    assert {r["source"] for r in rows} == {"gsm8k"}
    assert len({r["id"] for r in rows}) == 3 and all(isinstance(r["id"], str) for r in rows)
    assert set(rows[0]) == {"prompt", "answer", "id", "source"}


def test_math500_parquet_keeps_latex_answers(tmp_path):
    rows = load_rows("math500", "test", path=write_parquet(tmp_path / "math.parquet", MATH))
    assert [r["answer"] for r in rows] == ["\\frac{1}{2}", "4"]
    assert user_text(rows[1]) == "Compute $2+2$."
    assert rows[0]["source"] == "math500"


def test_aime_json_list_uses_its_id_field(tmp_path):
    rows = load_rows("aime2024", "test", path=write_json(tmp_path / "aime.json", AIME))
    assert [r["id"] for r in rows] == ["60", "61"]
    assert [r["answer"] for r in rows] == ["204", "113"]
    assert user_text(rows[0]) == "Find the remainder."


def test_custom_field_mapping_for_a_file(tmp_path):
    records = [{"q": "Two plus two?", "a": 4, "uid": "x1"}, {"q": "Three plus one?", "a": 4, "uid": "x2"}]
    path = write_jsonl(tmp_path / "mine.jsonl", records)
    rows = load_rows("file", "train", path=path, fields={"question": "q", "answer": "a", "id": "uid"})
    assert [(user_text(r), r["answer"], r["id"]) for r in rows] == [("Two plus two?", "4", "x1"),
                                                                  ("Three plus one?", "4", "x2")]
    assert rows[0]["source"] == "mine"


def test_fields_override_a_known_datasets_defaults(tmp_path):
    path = write_jsonl(tmp_path / "g.jsonl", [{"text": "Q?", "final": "7"}])
    rows = load_rows("gsm8k", "test", path=path, fields={"question": "text", "answer": "final"})
    assert (user_text(rows[0]), rows[0]["answer"]) == ("Q?", "7")


def test_file_defaults_to_question_and_answer_columns(tmp_path):
    rows = load_rows("file", "train", path=write_jsonl(tmp_path / "plain.jsonl", [{"question": "Q", "answer": "1"}]))
    assert (user_text(rows[0]), rows[0]["answer"]) == ("Q", "1")


def test_instruction_follows_the_question_and_system_prompt_comes_first(tmp_path):
    path = write_jsonl(tmp_path / "g.jsonl", GSM8K[:1])
    instruction = "Put your final answer within <answer></answer>."
    [row] = load_rows("gsm8k", "train", path=path, system_prompt="You are careful.", instruction=instruction)
    assert row["prompt"] == [
        {"role": "system", "content": "You are careful."},
        {"role": "user", "content": GSM8K[0]["question"] + "\n" + instruction},
    ]


def test_limit_keeps_the_first_rows_in_file_order(tmp_path):
    rows = load_rows("gsm8k", "train", path=write_jsonl(tmp_path / "g.jsonl", GSM8K), limit=2)
    assert [r["answer"] for r in rows] == ["1234", "42"]


def test_generated_ids_are_unique_and_stable(tmp_path):
    path = write_jsonl(tmp_path / "g.jsonl", GSM8K * 3)
    first, again = load_rows("gsm8k", "train", path=path), load_rows("gsm8k", "train", path=path)
    assert len({r["id"] for r in first}) == 9
    assert [r["id"] for r in first] == [r["id"] for r in again]


def test_duplicate_ids_in_the_file_are_an_error(tmp_path):
    path = write_json(tmp_path / "aime.json", [AIME[0], AIME[0]])
    with pytest.raises(WorkbenchError, match=r"row 2 repeats id '60'"):
        load_rows("aime2024", "test", path=path)


# --- bad input: one line, cause and fix -----------------------------------------------------------------------

def one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message and "; fix: " in message
    return message


def test_missing_file(tmp_path):
    with pytest.raises(WorkbenchError) as exc:
        load_rows("gsm8k", "train", path=str(tmp_path / "nope.jsonl"))
    message = one_line(exc)
    assert "nope.jsonl" in message and "does not exist" in message


def test_missing_field_names_the_line_the_field_and_the_fields_there(tmp_path):
    records = [GSM8K[0], {"question": "No answer here", "solution": "42"}]
    path = write_jsonl(tmp_path / "g.jsonl", records, blank_first=True)  # the blank line makes it line 3
    with pytest.raises(WorkbenchError) as exc:
        load_rows("gsm8k", "train", path=path)
    message = one_line(exc)
    assert "line 3" in message and "'answer'" in message
    assert "question, solution" in message and "data.fields" in message


def test_missing_field_in_parquet_names_the_row(tmp_path):
    path = write_parquet(tmp_path / "m.parquet", [{"question": "Q", "answer": "1"}])
    with pytest.raises(WorkbenchError) as exc:
        load_rows("math500", "test", path=path)  # math500 expects 'problem'
    message = one_line(exc)
    assert "row 1" in message and "'problem'" in message and "question, answer" in message


def test_null_answer_counts_as_missing(tmp_path):
    path = write_json(tmp_path / "a.json", [{"question": "Q", "answer": None}])
    with pytest.raises(WorkbenchError, match=r"row 1 has no 'answer' field"):
        load_rows("file", "train", path=path)


def test_empty_file(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    with pytest.raises(WorkbenchError) as exc:
        load_rows("gsm8k", "train", path=str(path))
    assert "empty.jsonl" in one_line(exc) and "no rows" in str(exc.value)


def test_empty_json_list(tmp_path):
    with pytest.raises(WorkbenchError, match="no rows"):
        load_rows("aime2024", "test", path=write_json(tmp_path / "a.json", []))


def test_unknown_dataset_name_lists_the_known_ones():
    with pytest.raises(WorkbenchError) as exc:
        load_rows("gsm9k", "train")
    message = one_line(exc)
    assert "gsm9k" in message
    assert all(name in message for name in ("arithmetic", "gsm8k", "math500", "aime2024", "file"))


def test_unknown_extension(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("question,answer\nQ,1\n")
    with pytest.raises(WorkbenchError) as exc:
        load_rows("file", "train", path=str(path))
    message = one_line(exc)
    assert "'.csv'" in message and ".jsonl" in message and ".parquet" in message


def test_invalid_jsonl_line(tmp_path):
    path = tmp_path / "g.jsonl"
    path.write_text(json.dumps(GSM8K[0]) + "\n{not json\n")
    with pytest.raises(WorkbenchError, match="line 2 is not valid JSON"):
        load_rows("gsm8k", "train", path=str(path))


def test_json_that_is_not_a_list(tmp_path):
    with pytest.raises(WorkbenchError, match="not a list"):
        load_rows("file", "train", path=write_json(tmp_path / "d.json", {"question": "Q", "answer": "1"}))


def test_file_needs_a_path():
    with pytest.raises(WorkbenchError, match="needs a path"):
        load_rows("file", "train")


def test_unknown_field_key(tmp_path):
    path = write_jsonl(tmp_path / "g.jsonl", GSM8K)
    with pytest.raises(WorkbenchError, match="unknown keys"):
        load_rows("gsm8k", "train", path=path, fields={"prompt": "question"})


def test_nonpositive_limit():
    with pytest.raises(WorkbenchError, match="limit=0"):
        load_rows("arithmetic", "train", limit=0)


def test_a_carved_split_is_only_read_through_the_task():
    """gsm8k's validation is a carve of its train split; only the Task makes it, so training leaves it out."""
    with pytest.raises(WorkbenchError) as exc:
        load_rows("gsm8k", "validation")
    assert "carved" in one_line(exc) and "Task.build(recipe).rows('validation')" in one_line(exc)


def test_split_an_eval_set_does_not_have():
    with pytest.raises(WorkbenchError) as exc:
        load_rows("math500", "train")
    assert "'train'" in one_line(exc) and "test" in str(exc.value)


@pytest.fixture
def empty_hub_cache(monkeypatch, tmp_path):
    """Nothing cached, whatever this machine holds; the libraries read the cache variables only at import."""
    import datasets
    from huggingface_hub import constants

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))


def test_hub_unreachable_fails_fast_with_the_local_file_fix(monkeypatch, empty_hub_cache):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    with pytest.raises(WorkbenchError) as exc:
        load_rows("gsm8k", "train")
    assert time.monotonic() - start < 10
    message = one_line(exc)
    assert "gsm8k" in message and "openai/gsm8k" in message
    assert "data.test: {path: FILE}" in message and "data.fields" in message and "HF_ENDPOINT" in message


def test_unreachable_hub_without_offline_variable_fails_fast(monkeypatch, empty_hub_cache):
    """Without HF_HUB_OFFLINE, datasets would retry for about half a minute; the probe makes it cache-only."""
    import workbench.tasks.dataset

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(workbench.tasks.dataset, "hub_reachable", lambda: False)
    start = time.monotonic()
    with pytest.raises(WorkbenchError, match="HuggingFaceH4/MATH-500"):
        load_rows("math500", "test")
    assert time.monotonic() - start < 10


def test_hub_probe_reports_a_closed_endpoint(monkeypatch):
    import workbench.tasks.dataset
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # discard port: nothing listens
    assert workbench.tasks.dataset.hub_reachable() is False


def test_hub_probe_sees_a_listening_endpoint_unless_offline_is_set(monkeypatch):
    import http.server
    import threading

    import workbench.tasks.dataset
    from huggingface_hub import constants

    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.server_port}")
        assert workbench.tasks.dataset.hub_reachable() is True
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        assert workbench.tasks.dataset.hub_reachable() is False
    finally:
        server.shutdown()
        server.server_close()


def test_hub_offline_mode_is_restored_after_a_failed_load(monkeypatch):
    import datasets
    from huggingface_hub import constants

    before = datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(WorkbenchError):
        load_rows("aime2024", "test")
    assert (datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE) == before


# --- arithmetic, conversion, prompt length --------------------------------------------------------------------

def test_arithmetic_is_delegated():
    rows = load_rows("arithmetic", "heldout", limit=5, seed=0)
    assert len(rows) == 5
    for row in rows:
        assert row["prompt"][-1]["role"] == "user" and row["answer"].lstrip("-").isdigit()
        assert row["source"] == "arithmetic" and row["id"].startswith("arith-heldout-")
    train_ids = {r["id"].split("-", 2)[2] for r in load_rows("arithmetic", "train")}
    assert not train_ids & {r["id"].split("-", 2)[2] for r in load_rows("arithmetic", "heldout")}


def test_arithmetic_takes_instruction_and_system_prompt():
    plain = load_rows("arithmetic", "train", limit=1)[0]
    [row] = load_rows("arithmetic", "train", limit=1, system_prompt="S", instruction="I")
    assert row["prompt"] == [{"role": "system", "content": "S"},
                             {"role": "user", "content": plain["prompt"][0]["content"] + "\nI"}]


def test_arithmetic_rejects_a_path(tmp_path):
    with pytest.raises(WorkbenchError, match="generated"):
        load_rows("arithmetic", "train", path=str(tmp_path / "x.jsonl"))


def test_to_hf_dataset_round_trip(tmp_path):
    rows = load_rows("gsm8k", "train", path=write_jsonl(tmp_path / "g.jsonl", GSM8K), system_prompt="S")
    ds = __import__("datasets").Dataset.from_list(rows)
    assert len(ds) == 3 and set(ds.column_names) == {"prompt", "answer", "id", "source"}
    assert ds.to_list() == rows


class ListTokenizer:
    """Old-style apply_chat_template: a list of ids, one per whitespace-separated word plus a generation prompt."""

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=False):
        assert add_generation_prompt and tokenize
        return list(range(sum(len(m["content"].split()) + 1 for m in messages) + 1))


def test_max_prompt_tokens_with_a_list_returning_tokenizer():
    rows = [{"prompt": [{"role": "user", "content": "a b c"}]},
            {"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "a b c d e"}]}]
    assert max_prompt_tokens(rows, ListTokenizer()) == (2 + 6 + 1)
    assert max_prompt_tokens([], ListTokenizer()) == 0


class BatchedTokenizer(ListTokenizer):
    """A mapping whose input_ids hold a batch of one, as some tokenizers return."""

    def apply_chat_template(self, messages, **kwargs):
        return {"input_ids": [super().apply_chat_template(messages, **kwargs)], "attention_mask": [[1]]}


def test_max_prompt_tokens_with_a_batch_of_one():
    rows = [{"prompt": [{"role": "user", "content": "a b c d"}]}]
    assert max_prompt_tokens(rows, BatchedTokenizer()) == 6


def test_max_prompt_tokens_with_a_transformers_tokenizer():
    """transformers 5 returns a BatchEncoding; build a word-level tokenizer locally, no download."""
    import tokenizers
    import transformers

    words = "user assistant system : what is 1 + 2 ? be brief".split()
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
                         "{% if add_generation_prompt %}assistant :{% endif %}")
    short = {"prompt": [{"role": "user", "content": "what is 1 + 2 ?"}]}
    long = {"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 1 + 2 ?"}]}
    # user : what is 1 + 2 ?  assistant :  -> 2 + 6 + 2 tokens; the system turn adds 'system : be brief'.
    assert max_prompt_tokens([short], tok) == 10
    assert max_prompt_tokens([short, long], tok) == 14


# --- the gold answers these rows carry are scored as intended -------------------------------------------------

def test_correctness_scores_boxed_latex_against_math_gold():
    scores = rewards.score("correctness", ["so \\boxed{\\frac{1}{2}}", "so \\boxed{\\frac{1}{3}}"],
                           answer=["\\frac{1}{2}", "\\frac{1}{2}"])
    assert scores == [1.0, 0.0]


def test_correctness_scores_a_comma_number_against_gsm8k_gold(tmp_path):
    [row] = load_rows("gsm8k", "train", path=write_jsonl(tmp_path / "g.jsonl", GSM8K[:1]))
    scores = rewards.score("correctness", ["<answer>1,234</answer>", "<answer>1,243</answer>"],
                           answer=[row["answer"]] * 2)
    assert scores == [1.0, 0.0]


def test_recipe_rows_use_the_data_section_and_check_prompt_length(tiny_model_dir):
    from transformers import AutoTokenizer

    from workbench import recipe
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    smoke = recipe.load("smoke")
    rows = Task.build(smoke).train_rows(tokenizer)
    assert len(rows) == 16 and rows[0]["source"] == "arithmetic"
    heldout = Task.build(smoke).rows("heldout")
    assert len(heldout) == 300
    longest = max_prompt_tokens(heldout + rows, tokenizer)
    assert 10 < longest <= smoke.data.max_prompt_length
    tight = recipe.load("smoke", [f"data.max_prompt_length={longest - 1}", "data.train_size=null"])
    with pytest.raises(WorkbenchError, match=f"prompt is {longest} tokens.*raise data.max_prompt_length to {longest}"):
        Task.build(tight).train_rows(tokenizer)


def test_eval_rows_are_the_first_num_samples_of_the_eval_split():
    from workbench import recipe
    smoke = recipe.load("smoke", ["eval.num_samples=20"])
    rows = Task.build(smoke).eval_rows(smoke.eval)
    assert len(rows) == 20
    assert rows == Task.build(smoke).rows(smoke.eval.split)[:20]
    assert all(r["id"].startswith(f"arith-{smoke.eval.split}-") for r in rows)
    too_many = recipe.load("smoke", ["data.heldout_size=50", "eval.num_samples=60"])
    with pytest.raises(WorkbenchError, match=r"eval.num_samples=60 but the heldout split has 50") as exc:
        Task.build(too_many).eval_rows(too_many.eval)
    one_line(exc)
