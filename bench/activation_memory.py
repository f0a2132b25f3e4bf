"""Activation memory per rank with and without sequence parallelism, beside Korthikanti et al. (2022).

TP gloo CPU ranks (torch.multiprocessing) build the same bf16 GPT (gpt2 variant: LayerNorm, GELU, biases,
dropout 0.1 everywhere, as in the paper) at TP = 2 and 4, with and without ``sequence_parallel``, and count
the bytes of the tensors autograd saves for the backward (``torch.autograd.graph.saved_tensors_hooks``; each
storage once, parameters left out): the activations held between forward and backward, which is what the
paper's formulas count and what sets the activation peak. (A CPU has no allocator statistics; on a GPU the
same census sits under ``torch.cuda.max_memory_allocated``.)

  one layer       one TransformerLayer, its input included (it is what the first norm saves)
  whole forward   embedding + L layers + final norm + output layer + the vocab-parallel cross-entropy
                  (whose fp32 softmax over [b, s, V / t] the paper leaves out)
  + checkpointing the whole forward with DeepSpeed's activation checkpointing of every layer

Formulas per layer (bytes, 2-byte activations and 1-byte dropout masks):
  TP alone    s b h (10 + 24 / t + 5 a s / (h t))
  TP with SP  s b h (34 / t + 5 a s / (h t))
The 5 a s / h term is the attention scores, their softmax and its dropout mask, [b, a / t, s, s]: with
fused SDPA attention they are not stored (the kernel keeps its output and a log-sum-exp per row), so the
table gives both with and without it, and what was measured says which kernel ran.

Last, the step time (forward + backward of the model, no optimizer) of SP over no SP, median of per-round
ratios with the two models interleaved in the same processes.

    python bench/activation_memory.py [--tp 2,4] [--seq 256] [--batch 2] [--hidden 256] [--heads 8]
                                      [--layers 2] [--vocab 2048] [--rounds 10]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import common  # noqa: E402
import deepspeed
import torch  # noqa: E402
from common import format_table  # noqa: E402
from dist import run_distributed  # noqa: E402  the tests' launcher: N spawned gloo CPU ranks, results returned

from models import GPT, GPTConfig
from models.parallel import get_parallel_state, initialize_model_parallel, model_parallel_seed


class SavedTensorCensus:
    """Bytes autograd saves for the backward inside the context, each storage once, ``exclude``d ones not; counted
    as the context ends, so that a storage freed in the forward (output-discarding recomputation) counts 0."""

    def __init__(self, exclude: set[int]):
        self.exclude, self.storages, self.bytes = exclude, {}, 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t):
        st = t.untyped_storage()
        seen = self.storages.get(st.data_ptr())
        if st.data_ptr() not in self.exclude and (seen is None or seen.data_ptr() != st.data_ptr()):
            self.storages[st.data_ptr()] = st  # (a storage freed since may have left its address to this one)
        return t

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        self.bytes = sum(st.nbytes() for st in self.storages.values())
        self.storages.clear()


def _param_storages(model) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in model.parameters()}


def _build(config_kw: dict, sequence_parallel: bool, checkpointing: bool):

    layout = get_parallel_state().layout.replace(sequence_parallel=sequence_parallel)
    model = GPT(GPTConfig(**config_kw), init_seed=0, layout=layout).to(torch.bfloat16).train()
    if checkpointing:
        model.checkpoint_fn = deepspeed.checkpointing.checkpoint
    return model


def _batch(b: int, s: int, vocab: int):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (b, s + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _layer_bytes(model, b: int, s: int, h: int, tp: int) -> int:
    local = s // tp if model.layout.sequence_parallel else s
    x = torch.randn(b, local, h, dtype=torch.bfloat16, requires_grad=True)
    with SavedTensorCensus(_param_storages(model)) as census:
        y = model.layers[0](x)
    y.float().sum().backward()  # the backward's collectives pair with the other ranks'
    return census.bytes


def _forward_bytes(model, ids, labels) -> int:
    with SavedTensorCensus(_param_storages(model)) as census:
        loss = model(ids, labels)
    loss.backward()
    return census.bytes


def _step_seconds(models: dict, ids, labels, rounds: int) -> dict:
    times = {name: [] for name in models}
    names = list(models)
    for r in range(rounds + 1):  # round 0 warms up
        for name in names[r % len(names):] + names[:r % len(names)]:
            torch.distributed.barrier()
            t0 = time.perf_counter()
            models[name](ids, labels).backward()
            torch.distributed.barrier()
            if r:
                times[name].append(time.perf_counter() - t0)
            models[name].zero_grad(set_to_none=True)
    return times


def _rank(rank, tp, config_kw, b, s, rounds):

    state = initialize_model_parallel(tensor_parallel=tp)
    model_parallel_seed(1234)
    deepspeed.checkpointing.configure(state)
    ids, labels = _batch(b, s, config_kw["vocab_size"])
    out = {}
    for sp in (False, True):
        model = _build(config_kw, sp, False)
        out[("layer", sp)] = _layer_bytes(model, b, s, config_kw["hidden_size"], tp)
        out[("forward", sp)] = _forward_bytes(model, ids, labels)
        out[("checkpointed", sp)] = _forward_bytes(_build(config_kw, sp, True), ids, labels)
    times = _step_seconds({sp: _build(config_kw, sp, False) for sp in (False, True)}, ids, labels, rounds)
    out["ratio"] = statistics.median(a / b_ for a, b_ in zip(times[True], times[False]))
    out["seconds"] = {sp: statistics.median(t) for sp, t in times.items()}
    return out


def parse_shape_args(doc: str, tp_default: str, argv=None):
    """The benchmark's arguments and the gpt2 config (dropout 0.1 everywhere, as in the paper) they give."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", default=tp_default)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=10, help="timed rounds of the step-time ratios")
    args = p.parse_args(argv)
    common.quiet_deepspeed()
    config_kw = dict(variant="gpt2", vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                     num_heads=args.heads, max_position_embeddings=args.seq, hidden_dropout=0.1,
                     attention_dropout=0.1, make_vocab_size_divisible_by=128)
    return args, config_kw


