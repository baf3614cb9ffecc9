"""The hand-written training loop: train() over train_step(), with the model's parallel wrapping, evaluation,
checkpoints and logging each behind a small component that decides for itself. Depends on: torch, tqdm, prm.*.
"step" here is an optimizer step (--max-steps, checkpoint-<step>); "n_labeled" counts reasoning steps."""
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

from prm.training.build import check_exportable, model_for, tokenizer_for
from prm.training.card import config_command, model_card
from prm.training.checkpoint import (Checkpointer, load_checkpoint, read_marker, run_lock, set_aside_after,
                            write_card)
from prm.config import Config
from prm.core.data import collate, global_batches, micro_batches, pack, pad_token_id
from prm.errors import Stopped, UsageError, check
from prm.core.evaluate import predict, report
from prm.readers.ingest import tokenize_dataset
from prm.core.lora import count_parameters
from prm.core.model import enable_activation_checkpointing, is_classifier, step_loss
from prm.training.rundir import prepare_output_dir
from prm.core.runtime import (Runtime, all_reduce_sum, autocast_dtype, barrier, decided_by_main, main_first,
                         progress_off, setup, teardown)
from prm.training.sharding import Parallel
from prm.readers.sources import data_digest, load_splits
from prm.training.tracking import Tracker, require
from prm.training.trainlog import LogSettings, MetricsFile, TrainLog, count
from prm.core.varlen import is_packed


def train(cfg: Config, command: str = "") -> dict:
    """Runs one training from cfg as given (resolved here: Config.resolve); returns the final held-out metrics
    on rank 0, None on the other ranks. command: what started the run, for the model card (default: an
    equivalent train.py line from cfg)."""
    return train_resolved(cfg.resolve(), command or config_command(cfg))


def train_resolved(cfg: Config, command: str) -> dict:
    """train() of a resolved Config (as parse_config returns it): the Trainer takes it as it is."""
    require(cfg.report_to)  # a missing tracker package stops the run before anything is written
    rt = setup()
    try:  # rank 0 holds the output directory's lock: a second trainer there stops at once
        with run_lock(cfg.output_dir) if rt.is_main else nullcontext():
            return Trainer(cfg, rt, command).train()  # ends at a barrier
    except BaseException as e:  # its frames hold the model, which holds the process group teardown ends
        traceback.clear_frames(e.__traceback__)
        raise
    finally:
        teardown(rt)


DECAY = {"linear": lambda p: 1 - p, "cosine": lambda p: 0.5 * (1 + math.cos(math.pi * p)),
         "cosine_with_min_lr": lambda p: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)),
         "constant": lambda p: 1.0, "constant_with_warmup": lambda p: 1.0}  # p: progress after warmup, 0 to 1


