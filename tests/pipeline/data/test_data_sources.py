"""Every --data form loads into the exact expected token stream; the validation split is a deterministic
partition of documents; each kind of bad input gets a clear message naming the file or field."""
import csv
import gzip
import json
import time

import datasets
import pytest
import torch

from conftest import shared_data
from pipeline.data import (DataSourceError, DistributedBatchLoader, build_pretraining_data, default_corpus,
                           load_tokenizer)

TOK = load_tokenizer("bytes")
EOD = TOK.eod_id


def _news_docs(n=12):
    text = shared_data("corpora", "news.txt").read_text(encoding="utf-8")[:200_000]
    docs = [d for d in text.split("\n\n") if d][:n]
    return docs + ["Ünïcödé — 日本語 🙂 closes the set"]


def _expected(docs):
    return [t for d in docs if d for t in (*d.encode("utf-8"), EOD)]


def _stream(seqs):
    return seqs.tokens(0, seqs.num_tokens).tolist()


def _build(data, tmp_path, **kw):
    kw.setdefault("valid_fraction", 0)
    train, valid = build_pretraining_data(data, TOK, kw.pop("seq_length", 16), cache_dir=str(tmp_path / "cache"), **kw)
    return train, valid


def _docs_of(tokens):
    """Split a byte-token stream at eod back into document texts."""
    docs, cur = [], []
    for t in tokens:
        if t == EOD:
            docs.append(bytes(cur).decode("utf-8"))
            cur = []
        else:
            cur.append(t)
    return docs


