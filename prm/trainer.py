"""The hand-written training loop: a short train() over train_step(), with logging, evaluation and checkpoints
behind one call each. Depends on: torch, tqdm, prm.*.

Here "step" always means an optimizer step (--max-steps, checkpoint-<step>); the reasoning steps of a solution
are the "labels" of the batch."""
import contextlib
import datetime
import json
import math
import os
import random
import shutil
import signal
import sys
import time

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from prm.build import model_for, tokenizer_for
from prm.card import config_command, model_card
from prm.checkpoint import (AppendFile, checkpoint_dir, load_checkpoint, run_lock, save_checkpoint, save_final,
                            saved_world_size, write_card)
from prm.config import Config, exit_on_problems
from prm.data import collate, global_batches, micro_batches, pack, pad_token_id, padded_tokens
from prm.evaluate import predict, report
from prm.ingest import tokenize_dataset
from prm.lora import count_parameters, has_lora
from prm.model import enable_activation_checkpointing, step_loss
from prm.rundir import prepare_output_dir
from prm.runtime import Runtime, all_reduce_sum, autocast_dtype, barrier, main_first, setup, teardown
from prm.sharding import full_state, full_tensor, save_shards, shard
from prm.sources import load_splits
from prm.tracking import Tracker, require
from prm.varlen import is_packed

PREEMPTED = {"signal": None}  # set by SIGTERM/SIGINT; the loop stops after the current optimizer step


def train(cfg: Config, command: str = "") -> dict:
    """Runs one training; returns the final held-out metrics on rank 0, None on the other ranks.

    command: what started the run, for the model card (default: an equivalent train.py line from cfg)."""
    if cfg.problems():
        raise ValueError("; ".join(cfg.problems()))
    require(cfg.report_to)  # a missing tracker package stops the run before anything is written
    rt = setup()
    try:  # rank 0 holds the output directory's lock: a second trainer there stops at once
        with run_lock(cfg.output_dir) if rt.is_main else contextlib.nullcontext():
            return Trainer(cfg, rt, command or config_command(cfg)).train()
    finally:
        teardown(rt)


@contextlib.contextmanager
def preemptible():
    """In the loop, SIGTERM/SIGINT finish the optimizer step, save a checkpoint and exit with 128 + signal; a second
    signal exits at once. Outside it (set-up, final evaluation) they keep their usual effect: a prompt stop."""
    PREEMPTED["signal"] = None
    old = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _on_signal(signum, frame):
    if PREEMPTED["signal"] is not None:  # asked twice: stop now, without a checkpoint
        raise SystemExit(128 + signum)
    PREEMPTED["signal"] = signum


DECAY = {"linear": lambda p: 1 - p, "cosine": lambda p: 0.5 * (1 + math.cos(math.pi * p)),
         "cosine_with_min_lr": lambda p: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)),
         "constant": lambda p: 1.0, "constant_with_warmup": lambda p: 1.0}  # p: progress after warmup, 0 to 1


def lr_lambda(cfg: Config, total: int):
    """Linear warmup to 1 (--warmup-steps, else --warmup-ratio of the steps), then --lr-scheduler-type's decay."""
    warmup = cfg.warmup_steps or math.ceil(cfg.warmup_ratio * total)

    def f(step):
        if step < warmup:
            return (step + 1) / warmup
        return DECAY[cfg.lr_scheduler_type](min((step - warmup) / max(1, total - warmup), 1.0))
    return f


