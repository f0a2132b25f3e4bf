"""Full (TP=1) state dicts: reading and writing them safely, and loading one into a model at any TP size.

A *full state dict* is what ``models.parallel.full_state_dict(model)`` returns: every
parameter in its unsharded TP=1 form, vocabulary padding dropped. It is the
exchange format between layouts: a model at any tensor-parallel size takes its
shard of each tensor with the parameter's ``ShardSpec``, without any collective.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from models.moe import expert_slice
from models.parallel import get_shard_spec, tp_rank, tp_world_size
from pipeline.job.errors import UserError
from pipeline.checkpoints.safe_load import UnsafeCheckpointError, safe_torch_load
from pipeline.hf.safetensors_io import SafetensorsError, SafetensorsFiles, reports_shapes, shape_of, write_safetensors


class StateDictError(UserError, ValueError):
    """A state dict that does not fit the model (names the offending key)."""


# -- loading into a model ----------------------------------------------------------------------------------------

def expected_full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The TP=1 shape of a (possibly sharded) parameter."""
    spec = get_shard_spec(param)
    shape = list(param.shape)
    if spec is not None:
        shape[spec.dim] = sum(spec.parts)
    return tuple(shape)


@torch.no_grad()
def load_full_state_dict(model: torch.nn.Module, full: Mapping[str, torch.Tensor], *, partial: bool = False,
                         name_map: Callable[[str], str] | None = None, source: str = "state dict") -> None:
    """Copy a full TP=1 state dict into ``model``, each TP rank cutting its own shard (no collectives).

    Strict: every parameter of the model must be in ``full`` with its full shape, and (unless
    ``partial``, for a pipeline stage that holds only some of the layers) every key of ``full``
    must be a parameter of the model. ``name_map`` turns a parameter name of ``model`` into its
    key in ``full`` (e.g. a pipeline stage's layer index into ``layers.N``). Values are cast to
    each parameter's dtype and device.
    """
    experts = expert_slice(model)  # under expert parallelism a rank's experts are some of the full dict's
    params = {experts.full_name(name_map(n) if name_map else n): p for n, p in model.named_parameters()}
    missing = [k for k in params if k not in full]
    unexpected = [] if partial else [k for k in full if k not in params and experts.holds(k)]
    if missing or unexpected:
        msg = [f"{source} does not match the model ({type(model).__name__})"]
        if missing:
            msg.append(f"missing key(s): {_names(missing)}")
        if unexpected:
            msg.append(f"unexpected key(s): {_names(unexpected)}")
        raise StateDictError("; ".join(msg))
    rank, tp = tp_rank(), tp_world_size()
    # Check every shape before copying anything, so a bad file leaves the model untouched.
    # (by shape only: a lazy mapping reads each tensor once, in the copy loop, and frees it after)
    lazy = reports_shapes(full)  # its values are tensors, read when asked for
    for name, param in params.items():
        if not lazy and not isinstance(full[name], torch.Tensor):
            raise StateDictError(f"{source}: {name} is a {type(full[name]).__name__}, not a tensor")
        want, got = expected_full_shape(param), shape_of(full, name)
        if got != want:
            raise StateDictError(f"{source}: {name} has shape {got}, the model expects {want}")
    for name, param in params.items():
        spec = get_shard_spec(param)
        value = full[name]
        if spec is not None:
            value = spec.shard(value, rank, tp)
        param.copy_(value.to(device=param.device, dtype=param.dtype))


def _names(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f" (and {len(keys) - limit} more)" if len(keys) > limit else "")


# -- files -------------------------------------------------------------------------------------------------------

def read_state_dict(path: str | Path, *, lazy: bool = False) -> Mapping[str, torch.Tensor]:
    """Tensors from a ``.safetensors`` file, or from a torch file with ``weights_only=True`` (never pickled code).

    ``lazy``: a safetensors file is returned as a mapping that reads each tensor when it is asked for
    (``pipeline.hf.safetensors_io.SafetensorsFiles``), so that every TP rank takes its shards from one big file,
    and a conversion holds one tensor at a time, without the whole model in memory.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"weights file {path} does not exist")
    if path.suffix == ".safetensors":
        try:
            files = SafetensorsFiles([path])
            return files if lazy else {name: files[name] for name in files}
        except SafetensorsError as e:
            raise StateDictError(str(e)) from None
    try:
        sd = safe_torch_load(path, map_location="cpu")
    except UnsafeCheckpointError as e:
        raise StateDictError(str(e)) from None
    except Exception as e:  # truncated zip, not a torch file: all mean "not a weights file"
        raise StateDictError(f"weights file {path} could not be read as a torch weights file "
                             f"(loaded with weights_only=True): {e}") from None
    if not isinstance(sd, Mapping) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise StateDictError(f"weights file {path} does not hold a flat name -> tensor state dict")
    return sd


def save_state_dict(state_dict: Mapping, path: str | Path, metadata: dict | None = None) -> None:
    """Write tensors (or ``PlannedTensor``s, produced one at a time) to one safetensors file, without copying
    the state dict first (tensors sharing storage are written as separate tensors)."""
    write_safetensors(path, state_dict, metadata={"format": "pt", **(metadata or {})})


# -- atomic output directories ---------------------------------------------------------------------------------------
