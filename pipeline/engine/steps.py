"""One optimizer step and one evaluation pass on a built engine, at any layout: a plain engine takes its
micro-batches by ``forward``/``backward``/``step``, a pipeline engine by ``train_batch``/``eval_batch``; losses
are averaged over data-parallel ranks only.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from models.moe import moe_step_stats, update_expert_biases
from models.parallel import collectives
from pipeline.engine.grad_watch import watch
from pipeline.engine.schedules import Scheduler


def lm_batches(loader):
    """(inputs, labels) pairs from batches of packed token sequences [b, s + 1]; (inputs, labels,
    {"reset": ...}) for the streams of truncated BPTT."""
    for batch in loader:
        tokens = batch["tokens"]
        pair = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        yield (*pair, {"reset": batch["reset"]}) if "reset" in batch else pair


def lm_forward(engine, batch) -> torch.Tensor:
    """The loss of one (inputs, labels[, extra kwargs]) micro-batch of ``lm_batches``."""
    inputs, labels, *extra = batch
    kwargs = {k: v.to(engine.device) for k, v in (extra[0] if extra else {}).items()}
    return engine(inputs.to(engine.device), labels.to(engine.device), **kwargs)


def data_parallel_mean(engine, values: torch.Tensor, *, summed: torch.Tensor | None = None) -> torch.Tensor:
    """``values`` averaged over the data-parallel group (in place; one all-reduce). Where the boolean mask
    ``summed`` is true the entry is summed instead (counts such as tokens)."""
    mpu = engine.mpu
    if mpu is not None and mpu.get_data_parallel_world_size() > 1:
        collectives.all_reduce(values, mpu.get_data_parallel_group(), name="dp/loss_mean")  # the comms logger sees it
        scale = torch.full_like(values, 1.0 / mpu.get_data_parallel_world_size())
        if summed is not None:
            scale[summed] = 1.0
        values *= scale
    return values


def optimizer_step(engine, batches, forward: Callable = lm_forward, *, counts: Sequence[str] = ()) -> dict:
    """One optimizer step over all micro-batches of the global batch (non-pipeline engines).

    ``forward(engine, batch)`` returns the loss, or a dict with the loss under "loss" and other scalars to
    log. Each is averaged over the micro-batches and the data-parallel ranks, except the ``counts``
    (summed). Returns floats, after one device sync.
    """
    gas = engine.gradient_accumulation_steps()
    grads = watch(engine)
    totals, keys = None, None
    for i in range(gas):
        out = forward(engine, next(batches))
        parts = out if isinstance(out, dict) else {"loss": out}
        engine.backward(parts["loss"])
        keys = keys or list(parts)
        values = torch.stack([torch.as_tensor(parts[k], device=engine.device).detach().double().reshape(())
                              for k in keys])
        totals = values if totals is None else totals + values
        engine.step()
    summed = torch.tensor([k in counts for k in keys], device=engine.device)
    totals = data_parallel_mean(engine, torch.where(summed, totals, totals / gas), summed=summed)
    totals = _read(grads, totals)
    return {k: float(v) for k, v in zip(keys, totals)}


def pipeline_step(engine, batches, to_pipe: Callable, *, data_group=None) -> dict:
    """One optimizer step of a pipeline engine over the global batch's micro-batches. Every stage takes them from
    ``batches`` (its loader keeps step with the others', as without stages; DeepSpeed's schedule reads them on the
    first and last stage only), each given to the schedule as ``to_pipe(batch)``'s (inputs, labels); its third
    item, {name: count} (tokens, say), is summed over the micro-batches and ``data_group`` (the data-parallel
    ranks, not the context-parallel ones that hold the same rows). The loss: DeepSpeed's mean over the
    micro-batches and its data-parallel ranks. Returns floats, after one device sync."""
    micro = [to_pipe(next(batches)) for _ in range(engine.gradient_accumulation_steps())]
    loss = engine.train_batch(data_iter=iter([(inputs, labels) for inputs, labels, _ in micro]))
    keys = list(micro[0][2])
    counts = torch.tensor([sum(float(m[2][k]) for m in micro) for k in keys], dtype=torch.float64,
                          device=engine.device)
    if keys and data_group is not None and torch.distributed.get_world_size(data_group) > 1:
        collectives.all_reduce(counts, data_group, name="dp/counts")
    loss = torch.as_tensor(loss).to(device=engine.device, dtype=torch.float64).reshape(1)
    values = _read(watch(engine), torch.cat([loss, counts]))
    return {"loss": float(values[0]), **{k: float(v) for k, v in zip(keys, values[1:])}}


def _read(grads, values: torch.Tensor) -> torch.Tensor:
    """``values`` on the host, with the step's gradient check in the same copy when there is one."""
    global _nonfinite_grad
    if grads is None:
        return values.cpu()
    values = grads.take(values)
    _nonfinite_grad = grads.first
    return values


