"""No code runs from a checkpoint: every file of a checkpoint is unpickled with ``weights_only=True``.

DeepSpeed's own ``TorchCheckpointEngine`` (and ``zero_to_fp32``, and its universal-checkpoint
readers) call ``torch.load(..., weights_only=False)``, which runs whatever a doctored pickle
carries. Three mechanisms close that:

* ``SafeCheckpointEngine`` replaces the engine's checkpoint engine (``install``): loads are
  ``weights_only=True``, saves hash each file's bytes as they are written (``COMPLETE.json``
  records them);
* ``weights_only_loads()`` sets ``TORCH_FORCE_WEIGHTS_ONLY_LOAD=1``, torch's own switch that turns every
  ``torch.load`` (and those of the processes started meanwhile) into a weights-only load, for as long as one
  of DeepSpeed's readers without a hook runs (``zero_to_fp32``, the universal conversion, the engine's
  universal load), and restores the environment after: importing the library changes no process-wide
  environment variable;
* ``scan`` lists the pickled globals of a file without unpickling it, so a refusal names the
  file and the type before any library reads it (``checkpoint.verify`` scans every file of a tag,
  ``universal`` every file it converts and every file of a cache before DeepSpeed reads them).

The only non-tensor types allowed are the few DeepSpeed writes itself (``DEEPSPEED_TYPES``).
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import re
import zipfile
from pathlib import Path

import torch
from deepspeed.checkpoint.universal_checkpoint import SubparamShape
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address

from pipeline.job.errors import UserError

# What DeepSpeed 0.19.8 pickles besides tensors and containers (found with
# torch.serialization.get_unsafe_globals_in_checkpoint on ZeRO 0-3, fp32/bf16/fp16, pipeline runs, and the
# universal checkpoints ds_to_universal writes: SubparamShape, with every fused parameter).
DEEPSPEED_TYPES = (ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address, SubparamShape)
ALLOWED = {f"{t.__module__}.{t.__qualname__}" for t in DEEPSPEED_TYPES}


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be loaded (missing, incomplete, damaged or unsafe); the message names the file."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file that holds something other than tensors and DeepSpeed's own types."""


_FORCE, _NO_FORCE = "TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"
torch.serialization.add_safe_globals(list(DEEPSPEED_TYPES))  # (torch's allow-list for weights-only loads)


@contextlib.contextmanager
def weights_only_loads():
    """Every torch.load inside (DeepSpeed's own, which ask for weights_only=False, and those of processes started
    meanwhile) loads weights only, DeepSpeed's types allowed; the environment is restored after."""
    saved = {name: os.environ.get(name) for name in (_FORCE, _NO_FORCE)}
    os.environ[_FORCE] = "1"
    os.environ.pop(_NO_FORCE, None)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _refusal(path, types) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"{path}: contains a pickled object of type {', '.join(sorted(types))}, not allowed (a checkpoint file may "
        f"hold only tensors and DeepSpeed's own types; this file was not written by this project's training): "
        f"do not load it; use a checkpoint from a source you trust")


def scan(path: str | Path) -> None:
    """Refuse a torch file whose pickle names any global beyond torch's safe set and ``DEEPSPEED_TYPES``.

    Reads the pickle's opcodes only (nothing is unpickled, no tensor data is read)."""
    try:
        found = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:
        if not zipfile.is_zipfile(path):
            _check_legacy(path)  # torch's pre-1.6 format: only a weights-only load can tell
        return  # damage: the weights-only load decides
    bad = set(found) - ALLOWED
    if bad:
        raise _refusal(path, bad)


def _check_legacy(path: Path) -> None:
    try:
        safe_torch_load(path, map_location="cpu")
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"{path}: not a readable torch file ({type(e).__name__}: {str(e)[:200]}); replace "
                              f"it, or convert the model to safetensors") from None


