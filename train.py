"""Train a process reward model: `python train.py`, or `torchrun --nproc_per_node 8 train.py`.
Read top to bottom; tests and prm.bench import it and call train(cfg)."""
from prm.cli import parse_config  # light: no torch
from prm.errors import exit_status

if __name__ == "__main__":  # --help and a bad flag answer before torch loads
    with exit_status():
        CLI_CONFIG = parse_config()

import contextlib
import dataclasses
import datetime
import json
import math
import os
import random
import signal
import time
import traceback

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm
from transformers import get_scheduler

from prm.config import Config
from prm.core.data import (collate, global_batches, micro_batches, pack, pad_token_id,
                           padded_tokens)
from prm.core.evaluate import predict, report
from prm.core.lora import count_parameters
from prm.core.model import enable_activation_checkpointing, is_classifier, step_loss
from prm.core.runtime import (Runtime, autocast_dtype, barrier, main_first, progress_off, setup,
                              teardown)
from prm.core.varlen import is_packed
from prm.errors import Diverged, Stopped, UsageError, check
from prm.files import write_lines
from prm.loading import check_exportable, model_for, tokenizer_for
from prm.readers.ingest import tokenize_dataset
from prm.readers.sources import load_splits
from prm.training.report import (Tracker, config_command, launch_command, model_card, shown,
                                 tracker_module)
from prm.training.checkpoint import Checkpointer, State, run_lock


def train(cfg: Config, command: str = "") -> dict:
    """Rank 0: the final held-out metrics."""
    command = command or config_command(cfg)
    cfg = cfg.resolve()
    tracker_module(cfg.report_to)  # refuses a missing package before any work
    rt = setup()
    try:
        with run_lock(cfg.output_dir) if rt.is_main else contextlib.nullcontext():
            return fit(cfg, rt, command)
    except BaseException as e:
        # the frames hold the model, which holds the process group teardown ends
        traceback.clear_frames(e.__traceback__)
        raise
    finally:
        teardown(rt)


@dataclasses.dataclass
class Run:
    """The loop's state. "step": an optimizer step; "n_labeled": labeled solution steps."""
    cfg: Config  # resolved
    rt: Runtime
    plan: "BatchPlan"
    train_ds: object  # datasets.Dataset
    eval_rows: list
    processbench: bool  # the held-out rows carry a first error
    net: torch.nn.Module  # state.model compiled, DDP-wrapped or the same
    state: State  # what a checkpoint holds
    amp_dtype: torch.dtype  # None: fp32
    packed: bool
    step: int = 0


def fit(cfg: Config, rt: Runtime, command: str) -> dict:
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    quiet = progress_off(cfg.disable_tqdm)  # before the data: datasets' bars follow it
    # a refused resume loads no data; bad rows are seen before any weight
    checkpointer = Checkpointer(cfg, rt)
    check_exportable(cfg)
    run, reports = build(cfg, rt, checkpointer)
    if rt.is_main:
        cfg.save(cfg.output_dir)
    log = TrainLog(run, quiet)
    trainable, n_params = count_parameters(run.state.model)
    steps = run.plan.total - run.step
    tokens = sum(run.plan.lengths) * steps / run.plan.steps_per_epoch  # non-pad
    if rt.is_main:
        print(f"{n_params / 1e6:.1f}M parameters, {trainable / 1e6:.2f}M trainable "
              f"({100 * trainable / n_params:.2f}%) | {len(run.train_ds)} train examples | "
              f"global batch {run.plan.global_batch} | {steps} steps, ~{short_number(tokens)} "
              f"tokens | autocast {run.amp_dtype or 'off'} | world {rt.world_size}")
    with log.pbar:
        loop(run, checkpointer, log)
    # ---- the end: final/ first: a failed evaluation never costs the weights
    log.stop_if_diverged()
    path = checkpointer.save_final(run.step, run.state)
    results = evaluate(run)
    results["train_tokens_per_second"], results["padding_efficiency"] = log.throughput()
    results.update(reports)
    if rt.is_main:
        card = model_card(cfg, results, command)
        write_lines(os.path.join(path, "README.md"), [card.removesuffix("\n")])
        log.record({"step": run.step, "final": results}, echo=False)
        if log.tracker:
            log.tracker.close()
    barrier(rt)
    return results if rt.is_main else None


