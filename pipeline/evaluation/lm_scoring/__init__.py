"""Language-model evaluation as Megatron-LM reports it: WikiText perplexity, LAMBADA accuracy, bits per character.

A model enters as a ``Scorer`` (ids -> per-token NLL and greedy predictions):
``HFScorer`` for Hugging Face causal LMs, ``GPTScorer`` for the project's GPT at
any tensor-parallel size. Text enters through a ``Tokenizer`` adapter.
"""
from pipeline.evaluation.lm_scoring.bpc import HeldOutText, evaluate_bpc, load_text
from pipeline.evaluation.lm_scoring.lambada import LambadaExample, encode_example, evaluate_lambada, load_lambada
from pipeline.evaluation.lm_scoring.loading import (load_hf_model, load_hf_tokenizer, load_project_model,
                                                    project_scorer, resolve_device)
from pipeline.evaluation.lm_scoring.parallel import DataShard, vocab_parallel_argmax
from pipeline.evaluation.lm_scoring.scoring import (GPTScorer, HFScorer, Scorer, StreamScore, TokenScores, Window,
                                                    score_token_stream, sliding_windows)
from pipeline.evaluation.lm_scoring.tokenization import ByteTokenizer, HFTokenizer, Tokenizer
from pipeline.evaluation.lm_scoring.wikitext import WikiText, evaluate_wikitext, load_wikitext, wikitext_detokenize

__all__ = [
    "Scorer", "TokenScores", "HFScorer", "GPTScorer", "Window", "sliding_windows", "StreamScore",
    "score_token_stream", "DataShard", "vocab_parallel_argmax",
    "Tokenizer", "HFTokenizer", "ByteTokenizer",
    "WikiText", "load_wikitext", "wikitext_detokenize", "evaluate_wikitext",
    "LambadaExample", "load_lambada", "encode_example", "evaluate_lambada",
    "HeldOutText", "load_text", "evaluate_bpc",
    "load_hf_model", "load_hf_tokenizer", "load_project_model", "project_scorer", "resolve_device",
]
