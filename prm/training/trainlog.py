"""What a training run reports: the log line and metrics.jsonl (MetricsFile), and the running sums behind them
with the divergence check, the throughput and the time left (TrainLog). Depends on: torch, prm.core,
prm.training.files, prm.errors."""
import datetime
import json
import math
import time

import torch

from prm.core.data import padded_tokens
from prm.core.runtime import Runtime, all_reduce_sum
from prm.errors import Diverged
from prm.training.files import AppendFile


class MetricsFile:
    """Rank 0's metrics.jsonl, appended to (a resume has dropped the records past its checkpoint), each record
    also sent to the tracker (TensorBoard / W&B) and shown as a log line. path None (the other ranks): writes
    nothing."""

    def __init__(self, path, pbar, *, tracker=None):
        self.pbar, self.tracker = pbar, tracker
        self.file = AppendFile(path) if path else None

    def write(self, rec: dict, echo: bool = True):
        if self.file is None:
            return
        self.file.write(json.dumps(strict_json(rec), allow_nan=False) + "\n")
        if self.tracker is not None:
            self.tracker.log(rec)
        if echo:
            self.pbar.write(log_line(rec))

    def close(self):
        if self.file is not None:
            self.file.close()
        if self.tracker is not None:
            self.tracker.close()


class TrainLog:
    """The running (cross-entropy sum, correct) of the steps since the last log line, the first non-finite
    step, throughput and the time left. The sums and the divergence flag stay on device until a log step; then
    one all-reduce, the only device sync. plan: the run's BatchPlan (its last step; per example, its tokens and
    labeled steps). resumed_at: the step this process started from (0: a fresh run). n_chunks: micro-batches of
    one global batch over all ranks, what padding is counted per. pack_to: the packed row's multiple (0: none),
    None for padded micro-batches. check_norm: False under fp16, where an inf norm is a GradScaler's skipped
    step, not a divergence. hint: the advice a divergence message ends with."""

    def __init__(self, rt: Runtime, out: MetricsFile, plan, *, resumed_at: int, n_chunks: int, pack_to: int = None,
                 check_norm: bool = True, hint: str = ""):
        self.rt, self.out, self.pbar, self.plan = rt, out, out.pbar, plan
        self.n_chunks, self.pack_to, self.check_norm, self.hint = n_chunks, pack_to, check_norm, hint
        # (cross-entropy sum, correct) since the last log line, and the first non-finite step (0: none): on device
        self.window = torch.zeros(2, device=rt.device)
        self.bad_step = torch.zeros((), dtype=torch.long, device=rt.device)
        # (step, loss) of the last log line with a finite loss
        self.last_finite = None
        # the same window's labels, tokens and seconds, on the host
        self.window_labeled, self.tokens, self.seconds = 0, 0, 0.0
        self.total_tokens, self.total_padded, self.total_seconds = 0, 0, 0.0
        # timed_from: (step, host time) when the time left started counting
        self.timed_from, self.estimated = None, False
        # the first record's window starts at the resume
        self.since_resume = bool(resumed_at)
        # (step, norm, epoch, lr) of the window's newest step; None: it is written
        self.unwritten = None

    def add(self, step: int, batch: list, sums, norm, *, t0: float, epoch: int, lr: float, write: bool):
        """One optimizer step done: sums = this rank's (cross-entropy sum, correct), norm = gradient norm."""
        # non-pad tokens of the global batch, every rank's share
        tokens = self.plan.tokens(batch)
        bad = ~torch.isfinite(sums[0]) | (~torch.isfinite(norm) if self.check_norm else False)
        # on device: no sync
        self.bad_step = torch.where((self.bad_step == 0) & bad, step, self.bad_step)
        self.window += sums
        self.window_labeled += self.plan.labeled(batch)
        self.tokens, self.total_tokens = self.tokens + tokens, self.total_tokens + tokens
        self.total_padded += padded_tokens(batch, self.plan.lengths, self.n_chunks, self.pack_to)
        self.pbar.update(1)
        self.estimate(step)
        self.unwritten = (step, norm, epoch, lr)
        if write:
            self.write(t0)
        else:
            self.seconds += time.perf_counter() - t0

    def write(self, t0: float = None):
        """The window's record, if it holds a step not written yet: at a log step, and before a stop's
        checkpoint (a resume drops only the records past it). t0: when this step began, if it is being timed.
        Every rank calls it together: its all-reduce is a log step's one sync."""
        if self.unwritten is None:
            return
        (step, norm, epoch, lr), self.unwritten = self.unwritten, None
        flags = torch.stack([norm.detach().float(), (self.bad_step > 0).float()])
        stats = all_reduce_sum(torch.cat([self.window, flags]), self.rt).tolist()
        if t0 is not None:  # timed after the sync, so queued device work is counted
            self.seconds += time.perf_counter() - t0
        n = max(self.window_labeled, 1)
        rec = {"step": step, "loss": stats[0] / n, "acc": stats[1] / n, "lr": lr,
               "norm": stats[2] / self.rt.world_size, "tok_per_s": self.tokens / self.seconds, "epoch": epoch}
        # said, not hidden: its loss is not the whole window an uninterrupted run logs
        if self.since_resume:
            rec["since_resume"], self.since_resume = True, False
        self.out.write(rec)
        if math.isfinite(stats[0] / n):
            self.last_finite = (step, stats[0] / n)
        if stats[3] > 0:
            self.diverged()
        self.window.zero_()
        self.total_seconds += self.seconds
        self.window_labeled, self.tokens, self.seconds = 0, 0, 0.0

    def estimate(self, step: int):
        """The remaining time, said once, from host wall-clock since this run's first step ended (it pays
        one-time costs: compilation, allocator warm-up), after 3 more steps or 10 s. No device sync: it reads
        the clock only, so device work still queued may be missed."""
        now = time.perf_counter()
        self.timed_from = self.timed_from or (step, now)
        done, seconds = step - self.timed_from[0], now - self.timed_from[1]
        due = done >= 3 or (done and seconds >= 10)
        if self.rt.is_main and not self.estimated and due and step < self.plan.total:
            left = datetime.timedelta(seconds=round(seconds / done * (self.plan.total - step)))
            self.pbar.write(f"about {left} left ({seconds / done:.2f} s per step)")
            self.estimated = True

    def stop_if_diverged(self):
        """Diverged if a step so far was not finite: the flag read now (a device sync), agreed by every rank."""
        if all_reduce_sum((self.bad_step > 0).float().view(1), self.rt).item() > 0:
            self.diverged()

    def diverged(self):
        step = int(self.bad_step)
        last = f"last finite loss {self.last_finite[1]:.4g} at step {self.last_finite[0]}" \
            if self.last_finite else "no finite loss logged before it"
        raise Diverged(f"the loss or gradient norm is not finite at step {step or '? (on another rank)'} "
                       f"({last}); no checkpoint was written from then on. {self.hint}")

    def throughput(self) -> tuple:
        """(non-pad tokens per second of training, non-pad tokens / tokens processed with padding); None, None
        (null in metrics.jsonl) when this process trained no step (a resumed run with all its steps done)."""
        if not self.total_tokens:
            return None, None
        tokens = self.total_tokens
        return tokens / max(self.total_seconds, 1e-9), tokens / max(self.total_padded, 1)


def count(n: float) -> str:
    """A count as people read it: 950, 18.2k, 1.3M, 3.4G (a small one in full, never 0.0k)."""
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}"


def log_line(rec: dict) -> str:
    """A metrics.jsonl record as the log shows it; an undefined metric (None) reads 'n/a'."""
    if "loss" in rec:
        # a window cut short by the resume
        since = " | since resume" if rec.get("since_resume") else ""
        return (f"step {rec['step']} | loss {rec['loss']:.4f} | acc {rec['acc']:.3f} | lr {rec['lr']:.2e} | "
                f"norm {rec['norm']:.2f} | {count(rec['tok_per_s'])} tok/s{since}")
    shown = lambda v: f"{v:.4f}" if isinstance(v, float) else "n/a" if v is None else v
    return " | ".join(f"{k} {shown(v)}" for k, v in rec.items())


def strict_json(x):
    """NaN and infinity become null, so metrics.jsonl stays strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: strict_json(v) for k, v in x.items()}
    return [strict_json(v) for v in x] if isinstance(x, list) else x