def build(cfg: Config, rt: Runtime, checkpointer: Checkpointer) -> tuple:
    """(the Run at its resume step, the tokenization reports)."""
    # ---- data
    tokenizer = tokenizer_for(cfg)
    digests = checkpointer.digests
    with main_first(rt):  # rank 0 fills the datasets cache, the others read it
        splits = {cfg.dataset: digests["train"], cfg.eval_dataset: digests["eval"]}
        train_raw, eval_raw = load_splits(cfg, splits)
        kw = dict(tokenizer=tokenizer, cfg=cfg, num_proc=cfg.num_proc)
        train_ds, train_report = tokenize_dataset(train_raw, is_eval=False, **kw)
        eval_ds, eval_report = tokenize_dataset(eval_raw, is_eval=True, drop_unlabeled=False, **kw)
    if len(train_ds) == 0:
        raise UsageError(f"no training example has a labeled step left (--max-length "
                         f"{cfg.max_length}, --max-completion-length {cfg.max_completion_length})")
    if rt.is_main:
        print(f"train data: {json.dumps(train_report)}\neval data: {json.dumps(eval_report)}")
    # [:]: a datasets 5 Column slices Arrow at every [i]
    plan = BatchPlan(cfg, train_ds["length"][:], train_ds["n_labeled"][:], rt.world_size)
    # ---- model (--lora-r, --packing)
    model = model_for(cfg, tokenizer).to(rt.device)
    new_head = cfg.model != "tiny" and not checkpointer.resume_from
    if rt.is_main and new_head and not is_classifier(model.config):
        print(f"--model {cfg.model}: a backbone: the PRM head is new")
    packed = is_packed(model)
    if cfg.gradient_checkpointing:
        enable_activation_checkpointing(model.backbone)
    amp_dtype = autocast_dtype(cfg.dtype, rt.device)
    if cfg.lora_base_dtype == "bf16" and amp_dtype != torch.bfloat16:  # bf16 weights need it
        raise UsageError(f"--lora-base-dtype bf16: --dtype {cfg.dtype or 'auto'} gives no "
                         f"bf16 autocast on {rt.device}")
    # ---- DDP or FSDP2
    net = wrap(model, cfg, rt, amp_dtype, packed)
    # ---- optimizer and schedule
    optimizer = make_optimizer(model, cfg, rt.device)
    scheduler = make_scheduler(optimizer, cfg, plan.total)
    # fp16: the loss scaled up so that small gradients survive
    scaler = torch.amp.GradScaler(rt.device.type, enabled=amp_dtype == torch.float16)
    state = State(model, optimizer, scheduler, scaler, tokenizer)
    # ---- resume (in place)
    step = checkpointer.load(state, plan.total)
    run = Run(cfg, rt, plan, train_ds.select_columns(["input_ids", "labels"]), eval_ds.to_list(),
              "first_error" in eval_ds.column_names, net, state, amp_dtype, packed, step)
    return run, {"train_data": train_report, "eval_data": eval_report}


# ---- data
class BatchPlan:
    """Each step's examples, a pure function of (seed, epoch): a resume needs no loader state."""

    def __init__(self, cfg: Config, lengths: list, n_labeled: list, world_size: int):
        self.cfg, self.lengths, self.n_labeled = cfg, lengths, n_labeled
        self.global_batch = cfg.batch_size * cfg.grad_accum * world_size
        self.steps_per_epoch = math.ceil(len(lengths) / self.global_batch)
        epochs = math.ceil(cfg.epochs * self.steps_per_epoch)
        self.total = cfg.max_steps if cfg.max_steps > 0 else max(1, epochs)
        self.epoch = None
        self.batches = None

    def batch(self, step: int) -> tuple:
        """(epoch, dataset indices) of step `step` + 1."""
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


def micro_batch(run: Run, idx: list) -> dict:
    cols = run.train_ds[idx]
    rows = [dict(zip(cols, row)) for row in zip(*cols.values())]
    pad = pad_token_id(run.state.tokenizer)
    # packed: one row, each example attending within itself
    mb = pack(rows, pad, run.cfg.pack_to) if run.packed else collate(rows, pad)
    pin = run.rt.device.type == "cuda"  # pinned: the copies are asynchronous
    return {k: (v.pin_memory() if pin else v).to(run.rt.device, non_blocking=True)
            if torch.is_tensor(v) else v for k, v in mb.items()}


