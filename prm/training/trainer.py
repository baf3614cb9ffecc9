"""The training loop: train() over train_step(); parallelism, checkpoints and logging behind Parallel,
Checkpointer and TrainLog. "step" is an optimizer step; "n_labeled" counts reasoning steps."""
from __future__ import annotations

from contextlib import nullcontext
import json
import math
import os
import random
import signal
import time
import traceback

import torch
from tqdm import tqdm
from transformers import get_scheduler

from prm.config import Config
from prm.core.data import collate, global_batches, micro_batches, pack, pad_token_id
from prm.core.evaluate import predict, report
from prm.core.lora import count_parameters
from prm.core.model import enable_activation_checkpointing, is_classifier, step_loss
from prm.core.runtime import (Runtime, all_reduce_sum, autocast_dtype, barrier, main_first, progress_off, setup,
                              teardown)
from prm.core.varlen import is_packed
from prm.errors import Stopped, UsageError
from prm.readers.ingest import tokenize_dataset
from prm.readers.sources import load_splits
from prm.training.build import check_exportable, model_for, tokenizer_for
from prm.training.card import config_command, model_card
from prm.training.checkpoint import Checkpointer, run_lock
from prm.files import write_lines
from prm.training.sharding import Parallel
from prm.training.tracking import Tracker, require
from prm.training.trainlog import MetricsFile, TrainLog, count


def train(cfg: Config, command: str = "") -> dict:
    """Runs one training; returns the final held-out metrics on rank 0, None elsewhere. command: what started
    the run, for the model card (default: an equivalent train.py line)."""
    return train_resolved(cfg.resolve(), command or config_command(cfg))


def train_resolved(cfg: Config, command: str) -> dict:
    """train() of a resolved Config (as parse_config returns it)."""
    require(cfg.report_to)
    rt = setup()
    try:
        with run_lock(cfg.output_dir) if rt.is_main else nullcontext():
            return Trainer(cfg, rt, command).train()
    except BaseException as e:
        # the frames hold the model, which holds the process group teardown ends
        traceback.clear_frames(e.__traceback__)
        raise
    finally:
        teardown(rt)


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


def make_scheduler(optimizer, cfg: Config, total: int):
    """transformers' --lr-scheduler-type schedule over `total` steps after --warmup-steps (else --warmup-ratio,
    rounded up); cosine_with_min_lr ends at 10% of --lr."""
    warmup = int(cfg.warmup_steps) or math.ceil(cfg.warmup_ratio * total)
    extra = {"min_lr_rate": 0.1} if cfg.lr_scheduler_type == "cosine_with_min_lr" else None
    return get_scheduler(cfg.lr_scheduler_type, optimizer, num_warmup_steps=warmup, num_training_steps=total,
                         scheduler_specific_kwargs=extra)


class BatchPlan:
    """Which examples each optimizer step trains, for the Trainer and the benchmark: each epoch's global batches
    are a pure function of (seed, epoch), so a resume needs no loader state. lengths, n_labeled: per example,
    its non-pad tokens and labeled steps (host lists)."""

    def __init__(self, cfg: Config, lengths: list, n_labeled: list, world_size: int):
        self.cfg, self.lengths, self.n_labeled = cfg, lengths, n_labeled
        self.global_batch = cfg.batch_size * cfg.grad_accum * world_size
        self.steps_per_epoch = math.ceil(len(lengths) / self.global_batch)
        # --max-steps, else --epochs passes over the data (one step at least)
        self.total = cfg.max_steps if cfg.max_steps > 0 else max(1, math.ceil(cfg.epochs * self.steps_per_epoch))
        self.epoch, self.batches = None, None

    def batch(self, step: int) -> tuple:
        """(epoch, global batch: a list of dataset indices) of the optimizer step that follows `step` steps."""
        epoch, position = divmod(step, self.steps_per_epoch)
        if epoch != self.epoch:
            self.epoch = epoch
            self.batches = global_batches(self.lengths, self.global_batch, self.cfg.seed, epoch,
                                          self.cfg.group_by_length)
        return epoch, self.batches[position]

    def tokens(self, batch) -> int:
        return sum(self.lengths[i] for i in batch)

    def labeled(self, batch) -> int:
        return sum(self.n_labeled[i] for i in batch)


