"""Language-model evaluation (pipeline.evaluation.lm_scoring, pipeline.evaluate) on tiny models built here and the real data files."""
import json
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT, shared_data
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast

from pipeline.evaluate import main as evaluate_main
from pipeline.evaluation.lm_scoring import (ByteTokenizer, HFScorer, HFTokenizer, LambadaExample, TokenScores,
                                            evaluate_bpc, evaluate_lambada, evaluate_wikitext, load_lambada,
                                            load_project_model, load_text, load_wikitext, score_token_stream,
                                            sliding_windows, vocab_parallel_argmax, wikitext_detokenize)

N_POSITIONS = 64


@pytest.fixture(scope="module")
def gpt2_tokenizer():
    # from_pretrained on the directory: in transformers 5, GPT2TokenizerFast(vocab_file=..., merges_file=...)
    # silently builds an empty vocabulary.
    return GPT2TokenizerFast.from_pretrained(shared_data("tokenizers", "gpt2"))


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory, gpt2_tokenizer):
    """A randomly initialised 2-layer GPT-2 with the real GPT-2 vocabulary, saved like any HF model."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(gpt2_tokenizer), n_positions=N_POSITIONS, n_embd=32,
                                       n_layer=2, n_head=2))
    path = tmp_path_factory.mktemp("tiny_gpt2")
    model.save_pretrained(path)
    gpt2_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_hf(tiny_hf_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_hf_dir)
    return model.eval(), HFScorer(model)


def _full_nll(model, ids):
    """Per-token NLL of ids[1:] given everything before, by hand."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1]
    return F.cross_entropy(logits.double(), torch.tensor(ids[1:]), reduction="none")


# --- detokenizer and loaders on the real files -----------------------------------
@pytest.mark.parametrize("tokenized, text", [
    (" \n = Robert Boulter = \n \n", "\n= Robert Boulter =\n\n"),
    ("\n = = Career = = \n", "\n== Career ==\n"),
    ("\n = = = 2000 – 2005 = = = \n", "\n=== 2000 – 2005 ===\n"),
    ("a guest @-@ starring role", "a guest-starring role"),
    ("1 @,@ 200 km and 3 @.@ 5 m", "1,200 km and 3.5 m"),
    ("He was cast , then left . Why ? Now ! Here : there ; and", "He was cast, then left. Why? Now! Here: there; and"),
    ("as \" Craig \" in \" Teddy 's Story \" of", "as \"Craig\" in \"Teddy's Story\" of"),
    ("Kiss You ( One Direction song ) and [ 1 ] { x }", "Kiss You (One Direction song) and [1] {x}"),
    ("the players ' union", "the players' union"),
    ("at 25 ° C", "at 25°C"),
])
def test_detokenizer_known_examples(tokenized, text):
    assert wikitext_detokenize(tokenized) == text


def test_wikitext_loader_reads_the_real_files():
    test = load_wikitext(shared_data("wikitext", "wikitext-2", "test.txt"))
    assert (test.num_lines, test.num_articles) == (4358, 62)
    # Megatron's "original tokens": 245,569 words + <eos> per line in the usual count, less the 3 the strip() drops.
    assert test.num_words == len(test.text.strip().split(" ")) == 245566
    raw = load_wikitext(shared_data("wikitext", "wiki.test.raw"))
    assert (raw.num_lines, raw.num_articles) == (4358, 62)
    assert "@-@" not in test.detokenized and " , " not in test.detokenized
    two = load_wikitext(shared_data("wikitext", "wikitext-2", "test.txt"), max_articles=2)
    assert two.num_articles == 2 and test.text.startswith(two.text)
    assert " = Du Fu = " in two.text and " = Kiss You ( One Direction song ) = " not in two.text


def test_lambada_loader_reads_the_real_file():
    examples = load_lambada(shared_data("lambada", "test.jsonl"))
    assert len(examples) == 5153
    first = examples[0]
    assert first.target == "signs" and first.context.endswith("I don't care about") and first.line == 1
    assert all(" " not in ex.target and ex.target for ex in examples)
    assert len(load_lambada(shared_data("lambada", "test.jsonl"), max_examples=7)) == 7


