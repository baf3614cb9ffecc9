"""The hand-written training loop: a short train() over train_step(), with logging, evaluation and checkpoints
behind one call each. Depends on: torch, tqdm, prm.*.

Here "step" always means an optimizer step (--max-steps, checkpoint-<step>); the reasoning steps of a solution
are the "labels" of the batch."""
import contextlib
import json
import math
import os
import random
import signal
import time

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from prm.build import model_for, tokenizer_for
from prm.card import config_command, model_card
from prm.checkpoint import load_checkpoint, resolve_resume, save_checkpoint, save_final
from prm.config import Config
from prm.data import collate, global_batches, micro_batches, pad_token_id, padded_tokens
from prm.evaluate import predict, report
from prm.ingest import tokenize_dataset
from prm.lora import count_parameters
from prm.model import enable_activation_checkpointing, step_loss
from prm.rundir import prepare_output_dir
from prm.runtime import Runtime, all_reduce_sum, autocast_dtype, barrier, main_first, setup, teardown
from prm.sources import load_splits
from prm.tracking import Tracker, require

PREEMPTED = {"signal": None}  # set by SIGTERM/SIGINT; the loop stops after the current optimizer step


def train(cfg: Config, command: str = "") -> dict:
    """Runs one training; returns the final held-out metrics on rank 0, None on the other ranks.

    command: what started the run, for the model card (default: an equivalent train.py line from cfg)."""
    PREEMPTED["signal"] = None
    rt = setup()
    old = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return Trainer(cfg, rt, command or config_command(cfg)).train()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        teardown(rt)


def _on_signal(signum, frame):
    PREEMPTED["signal"] = signum


def lr_lambda(warmup: int, total: int):
    """Linear warmup to 1, then cosine decay to 0.1 at the last step."""
    def f(step):
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return f


