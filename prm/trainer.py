"""The hand-written training loop: AdamW, warmup+cosine, autocast, accumulation, DDP, checkpoints, eval. Depends on: torch, transformers, tqdm, prm.*."""
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

from prm.card import config_command, model_card
from prm.checkpoint import load_checkpoint, resolve_resume, save_checkpoint
from prm.config import Config
from prm.data import collate, global_batches, micro_batches, pad_token_id, tokenize_dataset
from prm.evaluate import evaluate
from prm.lora import apply_lora, count_parameters
from prm.model import build_model, enable_checkpointing, load_tokenizer, step_loss
from prm.runtime import Runtime, all_reduce_sum, autocast_dtype, barrier, main_first, setup, teardown
from prm.sources import load_splits

PREEMPTED = {"signal": None}  # set by SIGTERM/SIGINT; the loop stops after the current optimizer step


def tokenizer_for(cfg: Config):
    if cfg.model == "tiny" and not cfg.tokenizer:
        from prm.synthetic import char_tokenizer
        return char_tokenizer()
    return load_tokenizer(cfg.tokenizer or cfg.model, cfg.trust_remote_code)


def model_for(cfg: Config, tokenizer):
    """The run's PRM on CPU: the backbone (pretrained, or 'tiny' from the seed), LoRA adapters when --lora-r is set.

    Adapters go in before .to(device) and DDP, so DDP sees which parameters train; resume and eval.py rebuild a
    LoRA checkpoint's frozen base with this same function."""
    model = build_model(cfg.model, tokenizer, cfg.seed, cfg.trust_remote_code)
    if cfg.lora_r:
        apply_lora(model.backbone, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_targets)
    return model


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


def _on_signal(signum, frame):
    PREEMPTED["signal"] = signum


def train(cfg: Config, command: str = "") -> dict:
    """command: what started the run, for the model card (default: an equivalent train.py line from cfg)."""
    PREEMPTED["signal"] = None
    rt = setup()
    old = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _train(cfg, rt, command or config_command(cfg))
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        teardown(rt)