def test_bad_input_names_the_file_and_line(tmp_path):
    bad = tmp_path / "lambada.jsonl"
    bad.write_text('{"text": "a b c"}\n{"txt": "oops"}\n')
    with pytest.raises(ValueError, match=r"lambada.jsonl, line 2: .*\"text\""):
        load_lambada(bad)
    bad.write_text('{"text": "a b c"}\n{"text": "oneword"}\n')
    with pytest.raises(ValueError, match="line 2: the text needs a context and a last word"):
        load_lambada(bad)
    not_wiki = tmp_path / "notes.txt"
    not_wiki.write_text("just some text\n")
    with pytest.raises(ValueError, match="notes.txt: no article title line"):
        load_wikitext(not_wiki)
    with pytest.raises(FileNotFoundError, match="has no model.safetensors"):
        load_project_model(tmp_path)


# --- sliding windows -----------------------------------------------------------------
@pytest.mark.parametrize("num_tokens", [2, 5, 17, 64, 65, 66, 200])
@pytest.mark.parametrize("context_length, stride", [(16, 16), (16, 5), (16, 1), (1, 1), (64, 32)])
def test_windows_score_every_token_but_the_first_exactly_once(num_tokens, context_length, stride):
    times = [0] * num_tokens
    for w in sliding_windows(num_tokens, context_length, stride):
        assert 0 <= w.start < w.first < w.end <= num_tokens
        assert w.end - w.start == min(context_length + 1, num_tokens)  # full windows, no padding
        assert w.first == 1 or w.first - w.start >= context_length - stride + 1  # the promised minimum context
        for p in range(w.first, w.end):
            times[p] += 1
    assert times == [0] + [1] * (num_tokens - 1)