# ---- DDP or FSDP2
def wrap(model, cfg: Config, rt: Runtime, amp_dtype, packed: bool):
    if cfg.fsdp:  # before the optimizer, which holds the sharded parameters
        check([] if rt.distributed else ["--fsdp needs torchrun --nproc_per_node 2+"])
        # each layer of the longest nn.ModuleList, then the root
        stacks = [m for m in model.backbone.modules() if isinstance(m, torch.nn.ModuleList)]
        if not stacks:
            raise ValueError(f"{type(model.backbone).__name__} has no nn.ModuleList to shard")
        reduce = torch.float32 if amp_dtype else None  # gradients reduce in fp32
        policy = MixedPrecisionPolicy(param_dtype=amp_dtype, reduce_dtype=reduce)
        for layer in max(stacks, key=len):
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
    net = model
    if cfg.compile:  # static only when rows padded to --pack-to repeat their shapes
        net = torch.compile(model, dynamic=not (packed and cfg.pack_to))
    if rt.distributed and not cfg.fsdp:  # a sharded model reduces its own gradients
        net = DDP(net, device_ids=[rt.device.index] if rt.device.type == "cuda" else None)
    return net


# ---- optimizer
def make_optimizer(model, cfg: Config, device):
    """AdamW, no decay on biases and norms."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    kw = dict(lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon)
    try:
        return torch.optim.AdamW(groups, **kw, fused=device.type in ("cuda", "cpu"))
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(groups, **kw, foreach=True)


def make_scheduler(optimizer, cfg: Config, total: int):
    warmup = int(cfg.warmup_steps) or math.ceil(cfg.warmup_ratio * total)
    extra = {"min_lr_rate": 0.1} if cfg.lr_scheduler_type == "cosine_with_min_lr" else None
    return get_scheduler(cfg.lr_scheduler_type, optimizer, num_warmup_steps=warmup,
                         num_training_steps=total, scheduler_specific_kwargs=extra)


# ---- the loop
def loop(run: Run, checkpointer: Checkpointer, log: "TrainLog"):
    cfg, total = run.cfg, run.plan.total
    eval_every = cfg.every("eval", run.plan.steps_per_epoch)  # 0: the final one alone
    save_every = cfg.every("save", run.plan.steps_per_epoch)
    run.net.train()
    with Preemption(run.rt) as preemption:
        while run.step < total:
            t0 = time.perf_counter()
            epoch, batch = run.plan.batch(run.step)
            sums, norm = train_step(run, batch)
            run.step += 1
            write = run.step % cfg.log_every == 0 or run.step == total
            lr = run.state.scheduler.get_last_lr()[0]
            log.add(run.step, batch, sums, norm, t0=t0, epoch=epoch, lr=lr, write=write)
            # (the last step is evaluated at the end)
            if eval_every and run.step % eval_every == 0 and run.step < total:
                evals = {f"eval_{k}": v for k, v in evaluate(run).items()}
                log.record({"step": run.step, **evals})
            stop = preemption.agreed(last=run.step == total)
            if stop and not write:  # the steps since the last log line
                log.write(run.step, norm, epoch, lr)
            if stop or (save_every and run.step % save_every == 0):
                log.stop_if_diverged()  # never a checkpoint of non-finite weights
                checkpointer.save(run.step, run.state)
                if stop:
                    raise preemption.stopped(run.step)


def train_step(run: Run, batch: list) -> tuple:
    """One optimizer step: this rank's (cross-entropy sum, correct), the grad norm."""
    cfg, rt, state = run.cfg, run.rt, run.state
    n_labeled = run.plan.labeled(batch)  # over every rank and micro-batch
    micro = micro_batches(batch, run.plan.lengths, rt.world_size, rt.rank, cfg.grad_accum)
    amp = contextlib.nullcontext()
    if run.amp_dtype:  # the trained weights stay fp32
        amp = torch.autocast(rt.device.type, dtype=run.amp_dtype)
    sums = torch.zeros(2, device=rt.device)
    for a, idx in enumerate(micro):
        inputs = micro_batch(run, idx)
        labels = inputs.pop("labels")  # (B, T); packed: (1, N)
        # gradients reduce over ranks in the last micro-batch only
        last = a == len(micro) - 1
        if cfg.fsdp:
            state.model.set_requires_gradient_sync(last)
        no_sync = rt.distributed and not cfg.fsdp and not last
        with run.net.no_sync() if no_sync else contextlib.nullcontext():
            with amp:
                logits = run.net(**inputs)  # (B, T, 2); packed: (1, N, 2)
            # over the global batch's labels: each label weighs alike
            loss, ce_sum, n_correct = step_loss(logits, labels, n_labeled)
            # DDP averages over ranks: times world size, the global sum
            state.scaler.scale(loss * rt.world_size).backward()
        sums += torch.stack([ce_sum, n_correct.float()])
    state.scaler.unscale_(state.optimizer)  # clip the true gradients
    norm = torch.nn.utils.clip_grad_norm_(state.model.parameters(), cfg.max_grad_norm or math.inf)
    if isinstance(norm, DTensor):  # sharded: over every rank's gradients
        norm = norm.full_tensor()
    scale = state.scaler.get_scale()  # fp16: a device sync
    state.scaler.step(state.optimizer)
    state.scaler.update()
    state.optimizer.zero_grad(set_to_none=True)
    # a lower scale: inf gradients skipped the update; skip the schedule too, as HF does
    if state.scaler.get_scale() >= scale:
        state.scheduler.step()
    return sums, norm


