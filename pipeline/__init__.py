"""Data flow, DeepSpeed engine wiring, pretraining, checkpoints, export and evaluation.

Importing it sets no environment variable: what a command sets for its own process (transparent huge pages for
torch's CPU allocations) is set when the command starts (``pipeline.job.errors.start_command``).
"""
import logging

# torchao (FP8 training) logs a warning for each of its CUDA-only kernels that fails to load on a CPU, and transformers
# imports it whenever it is installed; torch warns of torchao's enums once. Neither line is the user's business.
for _noisy in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_noisy).setLevel(logging.ERROR)