def test_sliding_window_equals_full_context_when_the_window_covers_the_text(tiny_hf):
    model, scorer = tiny_hf
    ids = torch.randint(0, 50257, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    full = _full_nll(model, ids)
    for context_length, stride in [(39, 39), (39, 1), (N_POSITIONS, 7)]:
        stream = score_token_stream(scorer, ids, context_length=context_length, stride=stride, batch_size=2,
                                    progress=False)
        torch.testing.assert_close(stream.token_nll[1:], full, atol=1e-5, rtol=1e-5)
    narrow = score_token_stream(scorer, ids, context_length=20, stride=5, progress=False)
    assert not torch.allclose(narrow.token_nll[1:], full, atol=1e-5, rtol=1e-5)  # the window limit is felt


def test_smaller_window_scores_each_token_once_with_its_own_left_context(tiny_hf):
    model, scorer = tiny_hf
    ids = torch.randint(0, 50257, (60,), generator=torch.Generator().manual_seed(2)).tolist()
    context_length, stride = 12, 5
    stream = score_token_stream(scorer, ids, context_length=context_length, stride=stride, batch_size=3,
                                progress=False)
    assert stream.times_scored.tolist() == [0] + [1] * 59
    assert stream.num_windows == len(sliding_windows(60, context_length, stride)) > 10
    assert math.isnan(stream.token_nll[0])
    for p in range(1, 60):  # each token's NLL is the model's on exactly the context its window gave it
        c = int(stream.context[p])
        assert c == p if p <= context_length else context_length - stride + 1 <= c <= context_length
        assert stream.token_nll[p].item() == pytest.approx(_full_nll(model, ids[p - c:p + 1])[-1].item(), abs=1e-5)


# --- the three tasks against hand computations -------------------------------------------
def test_wikitext_perplexities_equal_exp_of_the_losses_by_hand(tiny_hf, gpt2_tokenizer, tmp_path):
    model, scorer = tiny_hf
    path = tmp_path / "wiki.txt"
    path.write_text(" \n = Tiny = \n \n The cat , a grey one , sat @-@ still on the mat . \n")
    data = load_wikitext(path)
    tokenizer = HFTokenizer(gpt2_tokenizer)
    ids = tokenizer.encode("\n= Tiny =\n\nThe cat, a grey one, sat-still on the mat.\n")
    assert tokenizer.encode(data.detokenized) == ids
    nll = _full_nll(model, ids)
    out = evaluate_wikitext(scorer, tokenizer, data, context_length=N_POSITIONS, stride=8, progress=False)
    assert out["num_scored_tokens"] == len(ids) - 1
    assert out["token_perplexity"] == pytest.approx(math.exp(nll.mean().item()), rel=1e-6)
    words = len(path.read_text().strip().split(" "))
    assert out["num_words"] == words == 19
    assert out["word_perplexity"] == pytest.approx(math.exp(nll.sum().item() / (words - 1)), rel=1e-6)


def test_bits_per_character_by_hand(tiny_hf, gpt2_tokenizer, tmp_path):
    model, scorer = tiny_hf
    text = "Naïve café owners serve crème brûlée.\nThe end.\n"
    path = tmp_path / "held_out.txt"
    path.write_text(text, encoding="utf-8")
    tokenizer = HFTokenizer(gpt2_tokenizer)
    out = evaluate_bpc(scorer, tokenizer, load_text(path), context_length=N_POSITIONS, stride=4, progress=False)
    ids = [gpt2_tokenizer.eos_token_id] + tokenizer.encode(text)  # start token: every character is scored
    bits = _full_nll(model, ids).sum().item() / math.log(2)
    assert out["num_characters"] == len(text) < out["num_bytes"] == len(text.encode())
    assert out["bits_per_character"] == pytest.approx(bits / len(text), rel=1e-6)
    assert out["bits_per_byte"] == pytest.approx(bits / len(text.encode()), rel=1e-6)


class _OracleScorer:
    """Predicts every next token right, except that it never predicts the tokens in ``blind``."""
    max_positions, device = None, torch.device("cpu")

    def __init__(self, blind):
        self.blind = set(blind)

    def __call__(self, ids, *, greedy=False):
        nxt = ids[:, 1:]
        wrong = torch.tensor([[t in self.blind for t in row] for row in nxt.tolist()], dtype=torch.bool)
        return TokenScores(nll=wrong.float() * 3.0, greedy=torch.where(wrong, nxt + 1, nxt))


@pytest.mark.parametrize("batch_size", [1, 2, 3])
def test_strict_lambada_needs_every_token_of_the_word(batch_size):
    tokenizer = ByteTokenizer()  # one token per byte: " xy" is three tokens
    examples = [LambadaExample("first passage", "xy", 1),    # ' ', 'x' right, 'y' wrong: word wrong
                LambadaExample("second one", "xx", 2),       # all right
                LambadaExample("and a third", "yx", 3),      # first wrong, rest right: word wrong
                LambadaExample("the last", "x", 4)]          # right
    out = evaluate_lambada(_OracleScorer(blind=[ord("y")]), tokenizer, examples, context_length=64,
                           batch_size=batch_size, progress=False)
    assert (out["num_correct"], out["num_examples"], out["accuracy"]) == (2, 4, 0.5)
    assert (out["num_correct_tokens"], out["num_target_tokens"]) == (9, 11)
    assert out["token_accuracy"] == pytest.approx(9 / 11)
    assert out["target_perplexity"] == pytest.approx(math.exp(2 * 3.0 / 4))
    assert out["num_multi_token_targets"] == 4 and out["num_truncated"] == 0


def test_lambada_on_a_model_agrees_with_greedy_generation(tiny_hf, gpt2_tokenizer):
    model, scorer = tiny_hf
    tokenizer = HFTokenizer(gpt2_tokenizer)
    window = N_POSITIONS - 1  # the model reads 63 tokens: longer passages lose context from the left

    def generate(ctx, n):
        ctx = ctx[-(window + 1 - n):]
        return model.generate(torch.tensor([ctx]), max_new_tokens=n, do_sample=False, pad_token_id=0)[0, len(ctx):].tolist()

    examples, expected = [], []
    for ex in load_lambada(shared_data("lambada", "test.jsonl"), max_examples=5):
        ctx, tgt = tokenizer.encode(ex.context), tokenizer.encode(" " + ex.target)
        examples.append(ex)
        expected.append(generate(ctx, len(tgt)) == tgt)
        # Plus the same passage ending in the word the model itself would write (1 or 2 tokens): right by construction.
        for n in (2, 1):
            gen = generate(ctx, n)
            word = gpt2_tokenizer.decode(gen)
            if word.startswith(" ") and word[1:].strip() and " " not in word[1:] and tokenizer.encode(word) == gen:
                examples.append(LambadaExample(ex.context, word[1:], ex.line))
                expected.append(True)
                break
    assert sum(expected) >= 2
    for batch_size in (1, 4):
        out = evaluate_lambada(scorer, tokenizer, examples, context_length=window, batch_size=batch_size,
                               progress=False)
        assert out["num_correct"] == sum(expected) and out["num_examples"] == len(examples)
        assert 0 < out["num_truncated"] < len(examples)


def test_vocab_parallel_argmax_single_rank_matches_argmax_and_skips_padding():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0, 9.0], [2.0, 0.0, 1.0, 2.0, 5.0]])
    assert vocab_parallel_argmax(logits, vocab_size=4).tolist() == [1, 0]  # column 4 is padding; ties: first
    assert vocab_parallel_argmax(logits, vocab_size=5).tolist() == [4, 4]