def _train(cfg: Config, rt: Runtime, command: str) -> dict:
    cfg.resolve()
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    log = print if rt.is_main else (lambda *a, **k: None)
    tokenizer = tokenizer_for(cfg)
    pad_id = pad_token_id(tokenizer)
    with main_first(rt):  # data before model: bad rows are reported at once. Rank 0 fills the datasets cache
        train_raw, eval_raw = load_splits(cfg)
        train_ds, train_report = tokenize_dataset(train_raw, tokenizer, cfg, is_eval=False, num_proc=cfg.num_proc)
        eval_ds, eval_report = tokenize_dataset(eval_raw, tokenizer, cfg, is_eval=True, num_proc=cfg.num_proc)
    log(f"train data: {json.dumps(train_report)}\neval data: {json.dumps(eval_report)}")
    if len(train_ds) == 0:
        raise SystemExit(f"no training example has a labeled step left (--max-length {cfg.max_length}, "
                         f"--max-completion-length {cfg.max_completion_length}): see the report")
    model = model_for(cfg, tokenizer).to(rt.device)
    if cfg.gradient_checkpointing:
        enable_checkpointing(model.backbone)
    amp_dtype = autocast_dtype(cfg.dtype, rt.device)
    eval_rows = eval_ds.to_list()
    lengths = train_ds["length"]
    n_labeled = train_ds["n_labeled"]

    global_batch = cfg.batch_size * cfg.grad_accum * rt.world_size
    steps_per_epoch = math.ceil(len(train_ds) / global_batch)
    total = cfg.max_steps if cfg.max_steps > 0 else max(1, math.ceil(cfg.epochs * steps_per_epoch))
    optimizer = make_optimizer(model, cfg, cfg.lr, rt.device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.warmup_steps, total))
    scaler = torch.amp.GradScaler(rt.device.type, enabled=amp_dtype == torch.float16)
    step = 0
    resume = resolve_resume(cfg.resume, cfg.output_dir) if cfg.resume else None
    if resume:
        step = load_checkpoint(resume, model, optimizer, scheduler, scaler)
        log(f"resumed from {resume} at step {step}")
    raw_model = model
    if cfg.compile:
        # batch widths vary: one symbolic-shape graph at once, not a static one and then a recompile (~100 s on GPU)
        model = torch.compile(model, dynamic=True)
    if rt.distributed:
        model = DDP(model, device_ids=[rt.local_rank] if rt.device.type == "cuda" else None)
    amp = (lambda: torch.autocast(rt.device.type, dtype=amp_dtype)) if amp_dtype else contextlib.nullcontext
    run_eval = lambda: evaluate(raw_model, eval_rows, cfg.eval_batch_size, pad_id, rt.device, amp_dtype, cfg.threshold, rt)

    if rt.is_main:
        os.makedirs(cfg.output_dir, exist_ok=True)
        with open(os.path.join(cfg.output_dir, "config.train.json"), "w") as f:
            f.write(cfg.to_json())
    metrics_file = open(os.path.join(cfg.output_dir, "metrics.jsonl"), "a") if rt.is_main else None
    trainable, n_params = count_parameters(raw_model)
    log(f"{n_params / 1e6:.1f}M parameters, {trainable / 1e6:.2f}M trainable ({100 * trainable / n_params:.2f}%) | "
        f"{len(train_ds)} train examples | "
        f"global batch {global_batch} | {total} steps | autocast {amp_dtype or 'off'} | world {rt.world_size}")

    pbar = tqdm(total=total, initial=step, disable=not rt.is_main, desc="train")
    window = torch.zeros(2, device=rt.device)  # (ce sum, correct) since the last log line, summed on device
    window_labeled, window_tokens, window_time, total_tokens, processed_tokens, train_time = 0, 0, 0.0, 0, 0, 0.0
    plan_epoch, plan = None, None
    pin = rt.device.type == "cuda"  # page-locked host memory makes the non_blocking copies truly asynchronous
    model.train()
    while step < total:
        t0 = time.perf_counter()
        epoch, position = divmod(step, steps_per_epoch)
        if epoch != plan_epoch:  # reseeded every epoch; a pure function of (seed, epoch): resume needs no state
            plan_epoch, plan = epoch, global_batches(lengths, global_batch, cfg.seed, epoch, cfg.group_by_length)
        batch = plan[position]
        labeled = sum(n_labeled[i] for i in batch)  # all ranks know the whole global batch: no collective needed
        tokens = sum(lengths[i] for i in batch)
        micro = micro_batches(batch, lengths, rt.world_size, rt.rank, cfg.grad_accum)
        processed_tokens += sum(len(m) * max(lengths[i] for i in m) for r in range(rt.world_size)  # padded, all ranks
                                for m in micro_batches(batch, lengths, rt.world_size, r, cfg.grad_accum))
        for a, idx in enumerate(micro):
            mb = collate(_rows(train_ds, idx), pad_id)
            mb = {k: v.pin_memory() for k, v in mb.items()} if pin else mb
            ids, mask = (mb[k].to(rt.device, non_blocking=True) for k in ("input_ids", "attention_mask"))
            labels = mb["labels"].to(rt.device, non_blocking=True)
            last = a == len(micro) - 1
            sync = model.no_sync() if rt.distributed and not last else contextlib.nullcontext()
            with sync:
                with amp():
                    logits = model(ids, mask)  # (B, T, 2)
                loss, ce_sum, n_correct = step_loss(logits, labels, labeled)
                # DDP averages gradients over ranks; scaling by world size turns that back into the global sum
                scaler.scale(loss * rt.world_size).backward()
            window += torch.stack([ce_sum, n_correct.float()])
        scaler.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), cfg.max_grad_norm or float("inf"))
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        step += 1
        window_labeled += labeled
        window_tokens += tokens
        total_tokens += tokens
        pbar.update(1)

        if step % cfg.log_every == 0 or step == total:
            stats = all_reduce_sum(torch.cat([window, norm.detach().float().view(1)]), rt).tolist()  # one sync
            window_time += time.perf_counter() - t0  # timed after the sync, so queued device work is counted
            rec = {"step": step, "loss": stats[0] / max(window_labeled, 1), "acc": stats[1] / max(window_labeled, 1),
                   "lr": scheduler.get_last_lr()[0], "norm": stats[2] / rt.world_size,
                   "tok_per_s": window_tokens / window_time, "epoch": epoch}
            log_line(rec, pbar, metrics_file)
            window.zero_()
            train_time += window_time
            window_labeled, window_tokens, window_time = 0, 0, 0.0
        else:
            window_time += time.perf_counter() - t0
        if cfg.eval_every and step % cfg.eval_every == 0 and step < total:
            m = run_eval()
            log_line({"step": step, **{f"eval_{k}": v for k, v in m.items()}}, pbar, metrics_file)
        stop = _agree_to_stop(rt)
        if (cfg.save_every and step % cfg.save_every == 0) or stop:
            _save(cfg, rt, step, raw_model, optimizer, scheduler, scaler, tokenizer)
        if stop:
            name = signal.Signals(PREEMPTED["signal"]).name if PREEMPTED["signal"] else "a signal on another rank"
            log(f"stopped by {name} after step {step}; checkpoint saved. Continue with --resume auto")
            pbar.close()
            raise SystemExit(128 + (PREEMPTED["signal"] or signal.SIGTERM))
    pbar.close()

    final = run_eval()
    final["train_tokens_per_second"] = total_tokens / max(train_time, 1e-9)
    final["padding_efficiency"] = total_tokens / max(processed_tokens, 1)
    final["train_data"], final["eval_data"] = train_report, eval_report
    barrier(rt)
    if rt.is_main:
        path = os.path.join(cfg.output_dir, "final")
        raw_model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        with open(os.path.join(path, "config.train.json"), "w") as f:
            f.write(cfg.to_json())
        with open(os.path.join(path, "README.md"), "w") as f:
            f.write(model_card(cfg, final, command))
        metrics_file.write(json.dumps({"step": step, "final": final}) + "\n")
        metrics_file.close()
    barrier(rt)
    return final if rt.is_main else None


