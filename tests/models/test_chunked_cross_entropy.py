"""The chunked vocab-parallel cross-entropy (``chunk_tokens``) equals the unchunked one, loss and logits gradient,
at TP 1 and 2, fp32 and bf16 logits, with label smoothing, ignored tokens and padding columns; and it creates no
fp32 tensor larger than a chunk's [chunk_tokens, V/tp] (the unchunked one creates the whole)."""
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dist import run_distributed
from models.parallel import destroy_model_parallel, initialize_model_parallel, tp_rank, tp_world_size
from models.parallel import vocab_parallel_cross_entropy
from models import GPT, GPTConfig
from models.parallel import Layout
from models.parallel.sharding import padded_size

VOCAB, PADDED = 101, 112  # padded to a multiple of 8 x TP: rank 1 of 2 holds 45 real columns and 11 padding ones
SHAPE = (3, 12)  # 36 tokens: chunks of 5 leave a last chunk of 1
# measured: max |chunked - unchunked| over the loss and the gradient: 0, bit for bit (fp32 and bf16, TP1 and TP2)
TOLERANCE = 1e-6


def _inputs(dtype):
    g = torch.Generator().manual_seed(0)
    full = torch.randn(*SHAPE, PADDED, generator=g) * 3
    target = torch.randint(0, VOCAB, SHAPE, generator=g)
    target[0, :3] = -100
    grad_loss = torch.rand(*SHAPE, generator=g)
    local = full.chunk(tp_world_size(), dim=-1)[tp_rank()].to(dtype)
    return local, target, grad_loss


def _forward_backward(logits, target, grad_loss, smoothing, chunk):
    loss = vocab_parallel_cross_entropy(logits, target, vocab_size=VOCAB, label_smoothing=smoothing,
                                        reduction="none", chunk_tokens=chunk)
    loss.backward(grad_loss)
    return loss.detach()


def _loss_and_grad(dtype, smoothing, chunk):
    logits, target, grad_loss = _inputs(dtype)
    logits.requires_grad_()
    loss = _forward_backward(logits, target, grad_loss, smoothing, chunk)
    return loss, logits.grad.float()


def _differences() -> dict:
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for smoothing in (0.0, 0.1):
            loss, grad = _loss_and_grad(dtype, smoothing, None)
            for chunk in (1, 5, 64):
                c_loss, c_grad = _loss_and_grad(dtype, smoothing, chunk)
                out[f"{dtype} eps={smoothing} chunk={chunk}"] = max((c_loss - loss).abs().max().item(),
                                                                     (c_grad - grad).abs().max().item())
    return out


class _LargestFloat32(TorchDispatchMode):
    """The largest number of elements of an fp32 tensor any op makes."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.largest = max(self.largest, t.numel())
        return out


def _largest_fp32(chunk) -> int:
    logits, target, grad_loss = _inputs(torch.bfloat16)
    logits.requires_grad_()
    with _LargestFloat32() as mode:
        _forward_backward(logits, target, grad_loss, 0.1, chunk)
    return mode.largest


def _check(where: str) -> None:
    for case, diff in _differences().items():
        assert diff <= TOLERANCE, (where, case, diff)
    local_v = PADDED // tp_world_size()
    assert _largest_fp32(5) <= 5 * local_v, where
    assert _largest_fp32(None) >= SHAPE[0] * SHAPE[1] * local_v, where  # what the chunking saves


def test_chunked_equals_unchunked_at_tp1():
    destroy_model_parallel()
    _check("TP1")


def _tp2(rank):
    initialize_model_parallel(tensor_parallel=2)
    _check(f"TP2 rank {rank}")
    return True


def test_chunked_equals_unchunked_at_tp2():
    assert run_distributed(_tp2, 2) == [True, True]


TINY_GPT = GPTConfig(variant="gpt2", vocab_size=500, hidden_size=32, num_layers=1, num_heads=4,
                     max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0)


def _gpt_loss_and_grads(chunk: int) -> tuple[torch.Tensor, dict, int]:
    """A tiny bf16 GPT's loss and gradients with ``--loss-chunk-tokens chunk`` (0: off), and the largest fp32
    tensor of its forward and backward."""
    destroy_model_parallel()
    model = GPT(TINY_GPT, init_seed=0, layout=Layout(loss_chunk_tokens=chunk)).to(torch.bfloat16)
    tokens = torch.randint(0, TINY_GPT.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    with _LargestFloat32() as mode:
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, mode.largest


def test_the_gpt_takes_the_chunked_loss_from_its_layout():
    """--loss-chunk-tokens reaches the model's loss through the layout: the same loss and gradients bit for bit
    (measured: equal), and no fp32 tensor of the whole [tokens, V] logits (the loss without it makes one)."""
    loss, grads, largest = _gpt_loss_and_grads(8)
    whole_loss, whole_grads, whole_largest = _gpt_loss_and_grads(0)
    assert torch.equal(loss, whole_loss)
    assert all(torch.equal(grads[n], whole_grads[n]) for n in grads)
    logits = 2 * 16 * padded_size(TINY_GPT.vocab_size, 1, TINY_GPT.make_vocab_size_divisible_by)
    assert whole_largest >= logits and largest < logits // 2, (largest, whole_largest, logits)