def _write_jsonl(path, docs, field="text", opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": i, field: d}) + "\n")


# --- each source form --------------------------------------------------------------------------------

def test_txt_paragraphs_are_documents(tmp_path):
    docs = _news_docs()
    (tmp_path / "a.txt").write_text("\n\n".join(docs), encoding="utf-8")
    train, valid = _build(str(tmp_path / "a.txt"), tmp_path)
    assert valid is None
    assert _stream(train) == _expected(docs)
    assert len(train) == (len(_expected(docs)) - 1) // 16
    # sequences are seq_length + 1 tokens with stride seq_length: a long document runs across sequences
    assert train[0].shape == (17,) and train[0].dtype == torch.long
    assert torch.equal(train[1][0], train[0][-1]) and train[3].tolist() == _expected(docs)[48:65]


def test_jsonl_json_and_compressed(tmp_path):
    docs = _news_docs()
    _write_jsonl(tmp_path / "d.jsonl", docs, field="body")
    with open(tmp_path / "arr.json", "w", encoding="utf-8") as f:
        json.dump([{"body": d, "n": 1} for d in docs], f)
    _write_jsonl(tmp_path / "z.jsonl.gz", docs, field="body", opener=gzip.open)
    for name in ("d.jsonl", "arr.json", "z.jsonl.gz"):
        train, _ = _build(str(tmp_path / name), tmp_path, text_field="body")
        assert _stream(train) == _expected(docs), name


def test_real_jsonl_lambada(tmp_path):
    path = shared_data("lambada", "test.jsonl")
    docs = [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines()]
    train, _ = _build(str(path), tmp_path, seq_length=512)
    assert _stream(train) == _expected(docs)


def test_csv_and_real_tsv(tmp_path):
    docs = _news_docs()  # contain commas, quotes and newlines: CSV quoting must carry them
    with open(tmp_path / "d.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["label", "content"])
        writer.writerows([[i, d] for i, d in enumerate(docs)])
    train, _ = _build(str(tmp_path / "d.csv"), tmp_path, text_field="content")
    assert _stream(train) == _expected(docs)
    path = shared_data("sst2", "val.tsv")  # unquoted TSV whose sentences contain '"' characters
    rows = list(csv.reader(path.open(encoding="utf-8"), delimiter="\t", quoting=csv.QUOTE_NONE))[1:]
    train, _ = _build(str(path), tmp_path, text_field="sentence")
    assert _stream(train) == _expected([r[0] for r in rows])


def test_parquet_and_save_to_disk(tmp_path):
    docs = _news_docs()
    ds = datasets.Dataset.from_dict({"id": list(range(len(docs))), "body": docs})
    ds.to_parquet(str(tmp_path / "d.parquet"))
    train, _ = _build(str(tmp_path / "d.parquet"), tmp_path, text_field="body")
    assert _stream(train) == _expected(docs)
    ds.save_to_disk(str(tmp_path / "saved"))
    train, _ = _build(str(tmp_path / "saved"), tmp_path, text_field="body")
    assert _stream(train) == _expected(docs)
    datasets.DatasetDict(train=ds, test=ds.select([0])).save_to_disk(str(tmp_path / "saved_dict"))
    train, _ = _build(str(tmp_path / "saved_dict"), tmp_path, text_field="body")
    assert _stream(train) == _expected(docs)


def test_folder_glob_and_several_sources(tmp_path):
    docs = _news_docs()
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("\n\n".join(docs[:5]), encoding="utf-8")
    (folder / "sub" / "b.txt").write_text("\n\n".join(docs[5:9]), encoding="utf-8")
    _write_jsonl(folder / "c.jsonl", docs[9:])
    (folder / ".hidden.txt").write_text("never read", encoding="utf-8")
    (folder / "README.md").write_text("not data", encoding="utf-8")
    train, _ = _build(str(folder), tmp_path)  # text files (sorted) then the jsonl part
    assert _stream(train) == _expected(docs)
    train, _ = _build(str(folder / "**" / "*.txt"), tmp_path)
    assert _stream(train) == _expected(docs[:9])
    # comma-separated specs and a list are the same thing, in the order given
    train, _ = _build(f"{folder / 'c.jsonl'},{folder / 'a.txt'}", tmp_path)
    assert _stream(train) == _expected(docs[9:] + docs[:5])
    train2, _ = _build([str(folder / "c.jsonl"), str(folder / "a.txt")], tmp_path)
    assert _stream(train2) == _stream(train)


def test_a_folder_of_many_files_is_read_in_place_without_a_download_bar(tmp_path, capfd):
    """datasets' manager shows "Downloading data: N/N files" for 16 local files or more (nothing is downloaded);
    ours reads them where they lie, compressed ones extracted, in the order given, with the generation bar kept."""
    docs = _news_docs(20)
    folder = tmp_path / "many"
    folder.mkdir()
    for i, doc in enumerate(docs[:-1]):
        (folder / f"{i:02d}.txt").write_text(doc, encoding="utf-8")
    with gzip.open(folder / "99.txt.gz", "wt", encoding="utf-8") as f:
        f.write(docs[-1])
    capfd.readouterr()
    train, _ = _build(str(folder), tmp_path)
    shown = capfd.readouterr().err
    assert _stream(train) == _expected(docs)
    assert "Generating train split" in shown and "Downloading data" not in shown


def test_default_corpus_is_the_standard_library():
    files = default_corpus()
    assert len(files) > 300 and all(f.endswith(".py") for f in files)
    assert any(f.endswith("/json/decoder.py") for f in files)
    assert not any("site-packages" in f or "/test/" in f for f in files)
    for f in files:  # every file decodes: the default corpus never trips the strict UTF-8 check
        with open(f, encoding="utf-8") as fh:
            fh.read()


def test_default_corpus_builds(tmp_path):
    train, valid = build_pretraining_data(None, TOK, 1024, cache_dir=str(tmp_path / "cache"), streaming=True)
    first = next(iter(train))
    assert first.shape == (1025,) and "import" in TOK.decode(first)


# --- validation split -------------------------------------------------------------------------------

@pytest.mark.parametrize("streaming", [False, True])
def test_valid_split_partitions_documents_deterministically(tmp_path, streaming):
    docs = [f"document {i}: " + d for i, d in enumerate(_news_docs(40) * 3)]
    (tmp_path / "a.txt").write_text("\n\n".join(docs), encoding="utf-8")

    def split(seed):
        train, valid = _build(str(tmp_path / "a.txt"), tmp_path, valid_fraction=0.2, seed=seed,
                              streaming=streaming, seq_length=8)
        if streaming:  # one pass, concatenated back (consecutive sequences share one token)
            seqs = [s.tolist() for s in train]
            tr = seqs[0] + [t for s in seqs[1:] for t in s[1:]]
            seqs = [s.tolist() for s in valid]
            va = seqs[0] + [t for s in seqs[1:] for t in s[1:]]
        else:
            tr, va = _stream(train), _stream(valid)
        return _docs_of(tr), _docs_of(va)

    tr, va = split(1)
    assert not set(tr) & set(va)
    assert len(set(docs) - set(tr) - set(va)) <= 2  # only the unfilled tails of train and valid are left out
    assert 0.05 * len(docs) < len(va) < 0.4 * len(docs)
    assert split(1) == (tr, va)
    assert split(2)[1] != va


# --- bad input ----------------------------------------------------------------------------------------

def test_missing_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        _build(str(tmp_path / "nope.txt"), tmp_path)
    with pytest.raises(FileNotFoundError, match="the glob matches no files"):
        _build(str(tmp_path / "*.jsonl"), tmp_path)
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "empty_dir" / "x.bin").write_bytes(b"\0")
    with pytest.raises(DataSourceError, match="folder has no data files.*x.bin"):
        _build(str(tmp_path / "empty_dir"), tmp_path)
    (tmp_path / "data.xml").write_text("<a/>")
    with pytest.raises(DataSourceError, match="data.xml: unsupported file type"):
        _build(str(tmp_path / "data.xml"), tmp_path)


def test_empty_corpora(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataSourceError, match="every file is empty: .*empty.txt"):
        _build(str(tmp_path / "empty.txt"), tmp_path)
    (tmp_path / "blank.txt").write_text("\n\n\n\n")
    with pytest.raises(DataSourceError, match="blank.txt: no documents"):
        _build(str(tmp_path / "blank.txt"), tmp_path)
    stream, _ = _build(str(tmp_path / "blank.txt"), tmp_path, streaming=True)
    with pytest.raises(ValueError, match="the stream has no text"):
        next(iter(DistributedBatchLoader(stream, 2, 0, 1)))
    (tmp_path / "tiny.txt").write_text("two words")
    with pytest.raises(DataSourceError, match="10 training tokens, fewer than one sequence of seq_length \\+ 1 = 17"):
        _build(str(tmp_path / "tiny.txt"), tmp_path)
    with pytest.raises(DataSourceError, match="only one document, so no validation split"):
        _build(str(tmp_path / "tiny.txt"), tmp_path, valid_fraction=0.1)


def test_missing_text_field_names_file_and_columns(tmp_path):
    _write_jsonl(tmp_path / "d.jsonl", ["a", "b"], field="body")
    with pytest.raises(DataSourceError, match=r"d.jsonl: no text field 'text'; its columns are \['id', 'body'\]"):
        _build(str(tmp_path / "d.jsonl"), tmp_path)
    (tmp_path / "d.csv").write_text("label,content\n1,hello\n")
    with pytest.raises(DataSourceError, match=r"d.csv: no text field 'txt'; its columns are \['label', 'content'\]"):
        _build(str(tmp_path / "d.csv"), tmp_path, text_field="txt")
    ds = datasets.Dataset.from_dict({"n": [1, 2], "body": ["x", "y"]})
    ds.to_parquet(str(tmp_path / "d.parquet"))
    with pytest.raises(DataSourceError, match=r"d.parquet: no text field 'text'; its columns are \['n', 'body'\]"):
        _build(str(tmp_path / "d.parquet"), tmp_path)
    ds.save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(DataSourceError, match=r"saved: no text field 'text'; its columns are \['n', 'body'\]"):
        _build(str(tmp_path / "saved"), tmp_path)
    with pytest.raises(DataSourceError, match=r"saved: field 'n' holds .*int64.*, not text"):
        _build(str(tmp_path / "saved"), tmp_path, text_field="n")


@pytest.mark.parametrize("streaming", [False, True])
def test_undecodable_bytes(tmp_path, streaming):
    good = "\n\n".join(_news_docs(4))
    (tmp_path / "ok.txt").write_text(good, encoding="utf-8")
    raw = good.encode("utf-8")
    (tmp_path / "bad.txt").write_bytes(raw[:1000] + b"\xff\xfe" + raw[1000:])
    line = raw[:1000].count(b"\n") + 1
    spec = f"{tmp_path / 'ok.txt'},{tmp_path / 'bad.txt'}"
    with pytest.raises(DataSourceError, match=rf"bad.txt: not valid UTF-8 at byte 1000 \(line {line}, .*"
                                              "encoding_errors='replace'"):
        train, _ = _build(spec, tmp_path, streaming=streaming)
        list(train)
    train, _ = _build(spec, tmp_path, streaming=streaming, encoding_errors="replace")
    tokens = _stream(train) if not streaming else [t for s in train for t in s.tolist()]
    assert bytes(t for t in tokens if t != EOD).count("\ufffd".encode()) == 2


@pytest.mark.serial
def test_hub_name_offline_fails_at_once(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    with pytest.raises(DataSourceError, match=r"'someone/corpus:en:train'.*taken as a hub dataset.*offline"):
        _build("someone/corpus:en:train", tmp_path)
    assert time.monotonic() - start < 10


def test_bad_weights_and_fractions(tmp_path):
    (tmp_path / "a.txt").write_text("\n\n".join(_news_docs()), encoding="utf-8")
    with pytest.raises(ValueError, match="1 weights for 2 data sources"):
        _build(f"{tmp_path / 'a.txt'},{tmp_path / 'a.txt'}", tmp_path, weights=[1.0])
    with pytest.raises(ValueError, match="valid_fraction must be in"):
        _build(str(tmp_path / "a.txt"), tmp_path, valid_fraction=1.5)


def test_num_proc_2_equals_num_proc_1(tmp_path):
    docs = _news_docs(30) + ["a literal <|endoftext|> inside a document stays text"]
    (tmp_path / "a.txt").write_text("\n\n".join(docs), encoding="utf-8")
    gpt2 = load_tokenizer(str(shared_data("tokenizers", "gpt2")))
    one, _ = build_pretraining_data(str(tmp_path / "a.txt"), gpt2, 32, valid_fraction=0, num_proc=1,
                                    cache_dir=str(tmp_path / "c1"))
    two, _ = build_pretraining_data(str(tmp_path / "a.txt"), gpt2, 32, valid_fraction=0, num_proc=2,
                                    cache_dir=str(tmp_path / "c2"))
    assert _stream(two) == _stream(one) == [t for d in docs for t in (*gpt2.encode(d), gpt2.eod_id)]


def test_derived_files_never_land_in_the_users_data(tmp_path):
    docs = _news_docs()
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(tmp_path / "saved"))
    before = sorted(p.name for p in (tmp_path / "saved").iterdir())
    train, valid = _build(str(tmp_path / "saved"), tmp_path, valid_fraction=0.2, seq_length=8)
    assert sorted(p.name for p in (tmp_path / "saved").iterdir()) == before
    assert any(p.name.startswith("tokenized-") for p in (tmp_path / "cache").iterdir())
    assert sorted(_docs_of(_stream(train)) + _docs_of(_stream(valid))) == sorted(docs)
