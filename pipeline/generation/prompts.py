"""Prompts from the command line or a file, as token ids the model can continue; the refusals of bad ones.

A prompts file is plain text, one prompt a line (blank lines skipped), or, for a ``.jsonl`` file, JSON lines
``{"prompt": "..."}`` (a prompt holding line breaks). A prompt is encoded as the tokenizer would for its model
(with its special prefix, e.g. Llama's BOS); an empty prompt starts from the start token.
"""
from __future__ import annotations

import json
from pathlib import Path

from pipeline.job.errors import InputError
from pipeline.job.files import read_utf8_text


class PromptError(InputError):
    """A prompt the model cannot continue, or a prompts file without prompts."""


def read_prompts(prompt: str | None = None, path: str | Path | None = None) -> list[str]:
    if path is None:
        return [prompt or ""]
    path = Path(path)
    text = read_utf8_text(path, "prompts file")
    if path.suffix == ".jsonl":
        prompts = [_json_prompt(line, path, n) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    else:
        prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise PromptError(f"{path}: the prompts file holds no prompt; write one prompt a line "
                          f"(or JSON lines {{\"prompt\": ...}} in a .jsonl file)")
    return prompts


def _json_prompt(line: str, path: Path, n: int) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise PromptError(f"{path}, line {n}: not JSON ({e.msg}); write one {{\"prompt\": ...}} object a "
                          f"line") from None
    if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
        raise PromptError(f"{path}, line {n}: no \"prompt\" string; write one {{\"prompt\": ...}} object a line")
    return record["prompt"]


def encode_prompts(tokenizer, prompts: list[str], max_positions: int | None,
                   source: str = "--prompt") -> list[list[int]]:
    """Token ids of each prompt (``tokenizer``: an ``evaluation.lm_scoring.HFTokenizer``); a prompt longer than
    the model's context is refused, naming it."""
    out = []
    for n, text in enumerate(prompts, 1):
        ids = list(tokenizer.prefix) + tokenizer.encode(text)
        if not ids:
            if tokenizer.start_id is None:
                raise PromptError(f"{source}: prompt {n} is empty and the tokenizer has no BOS or EOS token to "
                                  f"start from; give a non-empty prompt")
            ids = [tokenizer.start_id]
        if max_positions is not None and len(ids) > max_positions:
            raise PromptError(f"{source}: prompt {n} is {len(ids)} tokens, longer than the model's context of "
                              f"{max_positions} positions; shorten it to at most {max_positions} tokens")
        out.append(ids)
    return out