def make_optimizer(model, cfg: Config, lr: float, device):
    """AdamW without decay on biases/norms; the fused kernel (one launch for all tensors) where it exists."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    kw = dict(lr=lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon)
    try:
        return torch.optim.AdamW(groups, **kw, fused=device.type in ("cuda", "cpu"))
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(groups, **kw, foreach=True)


class Trainer:
    """Set-up in __init__ (one _setup_* per concern), then train(): a loop over train_step()."""

    def __init__(self, cfg: Config, rt: Runtime, command: str):
        self.cfg, self.rt, self.command = cfg.resolve(), rt, command
        random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        self.say = print if rt.is_main else (lambda *a, **k: None)
        self.resume_from = prepare_output_dir(cfg, rt.is_main)  # first: a refused directory costs no data loading
        if self.resume_from:  # so does a refused resume: its settings need only the config and the world size
            self.check_resume(self.resume_from)
        self._setup_data()  # data before model: bad rows are reported before any weight loads
        self._setup_model()
        self._setup_optimizer()
        self._setup_output()

    def _setup_data(self):
        cfg, rt = self.cfg, self.rt
        self.tokenizer = tokenizer_for(cfg)
        self.pad_id = pad_token_id(self.tokenizer)
        with main_first(rt):  # rank 0 fills the datasets cache; the other ranks then read it
            train_raw, eval_raw = load_splits(cfg)
            train_ds, self.train_report = tokenize_dataset(train_raw, self.tokenizer, cfg, is_eval=False,
                                                           num_proc=cfg.num_proc)
            eval_ds, self.eval_report = tokenize_dataset(eval_raw, self.tokenizer, cfg, is_eval=True,
                                                         num_proc=cfg.num_proc, drop_unlabeled=False)
        self.say(f"train data: {json.dumps(self.train_report)}\neval data: {json.dumps(self.eval_report)}")
        if len(train_ds) == 0:
            raise SystemExit(f"no training example has a labeled step left (--max-length {cfg.max_length}, "
                             f"--max-completion-length {cfg.max_completion_length}): see the report")
        # host lists: no device sync; [:] because datasets 5 returns a lazy Column, whose every [i] slices Arrow
        self.lengths, self.n_labels = train_ds["length"][:], train_ds["n_labeled"][:]
        self.train_ds = train_ds.select_columns(["input_ids", "labels"])
        self.eval_rows = eval_ds.to_list()
        self.processbench = "first_error" in eval_ds.column_names
        self.global_batch = cfg.batch_size * cfg.grad_accum * rt.world_size
        self.steps_per_epoch = math.ceil(len(train_ds) / self.global_batch)
        self.total = cfg.max_steps if cfg.max_steps > 0 else max(1, math.ceil(cfg.epochs * self.steps_per_epoch))
        self.plan_epoch, self.plan = None, None

    def _setup_model(self):
        cfg, rt = self.cfg, self.rt
        self.model = model_for(cfg, self.tokenizer).to(rt.device)
        self.packed = is_packed(self.model)  # --packing on a backbone that supports it
        if cfg.gradient_checkpointing:
            enable_activation_checkpointing(self.model.backbone)
        self.amp_dtype = autocast_dtype(cfg.dtype, rt.device)
        if cfg.lora_base_dtype == "bf16" and self.amp_dtype != torch.bfloat16:  # bf16 weights need bf16 inputs
            exit_on_problems([f"--lora-base-dtype bf16: --dtype {cfg.dtype} gives no bf16 autocast on {rt.device}"])
        if cfg.fsdp:  # before the optimizer: it must hold the sharded parameters
            if not rt.distributed:
                exit_on_problems(["--fsdp shards over ranks: launch with torchrun --nproc_per_node 2 or more"])
            shard(self.model, self.amp_dtype)

    def _setup_optimizer(self):
        cfg, rt = self.cfg, self.rt
        self.optimizer = make_optimizer(self.model, cfg, cfg.lr, rt.device)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg, self.total))
        self.scaler = torch.amp.GradScaler(rt.device.type, enabled=self.amp_dtype == torch.float16)
        self.step = 0
        if self.resume_from:  # before compile and DDP: they wrap the weights loaded here
            self.step = load_checkpoint(self.resume_from, self.model, self.optimizer, self.scheduler, self.scaler)
            self.say(f"resumed from {self.resume_from} at step {self.step}")
        self.train_model = self.model  # what the forward runs; self.model stays the plain PRM
        if cfg.compile:  # varying widths: one symbolic-shape graph at once, not a static one and then a recompile;
            # packed rows padded to --pack-to repeat their shapes, so a static graph compiles once and stays
            self.train_model = torch.compile(self.train_model, dynamic=not (self.packed and cfg.pack_to))
        if rt.distributed and not cfg.fsdp:  # a sharded model reduces its own gradients
            self.train_model = DDP(self.train_model, device_ids=[rt.local_rank] if rt.device.type == "cuda" else None)

    def check_resume(self, path: str):
        """Settings that define the model, the data or its order (or live in the optimizer state, like --lr) must
        equal the checkpoint's; length and cadence settings may change, and are logged."""
        bad, changed = self.cfg.resume_conflicts(Config.load(path), saved_world_size(path), self.rt.world_size)
        if bad:
            exit_on_problems([f"--resume {path}: the checkpoint does not fit this model and data; these settings "
                              f"differ: {'; '.join(bad)}. Use the checkpoint's, or start a new run"])
        if changed:
            self.say(f"resuming with changed settings: {'; '.join(changed)}")

    def _setup_output(self):
        cfg, rt = self.cfg, self.rt
        if rt.is_main:
            cfg.save(cfg.output_dir)
        self.pbar = tqdm(total=self.total, initial=self.step, disable=not rt.is_main, desc="train")
        self.metrics = TrainLog(os.path.join(cfg.output_dir, "metrics.jsonl") if rt.is_main else None, rt, self.pbar,
                                lengths=self.lengths, n_labels=self.n_labels, n_chunks=rt.world_size * cfg.grad_accum,
                                pack_to=cfg.pack_to if self.packed else None,
                                check_norm=not self.scaler.is_enabled(), resumed_at=self.step, total=self.total,
                                hint=f"Lower --lr (now {cfg.lr:g}) or add --warmup-steps"
                                + ("; or train in bf16 instead of fp16" if cfg.dtype == "fp16" else ""),
                                tracker=Tracker(cfg) if rt.is_main and cfg.report_to != "none" else None)
        trainable, n_params = count_parameters(self.model)
        # every epoch passes over every example once: its non-pad tokens, scaled to the steps this run takes
        tokens = sum(self.lengths) * (self.total - self.step) / self.steps_per_epoch
        self.say(f"{n_params / 1e6:.1f}M parameters, {trainable / 1e6:.2f}M trainable "
                 f"({100 * trainable / n_params:.2f}%) | {len(self.train_ds)} train examples | global batch "
                 f"{self.global_batch} | {self.total - self.step} steps, ~{count(tokens)} tokens | autocast "
                 f"{self.amp_dtype or 'off'} | world {rt.world_size}")

    def train(self) -> dict:
        cfg = self.cfg
        self.train_model.train()
        with preemptible():
            while self.step < self.total:
                t0 = time.perf_counter()
                epoch, position = divmod(self.step, self.steps_per_epoch)
                batch = self.batch_plan(epoch)[position]
                # forward backward update
                sums, norm = self.train_step(batch)
                self.step += 1
                # logging: the loss sums stay on device until a log step, which also reads the divergence flag
                log = self.step % cfg.log_every == 0 or self.step == self.total
                self.metrics.add(self.step, batch, sums, norm, t0=t0, epoch=epoch, lr=self.scheduler.get_last_lr()[0],
                                 write=log)
                # evaluation, checkpoint, preemption
                if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < self.total:
                    self.metrics.write({"step": self.step, **{f"eval_{k}": v for k, v in self.evaluate().items()}})
                # ranks agree on stopping at log steps only: the agreement is a collective, so a device sync
                stop = agree_to_stop(self.rt) if log or not self.rt.distributed else False
                if (cfg.save_every and self.step % cfg.save_every == 0) or stop:
                    self.save_checkpoint()
                if stop:
                    self.stop()
        self.pbar.close()
        return self.finish()

    def batch_plan(self, epoch: int) -> list:
        if epoch != self.plan_epoch:  # reshuffled every epoch; a pure function of (seed, epoch): resume needs no state
            self.plan_epoch = epoch
            self.plan = global_batches(self.lengths, self.global_batch, self.cfg.seed, epoch, self.cfg.group_by_length)
        return self.plan

    def train_step(self, batch: list):
        """One optimizer step on one global batch: forward and backward on this rank's micro-batches, then clip
        and update. Returns this rank's (cross-entropy sum, correct) on device, and the gradient norm."""
        cfg, rt = self.cfg, self.rt
        n_labels = sum(self.n_labels[i] for i in batch)  # every rank knows the whole global batch: no collective
        micro = micro_batches(batch, self.lengths, rt.world_size, rt.rank, cfg.grad_accum)
        sums = torch.zeros(2, device=rt.device)
        for a, idx in enumerate(micro):
            inputs = self.micro_batch(idx)
            labels = inputs.pop("labels")  # (B, T); packed: (1, N)
            with self.grad_sync(last=a == len(micro) - 1):
                with self.autocast():
                    logits = self.train_model(**inputs)  # (B, T, 2); packed: (1, N, 2)
                # divided by the labels of the whole global batch, so accumulation and ranks weight every label equally
                loss, ce_sum, n_correct = step_loss(logits, labels, n_labels)
                # DDP averages gradients over ranks; scaling by world size turns that back into the global sum
                self.scaler.scale(loss * rt.world_size).backward()
            sums += torch.stack([ce_sum, n_correct.float()])
        self.scaler.unscale_(self.optimizer)  # clip the true gradients, not fp16-scaled ones
        # the norm over all shards' gradients: clipping by the global norm, as DDP does
        norm = full_tensor(torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm or float("inf")))
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return sums, norm

    def grad_sync(self, last: bool):
        """Gradients are reduced over ranks in the last micro-batch's backward only: it carries the sum of all."""
        if self.cfg.fsdp:
            self.model.set_requires_gradient_sync(last)
            return contextlib.nullcontext()
        return self.train_model.no_sync() if self.rt.distributed and not last else contextlib.nullcontext()

    def rows(self, idx: list) -> list:
        cols = self.train_ds[idx]
        return [{"input_ids": i, "labels": y} for i, y in zip(cols["input_ids"], cols["labels"])]

    def micro_batch(self, idx: list) -> dict:
        """The model's keyword arguments and the labels, on the device: one packed row, or padded rows."""
        rows = self.rows(idx)
        mb = pack(rows, self.pad_id, self.cfg.pack_to) if self.packed else collate(rows, self.pad_id)
        # page-locked host memory makes the non_blocking copies truly asynchronous; max_length stays a host int
        pin = self.rt.device.type == "cuda"
        return {k: (v.pin_memory() if pin else v).to(self.rt.device, non_blocking=True) if torch.is_tensor(v) else v
                for k, v in mb.items()}

    def autocast(self):
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.rt.device.type, dtype=self.amp_dtype)

    def evaluate(self) -> dict:
        """The held-out metrics, by the same route as eval.py (prm.evaluate: predict, then report)."""
        probs = predict(self.model, self.eval_rows, batch_size=self.cfg.eval_batch_size, pad_id=self.pad_id,
                        amp_dtype=self.amp_dtype, rt=self.rt, lockstep=self.cfg.fsdp)
        return report(probs, self.eval_rows, self.cfg.threshold, self.processbench)

    def save_checkpoint(self):
        self.metrics.stop_if_diverged()  # never save non-finite weights
        barrier(self.rt)
        if self.cfg.fsdp:  # every rank writes its shards into the temporary directory rank 0 then completes
            tmp = checkpoint_dir(self.cfg.output_dir, self.step) + ".tmp"
            if self.rt.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            barrier(self.rt)
            save_shards(tmp, self.model, self.optimizer, trainable_only=has_lora(self.model))
            barrier(self.rt)
        if self.rt.is_main:
            self.write_checkpoint()
        barrier(self.rt)

    def write_checkpoint(self):
        """Rank 0's part of a checkpoint; all of it unless --fsdp (then every rank wrote its shards first)."""
        save_checkpoint(self.cfg.output_dir, self.step, model=self.model, optimizer=self.optimizer,
                        scheduler=self.scheduler, scaler=self.scaler, tokenizer=self.tokenizer, cfg=self.cfg,
                        world_size=self.rt.world_size, sharded=self.cfg.fsdp)

    def stop(self):
        name = signal.Signals(PREEMPTED["signal"]).name if PREEMPTED["signal"] else "a signal on another rank"
        self.say(f"stopped by {name} after step {self.step}; checkpoint saved. Continue with --resume auto")
        self.pbar.close()
        raise SystemExit(128 + (PREEMPTED["signal"] or signal.SIGTERM))

    def finish(self) -> dict:
        """final/ first (a failed evaluation never costs the weights), then the final evaluation, the model card
        and the last metrics record."""
        self.metrics.stop_if_diverged()
        barrier(self.rt)
        state = full_state(self.model) if self.cfg.fsdp else None  # a collective: every rank sends its shards
        keep = None if self.cfg.fsdp else self.write_checkpoint  # rank 0 alone cannot write a sharded checkpoint
        path = save_final(self.cfg.output_dir, model=self.model, tokenizer=self.tokenizer, cfg=self.cfg, state=state,
                          step=self.step, keep=keep) if self.rt.is_main else None
        barrier(self.rt)
        final = self.evaluate()
        final["train_tokens_per_second"], final["padding_efficiency"] = self.metrics.throughput()
        final["train_data"], final["eval_data"] = self.train_report, self.eval_report
        if self.rt.is_main:
            write_card(path, model_card(self.cfg, final, self.command))
            self.metrics.write({"step": self.step, "final": final}, echo=False)
            self.metrics.close()
        barrier(self.rt)
        return final if self.rt.is_main else None


