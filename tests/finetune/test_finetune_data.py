"""Loaders: the real E-c and SST-2 files, generic CSV/TSV/JSON(L) through datasets, and every refusal
naming file, line and column."""
import json

import numpy as np
import pytest

from conftest import shared_data
from finetune.data import (PLUTCHIK_LABELS, SEMEVAL_EC_LABELS, DataFormatError, load_data, load_labeled_file,
                           load_semeval_ec, load_sst2)

# ../shared/data/README.md
TRAIN_POSITIVES = dict(anger=2544, anticipation=978, disgust=2602, fear=1242, joy=2477, love=700, optimism=1984,
                       pessimism=795, sadness=2008, surprise=361, trust=357)
DEV_POSITIVES = dict(anger=315, anticipation=124, disgust=319, fear=121, joy=400, love=132, optimism=307,
                     pessimism=100, sadness=265, surprise=35, trust=43)
EC_HEADER = "ID\tTweet\t" + "\t".join(SEMEVAL_EC_LABELS)


@pytest.mark.parametrize("split,rows,positives,neutral", [("train", 6838, TRAIN_POSITIVES, 204),
                                                          ("dev", 886, DEV_POSITIVES, 14)])
def test_semeval_ec_real_files(split, rows, positives, neutral):
    data = load_semeval_ec(shared_data("semeval2018-ec", f"{split}.tsv"))
    assert len(data) == rows and len(set(data.ids)) == rows
    assert data.labels.dtype == np.int8 and data.labels.shape == (rows, 11)
    assert data.label_names == SEMEVAL_EC_LABELS
    assert dict(zip(data.label_names, data.label_counts().tolist())) == positives
    assert int((data.labels.sum(axis=1) == 0).sum()) == neutral
    assert all("-En-" in i for i in data.ids) and all(t.strip() for t in data.texts)

    plutchik = load_semeval_ec(shared_data("semeval2018-ec", f"{split}.tsv"), labels=PLUTCHIK_LABELS)
    assert plutchik.label_names == PLUTCHIK_LABELS
    assert dict(zip(PLUTCHIK_LABELS, plutchik.label_counts().tolist())) == {k: positives[k] for k in PLUTCHIK_LABELS}
    subset = data.select_labels(PLUTCHIK_LABELS)
    assert np.array_equal(plutchik.labels, subset.labels) and plutchik.ids == subset.ids


def test_semeval_ec_to_hf():
    data = load_semeval_ec(shared_data("semeval2018-ec", "dev.tsv"))
    ds = data.to_hf()
    assert ds.column_names == ["id", "text", "labels"] and len(ds) == 886
    assert np.array_equal(np.array(ds["labels"], dtype=np.int8), data.labels)
    assert ds[5]["id"] == data.ids[5] and ds[5]["text"] == data.texts[5]


def test_sst2_real_files():
    train = load_sst2(shared_data("sst2", "train.tsv"))
    assert len(train) == 6920 and train.task == "single_label" and train.label_names == ("negative", "positive")
    assert train.label_counts().tolist() == [3310, 3610]
    val = load_data(shared_data("sst2", "val.tsv"))  # recognised by its header
    assert len(val) == 872 and val.class_indices().tolist().count(1) == 444
    assert val.to_hf().features["label"].names == ["negative", "positive"]


# ---------------------------------------------------------------------------------- E-c refusals

def _ec_file(tmp_path, rows, header=EC_HEADER, name="bad.tsv"):
    path = tmp_path / name
    path.write_text("\n".join([header, *rows]) + "\n", encoding="utf-8")
    return path


def _row(tid, text, labels="0\t1\t0\t0\t1\t0\t0\t0\t0\t0\t0"):
    return f"{tid}\t{text}\t{labels}"


def _refused(path, match, **kwargs):
    with pytest.raises(DataFormatError) as err:
        load_semeval_ec(path, **kwargs)
    message = str(err.value)
    assert message.startswith(str(path)), message
    assert match in message, message
    return err.value


