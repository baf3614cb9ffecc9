"""What a training run reports: the log line and metrics.jsonl (MetricsFile), and the running sums behind them
with the divergence check, the throughput and the time left (TrainLog)."""
import datetime
import json
import math
import time

import torch

from prm.core.data import padded_tokens
from prm.core.runtime import Runtime, all_reduce_sum
from prm.errors import Diverged
from prm.files import write_lines


class MetricsFile:
    """Rank 0's metrics.jsonl, each record also sent to the tracker and shown as a log line. path None (the
    other ranks): writes nothing."""

    def __init__(self, path, pbar, *, tracker=None):
        self.pbar, self.tracker, self.path = pbar, tracker, path

    def write(self, rec: dict, echo: bool = True):
        if self.path is None:
            return
        write_lines(self.path, [json.dumps(strict_json(rec), allow_nan=False)], "a")
        if self.tracker is not None:
            self.tracker.log(rec)
        if echo:
            self.pbar.write(log_line(rec))

    def close(self):
        if self.tracker is not None:
            self.tracker.close()


class TrainLog:
    """The running (cross-entropy sum, correct) since the last log line, the first non-finite step, throughput
    and the time left; on device until a log step's one all-reduce. n_chunks: micro-batches of one global
    batch over all ranks; pack_to: the packed row's multiple (None: padded). check_norm: False under fp16,
    where an inf norm is a skipped step. hint: the advice a divergence message ends with."""

    def __init__(self, rt: Runtime, out: MetricsFile, plan, *, resumed_at: int, n_chunks: int, pack_to: int = None,
                 check_norm: bool = True, hint: str = ""):
        self.rt, self.out, self.pbar, self.plan = rt, out, out.pbar, plan
        self.n_chunks, self.pack_to, self.check_norm, self.hint = n_chunks, pack_to, check_norm, hint
        # (cross-entropy sum, correct) since the last log line, on device
        self.window = torch.zeros(2, device=rt.device)
        # the first non-finite step (0: none)
        self.bad_step = torch.zeros((), dtype=torch.long, device=rt.device)
        # (step, loss) of the last finite log line
        self.last_finite = None
        self.window_labeled, self.tokens, self.seconds = 0, 0, 0.0
        self.total_tokens, self.total_padded, self.total_seconds = 0, 0, 0.0
        self.timed_from, self.estimated = None, False
        self.since_resume = bool(resumed_at)
        # (step, norm, epoch, lr) of the window's newest step, until written
        self.unwritten = None

    def add(self, step: int, batch: list, sums, norm, *, t0: float, epoch: int, lr: float, write: bool):
        """One optimizer step done: sums = this rank's (cross-entropy sum, correct), norm = gradient norm."""
        tokens = self.plan.tokens(batch)
        bad = ~torch.isfinite(sums[0]) | (~torch.isfinite(norm) if self.check_norm else False)
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
        """The window's record, if it holds a step not written yet; every rank together. t0: when this step
        began, if it is being timed."""
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
        """The remaining time, said once, timed from the end of the first step (which pays compilation) over 3
        more steps or 10 s; host clock only."""
        now = time.perf_counter()
        self.timed_from = self.timed_from or (step, now)
        done, seconds = step - self.timed_from[0], now - self.timed_from[1]
        due = done >= 3 or (done and seconds >= 10)
        if self.rt.is_main and not self.estimated and due and step < self.plan.total:
            left = datetime.timedelta(seconds=round(seconds / done * (self.plan.total - step)))
            self.pbar.write(f"about {left} left ({seconds / done:.2f} s per step)")
            self.estimated = True

    def stop_if_diverged(self):
        """Diverged if a step so far was not finite (a device sync, agreed by every rank)."""
        if all_reduce_sum((self.bad_step > 0).float().view(1), self.rt).item() > 0:
            self.diverged()

    def diverged(self):
        step = int(self.bad_step)
        last = f"last finite loss {self.last_finite[1]:.4g} at step {self.last_finite[0]}" \
            if self.last_finite else "no finite loss logged before it"
        raise Diverged(f"the loss or gradient norm is not finite at step {step or '? (on another rank)'} "
                       f"({last}); no checkpoint was written from then on. {self.hint}")

    def throughput(self) -> tuple:
        """(non-pad tokens per second, non-pad / padded tokens); None, None when this process trained no step."""
        if not self.total_tokens:
            return None, None
        tokens = self.total_tokens
        return tokens / max(self.total_seconds, 1e-9), tokens / max(self.total_padded, 1)


def count(n: float) -> str:
    """A count as people read it: 950, 18.2k, 1.3M, 3.4G."""
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}"


def log_line(rec: dict) -> str:
    """A metrics.jsonl record as the log shows it; an undefined metric (None) reads 'n/a'."""
    if "loss" in rec:
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