def lr_lambda(cfg: Config, total: int):
    """Linear warmup (--warmup-steps, else --warmup-ratio of the steps), then --lr-scheduler-type's decay."""
    warmup = cfg.warmup_steps or math.ceil(cfg.warmup_ratio * total)

    def f(step):
        if step < warmup:  # as HF's: from 0 (the first step's lr), reaching --lr after the warmup
            return step / warmup
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
    """Set-up in __init__, top-down, one _setup_* per concern (data, model and parallelism, optimizer,
    resume, output); then train(): a loop over train_step()."""
    cfg: Config  # resolved (Config.resolve): checked, the auto fields filled, as the saved config says
    rt: Runtime  # rank, world size, device
    command: str  # what started the run, for the model card
    quiet: bool  # no progress bars: --disable-tqdm, or stderr is no terminal
    resume_from: str  # the checkpoint to continue from; None: a fresh start
    digests: dict  # {"train": sha256, "eval": sha256} of local data files ('' for hub or synthetic data)
    tokenizer: object
    pad_id: int
    train_ds: object  # datasets.Dataset of input_ids, labels
    lengths: list  # per training example: its non-pad tokens ...
    n_labeled: list  # ... and its labeled steps (host lists: no device sync)
    train_report: dict
    eval_report: dict
    global_batch: int  # examples per optimizer step, all ranks and micro-batches
    steps_per_epoch: int
    total: int  # the run's last optimizer step
    model: torch.nn.Module  # the plain PRM
    packed: bool  # micro-batches packed into one row (else padded)
    amp_dtype: torch.dtype  # autocast dtype; None: fp32
    parallel: Parallel  # the model as the loop runs it
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler  # fp16 loss scaling; a no-op otherwise
    step: int  # optimizer steps done
    held_out: HeldOut
    pbar: tqdm
    out: MetricsFile
    log: TrainLog
    checkpointer: Checkpointer

    def __init__(self, cfg: Config, rt: Runtime, command: str):
        self.cfg, self.rt, self.command = cfg, rt, command
        random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        self.say = print if rt.is_main else (lambda *a, **k: None)
        self.quiet = progress_off(self.cfg.disable_tqdm)  # before the data: datasets' bars follow it too
        # first: a refused run loads no data. Rank 0 alone reads the directory and hashes the checkpoint and
        # the data files (on a shared disk, once instead of once a rank); every rank gets its answer
        self.resume_from, self.digests = decided_by_main(rt, lambda: (prepare_output_dir(self.cfg), {
            "train": data_digest(self.cfg.dataset), "eval": data_digest(self.cfg.eval_dataset)}))
        if self.resume_from:  # nor does a refused resume: it reads the config, world size and digests
            self.check_resume(self.resume_from)
        check_exportable(self.cfg)  # nor does a model that final/ could not be saved from
        self._setup_data()  # data before model: bad rows are reported before any weight loads
        self._setup_model()
        self._setup_optimizer()
        self._setup_resume()
        self._setup_output()

    def check_resume(self, path: str):
        """Settings that define the model, the data or its order (or live in the optimizer state, like --lr)
        and the data files' contents must equal the checkpoint's; cadence settings may change (logged)."""
        marker = read_marker(path)
        bad, changed = self.cfg.resume_conflicts(Config.load(path), marker.get("world_size", 1),
                                                 self.rt.world_size)
        for split, spec in (("train", self.cfg.dataset), ("eval", self.cfg.eval_dataset)):
            saved = marker.get("data", {}).get(split)
            if saved and self.digests[split] and saved != self.digests[split]:
                bad.append(f"{spec} changed since the checkpoint (its contents differ)")
        check([f"--resume {path}: the checkpoint does not fit this model and data; these settings differ: "
               f"{'; '.join(bad)}. Use the checkpoint's, or start a new run"] if bad else [])
        if changed:
            self.say(f"resuming with changed settings: {'; '.join(changed)}")

    def _setup_data(self):
        cfg, rt = self.cfg, self.rt
        self.tokenizer = tokenizer_for(cfg)
        self.pad_id = pad_token_id(self.tokenizer)
        with main_first(rt):  # rank 0 fills the datasets cache; the other ranks then read it
            # files hashed once: the same digests key the rows cache and go in the checkpoints
            train_raw, eval_raw = load_splits(cfg, {cfg.dataset: self.digests["train"],
                                                    cfg.eval_dataset: self.digests["eval"]})
            train_ds, self.train_report = tokenize_dataset(train_raw, self.tokenizer, cfg, is_eval=False,
                                                           num_proc=cfg.num_proc)
            eval_ds, self.eval_report = tokenize_dataset(eval_raw, self.tokenizer, cfg, is_eval=True,
                                                         num_proc=cfg.num_proc, drop_unlabeled=False)
        self.say(f"train data: {json.dumps(self.train_report)}\neval data: {json.dumps(self.eval_report)}")
        if len(train_ds) == 0:
            raise UsageError(f"no training example has a labeled step left (--max-length {cfg.max_length}, "
                             f"--max-completion-length {cfg.max_completion_length}): see the report")
        # [:] because datasets 5 returns a lazy Column, whose every [i] slices Arrow
        self.lengths, self.n_labeled = train_ds["length"][:], train_ds["n_labeled"][:]
        self.train_ds = train_ds.select_columns(["input_ids", "labels"])
        self.eval_rows, self.processbench = eval_ds.to_list(), "first_error" in eval_ds.column_names
        self.global_batch = cfg.batch_size * cfg.grad_accum * rt.world_size
        self.steps_per_epoch = math.ceil(len(train_ds) / self.global_batch)
        epochs_steps = max(1, math.ceil(cfg.epochs * self.steps_per_epoch))
        self.total = cfg.max_steps if cfg.max_steps > 0 else epochs_steps
        self.plan_epoch, self.plan = None, None

    def _setup_model(self):
        cfg, rt = self.cfg, self.rt
        self.model = model_for(cfg, self.tokenizer).to(rt.device)
        if cfg.model != "tiny" and not self.resume_from and not is_classifier(self.model.config):
            self.say(f"--model {cfg.model}: a backbone: the PRM head is new (zero weights: P(correct) = 0.5 "
                     "at every step)")
        self.packed = is_packed(self.model)  # --packing on a backbone that supports it
        if cfg.gradient_checkpointing:
            enable_activation_checkpointing(self.model.backbone)
        self.amp_dtype = autocast_dtype(cfg.dtype, rt.device)
        if cfg.lora_base_dtype == "bf16" and self.amp_dtype != torch.bfloat16:  # bf16 weights, bf16 inputs
            raise UsageError(f"--lora-base-dtype bf16: --dtype {cfg.dtype or 'auto'} gives no bf16 autocast on "
                             f"{rt.device}")
        self.parallel = Parallel(self.model, rt, cfg=cfg, amp_dtype=self.amp_dtype, packed=self.packed)

    def _setup_optimizer(self):
        cfg = self.cfg
        self.optimizer = make_optimizer(self.model, cfg, cfg.lr, self.rt.device)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg, self.total))
        self.scaler = torch.amp.GradScaler(self.rt.device.type, enabled=self.amp_dtype == torch.float16)

    def _setup_resume(self):
        """Weights, optimizer, scheduler, scaler and RNG from the checkpoint, loaded in place into the
        (wrapped) model every rank holds; a fresh run starts at step 0."""
        self.step = 0
        if self.resume_from:
            done = read_marker(self.resume_from)["step"]
            if done > self.total:  # its weights would be exported as a run of fewer steps than they saw
                raise UsageError(f"--resume {self.resume_from}: the checkpoint is at step {done}, past this "
                                 f"run's last step {self.total} (--max-steps, --epochs): nothing to continue")
            self.step = load_checkpoint(self.resume_from, self.model, self.optimizer, self.scheduler,
                                        self.scaler)
            self.say(f"resumed from {self.resume_from} at step {self.step}")
            if self.rt.is_main:  # newer checkpoints: an abandoned timeline, set aside (not pruned or resumed)
                set_aside_after(self.cfg.output_dir, self.step)

    def _setup_output(self):
        cfg, rt, world, steps_per_epoch = self.cfg, self.rt, self.rt.world_size, self.steps_per_epoch
        if rt.is_main:
            cfg.save(cfg.output_dir)
        self.held_out = HeldOut(self.model, self.eval_rows, cfg=cfg, rt=rt, pad_id=self.pad_id,
                                every=cfg.every("eval", steps_per_epoch), amp_dtype=self.amp_dtype,
                                processbench=self.processbench)
        self.pbar = tqdm(total=self.total, initial=self.step, desc="train",
                         disable=not rt.is_main or self.quiet)
        tracker = Tracker(cfg, self.step) if rt.is_main and cfg.report_to != "none" else None
        path = os.path.join(cfg.output_dir, "metrics.jsonl") if rt.is_main else None
        self.out = MetricsFile(path, self.pbar, resumed_at=self.step, tracker=tracker)
        hint = f"Lower --lr (now {cfg.lr:g}) or add --warmup-steps" + \
            ("; or train in bf16 instead of fp16" if cfg.dtype == "fp16" else "")
        settings = LogSettings(total=self.total, resumed_at=self.step, n_chunks=world * cfg.grad_accum,
                               pack_to=cfg.pack_to if self.packed else None,
                               check_norm=not self.scaler.is_enabled(), hint=hint)
        self.log = TrainLog(settings, rt, self.out, lengths=self.lengths, n_labeled=self.n_labeled)
        self.checkpointer = Checkpointer(cfg, rt, self.parallel, every=cfg.every("save", steps_per_epoch),
                                         optimizer=self.optimizer, scheduler=self.scheduler,
                                         scaler=self.scaler, tokenizer=self.tokenizer,
                                         before_save=self.log.stop_if_diverged, digests=self.digests)
        trainable, n_params = count_parameters(self.model)
        # every epoch passes over every example once: its non-pad tokens, scaled to the steps this run takes
        tokens = sum(self.lengths) * (self.total - self.step) / self.steps_per_epoch
        self.say(f"{n_params / 1e6:.1f}M parameters, {trainable / 1e6:.2f}M trainable "
                 f"({100 * trainable / n_params:.2f}%) | {len(self.train_ds)} train examples | global batch "
                 f"{self.global_batch} | {self.total - self.step} steps, ~{count(tokens)} tokens | autocast "
                 f"{self.amp_dtype or 'off'} | world {rt.world_size}")

    def train(self) -> dict:
        self.parallel.forward.train()
        with Preemption() as preemption:
            while self.step < self.total:
                t0 = time.perf_counter()
                epoch, position = divmod(self.step, self.steps_per_epoch)
                batch = self.batch_plan(epoch)[position]
                # forward backward update
                sums, norm = self.train_step(batch)
                self.step += 1
                # logging: the loss sums stay on device until a log step, which also reads the divergence flag
                log = self.step % self.cfg.log_every == 0 or self.step == self.total
                self.log.add(self.step, batch, sums, norm, t0=t0, epoch=epoch,
                             lr=self.scheduler.get_last_lr()[0], write=log)
                # evaluation, checkpoint, preemption: each decides whether this step is its turn
                metrics = self.held_out.every(self.step, last_step=self.total)
                if metrics:
                    self.out.write({"step": self.step, **{f"eval_{k}": v for k, v in metrics.items()}})
                # every step, though a collective (a device sync): torchrun SIGKILLs 30 s after its SIGTERM
                stop = preemption.agreed(self.rt)
                if stop:  # the steps since the last log line, recorded before the checkpoint resumed from
                    self.log.write()
                self.checkpointer.save(self.step, stopping=stop)
                if stop:
                    self.pbar.close()
                    raise preemption.stopped(self.step)
        self.pbar.close()
        return self.finish()

    def batch_plan(self, epoch: int) -> list:
        # reshuffled every epoch; a pure function of (seed, epoch): resume needs no state
        if epoch != self.plan_epoch:
            self.plan_epoch = epoch
            self.plan = global_batches(self.lengths, self.global_batch, self.cfg.seed, epoch,
                                       self.cfg.group_by_length)
        return self.plan

    def train_step(self, batch: list):
        """One optimizer step on one global batch: forward and backward on this rank's micro-batches, then
        clip and update. Returns this rank's (cross-entropy sum, correct) on device, and the gradient norm."""
        cfg, rt = self.cfg, self.rt
        n_labeled = sum(self.n_labeled[i] for i in batch)  # every rank knows the global batch: no collective
        micro = micro_batches(batch, self.lengths, rt.world_size, rt.rank, cfg.grad_accum)
        sums = torch.zeros(2, device=rt.device)
        for a, idx in enumerate(micro):
            inputs = self.micro_batch(idx)
            labels = inputs.pop("labels")  # (B, T); packed: (1, N)
            with self.parallel.grad_sync(last=a == len(micro) - 1):
                with self.autocast():
                    logits = self.parallel.forward(**inputs)  # (B, T, 2); packed: (1, N, 2)
                # over the labels of the whole global batch: accumulation and ranks weight each label alike
                loss, ce_sum, n_correct = step_loss(logits, labels, n_labeled)
                # DDP averages gradients over ranks; scaling by world size turns that back into the global sum
                self.scaler.scale(loss * rt.world_size).backward()
            sums += torch.stack([ce_sum, n_correct.float()])
        self.scaler.unscale_(self.optimizer)  # clip the true gradients, not fp16-scaled ones
        norm = self.parallel.clip_grad_norm(cfg.max_grad_norm)
        scale = self.scaler.get_scale()  # 1.0 without fp16; with it, a device sync
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
        # page-locked host memory makes the non_blocking copies asynchronous; max_length stays a host int
        pin = self.rt.device.type == "cuda"
        on_device = lambda v: (v.pin_memory() if pin else v).to(self.rt.device, non_blocking=True)
        return {k: on_device(v) if torch.is_tensor(v) else v for k, v in mb.items()}

    def autocast(self):
        return torch.autocast(self.rt.device.type, dtype=self.amp_dtype) if self.amp_dtype else nullcontext()

    def finish(self) -> dict:
        """final/ first (a failed evaluation never costs the weights), then the final evaluation, the model
        card and the last metrics record."""
        path = self.checkpointer.save_final(self.step)
        results = self.held_out.run()
        results["train_tokens_per_second"], results["padding_efficiency"] = self.log.throughput()
        results["train_data"], results["eval_data"] = self.train_report, self.eval_report
        if self.rt.is_main:
            write_card(path, model_card(self.cfg, results, self.command))
            self.out.write({"step": self.step, "final": results}, echo=False)
            self.out.close()
        barrier(self.rt)
        return results if self.rt.is_main else None


