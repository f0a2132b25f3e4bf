"""Learning-rate schedules: linear warmup, then cosine or linear decay.

Linear decay to zero after warmup is the schedule with which the 40 GB
mLSTM paper converged at a 32k global batch; warmup + cosine is Megatron's.
The scheduler is handed to ``deepspeed.initialize``, which steps it only on
steps the optimizer really took (fp16 overflow steps are skipped) and saves
its state in checkpoints: the step and the schedule itself. A resumed run
continues the saved schedule (peak, warmup, decay style, floor) from the saved
step; a new --train-steps moves the end of the decay, stretching what is left
of it from the LR of the saved step, so the LR never jumps. With
--override-lr-schedule the schedule of the command's flags applies at the saved
step instead (Megatron's --override-opt_param-scheduler).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

STYLES = ("cosine", "linear", "constant")


@dataclass
class LRSchedule:
    lr: float
    warmup_steps: int
    total_steps: int
    style: str = "cosine"
    min_lr: float = 0.0
    # the decay's progress is ``anchor_progress`` at step ``anchor_step`` and 1 at ``total_steps`` (None: 0 at the
    # end of warmup); a resume with another total anchors the decay at the saved step, so the LR is continuous
    anchor_step: int | None = None
    anchor_progress: float = 0.0
    override: bool = dataclasses.field(default=False, compare=False)  # on resume: this, not the saved one

    def __post_init__(self):
        if self.style not in STYLES:
            raise ValueError(f"unknown learning-rate decay style {self.style!r}; choose one of {', '.join(STYLES)}")
        if self.warmup_steps < 0 or self.total_steps < 1:
            raise ValueError(f"need warmup_steps >= 0 and total_steps >= 1, got {self.warmup_steps}, "
                             f"{self.total_steps}")
        if not 0.0 <= self.min_lr <= self.lr:
            raise ValueError(f"min_lr {self.min_lr} must be in [0, lr={self.lr}]")

    def __call__(self, step: int) -> float:
        """Learning rate for optimizer step ``step`` (0-based)."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.style == "constant":
            return self.lr
        return self.min_lr + (self.lr - self.min_lr) * self.decay_factor(step)

    def decay_factor(self, step: int) -> float:
        """Where the LR of step ``step`` is between its minimum (0) and its peak (1); 1 during warmup."""
        if step < self.warmup_steps or self.style == "constant":
            return 1.0
        progress = self.progress(step)
        return 1.0 - progress if self.style == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))

    def progress(self, step: int) -> float:
        """How far the decay is at ``step`` (0 before and at the end of warmup, 1 at the end)."""
        if step < self.warmup_steps:
            return 0.0
        start = self.warmup_steps if self.anchor_step is None else self.anchor_step
        return min(1.0, self.anchor_progress + (1.0 - self.anchor_progress) * (step - start)
                   / max(1, self.total_steps - start))

    def continued(self, step: int, total_steps: int) -> LRSchedule:
        """This schedule from ``step`` on, ending at ``total_steps`` instead: the same LR at ``step``."""
        if total_steps == self.total_steps:
            return self
        if step <= self.warmup_steps:  # the decay has not started: it only ends elsewhere
            return dataclasses.replace(self, total_steps=max(total_steps, self.warmup_steps + 1))
        return dataclasses.replace(self, total_steps=max(total_steps, step), anchor_step=step,
                                   anchor_progress=self.progress(step))

    def shape(self) -> tuple:
        """What the flags set (not where a resume anchored the decay)."""
        return self.lr, self.warmup_steps, self.total_steps, self.style, self.min_lr

    def text(self) -> str:
        return (f"peak {self.lr:g}, warmup {self.warmup_steps}, {self.style} to {self.min_lr:g} at step "
                f"{self.total_steps}")


def scaled_lr(base_lr: float, global_batch: int, base_batch: int, max_lr: float | None = None) -> float:
    """Linear scaling of the learning rate with the global batch, up to a cap (large-batch recipe)."""
    lr = base_lr * global_batch / base_batch
    return min(lr, max_lr) if max_lr else lr


