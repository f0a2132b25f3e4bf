"""Character-level multiplicative LSTM (Krause et al. 2016), as trained by NVIDIA's sentiment-discovery.

One layer, with x the input, h/c the carried hidden/cell state::

    m = (W_mx x) * (W_mh h_prev)                  multiplicative intermediate state
    i, f, o = sigmoid(W_x x + W_h m + b)[...]     gates (rows i, f, o, u of W_x / W_h)
    u       = tanh(W_x x + W_h m + b)[u rows]
    c = f * c_prev + i * u ;  h = o * tanh(c)

Speed: the input projections of every layer (gates and m, all time steps) are ONE matmul
before the time loop; the loop does only the two recurrent matmuls and a few fused
element-wise kernels per step, writing straight into preallocated [seq, batch, ...] buffers.
The backward pass is hand-written (``_MLSTMRecurrence``): it walks back through time doing
only the recurrent matmuls, then computes the weight gradients as two big matmuls over all
steps, like cuDNN's LSTM. Matmuls run in the compute dtype (the weights' dtype, or the
autocast dtype); the cell state is always kept in fp32 so long TBPTT streams in bf16/fp16
do not drift. Weight normalisation (w = g * v / |v| per output row) is applied once per
forward, not per step.

Layout inside the model is time-major [seq, batch, ...]; the public interface is
batch-major like the GPT: ``input_ids`` [batch, seq], ``labels`` pre-shifted (the model
reads tokens[:, :-1] and is scored against tokens[:, 1:]), ignore index -100.
Token ids are bytes: byte value b is id b; ids >= 256 are special tokens.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from .config import ConfigError, read_config_json

WEIGHT_NORM_MODES = ("all", "recurrent", "none")
State = tuple[torch.Tensor, torch.Tensor]   # (h [layers, batch, hidden], c [layers, batch, hidden] fp32)


@dataclass
class MLSTMConfig:
    """The paper's model: 64-d byte embedding, one 4096-unit mLSTM layer, weight norm, no dropout."""
    model_type: str = "mlstm"
    vocab_size: int = 257                  # 256 bytes + one special token
    embed_dim: int = 64
    hidden_size: int = 4096
    num_layers: int = 1
    weight_norm: str | bool = "all"        # "all" cell weights (sentiment-discovery), "recurrent" (W_h, W_mh) or "none"
    dropout: float = 0.0                   # on the embedding and on every layer's output
    seq_length: int = 256                  # TBPTT chunk length (bptt)
    init_range: float | None = None        # cell + output weights ~ U(-r, r); None: 1/sqrt(hidden_size) (as torch RNNs)
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        err = self._problem()
        if err:
            raise ConfigError(f"invalid mlstm config: {err}")

    def _problem(self) -> str | None:
        if self.model_type != "mlstm":
            return f"model_type is {self.model_type!r}, expected 'mlstm'"
        for name in ("vocab_size", "embed_dim", "hidden_size", "num_layers", "seq_length"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                return f"{name} must be a positive integer, got {v!r}"
        if self.weight_norm is True:
            self.weight_norm = "all"
        elif self.weight_norm is False:
            self.weight_norm = "none"
        if self.weight_norm not in WEIGHT_NORM_MODES:
            return (f"weight_norm must be one of {', '.join(WEIGHT_NORM_MODES)} (or true/false), "
                    f"got {self.weight_norm!r}")
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            return f"dropout must be in [0, 1), got {self.dropout!r}"
        if self.init_range is not None and not (isinstance(self.init_range, (int, float)) and self.init_range > 0):
            return f"init_range must be a positive number or null, got {self.init_range!r}"
        if not isinstance(self.extra, dict):
            return f"extra must be a dict, got {type(self.extra).__name__}"
        return None

    # -- (de)serialisation ----------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict, source: str = "mlstm config") -> "MLSTMConfig":
        if not isinstance(d, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"{source}: unknown field(s) {', '.join(unknown)}; "
                              f"known fields: {', '.join(sorted(known))}")
        try:
            return cls(**d)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> "MLSTMConfig":
        return cls.from_dict(read_config_json(path), source=str(path))

    # -- sizes ------------------------------------------------------------------
    def layer_input_sizes(self) -> list[int]:
        return [self.embed_dim] + [self.hidden_size] * (self.num_layers - 1)

    def num_parameters(self) -> int:
        H, V = self.hidden_size, self.vocab_size
        total = V * self.embed_dim + H * V + V                      # embedding, output layer (+ bias)
        for n_in in self.layer_input_sizes():
            total += 5 * H * n_in + 4 * H + 5 * H * H               # W_x (gates + m rows), bias, W_h, W_mh
            total += {"all": 10 * H, "recurrent": 5 * H, "none": 0}[self.weight_norm]   # weight-norm gains
        return total

    def flops_per_token(self, seq_length: int | None = None) -> float:
        """Training FLOPs per token (forward + backward): 6 per weight of every matmul (for MFU).

        Per layer the input projection (5H x in) and the recurrence (W_h 4H x H and W_mh H x H:
        5/4 of an LSTM's), plus the output layer. Element-wise work and weight norm are left out.
        ``seq_length`` is accepted for symmetry with GPTConfig; a recurrence does not depend on it.
        """
        H = self.hidden_size
        matmul = sum(5 * H * n_in + 5 * H * H for n_in in self.layer_input_sizes()) + H * self.vocab_size
        return 6.0 * matmul


# ---------------------------------------------------------------------------
# The recurrence: forward and hand-written backward through time
# ---------------------------------------------------------------------------
class _MLSTMRecurrence(torch.autograd.Function):
    """hs, cs = recurrence(proj, h0, c0, w_h, w_mh) for one layer, all steps.

    proj [s, b, 5H]: the input projection of every step, gate rows (i, f, o, u; bias
    included) then the m rows (W_mx x); h0 [b, H] (compute dtype), c0 [b, H] (fp32, or fp64
    for fp64); w_h [4H, H], w_mh [H, H]. Returns every step's hidden state hs [s, b, H]
    (compute dtype) and cell state cs [s, b, H] (c0's dtype); both may receive gradients
    (cs, e.g., for features taken at each sequence's own length).
    """

    @staticmethod
    def forward(ctx, proj, h0, c0, w_h, w_mh):
        s, b, H5 = proj.shape
        H = H5 // 5
        hs = proj.new_empty(s, b, H)
        cs = torch.empty(s, b, H, dtype=c0.dtype, device=proj.device)
        tcs = torch.empty_like(cs)               # tanh(c), reused by the backward
        act = proj.new_empty(s, b, 4 * H)        # activated gates: sigmoid(i, f, o), tanh(u)
        mh = proj.new_empty(s, b, H)             # W_mh h_prev (kept for d W_mx x)
        m = proj.new_empty(s, b, H)              # m (kept for d W_h)
        w_hT, w_mhT = w_h.t(), w_mh.t()
        # Per-step views made once (slicing in the loop costs more than the small kernels at small H).
        xg, xm = _steps(proj[..., :4 * H]), _steps(proj[..., 4 * H:])
        sig, i, f, o, u = (_steps(act[..., lo:hi]) for lo, hi in ((0, 3 * H), (0, H), (H, 2 * H), (2 * H, 3 * H),
                                                                   (3 * H, 4 * H)))
        hs_, cs_, tcs_, mh_, m_ = map(_steps, (hs, cs, tcs, mh, m))
        h, c = h0, c0
        for t in range(s):
            torch.mm(h, w_mhT, out=mh_[t])
            torch.mul(xm[t], mh_[t], out=m_[t])
            g = torch.addmm(xg[t], m_[t], w_hT)
            torch.sigmoid(g[:, :3 * H], out=sig[t])
            torch.tanh(g[:, 3 * H:], out=u[t])
            c = torch.mul(f[t], c, out=cs_[t])                       # f * c_prev  (>= fp32)
            c.addcmul_(i[t], u[t])                                   # + i * u
            h = torch.mul(o[t], torch.tanh(c, out=tcs_[t]), out=hs_[t])   # o * tanh(c)
        ctx.save_for_backward(proj, h0, c0, w_h, w_mh, hs, cs, tcs, act, mh, m)
        ctx.set_materialize_grads(False)
        return hs, cs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_hs, d_cs):
        proj, h0, c0, w_h, w_mh, hs, cs, tcs, act, mh, m = ctx.saved_tensors
        s, b, H5 = proj.shape
        H = H5 // 5
        d_proj = torch.empty_like(proj)          # d gate pre-activations | d (W_mx x)
        d_mh = proj.new_empty(s, b, H)
        sig, i, f, o, u = (_steps(act[..., lo:hi]) for lo, hi in ((0, 3 * H), (0, H), (H, 2 * H), (2 * H, 3 * H),
                                                                   (3 * H, 4 * H)))
        dg, dsig, di, df, do, du = (_steps(d_proj[..., lo:hi]) for lo, hi in (
            (0, 4 * H), (0, 3 * H), (0, H), (H, 2 * H), (2 * H, 3 * H), (3 * H, 4 * H)))
        d_xm, xm = _steps(d_proj[..., 4 * H:]), _steps(proj[..., 4 * H:])
        tcs_, mh_, d_mh_ = map(_steps, (tcs, mh, d_mh))
        c_prev = [c0] + _steps(cs)[:-1]
        d_hs_ = _steps(d_hs) if d_hs is not None else None
        d_cs_ = _steps(d_cs) if d_cs is not None else None
        sig_bwd, tanh_bwd = torch.ops.aten.sigmoid_backward.grad_input, torch.ops.aten.tanh_backward.grad_input
        dh = torch.zeros_like(h0)                # reaches h_t from step t+1 through W_mh
        dc = torch.zeros_like(c0)
        for t in range(s - 1, -1, -1):
            if d_hs_ is not None:
                dh = dh + d_hs_[t]
            if d_cs_ is not None:
                dc = dc + d_cs_[t]
            dc_h = dh * o[t]
            dc += tanh_bwd(dc_h, tcs_[t], grad_input=dc_h)               # through h = o * tanh(c)
            torch.mul(dc, u[t], out=di[t])
            torch.mul(dc, c_prev[t], out=df[t])
            torch.mul(dh, tcs_[t], out=do[t])
            torch.mul(dc, i[t], out=du[t])
            sig_bwd(dsig[t], sig[t], grad_input=dsig[t])                # through the activations
            tanh_bwd(du[t], u[t], grad_input=du[t])
            dc = dc * f[t]
            dm = torch.mm(dg[t], w_h)
            torch.mul(dm, mh_[t], out=d_xm[t])
            torch.mul(dm, xm[t], out=d_mh_[t])
            dh = torch.mm(d_mh_[t], w_mh)
        # Weight gradients: one big matmul over all steps instead of s small ones.
        d_w_h = d_proj[..., :4 * H].reshape(s * b, 4 * H).t() @ m.view(s * b, H)
        d_w_mh = d_mh[0].t() @ h0
        if s > 1:
            d_w_mh = d_w_mh + d_mh[1:].reshape(-1, H).t() @ hs[:-1].reshape(-1, H)
        return d_proj, dh.to(h0.dtype), dc.to(c0.dtype), d_w_h, d_w_mh


