"""Tiny random GPTs (gpt2, llama with GQA) saved as project model directories and exported to Hugging Face, and
prompts of unequal lengths, for the generation tests."""
from __future__ import annotations

from pathlib import Path

import torch

from models import GPT, GPTConfig
from models.parallel import destroy_model_parallel, full_state_dict, initialize_model_parallel
from pipeline.checkpoints.model_dir import write_model_dir
from pipeline.data.tokenizer import byte_tokenizer
from pipeline.hf.export import export_hf

# init_std 0.3: peaked next-token distributions, so that greedy choices are far from ties
TINY = dict(vocab_size=258, hidden_size=32, num_layers=2, max_position_embeddings=24, make_vocab_size_divisible_by=8,
            hidden_dropout=0.0, attention_dropout=0.0, init_std=0.3)
CONFIGS = {
    "gpt2": dict(variant="gpt2", num_heads=4, **TINY),
    "llama-gqa": dict(variant="llama", num_heads=4, num_kv_heads=2, ffn_hidden_size=48, tie_embeddings=False,
                      rope_theta=5000.0, **TINY),
}
PROMPTS = [[5, 17, 3, 99, 42, 8, 1], [64, 2], [7, 7, 30, 11]]
EOS = 256  # the byte tokenizer's <|endoftext|>


def make_model_dirs(root: Path, name: str) -> tuple[Path, Path]:
    """(project model directory, Hugging Face export) of a random ``CONFIGS[name]`` model, each with the byte
    tokenizer (vocabulary 258: 256 bytes, <|endoftext|>, <|pad|>)."""
    destroy_model_parallel()
    tokenizer = root / "bytes-tokenizer"
    if not tokenizer.is_dir():
        tokenizer.mkdir(parents=True)
        byte_tokenizer().save(tokenizer)
    initialize_model_parallel(1)
    config = GPTConfig(**CONFIGS[name])
    full = full_state_dict(GPT(config, init_seed=11))
    project = write_model_dir(config, full, root / f"{name}-project", tokenizer=tokenizer)
    hf = export_hf(config, full, root / f"{name}-hf", tokenizer_dir=tokenizer)
    destroy_model_parallel()
    return project, hf


def hf_greedy(hf_dir: Path, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' generate(do_sample=False) on the left-padded batch, each row's new tokens up to its EOS."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens, eos_token_id=EOS,
                         pad_token_id=0)[:, width:].tolist()
    return [row[:row.index(EOS) + 1] if EOS in row else row for row in out]
