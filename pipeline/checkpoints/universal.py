"""Universal checkpoints: resume a run at another TP / PP / DP size or ZeRO stage with its optimizer state.

DeepSpeed does the work: ``deepspeed.checkpoint.ds_to_universal`` turns a ZeRO checkpoint
into one folder per parameter (fp32 weight, Adam moments, step), and an engine built
with ``"checkpoint": {"load_universal": true}`` cuts them into its own partitions.
The project supplies what DeepSpeed needs to know about each parameter, read off its
``ShardSpec``: the ``universal_checkpoint_info`` saved with every checkpoint
(``checkpoint_info``). Written here are only the pieces DeepSpeed's universal path lacks,
each beside the code it fixes:

- names: a pipeline names parameters by layer index, the full model by module path; the cache
  stores the full model's names and a pipeline engine reads them under those (``_full_model_names``), as the
  model family's ``PipelineNames`` map them; a parameter several stages hold (the tied embedding) is kept from
  the first stage (``attach_info``).
- ZeRO stage changes: the cache holds the model files and ``optimizer_state.pt`` in the forms of
  both ZeRO-1/2 and ZeRO-3 (``_model_files_for_every_stage``, ``_optimizer_state_for_every_stage``),
  a TP=1 ZeRO-3 source goes through DeepSpeed's TP-aware merge (``_zero3_merged_as_tp1``), and a
  ZeRO-3 target cuts its shards with the ShardSpec (``_zero3_hp_loader``: DeepSpeed's takes the
  stored tensor as is, which a re-padded vocabulary breaks) and keeps each parameter group's own
  hyperparameters (``_zero3_param_groups``).
- ZeRO-0 (fp32, no pipeline): DeepSpeed has no universal path without ZeRO. A ZeRO-0 checkpoint records
  which optimizer slot is which parameter (``optimizer_param_names``); ``convert_zero0`` gathers its Adam
  state over the TP ranks into the same folders ds_to_universal writes, and ``_load_zero0`` fills a
  ZeRO-0 engine's torch optimizer from them.
- MoE layers (fp32 ZeRO-1/2, no pipeline): ds_to_universal misreads DeepSpeed-MoE's expert groups (DeepSpeed
  issue #5716). ``convert_moe`` joins each parameter from its own group's partitions (an expert group's are cut
  over the expert-data ranks) and writes each expert under its global index; DeepSpeed's loader fills each
  rank's experts from those folders once given their global names (``_global_expert_names``).
- the MoE gates' balancing biases (auxiliary-loss-free balancing): parameters without gradient, in no optimizer
  state, which DeepSpeed's universal loader leaves as the new engine built them. ``convert_moe`` writes each into
  a folder of its own (``<name>/fp32.pt``, from the source's model file) and ``load`` copies it into the engine
  (``_restore_balance_biases``).

Layout of the cache, beside the tags it converts::

    <run>/universal/<tag>/           what ds_to_universal writes (zero/<param>/..., mp_rank_* files)
    <run>/universal/<tag>/UNIVERSAL.json   written last: source tag and every file with its size and sha256

It is built under a temporary name and renamed into place, so it is complete or absent;
one whose manifest is missing or does not match its files (size or sha256) is removed and rebuilt.
No file is unpickled unsafely on the way (``pipeline.checkpoints.safe_load``): every file of the source tag is
scanned before ds_to_universal reads it, every file of a cache before DeepSpeed loads it (a file that
pickles anything but tensors and DeepSpeed's own types is refused, naming it), and the process loads
torch files weights-only throughout (DeepSpeed's own ``weights_only=False`` calls included).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import re
from pathlib import Path

import torch
import torch.distributed as dist
from deepspeed.checkpoint import ds_to_universal
from deepspeed.checkpoint.constants import (
    BASE_OPTIMIZER_STATE,
    CAT_DIM,
    DS_VERSION,
    OPTIMIZER_STATE_DICT,
    ORIGINAL_VOCAB_SIZE,
    PARAM,
    PARAM_GROUPS,
    PARAMETER_WITH_ROW_PARALLELISM_PATTERNS,
    PARAM_SLICE_MAPPINGS,
    PARAMETER_WITH_SUB_PARAMS,
    PARTITION_COUNT,
    PIPELINE_REPLICATED_PARAMETER_PATTERNS,
    SINGLE_PARTITION_OF_FP32_GROUPS,
    SUB_PARAM_SHAPE,
    SUB_PARAM_SHARD_WIDTHS,
    TP_REPLICATED_PARAMETER_PATTERNS,
    UNIVERSAL_CHECKPOINT_VERSION_KEY,
    VOCAB_TENSOR,
    VOCABULARY_PARAMETER_PATTERNS,
)
from deepspeed.checkpoint.universal_checkpoint import SubparamShape
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

from models.moe import EXPERT_INDEX, expert_slice, is_balance_bias
from models.parallel import Layout, get_shard_spec, tp_rank, tp_world_size
from pipeline.checkpoints import safe_load
from pipeline.job.errors import UserError, is_rank0
from pipeline.job.families import config_from_dict, family_of, family_of_dict
from pipeline.job.files import DiskFullError, atomic_dir
from pipeline.job.layout import experts_cannot_move

MANIFEST = "UNIVERSAL.json"
CACHE_DIR = "universal"
OPTIMIZER_PARAM_NAMES = "optimizer_param_names"  # in a ZeRO-0 checkpoint's client state and layout.json


class UniversalError(UserError):
    """A checkpoint that cannot move to another layout with its optimizer state; the message says why."""


# -- metadata: ShardSpec -> DeepSpeed's universal_checkpoint_info ------------------------------------------------

def checkpoint_info(named_params, vocab_size: int | None, tp: int) -> dict:
    """DeepSpeed's ``universal_checkpoint_info`` for ``(name, parameter)`` pairs saved at TP size ``tp``.

    Every name becomes an exact pattern of the category its ShardSpec describes: no spec
    (replicated on every TP rank), a split along dim 1 (row parallel), fused parts (QKV,
    gate/up: DeepSpeed's ``SubparamShape``, with each part's width per rank), a padded
    vocabulary. A plain split along dim 0 is DeepSpeed's default.
    """

    replicated, row, vocab, sub_params, widths = [], [], [], [], {}
    for name, param in named_params:
        spec, pattern = get_shard_spec(param), f"^{re.escape(name)}$"
        if spec is None:
            replicated.append(pattern)
        elif spec.pad_multiple:
            if spec.dim != 0 or len(spec.parts) != 1:
                raise UniversalError(f"{name}: a padded parameter must be one part split along dim 0 (a vocabulary)")
            vocab.append(pattern)
        elif len(spec.parts) > 1:
            sub_params.append(_subparam_shape(pattern, param.ndim, spec))
            widths[pattern] = [[p // tp] * tp for p in spec.parts]
        elif spec.dim == 1:
            row.append(pattern)
    info = {UNIVERSAL_CHECKPOINT_VERSION_KEY: 0.4, TP_REPLICATED_PARAMETER_PATTERNS: replicated,
            PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: row, VOCABULARY_PARAMETER_PATTERNS: vocab,
            PARAMETER_WITH_SUB_PARAMS: sub_params, SUB_PARAM_SHARD_WIDTHS: widths}
    if vocab:
        info[ORIGINAL_VOCAB_SIZE] = int(vocab_size)
    return info


def _subparam_shape(pattern: str, ndim: int, spec) -> dict:
    """DeepSpeed's SubparamShape of a fused parameter (QKV, gate-up): each part's full size along the split dim."""
    shape = [-1] * ndim
    shape[spec.dim] = tuple(spec.parts)
    return {"patterns": [pattern], "shape": tuple(shape), "partition_dim": spec.dim}


def optimizer_param_names(engine) -> list[list[str]] | None:
    """The names of each optimizer group's parameters, in the order ZeRO-0's optimizer state_dict numbers
    them; saved with every ZeRO-0 checkpoint (None at ZeRO 1-3, whose files name their parameters), so that
    its Adam moments can be matched to parameters without rebuilding the groups."""
    if engine.zero_optimization_stage() != 0 or not isinstance(engine.optimizer, torch.optim.Optimizer):
        return None  # (bf16 ZeRO-0: DeepSpeed's FP16_Optimizer, whose groups hold fp32 copies, is not converted)
    names = {id(p): n for n, p in engine.module.named_parameters()}
    groups = [group["params"] for group in engine.optimizer.param_groups]
    if any(id(p) not in names for group in groups for p in group):
        return None
    return [[names[id(p)] for p in group] for group in groups]


def attach_info(model: torch.nn.Module, model_config, pipeline: bool, adapt=None) -> None:
    """Give ``model`` (what DeepSpeed's engine wraps) the metadata its checkpoints are saved with. ``adapt``: what
    was done to the model once built (LoRA's adapters, ``build_engine``'s ``adapt``): the record then holds the
    parameters that train only, what the optimizer holds (the frozen base is read from its source again)."""
    if pipeline:  # a stage holds only its layers: describe the whole model, under the pipeline's names
        family = family_of(model_config)
        names = family.pipeline_names
        whole = family.meta_model(model_config)
        if adapt is not None:
            adapt(whole)
        named = [(names.to_pipeline(n, model_config), p) for n, p in whole.named_parameters()]
    else:
        named = list(model.named_parameters())
    if adapt is not None:
        named = [(n, p) for n, p in named if p.requires_grad]
    info = checkpoint_info(named, getattr(model_config, "vocab_size", None), tp_world_size())
    if pipeline:
        # A tied embedding lives on the first and the last stage; the last stage's copy of its position
        # embedding receives no gradient. The first stage's copy is the one to keep.
        info[PIPELINE_REPLICATED_PARAMETER_PATTERNS] = list(names.first_stage_copies)
    model.universal_checkpoint_info = info


# -- the decision on --load -----------------------------------------------------------------------------------------

def unsupported_reason(saved: dict, current: dict) -> str | None:
    """Why the optimizer state of a checkpoint saved at layout ``saved`` cannot move to ``current``."""
    if not saved.get("universal_info"):
        return "the checkpoint was saved without universal-checkpoint metadata (before this version)"
    if current.get("zero_stage", 0) < 1 and (current.get("precision", "fp32") != "fp32"
                                             or current.get("pipeline_parallel", 1) > 1):
        # load_universal writes into ZeRO's partitions only; torch's own optimizer is filled here (``_load_zero0``),
        # DeepSpeed's FP16_Optimizer and a pipeline's stages are not
        return "a universal checkpoint loads into ZeRO-0 in fp32 without pipeline parallelism only"
    if saved.get("zero_stage", 0) < 1:
        if not saved.get(OPTIMIZER_PARAM_NAMES):
            return "the ZeRO-0 checkpoint was saved without its optimizer's parameter names (before this version)"
        if saved.get("precision", "fp32") != "fp32" or saved.get("pipeline_parallel", 1) > 1:
            # DeepSpeed's FP16_Optimizer (fp16/bf16) and the pipeline's files keep the state in other forms
            return "a ZeRO-0 checkpoint converts in fp32 without pipeline parallelism only"
    return None


def has_experts(run_dir) -> bool:
    """Whether the run's model has MoE layers (DeepSpeed-MoE experts)."""
    return json.loads((Path(run_dir) / "config.json").read_text()).get("num_experts", 0) > 0


def saved_layout_of(record: dict) -> Layout:
    """The ``Layout`` a ``layout.json`` records (a record from before the ZeRO stage was recorded: ZeRO-1)."""
    return Layout.from_record({"zero_stage": 1, **record})


def enable(ds_config: dict) -> dict:
    return {**ds_config, "checkpoint": {**ds_config.get("checkpoint", {}), "load_universal": True}}


def prepare(load_dir, tag: str, saved: dict, current: dict, *, log=print, cache_root=None) -> Path | None:
    """Collective. The universal cache of ``load_dir/tag`` (converted on rank 0 if needed, into ``cache_root``,
    default ``load_dir``), or None (with the reason logged) where the optimizer state cannot move to this layout."""
    reason = unsupported_reason(saved, current)
    rank0 = is_rank0()
    if reason is not None:
        if saved.get("universal_only"):
            raise UniversalError(f"{Path(load_dir) / tag} holds a universal checkpoint only, and {reason}")
        if rank0:
            log(f"warning: resuming {Path(load_dir) / tag} at another layout with its weights only: the optimizer "
                f"state restarts, because {reason}")
        return None
    result = [None, None, False]  # the cache, or why not (and whether the disk was full: exit code 1, not 2)
    if rank0:
        try:
            result = [str(ensure_cache(load_dir, tag, log=log, cache_root=cache_root)), None, False]
        except UserError as e:  # its message names the file already; every rank must learn of it
            result = [None, str(e), isinstance(e, DiskFullError)]
        except Exception as e:  # or the others wait forever
            result = [None, f"converting {Path(load_dir) / tag} to a universal checkpoint failed: "
                            f"{type(e).__name__}: {e}", False]
    if dist.is_initialized():
        dist.broadcast_object_list(result, src=0)
    if result[1] is not None:
        raise (DiskFullError if result[2] else UniversalError)(result[1])
    return Path(result[0])


# -- conversion: a saved tag -> its universal cache ------------------------------------------------------------

def cache_path(run_dir, tag: str) -> Path:
    return Path(run_dir) / CACHE_DIR / tag


def _manifest_problem(cache: Path) -> str | None:
    """Why ``cache`` cannot be used (None: complete, every file as the manifest lists it)."""
    marker = cache / MANIFEST
    if not marker.is_file():
        return f"no {MANIFEST}"
    try:
        files = json.loads(marker.read_text())["files"]
    except (ValueError, KeyError, TypeError):
        return f"{MANIFEST} is unreadable"
    for name, entry in files.items():
        entry = entry if isinstance(entry, dict) else {"size": entry}  # size-only: written before sha256
        path = cache / name
        if Path(name).is_absolute() or ".." in Path(name).parts:
            return f"{MANIFEST} lists {name!r}, a path outside the cache"
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != entry.get("size"):
            return f"{name} has {path.stat().st_size} bytes, expected {entry.get('size')}"
        if "sha256" in entry and safe_load.sha256_file(path) != entry["sha256"]:
            return f"{name} does not match its sha256 (its bytes changed)"
    return None


def _scan_all(folder: Path) -> None:
    """Refuse (naming it) any torch file under ``folder`` that pickles more than tensors and DeepSpeed's types."""
    for path in sorted(folder.rglob("*.pt")):
        safe_load.scan(path)


def ensure_cache(run_dir, tag: str, *, log=print, cache_root=None) -> Path:
    """The universal checkpoint of ``run_dir/tag``: the cache (in ``cache_root``, default ``run_dir``) if it
    is complete, else converted now.

    Not collective: the caller runs it on one rank and waits for it on the others.
    """
    cache = cache_path(cache_root or run_dir, tag)
    if cache.exists():
        problem = _manifest_problem(cache)
        if problem is None:
            _scan_all(cache)  # the manifest matches: a doctored file came with a doctored manifest
            return cache
        log(f"universal checkpoint cache {cache} is damaged ({problem}): rebuilding it")
    tag_dir = Path(run_dir) / tag
    layout = json.loads((tag_dir / "layout.json").read_text())
    zero0 = layout.get("zero_stage", 1) == 0
    if not any(tag_dir.glob("mp_rank_*_model_states.pt" if zero0 else "*optim_states.pt")):
        raise UniversalError(f"{Path(run_dir) / tag} has no DeepSpeed optimizer files to convert (a run written by "
                             f"pipeline.reshard whose universal cache {cache} is gone); reshard the original run again")
    experts = has_experts(run_dir)
    if experts and (reason := experts_cannot_move(saved_layout_of(layout))):
        raise UniversalError(f"{tag_dir}: {reason}; resume it at the layout it was saved at")
    # built under a temporary name and swapped in by one rename (a damaged cache is replaced the same way)
    with atomic_dir(cache, force=True) as out, _torch_save_through_python_files():
        (convert_moe if experts else convert_zero0 if zero0 else convert)(tag_dir, out)
        manifest = {"source": tag, "files": safe_load.file_manifest(out)}
        (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return cache


@contextlib.contextmanager
def _torch_save_through_python_files():
    """torch.save to a path writes through C++, and a write that does not fit (a full disk, a quota, the file-size
    limit) comes back as a RuntimeError without the OS's error ("unexpected pos"); written to a Python file,
    that OSError is the RuntimeError's context, so the conversion's failure can say the disk is full."""
    save = torch.save

    def through_file(obj, f, *args, **kwargs):
        if not isinstance(f, (str, os.PathLike)):
            return save(obj, f, *args, **kwargs)
        with open(f, "wb") as file:
            return save(obj, file, *args, **kwargs)

    torch.save = through_file
    try:
        yield
    finally:
        torch.save = save


def convert(tag_dir: Path, out: Path) -> None:
    """DeepSpeed's ds_to_universal of one tag directory into ``out``, parameters under the full model's names."""
    _scan_all(tag_dir)  # ds_to_universal unpickles every file with weights_only=False (forced weights-only here)
    args = argparse.Namespace(input_folder=str(tag_dir), output_folder=str(out), num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=False)
    with (contextlib.redirect_stdout(io.StringIO()), _zero3_merged_as_tp1(ds_to_universal, tag_dir),
          safe_load.weights_only_loads()):
        ds_to_universal.main(args)  # (its progress report is for a terminal)
    (out.parent / "latest_universal").unlink(missing_ok=True)  # ds_to_universal writes it beside ``out``;
    # the tags are passed explicitly
    _rename_pipeline_params(tag_dir, out / "zero")
    _model_files_for_every_stage(out)
    _optimizer_state_for_every_stage(out / "zero")


def convert_zero0(tag_dir: Path, out: Path) -> None:
    """A ZeRO-0 tag into the universal form ``convert`` writes. ZeRO-0 keeps torch's Adam state_dict of each
    TP rank's shards in that rank's model file, a form ds_to_universal does not read: here each parameter's
    fp32 weight and moments are gathered over the TP ranks with its ShardSpec and written as ds_to_universal
    writes them (the full unpadded tensor, with how DeepSpeed's loader splits it)."""
    files = sorted(tag_dir.glob("mp_rank_*_model_states.pt"))  # one per TP rank, in rank order
    ranks = [safe_load.safe_torch_load(f, map_location="cpu") for f in files]
    raw = json.loads((tag_dir.parent / "config.json").read_text())
    family = family_of_dict(raw, str(tag_dir.parent / "config.json"))
    specs = family.shard_specs(family.config_class.from_dict(raw))
    per_rank = [_zero0_states(state) for state in ranks]
    zero = out / "zero"
    for name in per_rank[0]:  # the optimizer's parameters (a tied weight once), as ds_to_universal names them
        _write_param(zero / name, name, specs[name], [states[name] for states in per_rank])
    groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": [i]}
              for i, group in enumerate(ranks[0]["optimizer"]["param_groups"])]
    torch.save({PARAM_GROUPS: groups, DS_VERSION: ranks[0][DS_VERSION]}, zero / "optimizer_state.pt")
    for path, state in zip(files, ranks):
        # what the loading engine reads from the model files (step, LR schedule, client state), without
        # the optimizer, which now lives in zero/
        torch.save({**state, "optimizer": None}, out / path.name)
    _model_files_for_every_stage(out)
    _optimizer_state_for_every_stage(zero)


def _write_param(folder: Path, name: str, spec, per_tp_rank: list[dict]) -> None:
    """One parameter's universal folder, as ds_to_universal writes it: its fp32 weight and Adam moments joined
    over the TP ranks by its ShardSpec (``per_tp_rank``: each rank's shard of each), with how DeepSpeed's
    loader cuts them again, and its step."""
    folder.mkdir(parents=True)
    for key in ("fp32", "exp_avg", "exp_avg_sq"):
        shards = [states[key] for states in per_tp_rank]
        full = spec.gather(shards) if spec is not None else shards[0]
        torch.save({**_split_metadata(name, full.ndim, spec), PARAM: full.contiguous()}, folder / f"{key}.pt")
    torch.save(per_tp_rank[0]["step"], folder / "step.pt")


def _zero0_states(state: dict) -> dict:
    """{parameter: {fp32, exp_avg, exp_avg_sq, step}} of one TP rank's ZeRO-0 model file (fp32: the weights
    are the master weights); a parameter that never had a gradient has zero moments, as under ZeRO."""
    optimizer, weights = state["optimizer"], state["module"]
    steps = [s["step"] for s in optimizer["state"].values() if "step" in s]
    out = {}
    for group, names in zip(optimizer["param_groups"], state[OPTIMIZER_PARAM_NAMES]):
        for index, name in zip(group["params"], names):
            adam = optimizer["state"].get(index, {})
            weight = weights[name].detach().float()
            # torch's Adam counts steps per parameter, DeepSpeed's FusedAdam per group
            step = adam.get("step", group.get("step", steps[0] if steps else 0))
            out[name] = {"fp32": weight, "exp_avg": adam.get("exp_avg", torch.zeros_like(weight)),
                         "exp_avg_sq": adam.get("exp_avg_sq", torch.zeros_like(weight)),
                         "step": torch.as_tensor(step, dtype=torch.float32)}
    return out


def convert_moe(tag_dir: Path, out: Path) -> None:
    """A ZeRO-1/2 tag of a run with MoE layers into the universal form ``convert`` writes, each expert under
    its global index. ds_to_universal cannot (DeepSpeed issue #5716): it takes every optimizer group as cut over
    the whole data-parallel group and names an expert by its index on its rank, so it would join the experts of
    different expert-parallel ranks. Here each parameter's fragments are joined from its own group's flat
    partitions (``_moe_fragments``), then over the TP ranks by its ShardSpec."""
    layout = json.loads((tag_dir / "layout.json").read_text())
    tp = layout.get("tensor_parallel", 1)
    raw = json.loads((tag_dir.parent / "config.json").read_text())
    family = family_of_dict(raw, str(tag_dir.parent / "config.json"))
    config = family.config_class.from_dict(raw)
    specs = family.shard_specs(config)
    local = config.num_experts // layout.get("expert_parallel", 1)
    models = [safe_load.safe_torch_load(tag_dir / f"mp_rank_{r:02d}_model_states.pt", map_location="cpu")
              for r in range(tp)]
    per_rank, optimizer = zip(*(_moe_fragments(tag_dir, r, layout, local, models[r]) for r in range(tp)))
    biases = {name for name in specs if is_balance_bias(name)}
    if any(set(states) != set(specs) - biases for states in per_rank):
        missing = sorted((set(specs) - biases).symmetric_difference(per_rank[0]))[:3]
        raise UniversalError(f"{tag_dir}: its optimizer files do not hold the model's parameters "
                             f"({', '.join(missing)} differ)")
    for name, spec in specs.items():
        if name in biases:  # replicated; the same on every rank (update_expert_biases)
            (out / "zero" / name).mkdir(parents=True)
            torch.save({PARAM: models[0]["module"][name].float().clone()}, out / "zero" / name / "fp32.pt")
        else:
            _write_param(out / "zero" / name, name, spec, [states[name] for states in per_rank])
    # the groups' hyperparameters; their names and MoE flags (``ep_size_2``) belong to the loading layout's groups
    groups = [{k: v for k, v in group.items() if k not in ("name", "moe")}
              for group in optimizer[0][BASE_OPTIMIZER_STATE][PARAM_GROUPS]]
    sharded = (BASE_OPTIMIZER_STATE, PARAM_SLICE_MAPPINGS, SINGLE_PARTITION_OF_FP32_GROUPS)
    torch.save({**{k: v for k, v in optimizer[0].items() if k not in sharded}, PARAM_GROUPS: groups},
               out / "zero" / "optimizer_state.pt")
    for r, state in enumerate(models):
        torch.save(state, out / f"mp_rank_{r:02d}_model_states.pt")  # step, LR schedule, client state
    _model_files_for_every_stage(out)
    _optimizer_state_for_every_stage(out / "zero")


def _moe_fragments(tag_dir: Path, tp: int, layout: dict, local: int, model: dict) -> tuple[dict, dict]:
    """({global name: {fp32, exp_avg, exp_avg_sq: TP rank ``tp``'s shard, step}}, the optimizer state of data-
    parallel rank 0) from every data-parallel rank's ZeRO-1/2 file. A dense group is cut over the data-parallel
    ranks (rank d holds part d); an expert group over the expert-data group: DeepSpeed's expert groups are
    consecutive data-parallel ranks, so rank d holds experts ``d % EP x local ...`` and part ``d // EP``."""
    dp, ep = layout.get("data_parallel", 1), layout.get("expert_parallel", 1)
    shapes = {n: s for group in model["param_shapes"] for n, s in group.items()}  # experts of rank 0: 0 ... local-1
    parts, steps, first = {}, {}, None
    for d in range(dp):
        path = tag_dir / f"zero_pp_rank_{d}_mp_rank_{tp:02d}_optim_states.pt"
        if not path.is_file():  # a bf16 run's files carry DeepSpeed's "bf16_" prefix
            path = path.with_name(f"bf16_{path.name}")
        state = safe_load.safe_torch_load(path, map_location="cpu")[OPTIMIZER_STATE_DICT]
        first = state if d == 0 else first
        base = state[BASE_OPTIMIZER_STATE]
        for g, (group, mapping) in enumerate(zip(base[PARAM_GROUPS], state[PARAM_SLICE_MAPPINGS])):
            expert = bool(group.get("moe"))
            if state[PARTITION_COUNT][g] != (dp // ep if expert else dp):
                raise UniversalError(f"{path}: optimizer group {g} is cut in {state[PARTITION_COUNT][g]} parts, "
                                     f"not as DeepSpeed-MoE cuts it at DP {dp}, EP {ep}")
            flats = {"fp32": state[SINGLE_PARTITION_OF_FP32_GROUPS][g], "exp_avg": base["state"][g]["exp_avg"],
                     "exp_avg_sq": base["state"][g]["exp_avg_sq"]}
            for name, address in mapping.items():
                if expert:  # the rank's local expert i is global expert d % EP x local + i
                    name = EXPERT_INDEX.sub(lambda m, d=d: str(d % ep * local + int(m.group(1))), name)
                steps[name] = base["state"][g]["step"]
                for key, flat in flats.items():
                    parts.setdefault(name, {}).setdefault(key, []).append(
                        (d // ep if expert else d, flat.narrow(0, address.start, address.numel)))
    out = {}
    for name, keys in parts.items():
        shape = shapes[EXPERT_INDEX.sub(lambda m: str(int(m.group(1)) % local), name)]
        out[name] = {key: torch.cat([t for _, t in sorted(pieces, key=lambda p: p[0])]).view(shape)
                     for key, pieces in keys.items()}
        out[name]["step"] = torch.as_tensor(steps[name], dtype=torch.float32)
    return out, first


def _split_metadata(name: str, ndim: int, spec) -> dict:
    """How DeepSpeed's universal loader cuts a full tensor for a TP rank, from the parameter's ShardSpec."""
    if spec is None:
        return {}  # replicated: the loader takes it whole
    if spec.pad_multiple:
        return {CAT_DIM: 0, VOCAB_TENSOR: True}
    if len(spec.parts) > 1:
        return {SUB_PARAM_SHAPE: SubparamShape(**_subparam_shape(f"^{re.escape(name)}$", ndim, spec))}
    return {CAT_DIM: spec.dim}


def _model_files_for_every_stage(out: Path) -> None:
    """An engine loading a universal checkpoint reads its step, LR schedule and client state from the model
    files of the source, under the name its own ZeRO stage saves them: ``mp_rank_XX_model_states.pt`` below
    ZeRO-3, ``zero_pp_rank_0_mp_rank_XX_model_states.pt`` at ZeRO-3. Link each to the other name, so that
    the cache loads at any stage."""
    for path in sorted(out.glob("*model_states.pt")):
        match = re.fullmatch(r"(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt", path.name)
        if match is None or match.group(1) not in (None, "0"):
            continue
        other = out / (f"mp_rank_{match.group(2)}_model_states.pt" if match.group(1) else
                       f"zero_pp_rank_0_mp_rank_{match.group(2)}_model_states.pt")
        if not other.exists():
            os.link(path, other)


def _optimizer_state_for_every_stage(zero: Path) -> None:
    """ds_to_universal writes ``zero/optimizer_state.pt`` as the source's ZeRO stage has it, and each loader
    reads only its own form: ZeRO-3 the Adam step and parameter groups under ``optimizer_state_dict``,
    ZeRO-1/2 the groups at the top and the step beside every parameter (``step.pt``). Write both."""
    path = zero / "optimizer_state.pt"
    state = torch.load(path, map_location="cpu", weights_only=True)
    params = sorted(p for p in zero.iterdir() if p.is_dir())
    if OPTIMIZER_STATE_DICT not in state:  # from ZeRO-1/2
        # (a frozen parameter's folder, e.g. a LoRA run's base, has its weight only)
        step = torch.load(next(p for p in params if (p / "step.pt").exists()) / "step.pt", weights_only=True)
        state[OPTIMIZER_STATE_DICT] = {"state": {0: {"step": step}}, "param_groups": state[PARAM_GROUPS]}
        torch.save(state, path)
        return
    step = state[OPTIMIZER_STATE_DICT]["state"][0]["step"]  # from ZeRO-3
    for folder in params:
        if not (folder / "step.pt").exists():
            torch.save(step, folder / "step.pt")


def _rename_pipeline_params(tag_dir: Path, zero: Path) -> None:
    """A pipeline's parameter folders ("3.attention.qkv.weight") under the full model's names ("layers.2....")."""
    config_file = tag_dir.parent / "config.json"
    layout_file = tag_dir / "layout.json"
    if not layout_file.is_file() or json.loads(layout_file.read_text()).get("pipeline_parallel", 1) == 1:
        return

    config = config_from_dict(json.loads(config_file.read_text()), str(config_file))
    from_pipeline = family_of(config).pipeline_names.from_pipeline
    for folder in sorted(p for p in zero.iterdir() if p.is_dir()):
        folder.rename(zero / from_pipeline(folder.name, config))


@contextlib.contextmanager
def _zero3_merged_as_tp1(ds_to_universal, tag_dir: Path):
    """ds_to_universal merges a TP=1 ZeRO-3 checkpoint into flat tensors, vocabulary padding kept and without
    the checkpoint's universal_checkpoint_info, which no layout but the same ZeRO-3 one can load. Route it
    through the TP-aware merge DeepSpeed uses for ZeRO-3 at TP>1 (at TP=1), so that every cache holds the same
    thing: full unpadded tensors that say how they split."""
    original = ds_to_universal._merge_zero3_slice_files

    def merge(args, param_keys, dp_degree, temp_dir):
        model_files = ds_to_universal._get_zero3_model_state_files(str(tag_dir))
        info = ds_to_universal._load_universal_checkpoint_info_stage3(model_files)
        shapes = {k: v for group in ds_to_universal._parse_model_states_stage3(model_files) for k, v in group.items()}
        ds_to_universal._merge_tp_slice_files(args, info, 1, {k: [shapes[k]] for k in param_keys}, temp_dir)

    ds_to_universal._merge_zero3_slice_files = merge
    try:
        yield
    finally:
        ds_to_universal._merge_zero3_slice_files = original


# -- loading into an engine at any layout --------------------------------------------------------------------------

def load(engine, cache: Path, model_config) -> None:
    """Restore weights, Adam moments and step, loss scale and LR schedule of a universal checkpoint into
    ``engine`` (built with ``"checkpoint": {"load_universal": true}``). Collective."""
    _restore_balance_biases(engine, cache)
    if engine.zero_optimization_stage() == 0:
        _load_zero0(engine, cache)
        return
    with (_full_model_names(engine, model_config), _global_expert_names(engine, cache), _zero3_hp_loader(engine),
          safe_load.weights_only_loads()):  # (DeepSpeed reads each parameter's folder with plain torch.load)
        path, _ = engine.load_checkpoint(str(cache.parent), tag=cache.name, load_optimizer_states=True,
                                         load_lr_scheduler_states=True)
    if path is None:
        raise UniversalError(f"DeepSpeed could not load the universal checkpoint {cache}")
    _zero3_after_load(engine, cache)


@torch.no_grad()
def _restore_balance_biases(engine, cache: Path) -> None:
    """The gates' balancing biases from their folders (``convert_moe``): DeepSpeed's loader fills the optimizer's
    parameters only. (MoE layers resume through this path without pipeline stages: the full model's names.)"""
    for name, param in engine.module.named_parameters():
        if not is_balance_bias(name):
            continue
        path = cache / "zero" / name / "fp32.pt"
        if not path.is_file():
            raise UniversalError(f"universal checkpoint {cache} lacks {name}/fp32.pt, the balancing bias (a cache "
                                 f"written before biases were carried); delete {cache} to convert the tag again")
        param.copy_(_load_state(path)[PARAM])


def _load_zero0(engine, cache: Path) -> None:
    """Into ZeRO-0 (fp32), whose optimizer is torch's own, which DeepSpeed's universal loader does not fill:
    each parameter's TP shard of the full weight and Adam moments (cut with its ShardSpec, which pads a
    vocabulary as the model does), the Adam step, and each group's hyperparameters. The step count and LR
    schedule follow from the tag's layout (``checkpoint.restore_after_reshard``)."""
    zero, optimizer = cache / "zero", engine.optimizer
    _restore_group_hyperparameters(optimizer.param_groups, cache)
    names = {id(p): n for n, p in engine.module.named_parameters()}
    for group in optimizer.param_groups:
        for param in group["params"]:
            folder, spec = zero / names[id(param)], get_shard_spec(param)
            if not folder.is_dir():
                raise UniversalError(f"universal checkpoint {cache} has no state for {names[id(param)]}")

            def shard(key, spec=spec, folder=folder):
                full = _load_state(folder / f"{key}.pt")[PARAM]
                return (spec.shard(full, tp_rank(), tp_world_size()) if spec is not None else full).to(param)

            with torch.no_grad():
                param.copy_(shard("fp32"))
            step = torch.as_tensor(_load_state(folder / "step.pt"), dtype=torch.float32).clone()
            optimizer.state[param] = {"step": step, "exp_avg": shard("exp_avg"), "exp_avg_sq": shard("exp_avg_sq")}
        if "step" in group:  # DeepSpeed's FusedAdam counts steps per group
            group["step"] = int(step)
    engine.global_steps = int(step)


def _restore_group_hyperparameters(groups: list[dict], cache: Path) -> None:
    """Each optimizer group's saved hyperparameters (lr, weight decay, betas...), group by group."""
    saved = _load_state(cache / "zero" / "optimizer_state.pt")[PARAM_GROUPS]
    if len(saved) != len(groups):
        raise UniversalError(f"{cache}: {len(saved)} optimizer parameter groups saved, {len(groups)} in this run")
    for group, values in zip(groups, saved):
        group.update({k: v for k, v in values.items() if k != "params"})


def _zero3_after_load(engine, cache: Path) -> None:
    """ZeRO-3's universal loader gives every parameter group the hyperparameters of the first saved one (the
    project's groups differ: no weight decay on biases and norms), and all of them one shared Adam step
    tensor, which torch's Adam increments in place once per group and step. Give each group its own."""
    if not isinstance(engine.optimizer, DeepSpeedZeroOptimizer_Stage3):
        return
    _restore_group_hyperparameters(engine.optimizer.optimizer.param_groups, cache)
    for state in engine.optimizer.optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()


@contextlib.contextmanager
def _full_model_names(engine, model_config):
    """DeepSpeed finds a parameter's folder by the engine's name for it; the cache uses the full model's names."""
    names = getattr(engine.optimizer, "param_names", None)
    if not getattr(engine, "is_pipe", False) or names is None:
        yield
        return
    from_pipeline = family_of(model_config).pipeline_names.from_pipeline
    with _renamed(names, lambda n: from_pipeline(n, model_config)):
        yield


@contextlib.contextmanager
def _global_expert_names(engine, cache: Path):
    """The cache names an expert by its global index (``convert_moe``), the engine by its index on this rank:
    DeepSpeed's ZeRO-1/2 loader, which fills each group's partition (an expert group's over its expert-data
    group) from the folder of the engine's name, is given the global ones. It pairs the saved groups with the
    engine's in order, without counting them."""
    experts = expert_slice(engine.module)
    names = getattr(engine.optimizer, "param_names", None)
    if not experts.count or names is None:
        yield
        return
    saved = len(_load_state(cache / "zero" / "optimizer_state.pt")[PARAM_GROUPS])
    if saved != len(engine.optimizer.optimizer.param_groups):
        raise UniversalError(f"{cache}: {saved} optimizer parameter groups saved, "
                             f"{len(engine.optimizer.optimizer.param_groups)} in this run")
    with _renamed(names, experts.full_name):
        yield


@contextlib.contextmanager
def _renamed(names: dict, rename):
    """DeepSpeed's {parameter: name} map with every name renamed for the block, restored after it."""
    original = dict(names)
    names.update({p: rename(n) for p, n in original.items()})
    try:
        yield
    finally:
        names.clear()
        names.update(original)


@contextlib.contextmanager
def _zero3_hp_loader(engine):
    """ZeRO-3's universal loader (``DeepSpeedZeroOptimizer_Stage3.load_hp_checkpoint_state``) takes the stored
    full tensor as the parameter: right at TP=1 only when the vocabulary needs no other padding. Here each rank
    first cuts its TP shard of the full unpadded tensor with the parameter's ShardSpec (which pads it as the
    model does), then its ZeRO-3 partition exactly as DeepSpeed does."""
    optimizer = engine.optimizer
    if not isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3):
        yield
        return


    def load_hp_checkpoint_state(folder, key, param=None):
        state = _load_state(os.path.join(folder, f"{key}.pt"))
        full = state[PARAM] if isinstance(state, dict) else state
        spec = get_shard_spec(param) if param is not None else None
        shard = spec.shard(full, tp_rank(), tp_world_size()) if spec is not None else full
        flat = shard.reshape(-1)
        group = optimizer._get_param_partition_group(param) if param is not None else optimizer.dp_process_group
        rank, world = dist.get_rank(group=group), dist.get_world_size(group=group)
        per_rank = math.ceil(flat.numel() / world)
        flat = torch.cat([flat, flat.new_zeros(per_rank * world - flat.numel())])
        return flat.narrow(0, rank * per_rank, per_rank)

    optimizer.load_hp_checkpoint_state = load_hp_checkpoint_state
    try:
        yield
    finally:
        del optimizer.load_hp_checkpoint_state


def _load_state(path):
    return torch.load(path, map_location="cpu", weights_only=True)