def _steps(x: torch.Tensor) -> list[torch.Tensor]:
    return list(x.unbind(0))


def mlstm_recurrence(proj, h0, c0, w_h, w_mh):
    """Functional entry point (see ``_MLSTMRecurrence``)."""
    return _MLSTMRecurrence.apply(proj, h0, c0, w_h, w_mh)


def _weight_normed(v: torch.Tensor, g: torch.Tensor | None) -> torch.Tensor:
    # w = g * v / |v| per output row; the fused kernel is ~3x faster than the composite ops.
    return v if g is None else torch._weight_norm(v, g.unsqueeze(1), 0)


class MLSTMLayer(nn.Module):
    """One mLSTM layer. Parameters (rows of the gate matrices in order i, f, o, u):

    ``w_x`` [5H, in] (gate rows then the m rows: the whole input projection in one matrix),
    ``bias`` [4H], ``w_h`` [4H, H], ``w_mh`` [H, H]; with weight norm the matrices are the
    directions v and ``g_x`` [5H], ``g_h`` [4H], ``g_mh`` [H] the per-row gains.
    """

    def __init__(self, input_size: int, hidden_size: int, weight_norm: str = "all", init_range: float | None = None):
        super().__init__()
        H = self.hidden_size = hidden_size
        self.input_size = input_size
        r = init_range if init_range is not None else 1.0 / math.sqrt(hidden_size)
        self.w_x = nn.Parameter(torch.empty(5 * H, input_size).uniform_(-r, r))
        self.bias = nn.Parameter(torch.empty(4 * H).uniform_(-r, r))
        self.w_h = nn.Parameter(torch.empty(4 * H, H).uniform_(-r, r))
        self.w_mh = nn.Parameter(torch.empty(H, H).uniform_(-r, r))
        # Gains start at the rows' norms: the effective weights equal the initial directions.
        norm_x = weight_norm == "all"
        norm_h = weight_norm in ("all", "recurrent")
        self.g_x = nn.Parameter(self.w_x.detach().norm(dim=1)) if norm_x else None
        self.g_h = nn.Parameter(self.w_h.detach().norm(dim=1)) if norm_h else None
        self.g_mh = nn.Parameter(self.w_mh.detach().norm(dim=1)) if norm_h else None

    def effective_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(W_x, W_h, W_mh) after weight normalisation."""
        return (_weight_normed(self.w_x, self.g_x), _weight_normed(self.w_h, self.g_h),
                _weight_normed(self.w_mh, self.g_mh))

    def forward(self, x: torch.Tensor, h0: torch.Tensor, c0: torch.Tensor, dtype: torch.dtype):
        """x [s, b, in] -> (hs [s, b, H] in ``dtype``, cs [s, b, H] fp32). Runs with autocast off."""
        s, b, _ = x.shape
        H = self.hidden_size
        w_x, w_h, w_mh = (w.to(dtype) for w in self.effective_weights())
        bias = torch.cat([self.bias, self.bias.new_zeros(H)]).to(dtype)
        proj = torch.addmm(bias, x.reshape(s * b, -1).to(dtype), w_x.t()).view(s, b, 5 * H)
        c_dtype = torch.promote_types(dtype, torch.float32)     # the cell state never goes below fp32
        return mlstm_recurrence(proj, h0.to(dtype), c0.to(c_dtype), w_h, w_mh)

    def extra_repr(self) -> str:
        return f"input_size={self.input_size}, hidden_size={self.hidden_size}"


# ---------------------------------------------------------------------------
# The language model
# ---------------------------------------------------------------------------
class MLSTM(nn.Module):
    """Byte-level mLSTM language model: ``embedding`` -> ``layers[i]`` (MLSTMLayer) -> ``lm_head``.

    ``forward(input_ids, labels=None, state=None, reset=None)``:
      - returns ``(logits [b, s, V] or mean CE loss, new_state)``; ``state`` is (h, c), each
        [layers, b, hidden] (c in fp32); the caller detaches it between TBPTT chunks.
      - ``reset`` Bool[b]: rows whose carried state is zeroed before this chunk (a stream starts).
      - With ``model.carry_state = True`` the model keeps the (detached) state itself between
        calls and forward returns only the logits / loss, like the GPT, so a DeepSpeed engine
        does TBPTT unchanged: ``loss = engine(x, labels=y, reset=r)``. Each data-parallel rank
        holds its own model and therefore follows its own stream. Evaluate between training
        steps inside ``with model.isolated_state():`` so the training stream's state survives.
        The carried state is not part of ``state_dict()``: a resumed run restarts its streams
        from zero (send ``reset`` for every row on the first batch after a resume).
      - Labels are pre-shifted like the GPT's (inputs tokens[:, :-1], labels tokens[:, 1:]);
        -100 is ignored. The loss is computed in fp32 whatever the compute dtype.
    """

    def __init__(self, config: MLSTMConfig):
        super().__init__()
        self.config = config
        self.embedding = nn.Embedding(config.vocab_size, config.embed_dim)
        self.layers = nn.ModuleList(MLSTMLayer(n_in, config.hidden_size, config.weight_norm, config.init_range)
                                    for n_in in config.layer_input_sizes())
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size)
        r = config.init_range if config.init_range is not None else 1.0 / math.sqrt(config.hidden_size)
        with torch.no_grad():
            self.lm_head.weight.uniform_(-r, r)
            self.lm_head.bias.zero_()
        self.drop = nn.Dropout(config.dropout)
        self.carry_state = False
        self._state: State | None = None

    # -- state ------------------------------------------------------------------
    def zero_state(self, batch_size: int, dtype: torch.dtype | None = None, device=None) -> State:
        L, H = self.config.num_layers, self.config.hidden_size
        device = device or self.lm_head.weight.device
        h = torch.zeros(L, batch_size, H, dtype=dtype or self.lm_head.weight.dtype, device=device)
        return h, torch.zeros(L, batch_size, H, dtype=torch.float32, device=device)

    def reset_state(self) -> None:
        """Forget the carried state (the next call starts every stream from zero)."""
        self._state = None

    @property
    def carried_state(self) -> State | None:
        return self._state

    @contextlib.contextmanager
    def isolated_state(self, carry: bool = False):
        """Evaluate between training steps without touching the training stream's carried state.

        Inside, the model starts from no carried state and ``carry_state`` is ``carry``; on exit
        both the training state and the flag come back.
        """
        saved = self.carry_state, self._state
        self.carry_state, self._state = carry, None
        try:
            yield self
        finally:
            self.carry_state, self._state = saved

    def _initial_state(self, state: State | None, reset: torch.Tensor | None, b: int, dtype, device) -> State:
        if reset is not None and tuple(reset.shape) != (b,):
            raise ValueError(f"reset must be a Bool tensor of shape [batch]=({b},), got {tuple(reset.shape)}")
        if state is None:
            return self.zero_state(b, dtype, device)
        h, c = state
        L, H = self.config.num_layers, self.config.hidden_size
        if tuple(h.shape) != (L, b, H) or tuple(c.shape) != (L, b, H):
            raise ValueError(f"carried mLSTM state has shape h {tuple(h.shape)}, c {tuple(c.shape)} but this batch "
                             f"needs ({L}, {b}, {H}); the batch size changed between chunks of a stream - call "
                             f"reset_state() (or pass state=None) to start new streams")
        if reset is not None:
            keep = (~reset.to(device=h.device, dtype=torch.bool)).view(1, b, 1)
            h, c = h * keep, c * keep
        return h, c

    # -- forward ----------------------------------------------------------------
    def _run(self, input_ids: torch.Tensor, state: State | None, reset: torch.Tensor | None):
        """-> (last layer's hs [s, b, H], its cs [s, b, H] fp32, new state). Time-major inside."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        b = input_ids.shape[0]
        device = input_ids.device
        dev_type = device.type
        dtype = torch.get_autocast_dtype(dev_type) if torch.is_autocast_enabled(dev_type) else self.lm_head.weight.dtype
        h0, c0 = self._initial_state(state, reset, b, dtype, device)
        x = self.drop(self.embedding(input_ids.t()))            # [s, b, E]
        hs_last, cs_last = [], []
        with torch.autocast(dev_type, enabled=False):
            for l, layer in enumerate(self.layers):
                hs, cs = layer(x, h0[l], c0[l], dtype)
                hs_last.append(hs[-1])
                cs_last.append(cs[-1])
                x = self.drop(hs)
        return x, cs, (torch.stack(hs_last), torch.stack(cs_last))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, state: State | None = None,
                reset: torch.Tensor | None = None):
        if self.carry_state and state is None:
            state = self._state
        out, _, new_state = self._run(input_ids, state, reset)
        logits = self.lm_head(out)                               # [s, b, V]
        if labels is None:
            result = logits.transpose(0, 1)
        else:
            if labels.shape != input_ids.shape:
                raise ValueError(f"labels shape {tuple(labels.shape)} differs from input_ids {tuple(input_ids.shape)} "
                                 f"(labels are pre-shifted: inputs tokens[:, :-1], labels tokens[:, 1:])")
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32))   # the loss in >= fp32
            result = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.t().reshape(-1), ignore_index=-100)
        if self.carry_state:
            self._state = tuple(t.detach() for t in new_state)
            return result
        return result, new_state

    def features(self, input_ids: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Final cell state of the last layer for each row, [b, hidden] fp32 (the sentiment neuron's features).

        ``lengths`` [b]: the real length of each right-padded row (default: the full width).
        Starts from a zero state; differentiable (for finetuning).
        """
        _, cs, _ = self._run(input_ids, None, None)
        if lengths is None:
            return cs[-1]
        lengths = torch.as_tensor(lengths, device=cs.device)
        if lengths.min() < 1 or lengths.max() > cs.shape[0]:
            raise ValueError(f"lengths must be in [1, {cs.shape[0]}], got min {int(lengths.min())} "
                             f"max {int(lengths.max())}")
        return cs[lengths.long() - 1, torch.arange(cs.shape[1], device=cs.device)]

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


# ---------------------------------------------------------------------------
# Save / load (config.json + model.safetensors)
# ---------------------------------------------------------------------------
CONFIG_NAME, WEIGHTS_NAME = "config.json", "model.safetensors"


def _atomic_write(path: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def save_mlstm(model: MLSTM, directory: str | Path) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (each atomically) into ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    _atomic_write(directory / WEIGHTS_NAME,
                  lambda p: save_file(tensors, p, metadata={"format": "pt", "model_type": "mlstm"}))
    text = json.dumps(model.config.to_dict(), indent=2) + "\n"
    _atomic_write(directory / CONFIG_NAME, lambda p: Path(p).write_text(text))
    return directory


def load_mlstm(directory: str | Path, map_location: str | torch.device = "cpu") -> MLSTM:
    """Build an MLSTM from a directory written by ``save_mlstm``."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"mLSTM model directory {directory} does not exist")
    weights = directory / WEIGHTS_NAME
    if not weights.exists():
        raise FileNotFoundError(f"{weights} does not exist (expected {CONFIG_NAME} + {WEIGHTS_NAME} from save_mlstm)")
    model = MLSTM(MLSTMConfig.from_file(directory / CONFIG_NAME))
    sd = load_file(str(weights), device=str(map_location))
    expected = model.state_dict()
    missing, unexpected = sorted(set(expected) - set(sd)), sorted(set(sd) - set(expected))
    bad_shape = [f"{k} {tuple(sd[k].shape)} (model wants {tuple(expected[k].shape)})"
                 for k in expected if k in sd and sd[k].shape != expected[k].shape]
    if missing or unexpected or bad_shape:
        raise ValueError(f"{weights} does not match {directory / CONFIG_NAME}: missing {missing or 'none'}, "
                         f"unexpected {unexpected or 'none'}, wrong shape {bad_shape or 'none'}")
    model.load_state_dict(sd)
    return model.to(map_location)
