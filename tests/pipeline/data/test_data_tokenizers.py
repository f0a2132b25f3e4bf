"""Tokenizers: GPT-2 BPE equals transformers' on real text, bytes round-trip, save/load (ours and
AutoTokenizer), fingerprints refuse a different tokenizer, BPE training."""
import json

import pytest
from transformers import AutoTokenizer, GPT2TokenizerFast

from conftest import shared_data
from pipeline.data import (ByteTokenizer, check_same_tokenizer, load_saved_tokenizer, load_tokenizer)

NON_ASCII = "naïve café — 日本語のテキスト, emoji 🙂🚀, Ελληνικά, \u00a0nbsp, tab\tand\nnewline"


def _real_docs(n_per_corpus=60):
    docs = []
    for name in ("news.txt", "wikipedia.txt", "shakespeare.txt"):
        text = shared_data("corpora", name).read_text(encoding="utf-8")[:400_000]
        docs += [d for d in text.split("\n\n") if d][:n_per_corpus]
    return docs


@pytest.fixture(scope="module")
def gpt2():
    return load_tokenizer(str(shared_data("tokenizers", "gpt2")))


def test_gpt2_bpe_equals_transformers_on_real_text(gpt2):
    directory = shared_data("tokenizers", "gpt2")
    reference = GPT2TokenizerFast(vocab=str(directory / "vocab.json"), merges=str(directory / "merges.txt"))
    docs = _real_docs() + [NON_ASCII]
    ours = gpt2.encode_batch(docs)
    assert ours == [reference(d)["input_ids"] for d in docs]
    assert ours[0] == gpt2.encode(docs[0])
    assert all(gpt2.decode(ids) == d for ids, d in zip(ours, docs))
    assert (gpt2.name, gpt2.vocab_size, gpt2.eod_id) == ("gpt2-bpe", 50257, reference.eos_token_id)


@pytest.mark.parametrize("kind", ["gpt2", "bytes"])
def test_encode_documents_is_the_joined_stream(kind, gpt2):
    tok = gpt2 if kind == "gpt2" else load_tokenizer("bytes")
    docs = _real_docs(3) + ["", NON_ASCII]
    flat, lengths = tok.encode_documents(docs)
    expected = [t for d in docs if d for t in (*tok.encode(d), tok.eod_id)]
    assert flat.tolist() == expected and lengths.sum() == len(expected) and len(lengths) == len(docs) - 1


def test_literal_special_token_in_text_is_not_a_document_boundary(gpt2):
    ids = gpt2.encode("quoted <|endoftext|> here")
    assert gpt2.eod_id not in ids and gpt2.decode(ids) == "quoted <|endoftext|> here"


def test_bytes_round_trip_non_ascii():
    tok = load_tokenizer("bytes")
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 258 and tok.eod_id == 256
    ids = tok.encode(NON_ASCII)
    assert ids == list(NON_ASCII.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids) == NON_ASCII
    # the fast byte path equals the tokenizers backend that tokenizer.json describes
    assert tok.backend.encode(NON_ASCII, add_special_tokens=False).ids == ids
    assert tok.encode_batch([NON_ASCII, "", "a"]) == [ids, [], [97]]
    assert tok.decode(ids + [tok.eod_id]).endswith("<|endoftext|>")


@pytest.fixture(scope="module")
def trained():
    return load_tokenizer("train-bpe", corpus=_real_docs(200), vocab_size=600)


def test_train_bpe_on_corpus(trained):
    assert trained.name == "bpe-trained" and trained.vocab_size == 600
    docs = _real_docs(5) + [NON_ASCII]  # bytes never seen in training still encode (byte-level alphabet)
    for d in docs:
        ids = trained.encode(d)
        assert max(ids) < 600 and trained.decode(ids) == d
    assert len(trained.encode(docs[0])) < len(docs[0].encode("utf-8")) / 1.5  # merges learnt compress


def test_train_bpe_from_data_spec_is_deterministic(tmp_path):
    spec = str(tmp_path / "news.txt")
    with open(spec, "w", encoding="utf-8") as f:
        f.write(shared_data("corpora", "news.txt").read_text(encoding="utf-8")[:200_000])
    a = load_tokenizer("train-bpe", corpus=spec, vocab_size=400)
    b = load_tokenizer("train-bpe", corpus=[spec], vocab_size=400)
    assert a.fingerprint() == b.fingerprint() and a.vocab_size == 400


@pytest.mark.parametrize("kind", ["gpt2", "bytes", "trained"])
def test_saved_tokenizer_loads_with_autotokenizer_and_ours(kind, gpt2, trained, tmp_path):
    tok = {"gpt2": gpt2, "bytes": load_tokenizer("bytes"), "trained": trained}[kind]
    tok.save(tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == {"tokenizer.json", "tokenizer_config.json"}
    text = "Hello world. " + NON_ASCII
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    assert hf(text, add_special_tokens=False)["input_ids"] == tok.encode(text)
    assert hf.eos_token_id == tok.eod_id and len(hf) == tok.vocab_size
    assert hf.decode(tok.encode(text)) == text
    restored = load_saved_tokenizer(tmp_path)
    assert (restored.name, restored.vocab_size, restored.eod_id) == (tok.name, tok.vocab_size, tok.eod_id)
    assert restored.fingerprint() == tok.fingerprint() and type(restored) is type(tok)
    assert restored.encode(text) == tok.encode(text)
    assert load_tokenizer(str(tmp_path)).fingerprint() == tok.fingerprint()  # a dir with tokenizer.json
    assert load_tokenizer(str(tmp_path / "tokenizer.json")).fingerprint() == tok.fingerprint()
    check_same_tokenizer(tmp_path, restored)  # same: no error


def test_different_tokenizer_is_refused(gpt2, tmp_path):
    gpt2.save(tmp_path)
    with pytest.raises(ValueError, match=r"tokenizer mismatch: .* 'gpt2-bpe' .* 'bytes'"):
        check_same_tokenizer(tmp_path, load_tokenizer("bytes"))
    # same vocabulary, different end-of-document id: still a different tokenizer
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["pipeline_tokenizer"]["eod_token"] = "!"
    other = tmp_path / "other"
    other.mkdir()
    (other / "tokenizer.json").write_text((tmp_path / "tokenizer.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_saved_tokenizer(other).eod_id == 0
    with pytest.raises(ValueError, match="tokenizer mismatch"):
        check_same_tokenizer(other, gpt2)
    with pytest.raises(FileNotFoundError, match="no saved tokenizer"):
        check_same_tokenizer(tmp_path / "missing", gpt2)


def test_tokenizer_spec_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="unknown tokenizer 'gpt-9'"):
        load_tokenizer("gpt-9")
    (tmp_path / "notes.md").write_text("x")
    with pytest.raises(FileNotFoundError, match=r"neither tokenizer.json nor vocab.json \+ merges.txt .*notes.md"):
        load_tokenizer(str(tmp_path))
    with pytest.raises(ValueError, match="needs vocab_size"):
        load_tokenizer("train-bpe", corpus=["some text"])
    with pytest.raises(ValueError, match="empty corpus"):
        load_tokenizer("train-bpe", corpus=["", ""], vocab_size=300)
    bad = tmp_path / "broken.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read tokenizer file .*broken.json"):
        load_tokenizer(str(bad))
