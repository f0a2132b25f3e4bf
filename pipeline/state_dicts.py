"""Full (TP=1) state dicts: reading and writing them safely, and loading one into a model at any TP size.

A *full state dict* is what ``models.parallel.full_state_dict(model)`` returns: every
parameter in its unsharded TP=1 form, vocabulary padding dropped. It is the
exchange format between layouts: a model at any tensor-parallel size takes its
shard of each tensor with the parameter's ``ShardSpec``, without any collective.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from models.parallel import get_shard_spec, tp_rank, tp_world_size
from pipeline.errors import UserError


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
    params = {(name_map(n) if name_map else n): p for n, p in model.named_parameters()}
    missing = [k for k in params if k not in full]
    unexpected = [] if partial else [k for k in full if k not in params]
    if missing or unexpected:
        msg = [f"{source} does not match the model ({type(model).__name__})"]
        if missing:
            msg.append(f"missing key(s): {_names(missing)}")
        if unexpected:
            msg.append(f"unexpected key(s): {_names(unexpected)}")
        raise StateDictError("; ".join(msg))
    rank, tp = tp_rank(), tp_world_size()
    # Check every shape before copying anything, so a bad file leaves the model untouched.
    tensors = {}
    for name, param in params.items():
        value = full[name]
        if not isinstance(value, torch.Tensor):
            raise StateDictError(f"{source}: {name} is a {type(value).__name__}, not a tensor")
        want = expected_full_shape(param)
        if tuple(value.shape) != want:
            raise StateDictError(f"{source}: {name} has shape {tuple(value.shape)}, the model expects {want}")
        tensors[name] = value
    for name, param in params.items():
        spec = get_shard_spec(param)
        value = tensors[name]
        if spec is not None:
            value = spec.shard(value, rank, tp)
        param.copy_(value.to(device=param.device, dtype=param.dtype))


def _names(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f" (and {len(keys) - limit} more)" if len(keys) > limit else "")


# -- files -------------------------------------------------------------------------------------------------------

class LazySafetensors(Mapping):
    """A read-only mapping over a safetensors file that reads a tensor only when it is asked for.

    Lets every TP rank load its shards from one big file without holding the whole model.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._file = safe_open(str(self.path), framework="pt")
        self._keys = list(self._file.keys())

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._keys:
            raise KeyError(key)
        return self._file.get_tensor(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def read_state_dict(path: str | Path, *, lazy: bool = False) -> Mapping[str, torch.Tensor]:
    """Tensors from a ``.safetensors`` file, or from a torch file with ``weights_only=True`` (never pickled code)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"weights file {path} does not exist")
    if path.suffix == ".safetensors":
        try:
            if lazy:
                return LazySafetensors(path)
            return load_file(str(path))
        except SafetensorError as e:
            raise StateDictError(f"weights file {path} is not a readable safetensors file: {e}") from None
    from .safe_load import UnsafeCheckpointError, safe_torch_load
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


def save_state_dict(state_dict: Mapping[str, torch.Tensor], path: str | Path, metadata: dict | None = None) -> None:
    """Write tensors to one safetensors file (contiguous CPU copies; shared storage is written twice)."""
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in state_dict.items()}
    save_file(tensors, str(path), metadata={"format": "pt", **(metadata or {})})


# -- atomic output directories ---------------------------------------------------------------------------------------
