"""Optional experiment trackers: metrics.jsonl's records and the config sent to TensorBoard or W&B from rank 0."""
import dataclasses
import os

from prm.errors import check


def require(report_to: str):
    """The tracker's module (None for 'none'); UsageError for a missing package, on every rank."""
    if report_to == "none":
        return None
    try:
        if report_to == "tensorboard":
            import torch.utils.tensorboard as module
        else:
            import wandb as module
    except ImportError:
        check([f"--report-to {report_to} needs the {report_to} package: pip install {report_to}"])
    return module


def scalars(record: dict) -> dict:
    """A metrics.jsonl record -> {tag: number}: train/loss, eval/step_accuracy, final/auroc, ..."""
    if "final" in record:
        items = {f"final/{k}": v for k, v in record["final"].items()}
    else:
        items = {(f"eval/{k[len('eval_'):]}" if k.startswith("eval_") else f"train/{k}"): v
                 for k, v in record.items() if k != "step"}
    return {k: float(v) for k, v in items.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


class Tracker:
    """Rank 0's link to TensorBoard (<output-dir>/tensorboard/<run name>) or W&B ($WANDB_PROJECT, else 'prm').
    resumed_at: the step a resumed run continues from."""

    def __init__(self, cfg, resumed_at: int = 0):
        self.kind, module = cfg.report_to, require(cfg.report_to)
        name = cfg.run_name or os.path.basename(os.path.abspath(cfg.output_dir))
        if self.kind == "tensorboard":
            # resumed: the events past the checkpoint are purged
            self.writer = module.SummaryWriter(log_dir=os.path.join(cfg.output_dir, "tensorboard", name),
                                               purge_step=resumed_at + 1 if resumed_at else None)
            # indented: verbatim in TensorBoard's markdown
            self.writer.add_text("config", "\n".join("    " + line for line in cfg.to_json().splitlines()))
        else:
            self.run = module.init(project=os.environ.get("WANDB_PROJECT", "prm"), name=name,
                                   config=dataclasses.asdict(cfg), dir=cfg.output_dir)

    def log(self, record: dict):
        values = scalars(record)
        if self.kind == "tensorboard":
            for tag, value in values.items():
                self.writer.add_scalar(tag, value, record["step"])
            self.writer.flush()  # a crash keeps the curve up to here
        else:
            self.run.log(values, step=record["step"])

    def close(self):
        if self.kind == "tensorboard":
            self.writer.close()
        else:
            self.run.finish()