def test_ec_missing_column(tmp_path):
    header = EC_HEADER.replace("\tlove", "")
    path = _ec_file(tmp_path, [_row("a", "hi", "0\t1\t0\t0\t1\t0\t0\t0\t0\t0")], header=header)
    e = _refused(path, "line 1: missing label column 'love'")
    assert e.line == 1
    path = _ec_file(tmp_path, [], header=EC_HEADER.replace("Tweet", "Text"), name="b.tsv")
    _refused(path, "line 1: missing column 'Tweet'")


def test_ec_label_not_binary(tmp_path):
    path = _ec_file(tmp_path, [_row("a", "fine"), _row("b", "ok"), _row("c", "bad", "0\t0\t0\t0\t2\t0\t0\t0\t0\t0\t0")])
    e = _refused(path, "line 4, column 'joy': label must be 0 or 1, found '2'")
    assert (e.line, e.column) == (4, "joy")


def test_ec_empty_text(tmp_path):
    path = _ec_file(tmp_path, [_row("a", "fine"), _row("b", "   ")])
    _refused(path, "line 3, column 'Tweet': empty text")


def test_ec_duplicated_id(tmp_path):
    path = _ec_file(tmp_path, [_row("a", "one"), _row("b", "two"), _row("a", "three")])
    _refused(path, "line 4, column 'ID': duplicated ID 'a' (first on line 2)")


def test_ec_wrong_field_count_and_blank_line(tmp_path):
    path = _ec_file(tmp_path, [_row("a", "one"), "b\ttab\tinside\t0\t0\t0\t0\t0\t0\t0\t0\t0\t0\t0"])
    _refused(path, "line 3: expected 13 tab-separated fields (as in the header), found 14")
    path = _ec_file(tmp_path, [_row("a", "one"), "", _row("b", "two")], name="blank.tsv")
    _refused(path, "line 3: blank line")


def test_ec_unlabelled_files(tmp_path):
    none = "\t".join(["NONE"] * 11)
    path = _ec_file(tmp_path, [_row("a", "one", none), _row("b", "two", none)])
    _refused(path, "line 2, column 'anger': label cells are 'NONE'")
    data = load_semeval_ec(path, require_labels=False)
    assert data.labels is None and data.ids == ["a", "b"]
    mixed = _ec_file(tmp_path, [_row("a", "one"), _row("b", "two", none)], name="mixed.tsv")
    _refused(mixed, "line 3, column 'anger': rows labelled 0/1 and rows labelled 'NONE' are mixed",
             require_labels=False)


def test_ec_crlf_and_bom_accepted(tmp_path):
    path = tmp_path / "crlf.tsv"
    path.write_bytes(("\ufeff" + EC_HEADER + "\r\n" + _row("a", "x 😀") + "\r\n").encode("utf-8"))
    data = load_semeval_ec(path)
    assert data.texts == ["x 😀"] and data.labels[0].tolist() == [0, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0]


def test_ec_not_utf8(tmp_path):
    path = tmp_path / "latin1.tsv"
    path.write_bytes((EC_HEADER + "\n").encode() + _row("a", "caf\xe9").encode("latin-1") + b"\n")
    _refused(path, "line 2: not UTF-8")


# ------------------------------------------------------------------ generic files through datasets

def test_csv_label_columns_multiline_quoted(tmp_path):
    path = tmp_path / "emo.csv"
    path.write_text('id,text,joy,fear\n1,"hello, world",1,0\n2,"two\nlines",0,1\n3,NA,1,1\n', encoding="utf-8")
    data = load_labeled_file(path, id_column="id", label_columns=["joy", "fear"])
    assert data.texts == ["hello, world", "two\nlines", "NA"]  # "NA" is a text, not a missing value
    assert data.labels.tolist() == [[1, 0], [0, 1], [1, 1]] and data.ids == ["1", "2", "3"]
    # the record after the two-line one starts on line 5
    path.write_text('id,text,joy,fear\n1,"hello, world",1,0\n2,"two\nlines",0,1\n3,x,yes,1\n', encoding="utf-8")
    with pytest.raises(DataFormatError, match=r"emo.csv, line 5, column 'joy': label must be 0 or 1, found 'yes'"):
        load_labeled_file(path, id_column="id", label_columns=["joy", "fear"])


