"""Loaders: disjoint complete DP shards, exact resume at the batch level (map-style, streaming, mixtures,
BPTT streams), BPTT rows that continue their streams, and a real 2-rank gloo build."""
import io

import pytest
import torch
import torch.distributed as dist
from conftest import shared_data
from dist import run_distributed

from pipeline.data import DistributedBatchLoader, StreamBatchLoader, build_pretraining_data, load_tokenizer

TOK = load_tokenizer("bytes")


class IndexSequences:
    """Map-style sequences whose every token is the sequence's own index: batches show which were read."""

    def __init__(self, n, length=5):
        self.n, self.length = n, length

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.full((self.length,), i, dtype=torch.long)


def _ids(batch):
    return batch["tokens"][:, 0].tolist()


def _roundtrip(state):
    """A loader state goes into checkpoints: it must survive torch.save / torch.load(weights_only=True)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _corpus(tmp_path, name="a.txt", chars=60_000, offset=0):
    text = shared_data("corpora", "news.txt").read_text(encoding="utf-8")[offset:offset + chars]
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


# --- map-style ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [48, 50])
def test_dp_shards_are_disjoint_and_cover_each_epoch(n):
    world, micro = 4, 3
    loaders = [DistributedBatchLoader(IndexSequences(n), micro, r, world, seed=7) for r in range(world)]
    assert len(loaders[0]) == n // (world * micro)
    epochs = []
    for _ in range(2):
        seen = [i for _ in range(len(loaders[0])) for loader in loaders for i in _ids(next(loader))]
        assert len(seen) == len(set(seen)) == (n // 12) * 12  # disjoint; complete up to the short tail
        epochs.append(seen)
    assert epochs[0] != epochs[1]  # reshuffled each epoch
    if n == 48:
        assert set(epochs[0]) == set(epochs[1]) == set(range(48))
    assert all(loader.epoch == 1 for loader in loaders)
    # TP / PP ranks of one DP slot pass the same dp_rank and get the same batches
    a, b = (DistributedBatchLoader(IndexSequences(n), micro, 2, world, seed=7) for _ in range(2))
    assert all(torch.equal(next(a)["tokens"], next(b)["tokens"]) for _ in range(9))
    plain = DistributedBatchLoader(IndexSequences(n), 2, 1, 2, shuffle=False)
    assert [_ids(next(plain)) for _ in range(2)] == [[2, 3], [6, 7]]


def test_map_resume_is_exact(tmp_path):
    train, _ = build_pretraining_data(_corpus(tmp_path), TOK, 64, valid_fraction=0, cache_dir=str(tmp_path / "c"))
    make = lambda: DistributedBatchLoader(train, 2, 1, 2, seed=3)
    reference = make()
    per_epoch = len(reference)
    ref = [next(reference)["tokens"] for _ in range(per_epoch + 10)]
    assert ref[0].shape == (2, 65)
    for k in (0, 5, per_epoch, per_epoch + 3):
        first = make()
        for _ in range(k):
            next(first)
        resumed = make()
        resumed.load_state_dict(_roundtrip(first.state_dict()))
        for i in range(k, len(ref)):
            assert torch.equal(next(resumed)["tokens"], ref[i]), (k, i)


def test_resume_with_another_dp_size_keeps_the_global_order():
    seqs = IndexSequences(40)
    two = [DistributedBatchLoader(seqs, 2, r, 2, seed=1) for r in range(2)]
    four = [DistributedBatchLoader(seqs, 1, r, 4, seed=1) for r in range(4)]
    for _ in range(3):
        assert [i for l in two for i in _ids(next(l))] == [i for l in four for i in _ids(next(l))]
    four_resumed = [DistributedBatchLoader(seqs, 1, r, 4, seed=1) for r in range(4)]
    for loader in four_resumed:
        loader.load_state_dict(two[0].state_dict())
    for _ in range(12):  # across the epoch boundary too
        assert [i for l in two for i in _ids(next(l))] == [i for l in four_resumed for i in _ids(next(l))]


def test_loader_refuses_unfit_state_and_tiny_data():
    loader = DistributedBatchLoader(IndexSequences(40), 2, 0, 2)
    with pytest.raises(ValueError, match="num_sequences was 40 at the checkpoint and is 41 now"):
        DistributedBatchLoader(IndexSequences(41), 2, 0, 2).load_state_dict(loader.state_dict())
    with pytest.raises(ValueError, match="seed was 1234 at the checkpoint and is 5 now"):
        DistributedBatchLoader(IndexSequences(40), 2, 0, 2, seed=5).load_state_dict(loader.state_dict())
    with pytest.raises(ValueError, match="has 3 sequences, fewer than one global micro-batch"):
        DistributedBatchLoader(IndexSequences(3), 2, 0, 2)
    with pytest.raises(ValueError, match="dp_rank 2 is not in"):
        DistributedBatchLoader(IndexSequences(40), 2, 2, 2)


# --- streaming and mixtures -------------------------------------------------------------------------

def test_streaming_shards_are_disjoint_and_complete(tmp_path):
    files = [_corpus(tmp_path, f"{i}.txt", 20_000, offset=20_000 * i) for i in range(3)]
    train, _ = build_pretraining_data(files, TOK, 32, valid_fraction=0, streaming=True)
    everything = [e["text"] for e in train.documents]
    for world in (2, 3):  # 3 files: by example for 2 ranks, by file for 3
        shards = [[e["text"] for e in train.shard(r, world).documents] for r in range(world)]
        assert sorted(sum(shards, [])) == sorted(everything)  # each document on exactly one rank
        assert all(len(s) > 0 for s in shards)


@pytest.mark.parametrize("weights", [None, [3, 1]])
def test_streaming_resume_is_exact(tmp_path, weights):
    files = [_corpus(tmp_path, "a.txt", 30_000), _corpus(tmp_path, "b.txt", 10_000, offset=50_000)]
    train, _ = build_pretraining_data(files, TOK, 48, valid_fraction=0.05, streaming=True, weights=weights)
    train.doc_batch_size = 8  # several document batches per epoch: resume inside and between them
    make = lambda: DistributedBatchLoader(train, 3, 1, 2)
    reference = make()
    ref = [next(reference)["tokens"] for _ in range(160)]  # over 2 epochs of this rank's shard
    assert reference.epoch >= 1
    for k in (1, 37, 120):
        first = make()
        for _ in range(k):
            next(first)
        resumed = make()
        resumed.load_state_dict(_roundtrip(first.state_dict()))
        for i in range(k, min(k + 25, len(ref))):
            assert torch.equal(next(resumed)["tokens"], ref[i]), (k, i)
    with pytest.raises(ValueError, match="belongs to DP rank 1 of 2, not 0 of 2"):
        DistributedBatchLoader(train, 3, 0, 2).load_state_dict(first.state_dict())


def test_stream_equals_map_style_packing(tmp_path):
    path = _corpus(tmp_path)
    mapped, _ = build_pretraining_data(path, TOK, 40, valid_fraction=0, cache_dir=str(tmp_path / "c"))
    streamed, _ = build_pretraining_data(path, TOK, 40, valid_fraction=0, streaming=True)
    seqs = list(streamed)
    assert len(seqs) == len(mapped) and all(torch.equal(s, mapped[i]) for i, s in enumerate(seqs))


@pytest.mark.parametrize("streaming", [False, True])
def test_weighted_mixture(tmp_path, streaming):
    a = tmp_path / "a.jsonl"
    b = tmp_path / "b.jsonl"
    a.write_text("".join(f'{{"text": "A{i:03d}"}}\n' for i in range(300)))
    b.write_text("".join(f'{{"text": "B{i:03d}"}}\n' for i in range(30)))
    train, _ = build_pretraining_data([str(a), str(b)], TOK, 4, valid_fraction=0, weights="0.8,0.2",
                                      streaming=streaming, cache_dir=str(tmp_path / "c"))
    docs = [e["text"] for e in train.documents] if streaming else None
    if not streaming:  # each document is 4 bytes + eod = 5 tokens: read them back from the stream
        flat = train.tokens(0, train.num_tokens).tolist()
        docs = [bytes(flat[i:i + 4]).decode() for i in range(0, len(flat) - 4, 5)]
    share_a = sum(d.startswith("A") for d in docs) / len(docs)
    assert 0.72 < share_a < 0.88
    assert {d for d in docs if d.startswith("A")} == {f"A{i:03d}" for i in range(300)}  # all of A, once or more
    assert len([d for d in docs if d.startswith("B")]) > 30  # B repeated to keep its 20 %


# --- BPTT streams ------------------------------------------------------------------------------------

def test_bptt_rows_continue_their_streams():
    T, micro, bptt, world = 1000, 3, 10, 2
    stream = torch.arange(T)
    loaders = [StreamBatchLoader(stream, micro, bptt, r, world, seed=5) for r in range(world)]
    row_length = T // (micro * world)
    assert len(loaders[0]) == (row_length - 1) // bptt
    per_epoch = len(loaders[0])
    for epoch in range(2):
        rows = {r: [[] for _ in range(micro)] for r in range(world)}
        for b in range(per_epoch):
            for r, loader in enumerate(loaders):
                batch = next(loader)
                assert batch["tokens"].shape == (micro, bptt + 1) and batch["tokens"].dtype == torch.long
                assert batch["reset"].tolist() == [b == 0] * micro
                for j in range(micro):
                    window = batch["tokens"][j].tolist()
                    if b:  # the window continues the row: its first token is the last one of the previous
                        assert window[0] == rows[r][j][-1]
                        window = window[1:]
                    rows[r][j] += window
        offsets = []
        for r in range(world):
            for j in range(micro):
                row = rows[r][j]  # a contiguous piece of the (rotated) token stream
                assert row == [(row[0] + k) % T for k in range(len(row))]
                offsets.append(row[0])
        # rows sit row_length apart: disjoint, in rank-major order, covering the rotated stream
        assert [(o - offsets[0]) % T for o in offsets] == [g * row_length for g in range(micro * world)]
        if epoch == 0:
            first_offset = offsets[0]
    assert offsets[0] != first_offset  # a new rotation each epoch


def test_bptt_resume_and_packed_source(tmp_path):
    train, _ = build_pretraining_data(_corpus(tmp_path), TOK, 64, valid_fraction=0, cache_dir=str(tmp_path / "c"))
    make = lambda source: StreamBatchLoader(source, 4, 32, 1, 2, seed=9)
    reference = make(train)
    flat = make(torch.from_numpy(train.tokens(0, train.num_tokens).astype("int64")))
    ref = []
    for _ in range(len(reference) + 5):
        batch = next(reference)
        other = next(flat)
        assert torch.equal(batch["tokens"], other["tokens"]) and torch.equal(batch["reset"], other["reset"])
        ref.append(batch)
    for k in (3, len(reference), len(reference) + 2):
        first = make(train)
        for _ in range(k):
            next(first)
        resumed = make(train)
        resumed.load_state_dict(_roundtrip(first.state_dict()))
        for i in range(k, len(ref)):
            batch = next(resumed)
            assert torch.equal(batch["tokens"], ref[i]["tokens"]) and torch.equal(batch["reset"], ref[i]["reset"])
    with pytest.raises(ValueError, match="rows was 8 at the checkpoint and is 6 now"):
        StreamBatchLoader(train, 3, 32, 1, 2, seed=9).load_state_dict(first.state_dict())
    with pytest.raises(ValueError, match="fewer than one window of bptt_length \\+ 1 = 101"):
        StreamBatchLoader(torch.arange(500), 4, 100, 0, 2)


def test_bptt_over_a_streamed_corpus(tmp_path):
    path = _corpus(tmp_path, chars=30_000)
    mapped, _ = build_pretraining_data(path, TOK, 16, valid_fraction=0, cache_dir=str(tmp_path / "c"))
    streamed, _ = build_pretraining_data(path, TOK, 16, valid_fraction=0, streaming=True)
    micro, bptt, windows = 3, 16, 4
    make = lambda: StreamBatchLoader(streamed, micro, bptt, 0, 1, segment_windows=windows)
    loader = make()
    assert len(loader) == windows
    ref = [next(loader) for _ in range(3 * windows)]
    segments = []
    for s in range(3):
        rows = [[] for _ in range(micro)]
        for k in range(windows):
            batch = ref[s * windows + k]
            assert batch["tokens"].shape == (micro, bptt + 1) and batch["reset"].tolist() == [k == 0] * micro
            for j in range(micro):
                window = batch["tokens"][j].tolist()
                if k:
                    assert window[0] == rows[j][-1]  # the row continues its stream
                    window = window[1:]
                rows[j] += window
        segments += rows
    # segments are dealt in stream order: together they are the packed token stream, without gaps
    flat = segments[0] + [t for seg in segments[1:] for t in seg[1:]]
    assert flat == mapped.tokens(0, len(flat)).tolist()
    for k in (0, 2, windows, 2 * windows + 1):
        first = make()
        for _ in range(k):
            next(first)
        resumed = make()
        resumed.load_state_dict(_roundtrip(first.state_dict()))
        for i in range(k, len(ref)):
            batch = next(resumed)
            assert torch.equal(batch["tokens"], ref[i]["tokens"]) and torch.equal(batch["reset"], ref[i]["reset"])


# --- a real multi-process build -----------------------------------------------------------------------

def _rank_epoch(rank, path, cache_dir):
    train, valid = build_pretraining_data(path, TOK, 32, valid_fraction=0.05, cache_dir=cache_dir)
    loader = DistributedBatchLoader(train, 2, dist.get_rank(), dist.get_world_size(), seed=11)
    return {"batches": [next(loader)["tokens"] for _ in range(len(loader))], "n": len(train),
            "valid": len(valid)}


def test_two_gloo_ranks_build_and_read_disjoint_shards(tmp_path):
    path = _corpus(tmp_path, chars=20_000)
    cache = str(tmp_path / "cache")
    results = run_distributed(_rank_epoch, 2, path, cache)
    train, valid = build_pretraining_data(path, TOK, 32, valid_fraction=0.05, cache_dir=cache)
    assert results[0]["n"] == results[1]["n"] == len(train) and results[0]["valid"] == len(valid)
    rows = [tuple(row.tolist()) for res in results for batch in res["batches"] for row in batch]
    expected = {tuple(train[i].tolist()) for i in range(len(train))}
    assert len(rows) == (len(train) // 4) * 4 and set(rows) <= expected
    assert len(set(rows)) == len(rows) or len(set(expected)) < len(train)  # disjoint (up to repeated text)
