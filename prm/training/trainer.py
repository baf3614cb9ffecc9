"""The training loop. "step": an optimizer step; "n_labeled": a count of labeled reasoning steps."""
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
from prm.core.runtime import (Runtime, all_reduce_sum, autocast_dtype, barrier, main_first,
                              progress_off, setup, teardown)
from prm.core.varlen import is_packed
from prm.errors import Stopped, UsageError
from prm.readers.ingest import tokenize_dataset
from prm.readers.sources import load_splits
from prm.loading import check_exportable, model_for, tokenizer_for
from prm.training.card import config_command, model_card
from prm.training.checkpoint import Checkpointer, run_lock
from prm.files import write_lines
from prm.training.sharding import Parallel
from prm.training.tracking import Tracker, require
from prm.training.trainlog import MetricsFile, TrainLog, count


def train(cfg: Config, command: str = "") -> dict:
    """The final held-out metrics on rank 0, None elsewhere. command: for the model card."""
    return train_resolved(cfg.resolve(), command or config_command(cfg))


def train_resolved(cfg: Config, command: str) -> dict:
    """train() of a resolved Config (parse_config's)."""
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
    """AdamW, no decay on biases/norms; fused where it exists."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    kw = dict(lr=lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon)
    try:
        return torch.optim.AdamW(groups, **kw, fused=device.type in ("cuda", "cpu"))
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(groups, **kw, foreach=True)


def make_scheduler(optimizer, cfg: Config, total: int):
    """--lr-scheduler-type after the warmup; cosine_with_min_lr ends at 10% of --lr."""
    warmup = int(cfg.warmup_steps) or math.ceil(cfg.warmup_ratio * total)
    extra = {"min_lr_rate": 0.1} if cfg.lr_scheduler_type == "cosine_with_min_lr" else None
    return get_scheduler(cfg.lr_scheduler_type, optimizer, num_warmup_steps=warmup,
                         num_training_steps=total, scheduler_specific_kwargs=extra)


class BatchPlan:
    """Each step's examples: a pure function of (seed, epoch), so a resume needs no loader state.
    lengths, n_labeled: host lists, per example."""

    def __init__(self, cfg: Config, lengths: list, n_labeled: list, world_size: int):
        self.cfg, self.lengths, self.n_labeled = cfg, lengths, n_labeled
        self.global_batch = cfg.batch_size * cfg.grad_accum * world_size
        self.steps_per_epoch = math.ceil(len(lengths) / self.global_batch)
        # --max-steps, else --epochs passes (one step at least)
        epochs = math.ceil(cfg.epochs * self.steps_per_epoch)
        self.total = cfg.max_steps if cfg.max_steps > 0 else max(1, epochs)
        self.epoch = self.batches = None

    def batch(self, step: int) -> tuple:
        """(epoch, dataset indices) of the step after `step` steps."""
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
    cfg: Config  # resolved
    rt: Runtime
    command: str  # for the model card
    quiet: bool  # no progress bars
    checkpointer: Checkpointer
    tokenizer: object
    pad_id: int
    plan: BatchPlan
    train_ds: object  # datasets.Dataset of input_ids, labels
    eval_rows: list
    processbench: bool  # the held-out rows carry a first error
    reports: dict  # tokenize_dataset's
    model: torch.nn.Module  # the plain PRM
    packed: bool  # else padded
    amp_dtype: torch.dtype  # None: fp32
    parallel: Parallel  # the model as the loop runs it
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler  # a no-op without fp16
    step: int  # optimizer steps done
    eval_every: int  # 0: the final evaluation alone
    pbar: tqdm
    out: MetricsFile
    log: TrainLog

    def __init__(self, cfg: Config, rt: Runtime, command: str):
        self.cfg, self.rt, self.command = cfg, rt, command
        random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        self.say = print if rt.is_main else (lambda *a: None)
        # before the data: datasets' bars follow it
        self.quiet = progress_off(cfg.disable_tqdm)
        # a refused run loads no data; bad rows are reported before any weight loads
        self.checkpointer = Checkpointer(cfg, rt)
        check_exportable(cfg)
        self._setup_data()
        self._setup_model()
        # restored in place on a resume
        self.step = self.checkpointer.load(
            parallel=self.parallel, optimizer=self.optimizer, scaler=self.scaler,
            scheduler=self.scheduler, tokenizer=self.tokenizer, plan=self.plan)
        self._setup_output()

    def _setup_data(self):
        cfg, rt, digests = self.cfg, self.rt, self.checkpointer.digests
        self.tokenizer = tokenizer_for(cfg)
        self.pad_id = pad_token_id(self.tokenizer)
        # rank 0 fills the datasets cache, then the other ranks read it
        with main_first(rt):
            splits = {cfg.dataset: digests["train"], cfg.eval_dataset: digests["eval"]}
            train_raw, eval_raw = load_splits(cfg, splits)
            kw = dict(tokenizer=self.tokenizer, cfg=cfg, num_proc=cfg.num_proc)
            train_ds, train_report = tokenize_dataset(train_raw, is_eval=False, **kw)
            eval_ds, eval_report = tokenize_dataset(
                eval_raw, is_eval=True, drop_unlabeled=False, **kw)
        self.reports = {"train_data": train_report, "eval_data": eval_report}
        self.say(f"train data: {json.dumps(train_report)}\neval data: {json.dumps(eval_report)}")
        if len(train_ds) == 0:
            raise UsageError(
                f"no training example has a labeled step left (--max-length {cfg.max_length}, "
                f"--max-completion-length {cfg.max_completion_length}): see the report")
        # [:]: datasets 5 returns a lazy Column, whose every [i] slices Arrow
        self.plan = BatchPlan(cfg, train_ds["length"][:], train_ds["n_labeled"][:], rt.world_size)
        self.train_ds = train_ds.select_columns(["input_ids", "labels"])
        self.eval_rows = eval_ds.to_list()
        self.processbench = "first_error" in eval_ds.column_names

    def _setup_model(self):
        cfg, rt = self.cfg, self.rt
        self.model = model_for(cfg, self.tokenizer).to(rt.device)
        fresh = not self.checkpointer.resume_from and not is_classifier(self.model.config)
        if cfg.model != "tiny" and fresh:
            self.say(f"--model {cfg.model}: a backbone: the PRM head is new")
        self.packed = is_packed(self.model)
        if cfg.gradient_checkpointing:
            enable_activation_checkpointing(self.model.backbone)
        self.amp_dtype = autocast_dtype(cfg.dtype, rt.device)
        # bf16 weights need bf16 inputs
        if cfg.lora_base_dtype == "bf16" and self.amp_dtype != torch.bfloat16:
            raise UsageError(f"--lora-base-dtype bf16: --dtype {cfg.dtype or 'auto'} gives no "
                             f"bf16 autocast on {rt.device}")
        self.parallel = Parallel(
            self.model, rt, cfg=cfg, amp_dtype=self.amp_dtype, packed=self.packed)
        self.optimizer = make_optimizer(self.model, cfg, cfg.lr, rt.device)
        self.scheduler = make_scheduler(self.optimizer, cfg, self.plan.total)
        self.scaler = torch.amp.GradScaler(rt.device.type, enabled=self.amp_dtype == torch.float16)

    def _setup_output(self):
        cfg, rt, plan, main = self.cfg, self.rt, self.plan, self.rt.is_main
        if main:
            cfg.save(cfg.output_dir)
        self.eval_every = cfg.every("eval", plan.steps_per_epoch)
        quiet = not main or self.quiet
        self.pbar = tqdm(total=plan.total, initial=self.step, desc="train", disable=quiet)
        tracker = Tracker(cfg, self.step) if main and cfg.report_to != "none" else None
        path = os.path.join(cfg.output_dir, "metrics.jsonl") if main else None
        self.out = MetricsFile(path, self.pbar, tracker=tracker)
        fp16 = "; or train in bf16 instead of fp16" if cfg.dtype == "fp16" else ""
        hint = f"Lower --lr (now {cfg.lr:g}) or add --warmup-steps{fp16}"
        self.log = TrainLog(
            rt, self.out, plan, resumed_at=self.step, n_chunks=rt.world_size * cfg.grad_accum,
            pack_to=cfg.pack_to if self.packed else None, check_norm=not self.scaler.is_enabled(),
            hint=hint)
        trainable, n_params = count_parameters(self.model)
        steps = plan.total - self.step
        # the non-pad tokens of the steps this run takes
        tokens = sum(plan.lengths) * steps / plan.steps_per_epoch
        self.say(f"{n_params / 1e6:.1f}M parameters, {trainable / 1e6:.2f}M trainable "
                 f"({100 * trainable / n_params:.2f}%) | {len(self.train_ds)} train examples | "
                 f"global batch {plan.global_batch} | {steps} steps, ~{count(tokens)} tokens | "
                 f"autocast {self.amp_dtype or 'off'} | world {rt.world_size}")

    def train(self) -> dict:
        self.parallel.forward.train()
        total = self.plan.total
        with Preemption() as preemption, self.pbar:
            while self.step < total:
                t0 = time.perf_counter()
                epoch, batch = self.plan.batch(self.step)
                # forward backward update
                sums, norm = self.train_step(batch)
                self.step += 1
                # logging: the loss sums stay on device until a log step
                log = self.step % self.cfg.log_every == 0 or self.step == total
                self.log.add(self.step, batch, sums, norm, t0=t0, epoch=epoch,
                             lr=self.scheduler.get_last_lr()[0], write=log)
                # evaluation, preemption, checkpoint (finish() evaluates the last step)
                if self.eval_every and self.step % self.eval_every == 0 and self.step < total:
                    evals = {f"eval_{k}": v for k, v in self.evaluate().items()}
                    self.out.write({"step": self.step, **evals})
                # a collective every step: torchrun SIGKILLs 30 s after its SIGTERM
                stop = preemption.agreed(self.rt)
                if stop or self.checkpointer.due(self.step):
                    if stop:
                        self.log.write()
                    # never a checkpoint of non-finite weights (a device sync)
                    self.log.stop_if_diverged()
                    self.checkpointer.save(self.step)
                    if stop:
                        raise preemption.stopped(self.step)
        return self.finish()

    def train_step(self, batch: list):
        """One optimizer step: this rank's (cross-entropy sum, correct) on device, the grad norm."""
        cfg, rt = self.cfg, self.rt
        n_labeled = self.plan.labeled(batch)
        micro = micro_batches(batch, self.plan.lengths, rt.world_size, rt.rank, cfg.grad_accum)
        dtype = self.amp_dtype
        amp = torch.autocast(rt.device.type, dtype=dtype) if dtype else nullcontext()
        sums = torch.zeros(2, device=rt.device)
        for a, idx in enumerate(micro):
            inputs = self.micro_batch(idx)
            labels = inputs.pop("labels")  # (B, T); packed: (1, N)
            with self.parallel.grad_sync(last=a == len(micro) - 1):
                with amp:
                    logits = self.parallel.forward(**inputs)  # (B, T, 2); packed: (1, N, 2)
                # over the labels of the whole global batch: each label weighs alike
                loss, ce_sum, n_correct = step_loss(logits, labels, n_labeled)
                # DDP averages gradients over ranks: times world size is the global sum
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
        # a lower scale: inf gradients skipped the update; HF's Trainer skips the schedule too
        if self.scaler.get_scale() >= scale:
            self.scheduler.step()
        return sums, norm

    def micro_batch(self, idx: list) -> dict:
        """The model's keyword arguments and the labels, on the device."""
        cols = self.train_ds[idx]
        rows = [dict(zip(cols, row)) for row in zip(*cols.values())]
        pad = self.pad_id
        mb = pack(rows, pad, self.cfg.pack_to) if self.packed else collate(rows, pad)
        # pinned memory makes the copies asynchronous
        pin = self.rt.device.type == "cuda"
        on_device = lambda v: (v.pin_memory() if pin else v).to(self.rt.device, non_blocking=True)
        return {k: on_device(v) if torch.is_tensor(v) else v for k, v in mb.items()}

    def evaluate(self) -> dict:
        """The held-out metrics, by eval.py's route."""
        cfg = self.cfg
        probs = predict(
            self.model, self.eval_rows, batch_size=cfg.eval_batch_size, pad_id=self.pad_id,
            amp_dtype=self.amp_dtype, rt=self.rt, lockstep=cfg.fsdp, progress=not cfg.disable_tqdm)
        return report(probs, self.eval_rows, cfg.threshold, self.processbench)

    def finish(self) -> dict:
        """final/ first: a failed evaluation never costs the weights."""
        self.log.stop_if_diverged()
        path = self.checkpointer.save_final(self.step)
        results = self.evaluate()
        results["train_tokens_per_second"], results["padding_efficiency"] = self.log.throughput()
        results.update(self.reports)
        if self.rt.is_main:
            card = model_card(self.cfg, results, self.command)
            write_lines(os.path.join(path, "README.md"), [card.removesuffix("\n")])
            self.out.write({"step": self.step, "final": results}, echo=False)
            self.out.close()
        barrier(self.rt)
        return results if self.rt.is_main else None


class Preemption:
    """In the block, SIGTERM/SIGINT checkpoint after the step and stop; a second stops at once."""
    signum: int = None  # received in the block

    def __enter__(self):
        self.old = {s: signal.signal(s, self.on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        return self

    def __exit__(self, *exc):
        for s, handler in self.old.items():
            signal.signal(s, handler)

    def on_signal(self, signum, frame):
        if self.signum is not None:  # asked twice: stop now, without a checkpoint
            name = signal.Signals(signum).name
            raise Stopped(f"stopped by {name} again: no checkpoint saved", signum)
        self.signum = signum

    def agreed(self, rt: Runtime) -> bool:
        """Whether to stop now: every rank stops at the same step."""
        stop = self.signum is not None
        if rt.distributed:
            stop = all_reduce_sum(torch.tensor([float(stop)], device=rt.device), rt).item() > 0
        return stop

    def stopped(self, step: int) -> Stopped:
        name = signal.Signals(self.signum).name if self.signum else "a signal on another rank"
        return Stopped(f"stopped by {name} after step {step}; checkpoint saved. Continue with "
                       "--resume auto", self.signum or signal.SIGTERM)