class HeldOut:
    """The held-out metrics, by the same route as eval.py (prm.core.evaluate: predict, then report): every
    --eval-every steps, and at the end."""

    def __init__(self, model, rows: list, *, cfg: Config, rt: Runtime, every: int, pad_id: int, amp_dtype,
                 processbench: bool):
        self.model, self.rows, self.cfg, self.rt, self.interval = model, rows, cfg, rt, every  # 0: at the end
        self.pad_id, self.amp_dtype, self.processbench = pad_id, amp_dtype, processbench

    def every(self, step: int, *, last_step: int):
        """The metrics when --eval-every falls on `step` before the last (finish() does that one); or None."""
        return self.run() if self.interval and step % self.interval == 0 and step < last_step else None

    def run(self) -> dict:
        probs = predict(self.model, self.rows, batch_size=self.cfg.eval_batch_size, pad_id=self.pad_id,
                        amp_dtype=self.amp_dtype, rt=self.rt, lockstep=self.cfg.fsdp,
                        progress=not self.cfg.disable_tqdm)
        return report(probs, self.rows, self.cfg.threshold, self.processbench)


class Preemption:
    """In the loop, SIGTERM/SIGINT finish the optimizer step, save a checkpoint and stop with 128 + signal; a
    second signal stops at once. Outside the `with` block (set-up, final evaluation): their usual effect."""
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
