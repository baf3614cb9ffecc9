"""metrics.jsonl and log lines (MetricsFile); the sums behind them, divergence, time left."""
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
    """Rank 0's metrics.jsonl, tracker and log lines; path None: no-op."""

    def __init__(self, path, pbar, *, tracker=None):
        self.pbar, self.tracker, self.path = pbar, tracker, path
        if path:  # there from the start, even if the run ends before its first record
            write_lines(path, [], "a")

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
    """Sums since the last log line, on device until a log step's all-reduce. check_norm: False
    under fp16 (inf norm: a skipped step)."""

    def __init__(self, rt: Runtime, out: MetricsFile, plan, *, resumed_at: int, n_chunks: int,
                 pack_to: int = None, check_norm: bool = True, hint: str = ""):
        self.rt, self.out, self.pbar, self.plan = rt, out, out.pbar, plan
        self.n_chunks, self.pack_to = n_chunks, pack_to
        self.check_norm, self.hint = check_norm, hint
        self.window = torch.zeros(2, device=rt.device)  # (cross-entropy sum, correct)
        self.bad_step = torch.zeros((), dtype=torch.long, device=rt.device)  # 0: none
        self.last_finite = None  # (step, loss) of the last finite log line
        self.window_labeled, self.tokens, self.seconds = 0, 0, 0.0
        self.total_tokens, self.total_padded, self.total_seconds = 0, 0, 0.0
        self.timed_from, self.estimated = None, False
        self.since_resume = bool(resumed_at)
        self.unwritten = None  # (step, norm, epoch, lr) of a step not logged yet

    def add(self, step: int, batch: list, sums, norm, *, t0: float, epoch: int, lr: float,
            write: bool):
        """sums: this rank's (cross-entropy sum, correct) of an optimizer step."""
        tokens = self.plan.tokens(batch)
        bad = ~torch.isfinite(sums[0]) | (~torch.isfinite(norm) if self.check_norm else False)
        self.bad_step = torch.where((self.bad_step == 0) & bad, step, self.bad_step)
        self.window += sums
        self.window_labeled += self.plan.labeled(batch)
        self.tokens += tokens
        self.total_tokens += tokens
        self.total_padded += padded_tokens(batch, self.plan.lengths, self.n_chunks, self.pack_to)
        self.pbar.update(1)
        self.estimate(step)
        self.unwritten = (step, norm, epoch, lr)
        if write:
            self.write(t0)
        else:
            self.seconds += time.perf_counter() - t0

    def write(self, t0: float = None):
        """Logs the window's unwritten step, all ranks together."""
        if self.unwritten is None:
            return
        (step, norm, epoch, lr), self.unwritten = self.unwritten, None
        flags = torch.stack([norm.detach().float(), (self.bad_step > 0).float()])
        stats = all_reduce_sum(torch.cat([self.window, flags]), self.rt).tolist()
        if t0 is not None:  # timed after the sync, so queued device work is counted
            self.seconds += time.perf_counter() - t0
        n = max(self.window_labeled, 1)
        rec = {"step": step, "loss": stats[0] / n, "acc": stats[1] / n, "lr": lr,
               "norm": stats[2] / self.rt.world_size, "tok_per_s": self.tokens / self.seconds,
               "epoch": epoch}
        if self.since_resume:
            rec["since_resume"], self.since_resume = True, False
        self.out.write(rec)
        if math.isfinite(rec["loss"]):
            self.last_finite = (step, rec["loss"])
        if stats[3] > 0:
            self.diverged()
        self.window.zero_()
        self.total_seconds += self.seconds
        self.window_labeled, self.tokens, self.seconds = 0, 0, 0.0

    def estimate(self, step: int):
        """Says the time left once, timed after the first step (compiling)."""
        now = time.perf_counter()
        self.timed_from = self.timed_from or (step, now)
        done, seconds = step - self.timed_from[0], now - self.timed_from[1]
        due = done >= 3 or (done and seconds >= 10)
        if self.rt.is_main and not self.estimated and due and step < self.plan.total:
            left = datetime.timedelta(seconds=round(seconds / done * (self.plan.total - step)))
            self.pbar.write(f"about {left} left ({seconds / done:.2f} s per step)")
            self.estimated = True

    def stop_if_diverged(self):
        """Diverged if a step so far was not finite (syncs every rank)."""
        if all_reduce_sum((self.bad_step > 0).float().view(1), self.rt).item() > 0:
            self.diverged()

    def diverged(self):
        step = int(self.bad_step)
        last = "no finite loss logged before it"
        if self.last_finite:
            last = "last finite loss {1:.4g} at step {0}".format(*self.last_finite)
        raise Diverged(f"the loss or gradient norm is not finite at step "
                       f"{step or '? (on another rank)'} ({last}); no checkpoint was written "
                       f"from then on. {self.hint}")

    def throughput(self) -> tuple:
        """(non-pad tokens/s, non-pad / padded tokens)."""
        tokens = self.total_tokens
        if not tokens:
            return None, None
        return tokens / max(self.total_seconds, 1e-9), tokens / max(self.total_padded, 1)


def count(n: float) -> str:
    """950, 18.2k, 1.3M, 3.4G."""
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}"


def log_line(rec: dict) -> str:
    """A metrics.jsonl record as a log line; None reads 'n/a'."""
    if "loss" in rec:
        since = " | since resume" if rec.get("since_resume") else ""
        return (f"step {rec['step']} | loss {rec['loss']:.4f} | acc {rec['acc']:.3f} | "
                f"lr {rec['lr']:.2e} | norm {rec['norm']:.2f} | "
                f"{count(rec['tok_per_s'])} tok/s{since}")
    shown = lambda v: f"{v:.4f}" if isinstance(v, float) else "n/a" if v is None else v
    return " | ".join(f"{k} {shown(v)}" for k, v in rec.items())


def strict_json(x):
    """NaN and infinity -> null (strict JSON)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: strict_json(v) for k, v in x.items()}
    return [strict_json(v) for v in x] if isinstance(x, list) else x
