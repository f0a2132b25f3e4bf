"""The layout of one run: how a model is laid over ranks and memory, in one frozen value.

Every parallel dimension is one field (as torchtitan's ``ParallelDims``), and so is every memory or compute feature
that changes how the same model is computed (sequence parallelism, ZeRO, tiling, recomputation, compile,
precision, FP8). The model config describes the model only; a ``Layout`` describes the run. It is built once from the
command line (``pipeline.job.layout.layout_from_options``), validated once by one function holding every
combination rule (``pipeline.job.layout.validate``), then handed to what builds the process groups
(``models.parallel.state``), the model, the engine and the checkpoints (which record it: ``record``).

Nothing here knows a model; ``data`` is what is left of the world after tensor x context x pipeline.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

PRECISIONS = ("fp32", "bf16", "fp16")
RECOMPUTE_POLICIES = ("none", "selective", "full")
FP8_RECIPES = ("tensorwise", "rowwise")  # torchao's float8 training recipes (models/parallel/fp8.py)

# the record's names, as checkpoints have written them since the first round (``layout.json``)
_RECORD_NAMES = {"tensor": "tensor_parallel", "pipeline": "pipeline_parallel", "data": "data_parallel",
                 "context": "context_parallel", "expert": "expert_parallel", "sequence_parallel": "sequence_parallel",
                 "zero_stage": "zero_stage", "precision": "precision"}


@dataclass(frozen=True)
class Layout:
    tensor: int = 1                  # TP: heads, MLP columns and the vocabulary split over this many ranks
    pipeline: int = 1                # PP: stages of layers
    context: int = 1                 # CP (DeepSpeed-Ulysses): each sequence in this many chunks
    data: int = 1                    # DP: replicas (ZeRO shards over data x context)
    expert: int = 1                  # EP: each MoE layer's experts over this many of the data-parallel ranks
    sequence_parallel: bool = False  # SP (Korthikanti et al.): norms, dropout, residuals on 1/TP of the sequence
    zero_stage: int = 0
    precision: str = "fp32"
    tiled_mlp: int = 1               # ALST: the MLP on this many sequence tiles
    tiled_loss: int = 1              # ALST: the output layer and the loss on this many sequence tiles
    recompute: str = "none"          # none, selective (``recompute_modules``) or full
    recompute_modules: tuple[str, ...] = ()
    compile: bool = False
    fp8: str | None = None           # torchao's float8 recipe (tensorwise, rowwise) for the parallel linears' products
    loss_chunk_tokens: int = 0       # the cross-entropy this many tokens at a time (0: all at once); same loss

    @property
    def world(self) -> int:
        return self.tensor * self.context * self.pipeline * self.data

    @property
    def model_ranks(self) -> int:
        """The ranks one replica of the model is spread over (tensor x context x pipeline)."""
        return self.tensor * self.context * self.pipeline

    @classmethod
    def for_world(cls, world: int, **fields) -> Layout:
        """The layout of ``world`` ranks: ``data`` is what is left after tensor x context x pipeline (the caller
        checks that it divides: ``pipeline.job.layout.validate`` refuses it first, in one line)."""
        layout = cls(**fields)
        return dataclasses.replace(layout, data=max(1, world // max(1, layout.model_ranks)))

    def replace(self, **changes) -> Layout:
        return dataclasses.replace(self, **changes)

    # -- what a checkpoint records ------------------------------------------------------------------------------
    def record(self) -> dict:
        """The layout as ``layout.json`` records it (the names checkpoints have always used, and the rest)."""
        d = dataclasses.asdict(self)
        out = {_RECORD_NAMES.get(k, k): v for k, v in d.items()}
        out["recompute_modules"] = list(self.recompute_modules)
        return out

    @classmethod
    def from_record(cls, record: dict) -> Layout:
        """A saved layout (older records lack the newer fields: their defaults)."""
        names = {v: k for k, v in _RECORD_NAMES.items()}
        known = {f.name for f in dataclasses.fields(cls)}
        fields = {names.get(k, k): v for k, v in record.items() if names.get(k, k) in known}
        if "recompute_modules" in fields:
            fields["recompute_modules"] = tuple(fields["recompute_modules"])
        return cls(**fields)

    def __str__(self) -> str:
        parts = [f"TP {self.tensor}" + (" (SP)" if self.sequence_parallel else ""), f"CP {self.context}",
                 f"PP {self.pipeline}", f"DP {self.data}", f"EP {self.expert}", f"ZeRO {self.zero_stage}",
                 self.precision]
        extras = [f"tiled MLP {self.tiled_mlp}" if self.tiled_mlp > 1 else "",
                  f"tiled loss {self.tiled_loss}" if self.tiled_loss > 1 else "",
                  f"recompute {self.recompute}" + (f" ({','.join(self.recompute_modules)})"
                                                   if self.recompute == "selective" else "")
                  if self.recompute != "none" else "",
                  "compiled" if self.compile else "", f"FP8 {self.fp8}" if self.fp8 else "",
                  f"loss in chunks of {self.loss_chunk_tokens} tokens" if self.loss_chunk_tokens else ""]
        return ", ".join(parts + [e for e in extras if e])