def scan_weight_files(directory: str | Path) -> None:
    """Refuse a Hugging Face model directory whose torch weight files (``pytorch_model*.bin``, what transformers
    reads when there is no safetensors file) pickle anything beyond tensors, naming the file, before
    transformers reads them (its refusal does not name the file and suggests ``weights_only=False``)."""
    directory = Path(directory)
    if not directory.is_dir():
        return
    for path in sorted(directory.iterdir()):
        if path.name.startswith("pytorch_model") and path.suffix == ".bin" and path.is_file():
            scan(path)


def safe_torch_load(path: str | Path, map_location=None, **kwargs):
    """``torch.load(weights_only=True)`` whose refusal names the file and the type, not torch's advice to
    retry with ``weights_only=False``."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True, **kwargs)
    except pickle.UnpicklingError as e:
        raise _refusal(path, refused_globals(str(e))) from None


def refused_globals(message: str) -> set[str]:
    """The globals torch's weights-only unpickler names in its refusal ("GLOBAL exec was not an allowed global")."""
    found = re.findall(r"GLOBAL ([\w.]+)", message)
    return {name if "." in name else f"builtins.{name}" for name in found} or {"(unknown: " + message[-200:] + ")"}


# -- writing, with the sha256 of every byte as it goes out -----------------------------------------------------

class _HashingWriter:
    def __init__(self, f):
        self.f, self.sha, self.error = f, hashlib.sha256(), None

    def write(self, data) -> int:
        self.sha.update(data)
        try:
            return self.f.write(data)
        except OSError as e:  # torch's zip writer turns it into "unexpected pos": keep the OS's words
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()


def save_hashed(obj, path: str | Path, *, zipfile_serialization: bool = True) -> str:
    """``torch.save`` to ``path`` (fsynced); returns the sha256 of the bytes written."""
    with open(path, "wb") as f:
        writer = _HashingWriter(f)
        try:
            torch.save(obj, writer, _use_new_zipfile_serialization=zipfile_serialization)
        except RuntimeError:
            if writer.error is not None:
                raise writer.error from None
            raise
        f.flush()
        os.fsync(f.fileno())
    return writer.sha.hexdigest()


def sha256_file(path: str | Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            sha.update(block)
    return sha.hexdigest()


def file_manifest(folder: Path, digests: dict | None = None, skip: tuple[str, ...] = ()) -> dict:
    """{relative name: {size, sha256}} of every file under ``folder`` but ``skip``; ``digests`` ({absolute path:
    sha256}) are those computed as the bytes were written, any other file is read back."""
    files = {}
    for p in sorted(Path(folder).rglob("*")):
        name = str(p.relative_to(folder))
        if p.is_file() and name not in skip:
            sha = (digests or {}).get(str(p.resolve())) or sha256_file(p)
            files[name] = {"size": p.stat().st_size, "sha256": sha}
    return files


class SafeCheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed's torch checkpoint engine, loading weights only and hashing what it saves.

    ``written`` maps each saved file's absolute path to its sha256 (``checkpoint.save`` collects them)."""

    def __init__(self, config_params=None, zipfile_serialization: bool = True):
        super().__init__(None)
        self.name = "SafeCheckpointEngine"
        self.zipfile_serialization = zipfile_serialization
        self.written: dict[str, str] = {}

    def save(self, state_dict, path: str):
        self.written[str(Path(path).resolve())] = save_hashed(state_dict, path,
                                                              zipfile_serialization=self.zipfile_serialization)

    def load(self, path: str, map_location=None):
        scan(path)
        return safe_torch_load(path, map_location=map_location)


def install(engine) -> None:
    """Give a DeepSpeed engine the safe checkpoint engine (only in place of DeepSpeed's plain torch engine,
    whose file format it keeps; the other engines are not configured by this project)."""
    current = engine.checkpoint_engine
    if type(current) is not TorchCheckpointEngine:
        raise CheckpointError(f"DeepSpeed config: its \"checkpoint\" section selects the {type(current).__name__}; "
                              f"this project saves and loads checkpoints only through its weights-only engine "
                              f"(DeepSpeed's torch format); remove the checkpoint writer / engine setting")
    engine.checkpoint_engine = SafeCheckpointEngine(zipfile_serialization=current.zipfile_serialization)