def paper_layer_bytes(s: int, b: int, h: int, a: int, t: int, sequence_parallel: bool, scores: bool) -> float:
    attention = 5 * a * s / (h * t) if scores else 0.0
    return s * b * h * ((34 / t if sequence_parallel else 10 + 24 / t) + attention)


def main(argv=None):
    args, config_kw = parse_shape_args(__doc__, "2,4", argv)
    s, b, h, a = args.seq, args.batch, args.hidden, args.heads
    print(f"# activation bytes saved for the backward per rank (rank 0), gpt2 bf16, s={s} b={b} h={h} a={a} "
          f"L={args.layers} V={args.vocab}, dropout 0.1; {common.machine_note()}")
    rows, times = [], []
    mib = 1 / 2**20
    for tp in map(int, args.tp.split(",")):
        r = run_distributed(_rank, tp, tp, config_kw, b, s, args.rounds)[0]
        for sp in (False, True):
            rows.append([f"TP{tp}{' + SP' if sp else ''}", r[("layer", sp)] * mib,
                         paper_layer_bytes(s, b, h, a, tp, sp, True) * mib,
                         paper_layer_bytes(s, b, h, a, tp, sp, False) * mib,
                         r[("forward", sp)] * mib, r[("checkpointed", sp)] * mib])
        times.append([f"TP{tp}", r["seconds"][False], r["seconds"][True], r["ratio"]])
    print(format_table(["layout", "one layer MiB", "paper MiB", "paper w/o scores MiB", "whole forward MiB",
                        "+ checkpointing MiB"], rows))
    print()
    print(format_table(["layout", "step s (no SP)", "step s (SP)", "SP / no SP"], times))


if __name__ == "__main__":
    main()