def make_optimizer(model, cfg: Config, lr: float, device):
    """AdamW without decay on biases/norms; the fused kernel (one launch for all tensors) where it exists."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    try:
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=device.type in ("cuda", "cpu"))
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), foreach=True)


class Trainer:
    """Set-up in __init__ (one _setup_* per concern), then train(): a loop over train_step()."""

    def __init__(self, cfg: Config, rt: Runtime, command: str):
        self.cfg, self.rt, self.command = cfg.resolve(), rt, command
        random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        self.say = print if rt.is_main else (lambda *a, **k: None)
        prepare_output_dir(cfg, rt.is_main)  # first: a refused directory costs no data loading, and is left as it was
        require(cfg.report_to)  # a missing tracker package stops the run now, not after the data is tokenized
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
        self.lengths, self.n_labels = train_ds["length"], train_ds["n_labeled"]  # host lists: no device sync
        self.train_ds = train_ds.select_columns(["input_ids", "labels"])
        self.eval_rows = eval_ds.to_list()
        self.processbench = "first_error" in eval_ds.column_names
        self.global_batch = cfg.batch_size * cfg.grad_accum * rt.world_size
        self.steps_per_epoch = math.ceil(len(train_ds) / self.global_batch)
        self.total = cfg.max_steps if cfg.max_steps > 0 else max(1, math.ceil(cfg.epochs * self.steps_per_epoch))
        self.plan_epoch, self.plan = None, None

    def _setup_model(self):
        self.model = model_for(self.cfg, self.tokenizer).to(self.rt.device)
        if self.cfg.gradient_checkpointing:
            enable_activation_checkpointing(self.model.backbone)
        self.amp_dtype = autocast_dtype(self.cfg.dtype, self.rt.device)

    def _setup_optimizer(self):
        cfg, rt = self.cfg, self.rt
        self.optimizer = make_optimizer(self.model, cfg, cfg.lr, rt.device)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg.warmup_steps, self.total))
        self.scaler = torch.amp.GradScaler(rt.device.type, enabled=self.amp_dtype == torch.float16)
        self.step = 0
        resume = resolve_resume(cfg.resume, cfg.output_dir) if cfg.resume else None
        if resume:  # before compile and DDP: they wrap the weights loaded here
            self.step = load_checkpoint(resume, self.model, self.optimizer, self.scheduler, self.scaler)
            self.say(f"resumed from {resume} at step {self.step}")
        self.train_model = self.model  # what the forward runs; self.model stays the plain PRM
        if cfg.compile:  # batch widths vary: one symbolic-shape graph at once, not a static one and then a recompile
            self.train_model = torch.compile(self.train_model, dynamic=True)
        if rt.distributed:
            self.train_model = DDP(self.train_model, device_ids=[rt.local_rank] if rt.device.type == "cuda" else None)

    def _setup_output(self):
        cfg, rt = self.cfg, self.rt
        if rt.is_main:
            cfg.save(cfg.output_dir)
        self.pbar = tqdm(total=self.total, initial=self.step, disable=not rt.is_main, desc="train")
        self.metrics = TrainLog(os.path.join(cfg.output_dir, "metrics.jsonl") if rt.is_main else None, rt, self.pbar,
                                lengths=self.lengths, n_labels=self.n_labels, n_chunks=rt.world_size * cfg.grad_accum,
                                tracker=Tracker(cfg) if rt.is_main and cfg.report_to != "none" else None)
        trainable, n_params = count_parameters(self.model)
        self.say(f"{n_params / 1e6:.1f}M parameters, {trainable / 1e6:.2f}M trainable "
                 f"({100 * trainable / n_params:.2f}%) | {len(self.train_ds)} train examples | global batch "
                 f"{self.global_batch} | {self.total} steps | autocast {self.amp_dtype or 'off'} | "
                 f"world {rt.world_size}")

    def train(self) -> dict:
        cfg = self.cfg
        self.train_model.train()
        while self.step < self.total:
            t0 = time.perf_counter()
            epoch, position = divmod(self.step, self.steps_per_epoch)
            batch = self.batch_plan(epoch)[position]
            # forward backward update
            sums, norm = self.train_step(batch)
            self.step += 1
            # logging: the loss sums stay on device until a log step
            self.metrics.add(self.step, batch, sums, norm, t0=t0, epoch=epoch, lr=self.scheduler.get_last_lr()[0],
                             write=self.step % cfg.log_every == 0 or self.step == self.total)
            # evaluation, checkpoint, preemption
            if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < self.total:
                self.metrics.write({"step": self.step, **{f"eval_{k}": v for k, v in self.evaluate().items()}})
            stop = agree_to_stop(self.rt)
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
            ids, mask, labels = self.to_device(collate(self.rows(idx), self.pad_id))
            # DDP all-reduces gradients in every backward; the last micro-batch's all-reduce covers them all
            last = a == len(micro) - 1
            with self.train_model.no_sync() if rt.distributed and not last else contextlib.nullcontext():
                with self.autocast():
                    logits = self.train_model(ids, mask)  # (B, T, 2)
                # divided by the labels of the whole global batch, so accumulation and ranks weight every label equally
                loss, ce_sum, n_correct = step_loss(logits, labels, n_labels)
                # DDP averages gradients over ranks; scaling by world size turns that back into the global sum
                self.scaler.scale(loss * rt.world_size).backward()
            sums += torch.stack([ce_sum, n_correct.float()])
        self.scaler.unscale_(self.optimizer)  # clip the true gradients, not fp16-scaled ones
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm or float("inf"))
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return sums, norm

    def rows(self, idx: list) -> list:
        cols = self.train_ds[idx]
        return [{"input_ids": i, "labels": y} for i, y in zip(cols["input_ids"], cols["labels"])]

    def to_device(self, mb: dict) -> tuple:
        if self.rt.device.type == "cuda":  # page-locked host memory makes the non_blocking copies truly asynchronous
            mb = {k: v.pin_memory() for k, v in mb.items()}
        return tuple(mb[k].to(self.rt.device, non_blocking=True) for k in ("input_ids", "attention_mask", "labels"))

    def autocast(self):
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.rt.device.type, dtype=self.amp_dtype)

    def evaluate(self) -> dict:
        """The held-out metrics, by the same route as eval.py (prm.evaluate: predict, then report)."""
        probs = predict(self.model, self.eval_rows, batch_size=self.cfg.eval_batch_size, pad_id=self.pad_id,
                        amp_dtype=self.amp_dtype, rt=self.rt)
        return report(probs, self.eval_rows, self.cfg.threshold, self.processbench)

    def save_checkpoint(self):
        barrier(self.rt)
        if self.rt.is_main:
            save_checkpoint(self.cfg.output_dir, self.step, model=self.model, optimizer=self.optimizer,
                            scheduler=self.scheduler, scaler=self.scaler, tokenizer=self.tokenizer, cfg=self.cfg)
        barrier(self.rt)

    def stop(self):
        name = signal.Signals(PREEMPTED["signal"]).name if PREEMPTED["signal"] else "a signal on another rank"
        self.say(f"stopped by {name} after step {self.step}; checkpoint saved. Continue with --resume auto")
        self.pbar.close()
        raise SystemExit(128 + (PREEMPTED["signal"] or signal.SIGTERM))

    def finish(self) -> dict:
        """Final evaluation, then final/ (weights, tokenizer, config, model card) and the last metrics record."""
        final = self.evaluate()
        final["train_tokens_per_second"], final["padding_efficiency"] = self.metrics.throughput()
        final["train_data"], final["eval_data"] = self.train_report, self.eval_report
        barrier(self.rt)
        if self.rt.is_main:
            save_final(self.cfg.output_dir, model=self.model, tokenizer=self.tokenizer, cfg=self.cfg,
                       card=model_card(self.cfg, final, self.command))
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
    """The log line and metrics.jsonl (rank 0), and the throughput figures.

    Loss and accuracy sums stay on device until a log step; then one all-reduce, the only device sync."""

    def __init__(self, path, rt: Runtime, pbar, *, lengths: list, n_labels: list, n_chunks: int, tracker=None):
        self.rt, self.pbar, self.lengths, self.labels_of, self.n_chunks = rt, pbar, lengths, n_labels, n_chunks
        self.tracker = tracker  # prm.tracking.Tracker: TensorBoard / W&B get every record written here
        self.file = open(path, "a") if path else None
        self.window = torch.zeros(2, device=rt.device)  # (cross-entropy sum, correct) since the last log line
        self.n_labels, self.tokens, self.seconds = 0, 0, 0.0  # the same window, on the host
        self.total_tokens, self.total_padded, self.total_seconds = 0, 0, 0.0

    def add(self, step: int, batch: list, sums, norm, *, t0: float, epoch: int, lr: float, write: bool):
        """One optimizer step done: sums = this rank's (cross-entropy sum, correct), norm = the gradient norm."""
        tokens = sum(self.lengths[i] for i in batch)  # non-pad tokens of the global batch, every rank's share
        self.window += sums
        self.n_labels += sum(self.labels_of[i] for i in batch)
        self.tokens, self.total_tokens = self.tokens + tokens, self.total_tokens + tokens
        self.total_padded += padded_tokens(batch, self.lengths, self.n_chunks)
        self.pbar.update(1)
        if not write:
            self.seconds += time.perf_counter() - t0
            return
        stats = all_reduce_sum(torch.cat([self.window, norm.detach().float().view(1)]), self.rt).tolist()  # one sync
        self.seconds += time.perf_counter() - t0  # timed after the sync, so queued device work is counted
        n = max(self.n_labels, 1)
        self.write({"step": step, "loss": stats[0] / n, "acc": stats[1] / n, "lr": lr,
                    "norm": stats[2] / self.rt.world_size, "tok_per_s": self.tokens / self.seconds, "epoch": epoch})
        self.window.zero_()
        self.total_seconds += self.seconds
        self.n_labels, self.tokens, self.seconds = 0, 0, 0.0

    def throughput(self) -> tuple:
        """(non-pad tokens per second of training, non-pad tokens / tokens processed with padding)."""
        return self.total_tokens / max(self.total_seconds, 1e-9), self.total_tokens / max(self.total_padded, 1)

    def write(self, rec: dict, echo: bool = True):
        if self.file is None:
            return
        self.file.write(json.dumps(rec) + "\n")
        self.file.flush()
        if self.tracker is not None:
            self.tracker.log(rec)
        if not echo:
            return
        if "loss" in rec:
            msg = (f"step {rec['step']} | loss {rec['loss']:.4f} | acc {rec['acc']:.3f} | lr {rec['lr']:.2e} | "
                   f"norm {rec['norm']:.2f} | {rec['tok_per_s'] / 1000:.1f}k tok/s")
        else:
            msg = " | ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in rec.items())
        self.pbar.write(msg)

    def close(self):
        if self.file is not None:
            self.file.close()
        if self.tracker is not None:
            self.tracker.close()
