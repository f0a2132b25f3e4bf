"""Checkpoints: DeepSpeed's own files, made self-describing, complete-or-invisible, and checked on load.

Layout of a save directory::

    config.json              model config (with model_type)
    tokenizer/               the tokenizer the run trained with
    global_step<N>/          DeepSpeed save_checkpoint files (model, optimizer, scheduler, loss scale)
        rank<R>_state.pt     each rank's data position and RNG streams
        layout.json          TP / PP / DP sizes and the step
        COMPLETE.json        written last: every file of the tag with its size and sha256
    latest                   the newest complete tag, replaced atomically
    zero_to_fp32.py          the project's full weights at any layout (pipeline/checkpoints/recovery_script.py)
    universal/<tag>/         a tag converted for another layout (``pipeline.checkpoints.universal``), on demand

A save killed at any point leaves at most a tag directory without COMPLETE.json,
which ``latest`` never names. On load every file listed in COMPLETE.json must be
there with its size and sha256 (hashed as it was written), and every torch file may
pickle only tensors and DeepSpeed's own types (``pipeline.checkpoints.safe_load``), or the load is
refused naming the file. A tag (``latest`` or ``--load-tag``) names a directory of the
run directory itself, never a path outside it.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

from models.config import ConfigError
from models.parallel import get_rng_tracker
from pipeline.job.errors import UserError
from pipeline.job.families import family_of_dict
from pipeline.job.files import (DiskFullError, OutputError, atomic_dir, atomic_write_text, crash_point, disk_full,
                                disk_full_cause, refuse_links_out, tree_size)
from pipeline.checkpoints.model_dir import read_model_dir

from pipeline.checkpoints import recovery_script, safe_load
from pipeline.engine.pipe_model import pipe_to_gpt_name
from pipeline.checkpoints.safe_load import CheckpointError
from pipeline.checkpoints.universal import OPTIMIZER_PARAM_NAMES, optimizer_param_names

COMPLETE = "COMPLETE.json"


def tag_for_step(step: int) -> str:
    return f"global_step{step}"


def rng_state() -> dict:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(),
             "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
             "torch": torch.get_rng_state(),
             "tracker": get_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    get_rng_tracker().set_states(dict(state["tracker"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier():
    if dist.is_initialized():
        dist.barrier()


# what a pretraining run writes at the top of its --save (and the "." temporaries of its atomic writes)
RUN_ENTRIES = ("config.json", "tokenizer", "latest", "metrics.jsonl", "samples.jsonl", ".run.lock", "universal",
               recovery_script.SCRIPT_NAME, "zero_to_torch.py", "tensorboard", "csv_monitor", "wandb")


def check_save_dir(save, *, load=None, inputs=()) -> None:
    """``pretrain --save``: refused, before anything is written, when it would replace what the user owns: a
    directory holding files a run does not write (a data folder, a model), a link to outside it, an earlier
    run's checkpoints unless that run is the one resumed (``--load`` the same directory: pretrain sets it when
    --save holds a checkpoint and no --load is given), or an input of this run (``inputs``: (flag, path or None)
    pairs, e.g. the --model-config file) inside it."""
    if save is None:
        return
    save = Path(save)
    if save.exists() and not save.is_dir():
        raise OutputError(f"--save {save} is a file, not a directory; choose a directory for the run")
    if not save.is_dir():
        return
    resumed = load is not None and Path(load).resolve() == save.resolve()
    ours = (*RUN_ENTRIES, "args.json", "ds_config.json")  # (pipeline.job.run_dir: the run's settings)
    foreign = sorted(n for n in os.listdir(save) if not (n in ours or n.startswith((".", "global_step"))))
    if foreign or not _our_config(save / "config.json"):
        names = ", ".join(foreign[:5]) + (" ..." if len(foreign) > 5 else "") if foreign else "a config.json"
        raise OutputError(f"--save {save} holds {names}, which a pretraining run does not write (not a run "
                          f"directory); --save is the run's own directory: choose a new or empty one")
    refuse_links_out(save)
    tags = complete_tags(save)
    if tags and not resumed:
        raise OutputError(f"--save {save} holds the checkpoints of another run ({', '.join(tags[-3:])}); continue "
                          f"that run with --save {save} and no --load, or choose a new --save")
    for flag, path in inputs:
        if path is not None and not resumed and os.path.lexists(path) and (
                save.resolve() in Path(path).resolve().parents or save.resolve() == Path(path).resolve()):
            raise OutputError(f"{flag} {path} is inside --save {save}, whose files the run replaces; move it out "
                              f"of {save} or choose another --save")


def _our_config(path: Path) -> bool:
    """No config.json, or one of a model config of this project (not an HF model's or the user's own)."""
    if not path.exists():
        return True
    try:
        raw = json.loads(path.read_text())
        return isinstance(raw, dict) and family_of_dict(raw, str(path)).config_class.from_dict(raw) is not None
    except (ValueError, UserError, ConfigError, TypeError, OSError):
        return False


def save_run_files(save_dir: Path, model_config, tokenizer) -> None:
    """config.json and tokenizer/ beside the tags (rank 0, once per run)."""
    save_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(save_dir / "config.json", json.dumps(model_config.to_dict(), indent=2) + "\n")
    if tokenizer is not None:
        with atomic_dir(save_dir / "tokenizer", force=True) as tmp:
            tokenizer.save(tmp)


def save(engine, save_dir, step: int, *, data_state: dict | None, layout: dict, extra_client_state=None) -> Path:
    """Collective: every rank calls it. Returns the tag directory. A full disk (or file-size limit) removes the
    partial tag and leaves ``latest`` and the earlier tags as they were (``DiskFullError``, naming the bytes).
    (``pipeline.checkpoints.async_save`` writes the same files with the write off the training's path.)"""
    try:
        return _save(engine, save_dir, step, data_state=data_state, layout=layout,
                     extra_client_state=extra_client_state)
    except OSError as e:
        if disk_full_cause(e) is None:
            raise
        remove_partial_tag(Path(save_dir) / tag_for_step(step))
        raise save_disk_full(e, save_dir, step, estimate_bytes(engine)) from None


def estimate_bytes(engine) -> int:
    """About what a tag of ``engine`` takes: its weights and fp32 Adam state."""
    return sum(p.numel() * (p.element_size() + 12) for p in engine.module.parameters())


def remove_partial_tag(tag_dir: Path) -> None:
    """A save's own files, once no rank writes there: never complete (no COMPLETE.json, or not named by latest)."""
    shutil.rmtree(tag_dir, ignore_errors=True)


def save_disk_full(error: OSError, save_dir, step: int, estimate: int) -> DiskFullError:
    """The one line of a save that did not fit: the tag, and the bytes needed (the newest complete tag's, else
    ``estimate``)."""
    tags = complete_tags(save_dir)
    needed = tree_size(Path(save_dir) / tags[-1]) if tags else estimate
    return disk_full(disk_full_cause(error), Path(save_dir) / tag_for_step(step), f"the checkpoint of step {step}",
                     needed)


def _save(engine, save_dir, step: int, *, data_state: dict | None, layout: dict, extra_client_state=None) -> Path:
    save_dir = Path(save_dir)
    tag_dir, client_state = begin_tag(engine, save_dir, step, extra_client_state)
    writer = engine.checkpoint_engine  # a safe_load.SafeCheckpointEngine (build_engine installs it)
    writer.written.clear()
    engine.save_checkpoint(str(save_dir), tag=tag_dir.name, client_state=client_state, save_latest=False)
    crash_point(f"after-deepspeed-files:{step}")
    state_file = tag_dir / f"rank{_rank()}_state.pt"
    digests = {**writer.written, str(state_file.resolve()): safe_load.save_hashed(rank_state(data_state), state_file)}
    digests = gather_digests(digests)
    if _rank() == 0:
        commit_tag(tag_dir, step, digests, layout_text_of(engine, layout, step))
    _barrier()
    return tag_dir


def begin_tag(engine, save_dir: Path, step: int, extra_client_state=None) -> tuple[Path, dict]:
    """Collective, before DeepSpeed writes: the tag directory emptied of a save that never completed (or a rerun
    of this step), and the client state DeepSpeed saves with it."""
    tag_dir = save_dir / tag_for_step(step)
    if _rank() == 0:
        if tag_dir.exists():
            shutil.rmtree(tag_dir)
        _unlink_linked_scripts(save_dir)
    _barrier()
    client_state = {"step": step, **(extra_client_state or {})}
    names = optimizer_param_names(engine)  # ZeRO-0: which moments belong to which parameter
    if names is not None:
        client_state[OPTIMIZER_PARAM_NAMES] = names
    return tag_dir, client_state


def rank_state(data_state: dict | None) -> dict:
    """What each rank saves of its own: its data position and RNG streams."""
    return {"data": data_state, "rng": rng_state()}


def layout_text_of(engine, layout: dict, step: int) -> str:
    """layout.json of the tag: the run's layout, the step, the LR schedule and the skipped steps, as now."""
    scheduler = engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
    return json.dumps({**layout, "step": step, "scheduler": scheduler, "skipped_steps": int(engine.skipped_steps),
                       OPTIMIZER_PARAM_NAMES: optimizer_param_names(engine) is not None}, indent=2) + "\n"


def commit_tag(tag_dir: Path, step: int, digests: dict, layout_text: str) -> None:
    """Rank 0, once every rank's files are written: layout.json, then COMPLETE.json, then ``latest`` names the tag."""
    atomic_write_text(tag_dir / "layout.json", layout_text)
    digests = {**digests, str((tag_dir / "layout.json").resolve()): hashlib.sha256(layout_text.encode()).hexdigest()}
    write_complete(tag_dir, step, digests)
    recovery_script.install(tag_dir.parent)  # the project's zero_to_fp32.py over the one DeepSpeed copied
    atomic_write_text(tag_dir.parent / "latest", tag_dir.name + "\n")


def _unlink_linked_scripts(save_dir: Path) -> None:
    """DeepSpeed copies its recovery scripts over whatever is there: one made a link (or hard-linked) since the
    run started is removed first, so the copy never writes through it."""
    for name in (recovery_script.SCRIPT_NAME, "zero_to_torch.py"):
        path = save_dir / name
        if path.is_symlink() or (path.is_file() and path.stat().st_nlink > 1):
            path.unlink()


def gather_digests(digests: dict, group=None) -> dict:
    """Every rank's {absolute path: sha256} of the files it wrote, on every rank (over ``group``, default all)."""
    if not dist.is_initialized():
        return dict(digests)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, digests, group=group)
    return {k: v for d in everyone for k, v in d.items()}


