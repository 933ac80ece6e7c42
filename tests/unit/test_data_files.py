"""Dataset files users already have: Parquet (verl's layout), `datasets` folders (TRL's), CSV; the
same validation and errors as JSONL, naming file and row; a resumed sampler keeps its place."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollflow.config import DataConfig
from rollflow.data_files import read_rows
from rollflow.errors import DataError
from rollflow.sampler import Sampler

QUESTIONS = [f"What is {i} + {i}?" for i in range(7)]


def verl_parquet(path):
    """The layout of verl's preprocessed datasets (e.g. its gsm8k script)."""
    table = pa.table({
        "data_source": ["openai/gsm8k"] * len(QUESTIONS),
        "prompt": [[{"role": "user", "content": q}] for q in QUESTIONS],
        "ability": ["math"] * len(QUESTIONS),
        "reward_model": [{"style": "rule", "ground_truth": str(2 * i)} for i in range(len(QUESTIONS))],
        "extra_info": [{"split": "train", "index": i} for i in range(len(QUESTIONS))],
    })
    pq.write_table(table, path)
    return path


def test_verls_parquet_layout_reads_with_one_column_mapping(tmp_path):
    path = verl_parquet(tmp_path / "train.parquet")
    rows = read_rows([str(path)], {"reward_model.ground_truth": "answer"})
    assert [r.messages[0].content for r in rows] == QUESTIONS and rows[0].messages[0].role == "user"
    assert [r.answer for r in rows] == [str(2 * i) for i in range(7)]
    assert rows[3].id == "train.parquet:4" and rows[3].source == f"{path}, row 4"
    assert rows[3].metadata["data_source"] == "openai/gsm8k" and rows[3].metadata["extra_info"]["index"] == 3


def test_trls_layouts_saved_with_datasets_read_from_the_folder_and_a_split(tmp_path):
    datasets = pytest.importorskip("datasets")  # a dev dependency: the folder as `datasets` really writes it
    standard = datasets.Dataset.from_dict({"prompt": QUESTIONS, "solution": [str(2 * i) for i in range(7)]})
    standard.save_to_disk(tmp_path / "standard")
    rows = read_rows([str(tmp_path / "standard")], {"solution": "answer"})
    assert [(r.messages[0].content, r.answer) for r in rows] == [(q, str(2 * i)) for i, q in enumerate(QUESTIONS)]
    conversational = datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"prompt": [[{"role": "user", "content": "train?"}]], "answer": ["1"]}),
        "test": datasets.Dataset.from_dict({"prompt": [[{"role": "user", "content": "test?"}]], "answer": ["2"]}),
    })
    conversational.save_to_disk(tmp_path / "dict")
    (row,) = read_rows([str(tmp_path / "dict")], split="test")
    assert row.messages[0].content == "test?" and row.answer == "2"
    with pytest.raises(DataError, match=r"no split 'valid' \(data.split\); the dataset has \['train', 'test'\]"):
        read_rows([str(tmp_path / "dict")], split="valid")


def test_csv_columns_are_renamed_and_bad_rows_name_file_and_row(tmp_path):
    good = tmp_path / "q.csv"
    good.write_text("question,answer,level\nWhat is 1 + 1?,2,easy\nWhat is 2 + 2?,4,easy\n")
    rows = read_rows([str(good)], {"question": "prompt"})
    assert [(r.messages[0].content, r.answer, r.metadata) for r in rows] == [
        ("What is 1 + 1?", "2", {"level": "easy"}),
        ("What is 2 + 2?", "4", {"level": "easy"}),
    ]
    with pytest.raises(DataError, match=rf"{good}, row 1: no column 'query' \(data.columns maps it to 'prompt'\)"):
        read_rows([str(good)], {"query": "prompt"})
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"prompt": ["fine", ""], "answer": ["1", "2"]}), bad)
    with pytest.raises(DataError, match=rf"{bad}, row 2: `prompt` must be a non-empty string"):
        read_rows([str(bad)])
    roles = tmp_path / "roles.parquet"
    pq.write_table(pa.table({"messages": [[{"role": "narrator", "content": "x"}]]}), roles)
    with pytest.raises(DataError, match=rf"{roles}, row 1: unknown role 'narrator'"):
        read_rows([str(roles)])
    with pytest.raises(DataError, match=rf"{tmp_path}: not a dataset folder saved with `datasets`"):
        read_rows([str(tmp_path)])
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=rf"{broken}: cannot read dataset file"):
        read_rows([str(broken)])


def test_a_resumed_sampler_continues_at_its_row_in_a_parquet_source(tmp_path):
    path = verl_parquet(tmp_path / "train.parquet")
    config = DataConfig(task="jsonl", paths=[str(path)], columns={"reward_model.ground_truth": "answer"}, seed=3)
    first = Sampler(config, lambda messages: [len(messages)])
    drawn = [first.next().id for _ in range(5)]
    state = first.state_dict()
    rest = [first.next().id for _ in range(6)]  # across the end of the first epoch
    resumed = Sampler(config, lambda messages: [len(messages)])
    resumed.load_state_dict(state)
    assert [resumed.next().id for _ in range(6)] == rest
    assert len(set(drawn + rest[:2])) == 7 and rest[2].endswith("@1")
