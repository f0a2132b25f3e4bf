"""What ``pipeline.plan`` does with its parsed arguments (the command parses them without loading torch)."""
from __future__ import annotations

from pipeline.job.files import atomic_write_json, check_output_file
from pipeline.planning.hardware import profiles
from pipeline.planning.planner import PlanError, format_plan, format_validation, make_job, rank_layouts
from pipeline.planning.validation import plot_validation, validation_rows

__all__ = ["run_plan", "pinned_fields"]


def pinned_fields(args) -> dict:
    pinned = {k: getattr(args, k) for k in ("tp", "pp", "zero", "recompute", "recompute_modules", "micro_batch")
              if getattr(args, k) is not None}
    if args.sp is not None:
        pinned["sp"] = args.sp == "on"
    return pinned


def run_plan(args) -> int:
    """The ranked layouts (or the validation table, or the hardware profiles); 1 when a validation row is off."""
    if args.list_hardware:
        for name, d in profiles().items():
            print(f"{name}: {d['description']}")
        return 0
    if args.plot and not args.validate:
        raise PlanError("--plot draws the validation; add --validate")
    if args.validate:
        if args.plot:
            check_output_file(args.plot, args.force, flag="--plot")
        rows = validation_rows()
        print(format_validation(rows))
        if args.plot:
            print(f"wrote {plot_validation(args.plot)}")
        return 0 if all(r.ok for r in rows) else 1
    if args.model_config is None or args.gpus is None:
        raise PlanError("--model-config and --gpus are required (or --validate, --list-hardware); see --help")
    if args.json:
        check_output_file(args.json, args.force, flag="--json")
    job = make_job(args.model_config, args.gpus, args.hardware, args.seq_length, args.global_batch_size,
                   args.precision, args.sustained_tflops, args.bucket)
    feasible, tried, excluded = rank_layouts(job, pinned_fields(args))
    print(format_plan(job, feasible, tried, args.top, excluded, args.model_config))
    if args.json:
        atomic_write_json(args.json, [{"layout": p.layout.__dict__, "memory_bytes": p.memory, "times_s": p.times,
                                       "step_s": p.step_s, "tokens_per_s": p.tokens_per_s, "mfu": p.mfu}
                                      for p in feasible[:args.top]], indent=1)
    return 0