def write_complete(tag_dir: Path, step: int, digests: dict | None = None) -> None:
    """COMPLETE.json, written last: {name: {size, sha256}} of every file of the tag. ``digests`` are the
    sha256 the writers computed as the bytes went out ({absolute path: sha256}); a file none hashed is read back."""
    files = safe_load.file_manifest(tag_dir, digests, skip=(COMPLETE,))
    atomic_write_text(tag_dir / COMPLETE, json.dumps({"step": step, "files": files}, indent=2) + "\n")


LOAD_TAG = "with --load-tag"


def resolve_tag(load_dir, tag: str | None = None, *, choose: str = LOAD_TAG, flag: str = "--load-tag") -> str:
    """The tag to read: ``tag`` (given as ``flag``) or the one ``latest`` names, checked inside the run and
    verified; ``choose`` says how the command picks another."""
    load_dir = Path(load_dir)
    if not load_dir.is_dir():
        raise CheckpointError(f"checkpoint directory {load_dir} does not exist")
    if tag is None:
        latest = load_dir / "latest"
        if not latest.is_file():
            tags = complete_tags(load_dir)
            raise CheckpointError(f"{latest} does not exist: no complete checkpoint in {load_dir}"
                                  + (f" (complete tags: {', '.join(tags)})" if tags else ""))
        tag = _read_latest(latest, load_dir)
        source = f"{latest} names"
    else:
        source = flag
    _check_inside(load_dir, tag, source)
    try:
        check_tag(load_dir / tag)
    except DamagedTagError as e:
        backup = None if source == flag else intact_tag(load_dir, skip=tag)
        if backup is None:
            raise CheckpointError(f"{e}; {choose_another(load_dir, choose)}") from None
        how = choose.replace("<tag>", backup) if "<tag>" in choose else f"{choose} {backup}"
        raise CheckpointError(f"{e}; {source} {tag}, which is damaged: the complete checkpoint {backup} is intact, "
                              f"load it {how}") from None
    return tag


