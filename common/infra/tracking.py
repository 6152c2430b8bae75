"""Trust tier: read the faces, trust the body.

Logging: scalars under fixed namespaces (train/, eval/, perf/) to the console, TensorBoard and
Weights & Biases (offline mode works: WANDB_MODE=offline); tqdm bars on rank 0 only."""

import json
import os
from dataclasses import dataclass
from typing import Optional

from tqdm import tqdm


@dataclass
class LogArgs:
    logging_steps: int = 1
    """Log training scalars every N optimizer steps."""
    eval_steps: int = -1
    """Evaluate every N optimizer steps (-1: at the end of each epoch), and after the last step."""
    use_tensorboard: Optional[str] = None
    """TensorBoard log directory (off when unset)."""
    use_wandb: bool = False
    """Log to Weights & Biases (set WANDB_MODE=offline to log without a network)."""
    wandb_project: str = "minrlhf"
    """Weights & Biases project."""
    wandb_run_name: Optional[str] = None
    """Weights & Biases run name."""
    metrics_file: Optional[str] = None
    """Also append each logged scalar dict, with its step, as a JSON line to this file."""


class MetricsLogger:
    """Writes scalar dicts from rank 0 to every configured sink."""

    def __init__(self, args: LogArgs, config: dict, rank0: bool):
        self.rank0, self.tb, self.wandb, self.metrics_file = rank0, None, None, args.metrics_file
        if not rank0:
            return
        if self.metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(self.metrics_file)), exist_ok=True)
        if args.use_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(args.use_tensorboard)
        if args.use_wandb:
            import wandb

            self.wandb = wandb.init(project=args.wandb_project, name=args.wandb_run_name, config=config,
                                    dir=os.environ.get("WANDB_DIR", "."))

    def log(self, metrics: dict, step: int):
        if not self.rank0:
            return
        if self.tb is not None:
            for key, value in metrics.items():
                self.tb.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        if self.metrics_file:
            with open(self.metrics_file, "a") as f:
                f.write(json.dumps({"step": step, **metrics}) + "\n")

    def close(self):
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def eval_due(step, eval_steps, steps_per_epoch, total_steps):
    """The evaluation schedule of every script: after step `step` (counted from 1), every --eval_steps steps
    (-1: at the end of each epoch), and after the last step."""
    every = eval_steps if eval_steps > 0 else steps_per_epoch
    return step % every == 0 or step == total_steps


def progress(iterable=None, rank0=True, **kwargs):
    """tqdm on rank 0, a silent pass-through elsewhere."""
    return tqdm(iterable, disable=not rank0, dynamic_ncols=True, **kwargs)