# --- the command ------------------------------------------------------------------------
def test_cli_end_to_end_writes_the_result_json(tiny_hf_dir, tmp_path):
    out = tmp_path / "res" / "wikitext.json"
    record = evaluate_main(["--task", "wikitext", "--data", str(shared_data("wikitext", "wikitext-2", "test.txt")),
                            "--hf", str(tiny_hf_dir), "--out", str(out), "--max-examples", "1",
                            "--stride", "48", "--batch-size", "16", "--no-progress",
                            "--plot", str(tmp_path / "loss.png")])
    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(record))
    r = saved["results"]
    assert saved["settings"]["context_length"] == N_POSITIONS and saved["settings"]["stride"] == 48
    assert r["num_articles"] == 1 and r["num_scored_tokens"] == r["num_tokens"] - 1 > 1000
    assert r["token_perplexity"] == pytest.approx(math.exp(r["total_nll"] / r["num_scored_tokens"]))
    assert r["word_perplexity"] == pytest.approx(math.exp(r["total_nll"] / (r["num_words"] - 1)))
    assert saved["model"]["format"] == "hf" and len(saved["data"]["sha256"]) == 64
    assert not list(out.parent.glob("*.tmp"))
    by_context = r["loss_by_context"]
    assert sum(b["tokens"] for b in by_context) == r["num_scored_tokens"]
    assert by_context[0]["context_from"] == 1 and by_context[-1]["context_to"] >= N_POSITIONS - 48
    assert (tmp_path / "loss.png").stat().st_size > 1000

    # The module as a command, on LAMBADA.
    out = tmp_path / "lambada.json"
    proc = subprocess.run([sys.executable, "-m", "pipeline.evaluate", "--task", "lambada", "--data",
                           str(shared_data("lambada", "test.jsonl")), "--hf", str(tiny_hf_dir), "--out", str(out),
                           "--max-examples", "10", "--batch-size", "5"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())["results"]
    assert r["num_examples"] == 10 and 0 <= r["num_correct"] <= 10 and r["num_target_tokens"] >= 10
    assert "lambada: strict accuracy" in proc.stderr


def test_context_parallel_is_refused_where_it_cannot_split(tiny_hf_dir, tmp_path):
    """--context-parallel splits a --checkpoint's windows over ranks: below 1, or with --hf (one process), it is
    refused before any model is read."""
    text = tmp_path / "held_out.txt"
    text.write_text("some held-out text\n")
    common = ["--task", "bpc", "--data", str(text), "--out", str(tmp_path / "r.json")]
    with pytest.raises(ValueError, match="argument --context-parallel: '0' is out of range"):  # the flag's type
        evaluate_main([*common, "--checkpoint", str(tmp_path), "--context-parallel", "0"])
    with pytest.raises(ValueError, match="--context-parallel 2: splits a --checkpoint's windows over ranks; --hf runs "
                                         "in one process"):
        evaluate_main([*common, "--hf", str(tiny_hf_dir), "--context-parallel", "2"])
    assert not (tmp_path / "r.json").exists()
