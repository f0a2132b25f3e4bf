"""SFT data: the assistant-only loss mask equals TRL 1.16's (SFTTrainer with assistant_only_loss) on SmolLM2's
tokenizer, multi-turn and with a system message; packed conversations give the loss of the same conversations one
per row; the refusals."""
import json

import datasets
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from trl import SFTConfig, SFTTrainer
from trl.chat_template_utils import qwen2_5_chat_template

from finetune.lm.chat import (SMOLLM2_CHAT_TEMPLATE, ChatDataError, load_conversations, tokenize_conversations,
                              training_chat_template)
from finetune.lm.packing import collate, pack_conversations, unpacked
from finetune.lm.sft import sft_loss
from lm_utils import CONVERSATIONS, smollm2_tokenizer
from models import GPT, GPTConfig
from models.parallel import destroy_model_parallel, initialize_model_parallel, vocab_parallel_cross_entropy


def _trl_labels(tokenizer, tmp_path) -> tuple[list, list]:
    """input_ids and labels as TRL's SFTTrainer prepares them (assistant_only_loss, no packing, no truncation)."""
    vocab = len(tokenizer)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    args = SFTConfig(output_dir=str(tmp_path), assistant_only_loss=True, max_length=None, report_to="none",
                     use_cpu=True)
    trainer = SFTTrainer(model=model, args=args, processing_class=tokenizer,
                         train_dataset=datasets.Dataset.from_list([{"messages": m} for m in CONVERSATIONS]))
    return trainer.train_dataset["input_ids"], trainer.train_dataset["labels"]


def _ours(tokenizer) -> datasets.Dataset:
    template = training_chat_template(tokenizer)
    return tokenize_conversations(load_conversations(datasets.Dataset.from_list(
        [{"messages": m} for m in CONVERSATIONS])), tokenizer, template)


def test_smollm2_mask_equals_trl(tmp_path):
    """SmolLM2's template has no {% generation %} markers and is not in TRL's table (TRL refuses it): ours swaps in
    its training variant, which renders the same text; TRL given that variant masks the same tokens."""
    tok = smollm2_tokenizer()
    assert tok.chat_template == SMOLLM2_CHAT_TEMPLATE
    template = training_chat_template(tok)
    for messages in CONVERSATIONS:
        assert (tok.apply_chat_template(messages, tokenize=False, chat_template=template)
                == tok.apply_chat_template(messages, tokenize=False))
    ours = _ours(tok)
    tok.chat_template = template
    ids, labels = _trl_labels(tok, tmp_path)
    assert ours["input_ids"] == ids and ours["labels"] == labels
    # the assistant turns, their <|im_end|> included, and nothing of the system or user turns
    first = [t for t in labels[0] if t != -100]
    assert tok.decode(first) == "Paris.<|im_end|>\nRome.<|im_end|>\n"


def test_trl_training_template_swap_matches(tmp_path):
    """A template TRL knows without markers (Qwen2.5's, ChatML as SmolLM2's vocabulary): both swap in TRL's variant."""
    tok = smollm2_tokenizer()
    tok.chat_template = qwen2_5_chat_template
    ours = _ours(tok)
    ids, labels = _trl_labels(tok, tmp_path)
    assert ours["input_ids"] == ids and ours["labels"] == labels
    assert sum(t != -100 for t in labels[3]) < len(labels[3]) / 2


def _gpt(variant: str, vocab: int) -> GPT:
    extra = dict(num_kv_heads=2, ffn_hidden_size=32, tie_embeddings=False) if variant == "llama" else {}
    return GPT(GPTConfig(variant=variant, vocab_size=vocab, hidden_size=16, num_layers=2, num_heads=4,
                         max_position_embeddings=256, hidden_dropout=0.0, attention_dropout=0.0, init_std=0.3,
                         **extra),
               init_seed=3)


@pytest.mark.parametrize("variant", ["gpt2", "llama"])
def test_packed_equals_unpacked(variant):
    tok = smollm2_tokenizer()
    tokenized = _ours(tok)
    longest = max(len(r) for r in tokenized["input_ids"])
    seq_length = 2 * longest
    packed = pack_conversations(tokenized, seq_length)
    assert len(packed) < len(tokenized)  # conversations do share rows
    destroy_model_parallel()
    initialize_model_parallel(tensor_parallel=1)
    model = _gpt(variant, len(tok)).eval()
    rows = list(packed)
    packed_batch = collate(rows, seq_length, tok.pad_token_id)
    single_batch = collate(list(unpacked(tokenized, seq_length)), seq_length, tok.pad_token_id)
    assert packed_batch.num_targets == single_batch.num_targets == sum(
        sum(t != -100 for t in labels) for labels in tokenized["labels"])
    with torch.no_grad():
        packed_loss, single_loss = sft_loss(model, packed_batch), sft_loss(model, single_batch)
        # the same rows attended across conversations (the boundaries dropped) give another loss
        crossing = vocab_parallel_cross_entropy(model.parallel_logits(packed_batch.input_ids), packed_batch.targets,
                                                vocab_size=len(tok))
    destroy_model_parallel()
    difference = abs(packed_loss.item() - single_loss.item())
    print(f"{variant}: packed {packed_loss.item():.7f} unpacked {single_loss.item():.7f} difference {difference:.1e}; "
          f"attending across conversations {crossing.item():.7f}")
    assert difference < 1e-5  # measured: 0 to 1e-6 (fp32)
    assert abs(crossing.item() - single_loss.item()) > 1e-3


def test_refusals(tmp_path):
    tok = smollm2_tokenizer()
    with pytest.raises(ChatDataError, match="no 'messages' field .*fields: text"):
        load_conversations(datasets.Dataset.from_list([{"text": "hello"}]))
    good, bad = tmp_path / "chats.jsonl", tmp_path / "texts.jsonl"
    good.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS))
    bad.write_text(json.dumps({"prompt": "hello"}) + "\n")
    assert load_conversations(good)["messages"] == CONVERSATIONS
    with pytest.raises(ChatDataError, match=f"{bad}: no 'messages' field .*fields: prompt"):
        load_conversations(bad)
    tok.chat_template = None
    with pytest.raises(ChatDataError, match="the tokenizer has no chat template"):
        training_chat_template(tok)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ChatDataError, match="no known training variant"):
        training_chat_template(tok)
    with pytest.raises(ChatDataError, match="has no {% generation %} markers"):
        training_chat_template(tok, template=tok.chat_template)