def choose_another(load_dir: Path, choose: str) -> str:
    return f"choose another {choose} (complete checkpoints: {', '.join(complete_tags(load_dir)) or 'none'})"


def intact_tag(load_dir: Path, skip: str) -> str | None:
    """The newest complete tag but ``skip`` whose files all pass ``verify`` (a refusal's way out), or None."""
    for tag in reversed(complete_tags(load_dir)):
        if tag != skip:
            with contextlib.suppress(CheckpointError):
                check_tag(load_dir / tag)
                return tag
    return None


def _read_latest(latest: Path, load_dir: Path) -> str:
    """The tag ``latest`` names: one line of text, else refused naming the file and the complete tags."""
    raw = latest.read_bytes()
    try:
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        text = None
    if text is None or "\n" in text or "\x00" in text or len(text) > 255:
        tags = complete_tags(load_dir)
        raise CheckpointError(f"{latest}: holds {len(raw)} bytes that are not a tag name (it is damaged); write the "
                              f"tag of a complete checkpoint into it ({', '.join(tags) or 'none in ' + str(load_dir)})")
    return text


def _check_inside(load_dir: Path, tag: str, source: str) -> None:
    """A tag is the name of a directory of the run directory: no path, no way out of it."""
    target = (load_dir / tag).resolve()
    if not tag or Path(tag).name != tag or tag in (".", "..") or target.parent != load_dir.resolve():
        raise CheckpointError(f"{source} tag {tag!r}, which is not a checkpoint directory inside {load_dir}; a tag "
                              f"is the name of a global_step<N> directory of the run (complete tags: "
                              f"{', '.join(complete_tags(load_dir)) or 'none'})")


