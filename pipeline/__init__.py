"""Data flow, DeepSpeed engine wiring, pretraining, checkpoints, export and evaluation."""
import logging
import os

# CPU runs: torch puts its large allocations on 2 MB transparent huge pages instead of faulting in 4 KB pages
# after every free (measured on the E-c finetune, 2 cores: 178k -> 16k page faults/s, 3.7 -> 2.2 s per step).
# torch reads the variable at its first CPU allocation, so importing this package first is enough; it does
# nothing on GPU tensors, and a user's own setting (THP_MEM_ALLOC_ENABLE=0) wins.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

# torchao (FP8 training) logs a warning for each of its CUDA-only kernels that fails to load on a CPU, and transformers
# imports it whenever it is installed; torch warns of torchao's enums once. Neither line is the user's business.
for _noisy in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_noisy).setLevel(logging.ERROR)