def _rows(ds, idx: list) -> list:
    cols = ds[idx]
    return [{"input_ids": i, "labels": l} for i, l in zip(cols["input_ids"], cols["labels"])]


def log_line(rec: dict, pbar, metrics_file):
    if metrics_file is None:
        return
    metrics_file.write(json.dumps(rec) + "\n")
    metrics_file.flush()
    if "loss" in rec:
        msg = (f"step {rec['step']} | loss {rec['loss']:.4f} | acc {rec['acc']:.3f} | lr {rec['lr']:.2e} | "
               f"norm {rec['norm']:.2f} | {rec['tok_per_s'] / 1000:.1f}k tok/s")
    else:
        msg = " | ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in rec.items())
    pbar.write(msg)


def _agree_to_stop(rt: Runtime) -> bool:
    """Under DDP every rank must stop at the same step, even if only one was signalled."""
    flag = float(PREEMPTED["signal"] is not None)
    if not rt.distributed:
        return bool(flag)
    return all_reduce_sum(torch.tensor([flag], device=rt.device), rt).item() > 0


def _save(cfg, rt, step, model, optimizer, scheduler, scaler, tokenizer):
    barrier(rt)
    if rt.is_main:
        save_checkpoint(cfg.output_dir, step, model, optimizer, scheduler, scaler, cfg.to_json(), cfg.keep_last,
                        tokenizer)
    barrier(rt)