def complete_tags(load_dir) -> list[str]:
    tags = [p.name for p in Path(load_dir).glob("global_step*") if (p / COMPLETE).is_file()]
    return sorted(tags, key=lambda t: int(t.removeprefix("global_step")))


class DamagedTagError(CheckpointError):
    """A tag that is incomplete or damaged; its message says what, the caller adds the way out."""


def verify(tag_dir: Path, choose: str = LOAD_TAG) -> dict:
    """Every file COMPLETE.json lists is there with its size and sha256, and pickles nothing but tensors and
    DeepSpeed's own types; else refuse, naming the file. ``choose``: how the command picks another tag."""
    try:
        return check_tag(tag_dir)
    except DamagedTagError as e:
        raise CheckpointError(f"{e}; {choose_another(tag_dir.parent, choose)}") from None


def check_tag(tag_dir: Path) -> dict:
    """``verify`` without the way out: ``DamagedTagError`` names what is wrong (``UnsafeCheckpointError`` a pickle
    that is not weights)."""
    marker = tag_dir / COMPLETE
    if not tag_dir.is_dir():
        raise CheckpointError(f"checkpoint {tag_dir} does not exist (complete checkpoints: "
                              f"{', '.join(complete_tags(tag_dir.parent)) or 'none'})")
    if not marker.is_file():
        raise DamagedTagError(f"checkpoint {tag_dir} is incomplete (no {COMPLETE}: its save was interrupted)")
    try:
        manifest = json.loads(marker.read_text())
        entries = {name: entry if isinstance(entry, dict) else {"size": entry}  # size-only: saved before sha256
                   for name, entry in manifest["files"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise DamagedTagError(f"{marker}: not a valid {COMPLETE} ({e})") from None
    for name, entry in entries.items():
        path = tag_dir / name
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise DamagedTagError(f"{marker}: lists {name!r}, a path outside the checkpoint")
        if not path.is_file():
            raise DamagedTagError(f"checkpoint {tag_dir} is damaged: {path} is missing")
        if path.stat().st_size != entry.get("size"):
            raise DamagedTagError(f"checkpoint {tag_dir} is damaged: {path} has {path.stat().st_size} bytes, "
                                  f"expected {entry.get('size')} (truncated?)")
        if "sha256" in entry and safe_load.sha256_file(path) != entry["sha256"]:
            raise DamagedTagError(f"checkpoint {tag_dir} is damaged: {path} does not match the sha256 recorded "
                                  f"when it was written (its bytes changed)")
        if path.suffix == ".pt":
            safe_load.scan(path)
    return manifest


def load(engine, load_dir, tag: str | None = None, *, load_optimizer: bool = True) -> tuple[int, dict | None]:
    """Restore engine, RNG streams and this rank's data state; returns (step, data_state)."""
    tag = resolve_tag(load_dir, tag)
    with safe_load.weights_only_loads():  # (a universal load reads files past the engine's weights-only hook)
        path, client = engine.load_checkpoint(str(load_dir), tag=tag, load_optimizer_states=load_optimizer,
                                              load_lr_scheduler_states=load_optimizer,
                                              load_module_only=not load_optimizer)
    if path is None:
        raise CheckpointError(f"DeepSpeed could not load checkpoint {Path(load_dir) / tag}")
    state_file = Path(load_dir) / tag / f"rank{_rank()}_state.pt"
    step = int(client.get("step", int(tag.removeprefix("global_step"))))
    if not state_file.is_file():
        return step, None  # a different world size: no per-rank state to restore
    state = safe_load.safe_torch_load(state_file)
    set_rng_state(state["rng"])
    return step, state["data"]


# -- resharding: any saved layout -> full TP=1 weights -> any other layout ------------------------------------

def saved_layout(load_dir, tag: str) -> dict:
    return json.loads((Path(load_dir) / tag / "layout.json").read_text())


def read_full_model_state(load_dir, tag: str | None = None):
    """(model config, full TP=1 state dict, tokenizer dir) of a checkpoint saved at any (TP, PP, DP).

    Reads the DeepSpeed model files of every TP rank (and, for pipelines, every layer file),
    and joins the shards with each parameter's ShardSpec. The weights are those the run
    computed with (bf16/fp16 runs store them in that precision). ZeRO-3 partitions the
    weights themselves: those runs are read with DeepSpeed's zero_to_fp32 (TP=1 only).
    """
    load_dir = Path(load_dir)
    # the commands that read a whole model (export_hf, evaluate, finetune --base) take the tag latest names
    tag = resolve_tag(load_dir, tag, choose=f"by passing {load_dir}/<tag> in place of {load_dir}")
    tag_dir = load_dir / tag
    tokenizer_dir = load_dir / "tokenizer"
    tokenizer_dir = tokenizer_dir if tokenizer_dir.is_dir() else None
    raw = json.loads((load_dir / "config.json").read_text())
    family = family_of_dict(raw, str(load_dir / "config.json"))
    config = family.config_class.from_dict(raw, source=str(load_dir / "config.json"))
    layout = saved_layout(load_dir, tag)
    tp, pp = layout.get("tensor_parallel", 1), layout.get("pipeline_parallel", 1)
    specs = family.shard_specs(config)
    if layout.get("universal_only"):  # what pipeline.reshard writes: the weights are in the universal folder
        return config, _universal_weights(load_dir / "universal" / tag / "zero", specs), \
            tokenizer_dir
    per_rank: list[dict] = [dict() for _ in range(tp)]
    if pp == 1 and not (tag_dir / "mp_rank_00_model_states.pt").is_file():
        per_rank = _zero3_weights(load_dir, tag, tp)  # ZeRO-3 writes zero_pp_rank_<dp>_mp_rank_<tp> files only
    elif pp == 1:
        for r in range(tp):
            state = safe_load.safe_torch_load(tag_dir / f"mp_rank_{r:02d}_model_states.pt", map_location="cpu")
            per_rank[r] = {**state["module"], **_expert_weights(tag_dir, r)}
        if not per_rank[0] or any(v.numel() == 0 for v in per_rank[0].values()):
            per_rank = _zero3_weights(load_dir, tag, tp)
    else:
        for path in sorted(tag_dir.glob("layer_*-model_states.pt")):
            idx = int(path.name.split("-")[0].removeprefix("layer_"))
            r = int(path.name.split("-model_")[1][:2]) if "-model_" in path.name else 0
            for name, value in safe_load.safe_torch_load(path, map_location="cpu").items():
                full_name = pipe_to_gpt_name(f"{idx}.{name}", config)
                if full_name.startswith("lm_head.") and config.tie_embeddings:
                    full_name = f"embedding.{name}"  # the tied copy on the last stage
                per_rank[r].setdefault(full_name, value)
    missing = sorted(set(specs) - set(per_rank[0]))
    if missing:
        raise CheckpointError(f"checkpoint {tag_dir} lacks weights for {', '.join(missing[:5])}")
    full = {}
    for name, spec in specs.items():
        shards = [per_rank[r][name] for r in range(tp)]
        full[name] = spec.gather(shards) if spec is not None else shards[0]
    return config, own_storage(full), tokenizer_dir


def _expert_weights(tag_dir: Path, tp_rank: int) -> dict:
    """The MoE experts of a TP rank: DeepSpeed-MoE saves each in a file of its own
    (``layer_<MoE layer>_expert_<global id>_mp_rank_<TP rank>_model_states.pt``), named by its global expert
    index whatever the expert-parallel size, and leaves them out of the model-states file."""
    out = {}
    for path in sorted(tag_dir.glob(f"layer_*_expert_*_mp_rank_{tp_rank:02d}_model_states.pt")):
        out.update(safe_load.safe_torch_load(path, map_location="cpu"))
    return out


def _universal_weights(zero: Path, specs: dict) -> dict:
    """The full fp32 weights of a universal checkpoint (one ``<name>/fp32.pt`` per parameter, TP=1 shapes),
    loaded weights-only; a vocabulary padded for the old TP size is cut back to the model's."""
    full = {}
    for name, spec in specs.items():
        path = zero / name / "fp32.pt"
        if not path.is_file():
            raise CheckpointError(f"universal checkpoint {zero.parent} lacks {name}/fp32.pt")
        tensor = safe_load.safe_torch_load(path, map_location="cpu")["param"]
        if spec is not None and spec.pad_multiple and tensor.shape[spec.dim] > sum(spec.parts):
            tensor = tensor.narrow(spec.dim, 0, sum(spec.parts))  # a padded vocabulary
        full[name] = tensor.contiguous()
    return full


def own_storage(state_dict) -> dict:
    """Each tensor in a storage of its own. DeepSpeed saves some weights as views into its flat buffers
    (fp32 ZeRO-1/2: a 16 KiB embedding at an offset of a 496 KiB storage); safetensors, and any writer
    that drops shared storage, refuse or bloat such views."""
    def alone(t: torch.Tensor) -> bool:
        return (t.storage_offset() == 0 and t.is_contiguous()
                and t.untyped_storage().nbytes() == t.numel() * t.element_size())
    return {k: v if alone(v) else v.clone(memory_format=torch.contiguous_format) for k, v in state_dict.items()}


def _zero3_weights(load_dir: Path, tag: str, tp: int) -> list[dict]:
    """Each TP rank's weights of a ZeRO-3 checkpoint, by DeepSpeed's zero_to_fp32 (weights-only loads).

    zero_to_fp32 merges every ``*_optim_states.pt`` of a tag as one data-parallel group; at TP > 1 each
    TP rank's files are therefore shown to it alone, in a directory of links."""

    if tp == 1:
        with safe_load.weights_only_loads():
            return [dict(get_fp32_state_dict_from_zero_checkpoint(str(load_dir), tag=tag))]
    per_rank = []
    for r in range(tp):
        with tempfile.TemporaryDirectory(prefix="zero3-tp-rank") as view:
            (Path(view) / tag).mkdir()
            for path in (load_dir / tag).glob(f"*mp_rank_{r:02d}_*_states.pt"):
                (Path(view) / tag / path.name).symlink_to(path.resolve())
            with safe_load.weights_only_loads():
                per_rank.append(dict(get_fp32_state_dict_from_zero_checkpoint(view, tag=tag)))
    return per_rank


def same_layout(saved: dict, current: dict) -> bool:
    keys = ("tensor_parallel", "pipeline_parallel", "data_parallel", "precision")
    # another expert-parallel size puts other experts on each rank (recorded since EP; 1 before)
    same_ep = saved.get("expert_parallel", 1) == current.get("expert_parallel", 1)
    # checkpoints from before the ZeRO stage was recorded resume as they always did
    same_stage = "zero_stage" not in saved or saved["zero_stage"] == current.get("zero_stage")
    # ZeRO partitions over data x context: a run saved at another context-parallel size (recorded since CP; 1
    # before) resumes through the universal path, as at another data-parallel size
    same_cp = saved.get("context_parallel", 1) == current.get("context_parallel", 1)
    return same_stage and same_cp and same_ep and all(saved.get(k) == current.get(k) for k in keys)


def layout_text(layout: dict) -> str:
    """A saved layout as the arguments that run at it: ``TP 2, PP 1, DP 2, EP 2, ZeRO 1``."""
    keys = {"TP": "tensor_parallel", "PP": "pipeline_parallel", "DP": "data_parallel", "EP": "expert_parallel"}
    return ", ".join([*(f"{k} {layout.get(v, 1)}" for k, v in keys.items()), f"ZeRO {layout.get('zero_stage', 1)}"])


def restore_after_reshard(engine, load_dir, tag: str) -> tuple[int, dict | None]:
    """After a load at a new layout (``universal.load``, or ``read_full_model_state`` weights where DeepSpeed
    has no universal path): the step, the learning-rate schedule and the (global, layout-free) data
    position. RNG streams start afresh (they belong to the ranks of the old layout); without a universal
    load, so do the Adam moments and the loss scale."""
    layout = saved_layout(load_dir, tag)
    if engine.lr_scheduler is not None and layout.get("scheduler") is not None:
        engine.lr_scheduler.load_state_dict(layout["scheduler"])
    state = safe_load.safe_torch_load(Path(load_dir) / tag / "rank0_state.pt")
    data = state["data"]
    if data is not None and data.get("kind") != "map":
        data = None  # a streamed corpus's position belongs to its DP rank: it restarts
    return int(layout["step"]), data


def is_deepspeed_run_dir(path) -> bool:
    path = Path(path)
    return (path / "latest").is_file() or any(path.glob("global_step*"))


def read_full_checkpoint(path, tag: str | None = None, *, lazy: bool = False):
    """(model config, full TP=1 state dict, tokenizer dir) of any model directory the project writes:
    a pretraining run directory (DeepSpeed checkpoints at any layout; ``tag`` or its latest), one of
    its ``global_step<N>`` directories, or a ``config.json`` + ``model.safetensors`` directory
    (what ``pipeline.import_hf`` writes; ``pipeline.checkpoints.model_dir``; ``lazy``: its tensors are read when asked
    for)."""
    path = Path(path)
    if path.name.startswith("global_step") and (path.parent / "config.json").is_file():
        return read_full_model_state(path.parent, path.name)
    if is_deepspeed_run_dir(path):
        return read_full_model_state(path, tag)
    refuse_other_model_kinds(path)
    return read_model_dir(path, lazy=lazy)


# directories the project writes that hold no language model of its own format: (marker file, what, what to do)
OTHER_KINDS = (
    ("ensemble.json", "an ensemble of finetuned classifiers", "its predictions come from python -m finetune.predict "
                                                             "--model {path}; it has no single model to read"),
    ("classifier.json", "a finetuned classifier", "its predictions come from python -m finetune.predict --model "
                                                  "{path}; python -m finetune.export_hf exports it"),
    ("tfidf.json", "a TF-IDF classifier", "its predictions come from python -m finetune.predict --model {path}"),
)


def refuse_other_model_kinds(path: Path, allow: tuple[str, ...] = ()) -> None:
    """A classifier, an ensemble or a Hugging Face model directory given where a language-model checkpoint of
    the project belongs: one line saying what it is and which command reads it (``allow``: marker files of
    kinds the caller reads itself)."""
    for marker, what, todo in OTHER_KINDS:
        if (path / marker).is_file() and marker not in allow:
            raise CheckpointError(f"{path} is {what} ({marker}), not a language-model checkpoint; "
                                  + todo.format(path=path))
    config = path / "config.json"
    with contextlib.suppress(OSError, ValueError):
        raw = json.loads(config.read_text())
        if isinstance(raw, dict) and "architectures" in raw:
            raise CheckpointError(f"{path} is a Hugging Face model directory ({config} names "
                                  f"{', '.join(map(str, raw['architectures']))}), not a checkpoint of this project; "
                                  f"read it with --hf where a command takes one, or import it with python -m "
                                  f"pipeline.import_hf --model {path} --out DIR")