def evaluate(run: Run) -> dict:
    """By eval.py's route."""
    cfg = run.cfg
    probs = predict(run.state.model, run.eval_rows, batch_size=cfg.eval_batch_size,
                    pad_id=pad_token_id(run.state.tokenizer), amp_dtype=run.amp_dtype, rt=run.rt,
                    lockstep=cfg.fsdp, progress=not cfg.disable_tqdm)
    return report(probs, run.eval_rows, cfg.threshold, run.processbench)


# ---- preemption
class Preemption:
    """SIGTERM/SIGINT: a checkpoint after a step all ranks agree on, then stop; again: stop now.
    The ranks' flags sum on a gloo group in the background, read a step later: no device sync."""
    signum: int = None

    def __init__(self, rt: Runtime):
        self.rt = rt
        self.group = dist.new_group(backend="gloo") if rt.distributed else None
        self.pending = None  # (work, flag) in flight

    def __enter__(self):
        self.old = {s: signal.signal(s, self.on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        return self

    def __exit__(self, *exc):
        for s, handler in self.old.items():
            signal.signal(s, handler)
        if self.pending:  # every rank started it
            self.pending[0].wait()

    def on_signal(self, signum, frame):
        if self.signum is not None:
            name = signal.Signals(signum).name
            raise Stopped(f"stopped by {name} again: no checkpoint saved", signum)
        self.signum = signum

    def agreed(self, last: bool) -> bool:
        """Whether every rank stops (on the last step: known now)."""
        mine = self.signum is not None
        if not self.rt.distributed:
            return mine
        if self.pending and self.read():
            return True
        flag = torch.tensor([float(mine)])  # on the CPU: no device sync
        self.pending = (dist.all_reduce(flag, group=self.group, async_op=True), flag)
        return self.read() if last else False

    def read(self) -> bool:
        work, flag = self.pending
        self.pending = None
        work.wait()
        return flag.item() > 0

    def stopped(self, step: int) -> Stopped:
        name = signal.Signals(self.signum).name if self.signum else "a signal on another rank"
        return Stopped(f"stopped by {name} after step {step}; checkpoint saved. Continue with "
                       "--resume auto", self.signum or signal.SIGTERM)


# ---- logging
class TrainLog:
    """Progress bar, metrics.jsonl, tracker, divergence, time left; sums stay on the device."""

    def __init__(self, run: Run, quiet: bool):
        cfg, rt = run.cfg, run.rt
        self.cfg, self.rt, self.plan = cfg, rt, run.plan
        self.pbar = tqdm(total=run.plan.total, initial=run.step, desc="train",
                         disable=quiet or not rt.is_main)
        self.path = os.path.join(cfg.output_dir, "metrics.jsonl") if rt.is_main else None
        if self.path:  # there even with no record
            write_lines(self.path, [], "a")
        tracked = self.path and cfg.report_to != "none"
        self.tracker = Tracker(cfg, run.step) if tracked else None
        self.n_chunks = rt.world_size * cfg.grad_accum  # micro-batches per step
        self.pack_to = cfg.pack_to if run.packed else None
        self.check_norm = not run.state.scaler.is_enabled()  # fp16 skips inf-norm steps
        self.window = torch.zeros(2, device=rt.device)  # (cross-entropy sum, correct)
        self.bad_step = torch.zeros((), dtype=torch.long, device=rt.device)  # 0: none
        self.new_window()
        self.total_tokens = self.total_padded = self.total_seconds = 0
        self.last_finite = None  # (step, loss)
        self.timed_from = None  # (step, time)
        self.estimated = False
        self.since_resume = bool(run.step)

    def add(self, step: int, batch: list, sums, norm, *, t0: float, epoch: int, lr: float,
            write: bool):
        bad = ~torch.isfinite(sums[0]) | (~torch.isfinite(norm) if self.check_norm else False)
        self.bad_step = torch.where((self.bad_step == 0) & bad, step, self.bad_step)
        self.window += sums
        self.window_labeled += self.plan.labeled(batch)
        self.window_tokens += self.plan.tokens(batch)
        self.total_padded += padded_tokens(batch, self.plan.lengths, self.n_chunks, self.pack_to)
        self.pbar.update(1)
        self.estimate(step)
        if write:
            self.write(step, norm, epoch, lr, t0)
        else:
            self.window_seconds += time.perf_counter() - t0

    def write(self, step: int, norm, epoch: int, lr: float, t0: float = None):
        flags = torch.stack([norm.detach().float(), (self.bad_step > 0).float()])
        stats = torch.cat([self.window, flags])
        if self.rt.distributed:
            dist.all_reduce(stats)
        stats = stats.tolist()
        if t0 is not None:  # after the sync: queued device work counts
            self.window_seconds += time.perf_counter() - t0
        n = max(self.window_labeled, 1)
        rec = {"step": step, "loss": stats[0] / n, "acc": stats[1] / n, "lr": lr,
               "norm": stats[2] / self.rt.world_size,
               "tok_per_s": self.window_tokens / self.window_seconds, "epoch": epoch}
        if self.since_resume:
            rec["since_resume"] = True
            self.since_resume = False
        self.record(rec)
        if math.isfinite(rec["loss"]):
            self.last_finite = (step, rec["loss"])
        if stats[3] > 0:
            self.diverged()
        self.total_seconds += self.window_seconds
        self.total_tokens += self.window_tokens
        self.new_window()

    def new_window(self):
        self.window.zero_()
        self.window_labeled = self.window_tokens = self.window_seconds = 0

    def record(self, rec: dict, echo: bool = True):
        if self.path is None:
            return
        write_lines(self.path, [json.dumps(strict_json(rec))], "a")
        if self.tracker:
            self.tracker.log(rec)
        if echo:
            self.pbar.write(log_line(rec))

    def estimate(self, step: int):
        """Says the time left once, timed from the first step's end (compiling)."""
        now = time.perf_counter()
        self.timed_from = self.timed_from or (step, now)
        done = step - self.timed_from[0]
        seconds = now - self.timed_from[1]
        due = done >= 3 or (done and seconds >= 10)
        if self.rt.is_main and not self.estimated and due and step < self.plan.total:
            left = datetime.timedelta(seconds=round(seconds / done * (self.plan.total - step)))
            self.pbar.write(f"about {left} left ({seconds / done:.2f} s per step)")
            self.estimated = True

    def stop_if_diverged(self):
        """Syncs every rank."""
        bad = (self.bad_step > 0).float()
        if self.rt.distributed:
            dist.all_reduce(bad)
        if bad.item() > 0:
            self.diverged()

    def diverged(self):
        last = "no finite loss logged before it"
        if self.last_finite:
            last = "last finite loss {1:.4g} at step {0}".format(*self.last_finite)
        fp16 = ", or --dtype bf16" if self.cfg.dtype == "fp16" else ""
        raise Diverged(f"the loss or gradient norm is not finite at step "
                       f"{int(self.bad_step) or '? (on another rank)'} ({last}); no checkpoint "
                       f"since. Lower --lr (now {self.cfg.lr:g}) or add --warmup-steps{fp16}")

    def throughput(self) -> tuple:
        """(non-pad tokens/s, non-pad / padded tokens), None if no step ran."""
        if not self.total_tokens:
            return None, None
        return (self.total_tokens / max(self.total_seconds, 1e-9),
                self.total_tokens / max(self.total_padded, 1))


def short_number(n: float) -> str:
    """950, 18.2k, 1.3M, 3.4G."""
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}"


def log_line(rec: dict) -> str:
    if "loss" in rec:
        since = " | since resume" if rec.get("since_resume") else ""
        return (f"step {rec['step']} | loss {rec['loss']:.4f} | acc {rec['acc']:.3f} | "
                f"lr {rec['lr']:.2e} | norm {rec['norm']:.2f} | "
                f"{short_number(rec['tok_per_s'])} tok/s{since}")
    return " | ".join(f"{k} {shown(v)}" for k, v in rec.items())


def strict_json(x):
    """NaN and infinity -> null."""
    return json.loads(json.dumps(x), parse_constant=lambda name: None)


if __name__ == "__main__":
    with exit_status():  # one line; exit 2: bad input, 1: failed write, 3: divergence
        results = train(CLI_CONFIG, launch_command())
    if results is not None:
        summary = {k: v for k, v in results.items() if k not in ("train_data", "eval_data")}
        print(json.dumps(summary), flush=True)
