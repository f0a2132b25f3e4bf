"""Conversations in the messages format, rendered by the tokenizer's own chat template, with the loss on the
assistant's tokens only, as TRL 1.16's ``SFTTrainer`` with ``assistant_only_loss=True`` computes it.

The mask comes from ``apply_chat_template(..., return_assistant_tokens_mask=True)``, which needs
``{% generation %}`` markers in the template. A template without them is swapped, as TRL does, for its training
variant (``trl.chat_template_utils.get_training_chat_template``: an exact match against the templates TRL knows,
plus SmolLM2's here); another one is refused, as TRL refuses it: the user hands in a template with markers.
Labels are the token ids on assistant tokens and -100 elsewhere, unshifted (Hugging Face's convention).
"""
from __future__ import annotations

from pathlib import Path

import datasets
from trl.chat_template_utils import get_training_chat_template, has_generation_markers

from pipeline.job.errors import UserError

IGNORE_INDEX = -100
MESSAGES_FIELD = "messages"

# SmolLM2-Instruct's template (HuggingFaceTB/SmolLM2-*-Instruct), which TRL's table lacks, and its training
# variant: the same text, the assistant's content and its "<|im_end|>\n" inside {% generation %} (TRL's ChatML
# training templates, e.g. qwen2_5_training.jinja, mark the same span).
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SMOLLM2_TRAINING_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n'}}{% if message['role'] == 'assistant' %}{% generation %}"
    "{{ message['content'] + '<|im_end|>' + '\n' }}{% endgeneration %}{% else %}"
    "{{ message['content'] + '<|im_end|>' + '\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
_TRAINING_TEMPLATES = {SMOLLM2_CHAT_TEMPLATE: SMOLLM2_TRAINING_CHAT_TEMPLATE}


class ChatDataError(UserError, ValueError):
    """Conversations or a chat template that cannot give an assistant-only loss."""


def training_chat_template(tokenizer, where: str = "tokenizer", template: str | None = None) -> str:
    """The template that renders ``tokenizer``'s conversations with ``{% generation %}`` markers: ``template`` (the
    user's) when given, else the tokenizer's own when it has them, else its training variant."""
    if template is not None:
        if not has_generation_markers(template):
            raise ChatDataError(f"{where}: the chat template given has no {{% generation %}} markers; put "
                                f"{{% generation %}}...{{% endgeneration %}} around each assistant turn")
        return template
    own = tokenizer.chat_template
    if isinstance(own, dict):
        own = own.get("default")
    if not own:
        raise ChatDataError(f"{where}: the tokenizer has no chat template; use an instruct tokenizer or hand in a "
                            f"template with {{% generation %}} markers")
    if has_generation_markers(own):
        return own
    if own in _TRAINING_TEMPLATES:
        return _TRAINING_TEMPLATES[own]
    try:
        return get_training_chat_template(tokenizer) or own
    except ValueError:
        raise ChatDataError(f"{where}: the chat template has no {{% generation %}} markers and no known training "
                            f"variant; hand in a copy with {{% generation %}}...{{% endgeneration %}} around each "
                            f"assistant turn") from None


def tokenize_conversation(tokenizer, messages: list[dict], template: str, where: str = "conversation") -> dict:
    """``{"input_ids", "labels"}`` of one conversation: labels are the ids of the assistant's tokens, -100 elsewhere."""
    out = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
    ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
    if 1 not in mask:
        raise ChatDataError(f"{where}: no assistant tokens (no assistant message, or a template whose "
                            f"{{% generation %}} markers mark nothing); give each conversation an assistant turn")
    return {"input_ids": ids, "labels": [t if m else IGNORE_INDEX for t, m in zip(ids, mask)]}


def load_conversations(source: str | Path | datasets.Dataset, field: str = MESSAGES_FIELD) -> datasets.Dataset:
    """A ``datasets.Dataset`` of conversations: the one given, or the records of a JSON-lines file."""
    ds = source if isinstance(source, datasets.Dataset) else datasets.load_dataset(
        "json", data_files=str(source), split="train")
    if field not in ds.column_names:
        where = source if not isinstance(source, datasets.Dataset) else "dataset"
        raise ChatDataError(f"{where}: no {field!r} field (fields: {', '.join(ds.column_names) or 'none'}); give "
                            f"each record a list of {{'role', 'content'}} messages under {field!r}")
    return ds


def tokenize_conversations(conversations: datasets.Dataset, tokenizer, template: str, *,
                           field: str = MESSAGES_FIELD, num_proc: int | None = None) -> datasets.Dataset:
    """Columns ``input_ids`` and ``labels`` (assistant tokens only), one row per conversation."""
    return conversations.map(_Tokenize(tokenizer, template, field), with_indices=True,
                             remove_columns=conversations.column_names, num_proc=num_proc,
                             desc="rendering conversations")


class _Tokenize:
    def __init__(self, tokenizer, template: str, field: str):
        self.tokenizer, self.template, self.field = tokenizer, template, field

    def __call__(self, record: dict, index: int) -> dict:
        return tokenize_conversation(self.tokenizer, record[self.field], self.template,
                                     f"record {index} ({self.field!r})")
