"""Generation: text from any checkpoint at any TP size (decoders with a KV cache or the mLSTM state, sampling,
the decoding loop, prompts) and samples during pretraining; ``python -m pipeline.generate`` is its command."""
