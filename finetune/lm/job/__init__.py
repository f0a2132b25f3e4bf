"""The language-model finetuning commands (``sft``, ``dpo``) over the job layer: their arguments, layout rule and
providers."""