class Scheduler:
    """Sets the optimizer's learning rate from an ``LRSchedule``; the state is the step count and the schedule.

    On load the saved schedule continues (``LRSchedule.continued`` to this run's total steps), unless
    ``schedule.override``: then this one applies at the saved step. ``note`` says which, when the two differ."""

    def __init__(self, optimizer, schedule: LRSchedule):
        self.optimizer = optimizer
        self.schedule = schedule
        self.last_step = 0
        self.note = None
        self._apply()

    def _apply(self):
        lr = self.schedule(self.last_step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)

    def step(self, *args, **kwargs):
        self.last_step += 1
        self._apply()

    def get_lr(self):
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_last_lr(self):
        return self.get_lr()

    def state_dict(self):
        saved = {k: v for k, v in dataclasses.asdict(self.schedule).items() if k != "override"}
        return {"last_step": self.last_step, "schedule": saved}

    def load_state_dict(self, state):
        self.last_step = int(state["last_step"])
        saved = LRSchedule(**state["schedule"]) if state.get("schedule") else None
        if saved is not None and not self.schedule.override:
            if saved.shape() != self.schedule.shape():
                self.note = self._continue_note(saved)
            self.schedule = saved.continued(self.last_step, self.schedule.total_steps)
        elif saved is not None and saved.shape() != self.schedule.shape():
            self.note = (f"LR schedule: this command's ({self.schedule.text()}) from step {self.last_step} "
                         f"(--override-lr-schedule; the run's was {saved.text()})")
        self._apply()

    def _continue_note(self, saved: LRSchedule) -> str:
        note = f"LR schedule: the run's ({saved.text()}) continues from step {self.last_step}"
        if saved.total_steps != self.schedule.total_steps:
            note += (f", its decay from {saved(self.last_step):.3g} now ending at step {self.schedule.total_steps}")
        return note + " (--override-lr-schedule for this command's)"


def add_lr_args(parser) -> None:
    """The learning-rate arguments of a training command (its "optimization" group)."""
    g = parser.add_argument_group("optimization")
    g.add_argument("--train-steps", type=int, default=100, help="optimizer steps of the run")
    g.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the DS config's optimizer lr)")
    g.add_argument("--min-lr", type=float, default=0.0, help="the learning rate the decay ends at")
    g.add_argument("--lr-warmup-steps", type=int, default=None, help="default: 1%% of --train-steps")
    g.add_argument("--lr-decay-style", choices=list(STYLES), default="cosine", help="the decay after warmup")
    g.add_argument("--lr-scale-base-batch", type=int, default=None,
                   help="large-batch recipe: the lr is --lr x global batch / this batch, capped at --lr-max")
    g.add_argument("--lr-max", type=float, default=None, help="cap of the batch-scaled learning rate")
    g.add_argument("--override-lr-schedule", action="store_true",
                   help="on resume, this command's schedule (--lr, --lr-warmup-steps, --train-steps, ...) at the saved "
                        "step, instead of the run's saved schedule continued (its decay stretched to --train-steps)")


def schedule_from_args(args, ds: dict) -> LRSchedule | None:
    """The schedule ``add_lr_args`` describes (None when the DeepSpeed config brings its own scheduler)."""
    base_lr = args.lr or ds.get("optimizer", {}).get("params", {}).get("lr", 3e-4)
    if args.lr_scale_base_batch:
        base_lr = scaled_lr(base_lr, ds["train_batch_size"], args.lr_scale_base_batch, args.lr_max)
    warmup = args.lr_warmup_steps if args.lr_warmup_steps is not None else max(1, args.train_steps // 100)
    return None if "scheduler" in ds else LRSchedule(base_lr, warmup, args.train_steps, args.lr_decay_style,
                                                     args.min_lr, override=getattr(args, "override_lr_schedule", False))
