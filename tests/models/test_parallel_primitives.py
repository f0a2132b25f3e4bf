"""Vocab-parallel cross-entropy, the f/g ops, column/row linears, the RNG tracker, sharding specs."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
from dist import run_distributed

from models.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardSpec,
    copy_to_tensor_parallel_region,
    gather_from_tensor_parallel_region,
    get_rng_tracker,
    initialize_model_parallel,
    model_parallel_seed,
    reduce_from_tensor_parallel_region,
    scatter_to_tensor_parallel_region,
    tensor_parallel_rng,
    tp_rank,
    vocab_parallel_cross_entropy,
)
from models.parallel.state import ParallelConfigError, ParallelState

VOCAB, PADDED = 50, 56  # a vocabulary padded by 6 columns, split over 2 ranks (28 each)
CE_CASES = [(0.0, "mean"), (0.1, "mean"), (0.2, "none")]


def _ce_inputs():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 7, PADDED, generator=g) * 3
    target = torch.randint(0, VOCAB, (4, 7), generator=g)
    target[1, 2:5] = -100
    return logits, target


def _ce_reference(smoothing, reduction):
    logits, target = _ce_inputs()
    logits = logits[..., :VOCAB].clone().requires_grad_()
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1), ignore_index=-100,
                           label_smoothing=smoothing, reduction=reduction)
    loss.reshape(-1).sum().backward() if reduction == "none" else loss.backward()
    return loss.detach(), logits.grad


def _ce_worker(rank, world):
    initialize_model_parallel(tensor_parallel=world)
    out = []
    for smoothing, reduction in CE_CASES:
        logits, target = _ce_inputs()
        local = logits.chunk(world, dim=-1)[rank].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(local, target, vocab_size=VOCAB, label_smoothing=smoothing,
                                            reduction=reduction)
        loss.sum().backward()
        out.append((loss.detach(), local.grad))
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_vocab_parallel_cross_entropy_matches_torch(world):
    results = run_distributed(_ce_worker, world, world)
    for case, (smoothing, reduction) in enumerate(CE_CASES):
        ref_loss, ref_grad = _ce_reference(smoothing, reduction)
        full_grad = torch.cat([results[r][case][1] for r in range(world)], dim=-1)
        torch.testing.assert_close(results[0][case][0].reshape(ref_loss.shape), ref_loss, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(full_grad[..., :VOCAB].reshape(ref_grad.shape), ref_grad, rtol=1e-5, atol=1e-7)
        assert torch.all(full_grad[..., VOCAB:] == 0), "padding columns must get no gradient"


def _mappings_worker(rank, world):
    initialize_model_parallel(tensor_parallel=world)
    x = torch.arange(8.0).reshape(2, 4).requires_grad_()
    out = {}
    y = copy_to_tensor_parallel_region(x)
    (y * (rank + 1)).sum().backward()
    out["copy_fwd"], out["copy_grad"] = y.detach(), x.grad.clone()
    x.grad = None
    y = reduce_from_tensor_parallel_region(x * (rank + 1))
    (y * 2).sum().backward()
    out["reduce_fwd"], out["reduce_grad"] = y.detach(), x.grad.clone()
    x.grad = None
    y = scatter_to_tensor_parallel_region(x)
    out["scatter_fwd"] = y.detach()
    z = gather_from_tensor_parallel_region(y * (rank + 1))
    out["gather_fwd"] = z.detach()
    z.sum().backward()
    out["roundtrip_grad"] = x.grad.clone()
    return out


def test_conjugate_ops():
    res = run_distributed(_mappings_worker, 2, 2)
    x = torch.arange(8.0).reshape(2, 4)
    for rank in range(2):
        r = res[rank]
        assert torch.equal(r["copy_fwd"], x)                      # f: identity forward
        assert torch.equal(r["copy_grad"], torch.full_like(x, 3.0))  # f: all-reduce backward (1 + 2)
        assert torch.equal(r["reduce_fwd"], x * 3)                 # g: all-reduce forward
        assert torch.equal(r["reduce_grad"], torch.full_like(x, 2.0) * (rank + 1))  # g: identity backward
        assert torch.equal(r["scatter_fwd"], x[:, 2 * rank:2 * rank + 2])
        assert torch.equal(r["gather_fwd"], torch.cat([x[:, :2], 2 * x[:, 2:]], dim=-1))
        assert torch.equal(r["roundtrip_grad"], torch.cat([torch.ones(2, 2), 2 * torch.ones(2, 2)], dim=-1))


def _linear_worker(rank, world, gather_output, input_is_parallel):
    initialize_model_parallel(tensor_parallel=world)
    torch.manual_seed(0)
    col = ColumnParallelLinear(6, 8, gather_output=gather_output)
    row = RowParallelLinear(8, 5, input_is_parallel=input_is_parallel)
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(1))
    h = col(x)
    if gather_output and input_is_parallel:
        h = h.chunk(world, dim=-1)[rank]
    return row(torch.relu(h)).detach()


@pytest.mark.parametrize("gather_output,input_is_parallel", [(False, True), (True, False)])
def test_column_row_parallel_linear_equal_dense(gather_output, input_is_parallel):
    ref = run_distributed(_linear_worker, 1, 1, gather_output, input_is_parallel)[0]
    for out in run_distributed(_linear_worker, 2, 2, gather_output, input_is_parallel):
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


def _rng_worker(rank, tp, seeds):
    """The masks of each seed in turn (seeding again resets every stream), in one launch."""
    state = initialize_model_parallel(tensor_parallel=tp)
    out = []
    for seed in seeds:
        model_parallel_seed(seed)
        with tensor_parallel_rng():
            tp_mask = F.dropout(torch.ones(1000), p=0.5)
        default_mask = F.dropout(torch.ones(1000), p=0.5)
        # a fork resumes the tracked stream where it stopped, and leaves the default stream alone
        before = torch.get_rng_state()
        with get_rng_tracker().fork():
            second = F.dropout(torch.ones(1000), p=0.5)
        assert torch.equal(before, torch.get_rng_state())
        out.append({"tp": tp_mask, "default": default_mask, "second": second, "tp_rank": tp_rank(),
                    "dp_rank": state.get_data_parallel_rank()})
    return out


def test_rng_tracker_masks():
    # 4 ranks as TP=2 x DP=2; the seeds 1234, 1234 again, 4321
    res, again, other = zip(*run_distributed(_rng_worker, 4, 2, (1234, 1234, 4321)))
    by = {(r["dp_rank"], r["tp_rank"]): r for r in res}
    # inside TP regions: different across TP ranks, identical across DP replicas
    assert not torch.equal(by[0, 0]["tp"], by[0, 1]["tp"])
    assert torch.equal(by[0, 0]["tp"], by[1, 0]["tp"]) and torch.equal(by[0, 1]["tp"], by[1, 1]["tp"])
    # default stream: identical on the TP ranks (replicated activations get the same mask)
    assert torch.equal(by[0, 0]["default"], by[0, 1]["default"])
    assert not torch.equal(by[0, 0]["tp"], by[0, 0]["second"])
    # reproducible from the seed, different with another seed
    for a, b, c in zip(res, again, other):
        assert torch.equal(a["tp"], b["tp"]) and torch.equal(a["default"], b["default"])
        assert not torch.equal(a["tp"], c["tp"])


def _bad_world_worker(rank):
    try:
        initialize_model_parallel(tensor_parallel=2, pipeline_parallel=2)
    except ParallelConfigError as e:
        return str(e)
    return "no error"


def test_world_size_not_tp_pp_dp():
    msg = run_distributed(_bad_world_worker, 3)[0]
    assert "world size 3" in msg and "tensor_parallel (2) x pipeline_parallel (2)" in msg


def _mpu_worker(rank):
    s = initialize_model_parallel(tensor_parallel=2, pipeline_parallel=2)
    return {"tp": s.get_model_parallel_rank(), "pp": s.get_pipe_parallel_rank(), "dp": s.get_data_parallel_rank(),
            "tp_members": dist.get_process_group_ranks(s.get_model_parallel_group()),
            "dp_members": dist.get_process_group_ranks(s.get_data_parallel_group()),
            "pp_members": dist.get_process_group_ranks(s.get_pipe_parallel_group()),
            "sizes": (s.get_model_parallel_world_size(), s.get_pipe_parallel_world_size(),
                      s.get_data_parallel_world_size())}


def test_parallel_state_groups_follow_deepspeed_topology():
    res = run_distributed(_mpu_worker, 8)
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    for rank, r in enumerate(res):
        c = topo.get_coord(rank)
        assert (r["tp"], r["pp"], r["dp"]) == (c.model, c.pipe, c.data)
        assert r["sizes"] == (2, 2, 2)
        assert rank in r["tp_members"] and rank in r["dp_members"] and rank in r["pp_members"]
        assert all(topo.get_coord(m).pipe == c.pipe and topo.get_coord(m).data == c.data for m in r["tp_members"])
        assert all(topo.get_coord(m).model == c.model and topo.get_coord(m).pipe == c.pipe for m in r["dp_members"])


def test_single_process_state_is_trivial():
    s = ParallelState(1, 1)
    assert (s.get_model_parallel_world_size(), s.get_data_parallel_world_size(), s.get_model_parallel_rank()) == (1, 1, 0)


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_shard_spec_roundtrip(tp):
    full = torch.randn(3 * 12 + 0, 5)
    spec = ShardSpec(dim=0, parts=(12, 12, 12))
    assert torch.equal(spec.gather([spec.shard(full, r, tp) for r in range(tp)]), full)
    vocab = torch.randn(101, 4)
    vspec = ShardSpec(dim=0, parts=(101,), pad_multiple=8)
    shards = [vspec.shard(vocab, r, tp) for r in range(tp)]
    assert sum(s.shape[0] for s in shards) % (8 * tp) == 0
    assert torch.equal(vspec.gather(shards), vocab)