class Trainer:
    """Set-up in __init__, one _setup_* per concern, the checkpointer deciding and loading a resume; then
    train(): a loop over train_step()."""
    cfg: Config  # resolved: checked, the auto fields filled
    rt: Runtime  # rank, world size, device
    command: str  # what started the run, for the model card
    quiet: bool  # no progress bars: --disable-tqdm, or stderr is no terminal
    checkpointer: Checkpointer  # the output directory, checkpoints and resume
    tokenizer: object
    pad_id: int
    plan: BatchPlan  # which examples each optimizer step trains
    train_ds: object  # datasets.Dataset of input_ids, labels
    eval_rows: list  # the held-out set, tokenized
    processbench: bool  # the held-out rows carry a first error
    train_report: dict
    eval_report: dict
    model: torch.nn.Module  # the plain PRM
    packed: bool  # micro-batches packed into one row (else padded)
    amp_dtype: torch.dtype  # autocast dtype; None: fp32
    parallel: Parallel  # the model as the loop runs it
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler  # fp16 loss scaling; a no-op otherwise
    step: int  # optimizer steps done
    eval_every: int  # steps between held-out evaluations; 0: the final one alone
    pbar: tqdm
    out: MetricsFile
    log: TrainLog

    def __init__(self, cfg: Config, rt: Runtime, command: str):
        self.cfg, self.rt, self.command = cfg, rt, command
        random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        self.say = print if rt.is_main else (lambda *a, **k: None)
        # no bars with --disable-tqdm or without a terminal; before the data: datasets' bars follow it
        self.quiet = progress_off(self.cfg.disable_tqdm)
        # a refused run, resume or model loads no data; bad rows are reported before any weight loads
        self.checkpointer = Checkpointer(self.cfg, rt)
        check_exportable(self.cfg)
        self._setup_data()
        self._setup_model()
        self._setup_optimizer()
        # restored in place on a resume
        self.step = self.checkpointer.load(parallel=self.parallel, optimizer=self.optimizer, scaler=self.scaler,
                                           scheduler=self.scheduler, tokenizer=self.tokenizer, plan=self.plan)
        self._setup_output()

    def _setup_data(self):
        cfg, rt, digests = self.cfg, self.rt, self.checkpointer.digests
        self.tokenizer = tokenizer_for(cfg)
        self.pad_id = pad_token_id(self.tokenizer)
        # rank 0 fills the datasets cache, then the other ranks read it
        with main_first(rt):
            train_raw, eval_raw = load_splits(cfg, {cfg.dataset: digests["train"], cfg.eval_dataset: digests["eval"]})
            train_ds, self.train_report = tokenize_dataset(train_raw, self.tokenizer, cfg, is_eval=False,
                                                           num_proc=cfg.num_proc)
            eval_ds, self.eval_report = tokenize_dataset(eval_raw, self.tokenizer, cfg, is_eval=True,
                                                         num_proc=cfg.num_proc, drop_unlabeled=False)
        self.say(f"train data: {json.dumps(self.train_report)}\neval data: {json.dumps(self.eval_report)}")
        if len(train_ds) == 0:
            raise UsageError(f"no training example has a labeled step left (--max-length {cfg.max_length}, "
                             f"--max-completion-length {cfg.max_completion_length}): see the report")
        # [:] because datasets 5 returns a lazy Column, whose every [i] slices Arrow
        self.plan = BatchPlan(cfg, train_ds["length"][:], train_ds["n_labeled"][:], rt.world_size)
        self.train_ds = train_ds.select_columns(["input_ids", "labels"])
        self.eval_rows, self.processbench = eval_ds.to_list(), "first_error" in eval_ds.column_names

    def _setup_model(self):
        cfg, rt = self.cfg, self.rt
        self.model = model_for(cfg, self.tokenizer).to(rt.device)
        if cfg.model != "tiny" and not self.checkpointer.resume_from and not is_classifier(self.model.config):
            self.say(f"--model {cfg.model}: a backbone: the PRM head is new (drawn as transformers "
                     "draws a classifier's)")
        self.packed = is_packed(self.model)
        if cfg.gradient_checkpointing:
            enable_activation_checkpointing(self.model.backbone)
        self.amp_dtype = autocast_dtype(cfg.dtype, rt.device)
        # bf16 weights need bf16 inputs
        if cfg.lora_base_dtype == "bf16" and self.amp_dtype != torch.bfloat16:
            raise UsageError(f"--lora-base-dtype bf16: --dtype {cfg.dtype or 'auto'} gives no bf16 autocast on "
                             f"{rt.device}")
        self.parallel = Parallel(self.model, rt, cfg=cfg, amp_dtype=self.amp_dtype, packed=self.packed)

    def _setup_optimizer(self):
        cfg = self.cfg
        self.optimizer = make_optimizer(self.model, cfg, cfg.lr, self.rt.device)
        self.scheduler = make_scheduler(self.optimizer, cfg, self.plan.total)
        self.scaler = torch.amp.GradScaler(self.rt.device.type, enabled=self.amp_dtype == torch.float16)

    def _setup_output(self):
        cfg, rt, plan = self.cfg, self.rt, self.plan
        if rt.is_main:
            cfg.save(cfg.output_dir)
        self.eval_every = cfg.every("eval", plan.steps_per_epoch)
        self.pbar = tqdm(total=plan.total, initial=self.step, desc="train", disable=not rt.is_main or self.quiet)
        tracker = Tracker(cfg, self.step) if rt.is_main and cfg.report_to != "none" else None
        self.out = MetricsFile(os.path.join(cfg.output_dir, "metrics.jsonl") if rt.is_main else None, self.pbar,
                               tracker=tracker)
        hint = f"Lower --lr (now {cfg.lr:g}) or add --warmup-steps" + \
            ("; or train in bf16 instead of fp16" if cfg.dtype == "fp16" else "")
        self.log = TrainLog(rt, self.out, plan, resumed_at=self.step, n_chunks=rt.world_size * cfg.grad_accum,
                            pack_to=cfg.pack_to if self.packed else None, check_norm=not self.scaler.is_enabled(),
                            hint=hint)
        trainable, n_params = count_parameters(self.model)
        # the non-pad tokens of the steps this run takes
        tokens = sum(plan.lengths) * (plan.total - self.step) / plan.steps_per_epoch
        self.say(f"{n_params / 1e6:.1f}M parameters, {trainable / 1e6:.2f}M trainable "
                 f"({100 * trainable / n_params:.2f}%) | {len(self.train_ds)} train examples | global batch "
                 f"{plan.global_batch} | {plan.total - self.step} steps, ~{count(tokens)} tokens | autocast "
                 f"{self.amp_dtype or 'off'} | world {rt.world_size}")

    def train(self) -> dict:
        self.parallel.forward.train()
        with Preemption() as preemption:
            while self.step < self.plan.total:
                t0 = time.perf_counter()
                epoch, batch = self.plan.batch(self.step)
                # forward backward update
                sums, norm = self.train_step(batch)
                self.step += 1
                # logging: the loss sums stay on device until a log step
                log = self.step % self.cfg.log_every == 0 or self.step == self.plan.total
                self.log.add(self.step, batch, sums, norm, t0=t0, epoch=epoch,
                             lr=self.scheduler.get_last_lr()[0], write=log)
                # evaluation, preemption, checkpoint (finish() evaluates the last step)
                if self.eval_every and self.step % self.eval_every == 0 and self.step < self.plan.total:
                    self.out.write({"step": self.step, **{f"eval_{k}": v for k, v in self.evaluate().items()}})
                # a collective every step: torchrun SIGKILLs 30 s after its SIGTERM
                stop = preemption.agreed(self.rt)
                if stop:
                    self.log.write()
                if stop or self.checkpointer.due(self.step):
                    # never a checkpoint of non-finite weights (a device sync)
                    self.log.stop_if_diverged()
                    self.checkpointer.save(self.step)
                if stop:
                    self.pbar.close()
                    raise preemption.stopped(self.step)
        self.pbar.close()
        return self.finish()

    def train_step(self, batch: list):
        """One optimizer step on one global batch; returns this rank's (cross-entropy sum, correct) on device,
        and the gradient norm."""
        cfg, rt = self.cfg, self.rt
        n_labeled = self.plan.labeled(batch)
        micro = micro_batches(batch, self.plan.lengths, rt.world_size, rt.rank, cfg.grad_accum)
        sums = torch.zeros(2, device=rt.device)
        for a, idx in enumerate(micro):
            inputs = self.micro_batch(idx)
            labels = inputs.pop("labels")  # (B, T); packed: (1, N)
            with self.parallel.grad_sync(last=a == len(micro) - 1):
                with torch.autocast(rt.device.type, dtype=self.amp_dtype) if self.amp_dtype else nullcontext():
                    logits = self.parallel.forward(**inputs)  # (B, T, 2); packed: (1, N, 2)
                # over the labels of the whole global batch: accumulation and ranks weight each label alike
                loss, ce_sum, n_correct = step_loss(logits, labels, n_labeled)
                # DDP averages gradients over ranks; scaling by world size turns that back into the global sum
                self.scaler.scale(loss * rt.world_size).backward()
            sums += torch.stack([ce_sum, n_correct.float()])
        # clip the true gradients, not fp16-scaled ones
        self.scaler.unscale_(self.optimizer)
        norm = self.parallel.clip_grad_norm(cfg.max_grad_norm)
        # 1.0 without fp16; with it, a device sync
        scale = self.scaler.get_scale()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        # a lower scale: inf gradients skipped the update; HF's Trainer skips the schedule then too
        if self.scaler.get_scale() >= scale:
            self.scheduler.step()
        return sums, norm

    def micro_batch(self, idx: list) -> dict:
        """The model's keyword arguments and the labels, on the device: one packed row, or padded rows."""
        cols = self.train_ds[idx]
        rows = [{"input_ids": i, "labels": y} for i, y in zip(cols["input_ids"], cols["labels"])]
        mb = pack(rows, self.pad_id, self.cfg.pack_to) if self.packed else collate(rows, self.pad_id)
        # pinned memory makes the copies asynchronous
        pin = self.rt.device.type == "cuda"
        on_device = lambda v: (v.pin_memory() if pin else v).to(self.rt.device, non_blocking=True)
        return {k: on_device(v) if torch.is_tensor(v) else v for k, v in mb.items()}

    def evaluate(self) -> dict:
        """The held-out metrics, by eval.py's route."""
        cfg = self.cfg
        probs = predict(self.model, self.eval_rows, batch_size=cfg.eval_batch_size, pad_id=self.pad_id,
                        amp_dtype=self.amp_dtype, rt=self.rt, lockstep=cfg.fsdp, progress=not cfg.disable_tqdm)
        return report(probs, self.eval_rows, cfg.threshold, self.processbench)

    def finish(self) -> dict:
        """final/ first (a failed evaluation never costs the weights), then the final evaluation, the model
        card and the last metrics record."""
        self.log.stop_if_diverged()
        path = self.checkpointer.save_final(self.step)
        results = self.evaluate()
        results["train_tokens_per_second"], results["padding_efficiency"] = self.log.throughput()
        results["train_data"], results["eval_data"] = self.train_report, self.eval_report
        if self.rt.is_main:
            card = model_card(self.cfg, results, self.command)
            write_lines(os.path.join(path, "README.md"), [card.removesuffix("\n")])
            self.out.write({"step": self.step, "final": results}, echo=False)
            self.out.close()
        barrier(self.rt)
        return results if self.rt.is_main else None


class Preemption:
    """In the block, SIGTERM/SIGINT finish the optimizer step, save a checkpoint and stop with 128 + signal; a
    second signal stops at once."""
    signum: int = None  # the signal received in the loop; None: none

    def __enter__(self):
        self.signum = None
        self.old = {s: signal.signal(s, self.on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        return self

    def __exit__(self, *exc):
        for s, handler in self.old.items():
            signal.signal(s, handler)

    def on_signal(self, signum, frame):
        if self.signum is not None:  # asked twice: stop now, without a checkpoint
            raise Stopped(f"stopped by {signal.Signals(signum).name} again: no checkpoint saved", signum)
        self.signum = signum

    def agreed(self, rt: Runtime) -> bool:
        """Whether to stop now; under DDP every rank stops at the same step, even if one was signalled."""
        if not rt.distributed:
            return self.signum is not None
        return all_reduce_sum(torch.tensor([float(self.signum is not None)], device=rt.device), rt).item() > 0

    def stopped(self, step: int) -> Stopped:
        name = signal.Signals(self.signum).name if self.signum else "a signal on another rank"
        return Stopped(f"stopped by {name} after step {step}; checkpoint saved. Continue with --resume auto",
                       self.signum or signal.SIGTERM)
