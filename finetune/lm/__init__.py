"""Language-model finetuning: conversations rendered by the tokenizer's chat template with the loss on the
assistant's tokens (``chat``), packed with their boundaries kept (``packing``), and preference pairs with the
DPO loss (``dpo``)."""