def agree_to_stop(rt: Runtime) -> bool:
    """Under DDP every rank must stop at the same step, even if only one was signalled."""
    flag = float(PREEMPTED["signal"] is not None)
    if not rt.distributed:
        return bool(flag)
    return all_reduce_sum(torch.tensor([flag], device=rt.device), rt).item() > 0


class TrainLog:
    """The log line and metrics.jsonl (rank 0), the throughput figures, and the divergence check.

    Loss and accuracy sums and the first non-finite step stay on device until a log step; then one all-reduce, the
    only device sync. A divergence is also read before every save, so non-finite weights are never written."""

    def __init__(self, path, rt: Runtime, pbar, *, lengths: list, n_labels: list, n_chunks: int, pack_to,
                 check_norm: bool, resumed_at: int, total: int, hint: str, tracker=None):
        self.rt, self.pbar, self.lengths, self.labels_of, self.n_chunks = rt, pbar, lengths, n_labels, n_chunks
        self.pack_to = pack_to  # None: padded micro-batches
        self.check_norm, self.hint = check_norm, hint  # fp16: an inf norm is the GradScaler's skipped step, not news
        self.tracker = tracker  # prm.tracking.Tracker: TensorBoard / W&B get every record written here
        if path and resumed_at:
            keep_records_until(path, resumed_at)  # the records a stopped run wrote past its checkpoint
        self.file = AppendFile(path) if path else None  # a full disk ends the run with the path, not a traceback
        self.window = torch.zeros(2, device=rt.device)  # (cross-entropy sum, correct) since the last log line
        self.bad_step = torch.zeros((), dtype=torch.long, device=rt.device)  # first non-finite step, 0: none
        self.last_finite = None  # (step, loss) of the last log line with a finite loss
        self.n_labels, self.tokens, self.seconds = 0, 0, 0.0  # the same window, on the host
        self.total_tokens, self.total_padded, self.total_seconds = 0, 0, 0.0
        self.total, self.timed_from, self.estimated = total, None, False  # timed_from: (step, host time)
        self.since_resume = bool(resumed_at)  # the first record after a resume averages the steps since it only

    def add(self, step: int, batch: list, sums, norm, *, t0: float, epoch: int, lr: float, write: bool):
        """One optimizer step done: sums = this rank's (cross-entropy sum, correct), norm = the gradient norm."""
        tokens = sum(self.lengths[i] for i in batch)  # non-pad tokens of the global batch, every rank's share
        bad = ~torch.isfinite(sums[0]) | (~torch.isfinite(norm) if self.check_norm else False)
        self.bad_step = torch.where((self.bad_step == 0) & bad, step, self.bad_step)  # on device: no sync
        self.window += sums
        self.n_labels += sum(self.labels_of[i] for i in batch)
        self.tokens, self.total_tokens = self.tokens + tokens, self.total_tokens + tokens
        self.total_padded += padded_tokens(batch, self.lengths, self.n_chunks, self.pack_to)
        self.pbar.update(1)
        self.estimate(step)
        if not write:
            self.seconds += time.perf_counter() - t0
            return
        flags = torch.stack([norm.detach().float(), (self.bad_step > 0).float()])
        stats = all_reduce_sum(torch.cat([self.window, flags]), self.rt).tolist()  # the one sync of a log step
        self.seconds += time.perf_counter() - t0  # timed after the sync, so queued device work is counted
        n = max(self.n_labels, 1)
        rec = {"step": step, "loss": stats[0] / n, "acc": stats[1] / n, "lr": lr,
               "norm": stats[2] / self.rt.world_size, "tok_per_s": self.tokens / self.seconds, "epoch": epoch}
        if self.since_resume:  # said, not hidden: its loss is not the whole window's an uninterrupted run logs
            rec["since_resume"], self.since_resume = True, False
        self.write(rec)
        if math.isfinite(stats[0] / n):
            self.last_finite = (step, stats[0] / n)
        if stats[3] > 0:
            self.diverged()
        self.window.zero_()
        self.total_seconds += self.seconds
        self.n_labels, self.tokens, self.seconds = 0, 0, 0.0

    def estimate(self, step: int):
        """The remaining time, said once, from host wall-clock since this run's first step ended (it pays one-time
        costs: compilation, allocator warm-up), after 3 more steps or 10 s. No device sync: it reads the clock only,
        so device work still queued may be missed."""
        now = time.perf_counter()
        self.timed_from = self.timed_from or (step, now)
        done, seconds = step - self.timed_from[0], now - self.timed_from[1]
        if self.rt.is_main and not self.estimated and (done >= 3 or (done and seconds >= 10)) and step < self.total:
            left = datetime.timedelta(seconds=round(seconds / done * (self.total - step)))
            self.pbar.write(f"about {left} left ({seconds / done:.2f} s per step)")
            self.estimated = True

    def stop_if_diverged(self):
        """Reads the divergence flag now (a device sync: before saves only), agreed by every rank."""
        if all_reduce_sum((self.bad_step > 0).float().view(1), self.rt).item() > 0:
            self.diverged()

    def diverged(self):
        step = int(self.bad_step)
        last = f"last finite loss {self.last_finite[1]:.4g} at step {self.last_finite[0]}" if self.last_finite \
            else "no finite loss logged before it"
        print(f"error: the loss or gradient norm is not finite at step {step or '? (on another rank)'} ({last}); "
              f"no checkpoint was written from then on. {self.hint}", file=sys.stderr, flush=True)
        raise SystemExit(3)

    def throughput(self) -> tuple:
        """(non-pad tokens per second of training, non-pad tokens / tokens processed with padding); None, None
        (null in metrics.jsonl) when this process trained no step, as when resuming a run whose steps were all done."""
        if not self.total_tokens:
            return None, None
        return self.total_tokens / max(self.total_seconds, 1e-9), self.total_tokens / max(self.total_padded, 1)

    def write(self, rec: dict, echo: bool = True):
        if self.file is None:
            return
        self.file.write(json.dumps(strict_json(rec), allow_nan=False) + "\n")
        self.file.flush()
        if self.tracker is not None:
            self.tracker.log(rec)
        if echo:
            self.pbar.write(log_line(rec))

    def close(self):
        if self.file is not None:
            self.file.close()
        if self.tracker is not None:
            self.tracker.close()


def count(n: float) -> str:
    """A count as people read it: 950, 18.2k, 1.3M, 3.4G (a small one in full, never 0.0k)."""
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}"


def log_line(rec: dict) -> str:
    """A metrics.jsonl record as the log shows it; an undefined metric (None) reads 'n/a'."""
    if "loss" in rec:
        since = " | since resume" if rec.get("since_resume") else ""  # a window cut short by the resume
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


def keep_records_until(path: str, step: int):
    """Drops the records past `step` (and final ones) from metrics.jsonl: after a resume, each step appears once."""
    if not os.path.isfile(path):
        return
    kept = []
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by the crash that made this run resume
                continue
            if rec.get("step", 0) <= step and "final" not in rec:
                kept.append(line)
    with open(path, "w") as f:
        f.writelines(kept)