_nonfinite_grad: tuple[int, str] | None = None


def nonfinite_grad() -> tuple[int, str] | None:
    """(its position in the module's order, "name (nan|inf)") of the first parameter of this rank whose local
    gradient was NaN or Inf in the last step; None when every one was finite, or under fp16."""
    return _nonfinite_grad


def train_step(engine, batches) -> float:
    """One optimizer step (all micro-batches of the global batch); the mean loss over them and over DP. Then the
    MoE layers' expert biases (auxiliary-loss-free balancing) move by the step's loads over data x context."""
    if engine.is_pipe:
        loss = engine.train_batch(data_iter=batches)
        loss = float(_read(watch(engine), torch.as_tensor(loss).reshape(1))[0])
    else:
        loss = optimizer_step(engine, batches)["loss"]
    update_expert_biases(engine.module, sequence_data_parallel_group(engine), lr_decay_of_last_step(engine))
    return loss


def lr_decay_of_last_step(engine) -> float:
    """The LR schedule's decay factor (``LRSchedule.decay_factor``) at the step just taken; 1 without the project's
    scheduler."""
    scheduler = engine.lr_scheduler
    if not isinstance(scheduler, Scheduler):
        return 1.0
    return scheduler.schedule.decay_factor(max(scheduler.last_step - 1, 0))


def sequence_data_parallel_group(engine):
    """The ranks that hold other tokens of the step: data x context (the pipeline engine's grid counts the context
    ranks among its data-parallel ones); None in one process."""
    mpu = engine.mpu
    if mpu is None:
        return None
    return getattr(mpu, "get_sequence_data_parallel_group", mpu.get_data_parallel_group)()


def eval_loss(engine, batches, num_batches: int) -> float:
    """Mean loss over ``num_batches`` global batches, without gradients."""
    total = 0.0
    if engine.is_pipe:
        for _ in range(num_batches):
            total += float(engine.eval_batch(data_iter=batches))
        return total / num_batches
    engine.eval()
    with torch.no_grad():
        for _ in range(num_batches * engine.gradient_accumulation_steps()):
            total += float(lm_forward(engine, next(batches)))
    engine.train()
    total = torch.tensor(total / (num_batches * engine.gradient_accumulation_steps()), device=engine.device)
    return float(data_parallel_mean(engine, total.reshape(1)))


def loss_scale(engine) -> float:
    opt = engine.optimizer
    for attr in ("cur_scale", "loss_scale"):
        value = getattr(opt, attr, None)
        if value is not None and not callable(value):
            return float(value)
    return 1.0


def grad_norm(engine) -> float | None:
    norm = engine.get_global_grad_norm()
    return None if norm is None else float(norm)


def lm_step_record(engine, r, *, tokens_per_step: int, flops_per_step: float, world_size: int,
                   peak_tflops: float | None) -> dict:
    """What a language model's training step logs: loss, lr, loss scale, gradient norm, speed and MFU."""
    tflops = flops_per_step / r.seconds / world_size / 1e12
    dp_group = sequence_data_parallel_group(engine)  # the MoE routing of every token: over data x context
    pipe_group = engine.mpu.get_pipe_parallel_group() if getattr(engine, "is_pipe", False) else None
    return {"step": r.step, "loss": r.out, "lr": engine.get_lr()[0], "loss_scale": loss_scale(engine),
            "grad_norm": grad_norm(engine), "skipped_steps": int(engine.skipped_steps),
            "tokens_per_s": tokens_per_step / r.seconds, "tflops_per_device": tflops,
            "mfu": tflops / peak_tflops if peak_tflops else None, "step_seconds": r.seconds,
            **moe_step_stats(engine.module, dp_group, pipe_group)}


def lm_validation_record(engine, batches, num_batches: int, step: int, *, streams: bool) -> dict:
    """Validation loss with perplexity, or bits per character for a recurrent model trained on streams (whose
    training streams' state survives the pass)."""
    if streams:
        with engine.module.isolated_state(carry=True):
            val = eval_loss(engine, batches, num_batches)
        return {"step": step, "valid_loss": val, "valid_bpc": val / math.log(2)}
    val = eval_loss(engine, batches, num_batches)
    return {"step": step, "valid_loss": val, "valid_perplexity": math.exp(min(val, 700.0))}