def test_csv_missing_column_and_ragged_row(tmp_path):
    path = tmp_path / "emo.csv"
    path.write_text("text,joy\nhi,1\n", encoding="utf-8")
    with pytest.raises(DataFormatError, match=r"emo.csv, line 1: missing column 'fear'"):
        load_labeled_file(path, label_columns=["joy", "fear"])
    path.write_text("text,joy\nhi,1\nho,1,0\n", encoding="utf-8")
    with pytest.raises(DataFormatError, match=r"emo.csv, line 3: expected 2 fields"):
        load_labeled_file(path, label_columns=["joy"])


def test_tsv_label_list_and_subset(tmp_path):
    path = tmp_path / "emo.tsv"
    path.write_text('text\temotions\n"quoted" start\tjoy,trust\nnone here\t\nscared\tfear\n', encoding="utf-8")
    data = load_labeled_file(path, label_list_column="emotions", label_names=PLUTCHIK_LABELS)
    assert data.texts[0] == '"quoted" start'  # TSV: no quoting by default
    assert data.label_names == PLUTCHIK_LABELS and data.label_counts().sum() == 3
    assert data.labels[1].sum() == 0 and data.labels[0, PLUTCHIK_LABELS.index("trust")] == 1
    sub = load_labeled_file(path, label_list_column="emotions", label_names=PLUTCHIK_LABELS, labels=["fear", "joy"])
    assert sub.labels.tolist() == [[0, 1], [0, 0], [1, 0]]
    path.write_text("text\temotions\nok\tjoy\nbad\tjoy,rage\n", encoding="utf-8")
    with pytest.raises(DataFormatError, match=r"emo.tsv, line 3, column 'emotions': unknown label 'rage'"):
        load_labeled_file(path, label_list_column="emotions", label_names=PLUTCHIK_LABELS)


def test_jsonl_label_lists_and_refusals(tmp_path):
    path = tmp_path / "emo.jsonl"
    rows = [{"id": "x", "text": "yay", "labels": ["joy"]}, {"id": "y", "text": "hmm", "labels": []},
            {"id": "z", "text": "eek", "labels": ["fear", "joy"]}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    data = load_labeled_file(path, id_column="id", label_list_column="labels")
    assert data.label_names == ("fear", "joy")  # inferred, sorted
    assert data.labels.tolist() == [[0, 1], [0, 0], [1, 1]]
    rows[2]["id"] = "x"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    with pytest.raises(DataFormatError, match=r"emo.jsonl, line 3, column 'id': duplicated ID 'x' \(first on line 1\)"):
        load_labeled_file(path, id_column="id", label_list_column="labels")
    rows[2]["id"], rows[1]["text"] = "z", ""
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    with pytest.raises(DataFormatError, match=r"emo.jsonl, line 2, column 'text': empty text"):
        load_labeled_file(path, id_column="id", label_list_column="labels")


def test_json_array_single_label(tmp_path):
    path = tmp_path / "sent.json"
    path.write_text(json.dumps([{"sentence": "good", "label": 1}, {"sentence": "bad", "label": 0},
                                {"sentence": "meh", "label": 1}], indent=1), encoding="utf-8")
    data = load_labeled_file(path, text_column="sentence", label_column="label", label_names=["neg", "pos"])
    assert data.task == "single_label" and data.class_indices().tolist() == [1, 0, 1]
    path.write_text(json.dumps([{"sentence": "good", "label": 1}, {"sentence": "bad", "label": 2}]), encoding="utf-8")
    with pytest.raises(DataFormatError, match=r"sent.json, record 2, column 'label': unknown class 2"):
        load_labeled_file(path, text_column="sentence", label_column="label", label_names=["neg", "pos"])
