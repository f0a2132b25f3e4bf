"""Data flow, DeepSpeed engine wiring, pretraining, checkpoints, export and evaluation."""
