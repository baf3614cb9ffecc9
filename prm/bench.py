"""Times train.py's tokenization and training loop (any train.py flag); prints one JSON line.
steady_*: from step 2 on. Memory: CUDA's max allocated, else max RSS."""
import contextlib
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, replace

import datasets
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from transformers import AutoModel

from prm.loading import hf_config_for, tokenizer_for
from prm.cli import Parser, parsed
from prm.config import Config, opt
from prm.errors import PRMError, UsageError, exit_status
from prm.tools.gpucheck import gpu_check
from prm.readers.ingest import tokenize_dataset
from prm.readers.sources import load_splits
from prm.core.runtime import autocast_dtype
from prm.core.varlen import kernel_dtype, supports_packing

# dense bf16 peaks by device name, the more specific first (GH200: H200's)
BF16_PEAK_TFLOPS = {"H100 PCIe": 756.0, "H100 NVL": 835.0, "H200 NVL": 835.0, "H100": 989.0,
                    "H200": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10": 125.0}
VARIANTS = {"padded": ["--no-packing", "--no-compile"], "packed": ["--packing", "--no-compile"],
            "packed-compiled": ["--packing", "--compile"]}
# a child runs once (of a flag given twice, the last wins)
ONCE = ["--repeats", "1", "--variants", "", "--peer-python", "", "--peer-script", ""]
REPORTED = ("model", "dataset", "batch_size", "grad_accum", "max_length", "group_by_length",
            "gradient_checkpointing", "compile", "packing", "pack_to", "lora_r")


@dataclass
class BenchOptions:
    steps: int = opt(20, "optimizer steps to time", dest="max_steps", section="benchmark")
    repeats: int = opt(1, "fresh processes to run; medians reported")
    peak_tflops: float = opt(0.0, "bf16 dense peak for MFU (0: by device name)")
    peer_python: str = opt("", "python of a venv with trl==1.13.0, to run the TRL peer")
    peer_script: str = opt("", "shared/tools/bench/trl_peer.py")
    variants: str = opt("", f"comma-separated, of {', '.join(VARIANTS)}")
    gpu_check: bool = opt(False, "CUDA tests, then the variants on a random Qwen2-0.5B "
                          "(other flags ignored)")
    dry_run: bool = opt(False, "--gpu-check on the CPU at a tiny shape")


def parser():
    p = Parser(Config, BenchOptions, description=__doc__.splitlines()[0])
    p.set_defaults(max_steps=20, eval_fraction=0.01, log_every=10**9, save_every=0, output_dir="")
    return p


def _memory_now(device) -> int:
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    with open("/proc/self/statm") as f:  # the resident set, in pages
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def flops_per_token(model_cfg, lengths: list, lora_trainable: int = None) -> tuple:
    """(6 FLOPs per weight (4 if frozen) + 12 x layers x attention width x s_eff, non-embedding
    parameters, all parameters), the 2-way head's included; lora_trainable: adapter + head."""
    with torch.device("meta"):
        backbone = AutoModel.from_config(model_cfg)
    embed = sum(p.numel() for m in backbone.modules() if isinstance(m, torch.nn.Embedding)
                for p in m.parameters())
    text = model_cfg.get_text_config()
    head = 2 * text.hidden_size + 2
    n = sum(p.numel() for p in backbone.parameters()) - embed + head
    width = text.num_attention_heads * head_dim(text)
    s_eff = sum(x * x for x in lengths) / max(sum(lengths), 1)
    weights = 6 * n if lora_trainable is None else 4 * (n - head) + 6 * lora_trainable
    return weights + 12 * text.num_hidden_layers * width * s_eff, n, n + embed


def head_dim(text) -> int:
    return getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads


def _mb(n: int) -> float:
    return round(n / 2**20, 1)


def _device_peak(device, override: float) -> float:
    name = torch.cuda.get_device_name(device)
    by_name = (tflops for key, tflops in BF16_PEAK_TFLOPS.items() if key in name)
    return (override or next(by_name, 0.0)) * 1e12


def attention_kernel(cfg: Config, backbone, device) -> str:
    if not (cfg.packing and supports_packing(backbone)):
        return "sdpa (padded, with a mask)"
    dim = head_dim(backbone.config.get_text_config())
    amp = autocast_dtype(cfg.dtype, device)
    with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
        half = kernel_dtype(torch.empty((1, 1, 1, dim), device=device))
    if not half:
        return "sdpa per example (packed, exact fallback)"
    return f"varlen_attn ({str(half).removeprefix('torch.')})"


@contextlib.contextmanager
def counting_syncs(device, seen: dict):
    """CUDA: sync debug mode's warnings into seen["warnings"]."""
    if device.type != "cuda":
        yield
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        seen["warnings"] = caught
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")


def training():  # train.py, beside the package
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root not in sys.path:
        sys.path.insert(0, root)
    import train
    return train


def _train_watched(cfg: Config, device) -> tuple:
    """(final metrics, what the optimizer-step hook saw, baseline memory)."""
    seen = {"after_step": [], "params": 0, "syncs": [], "times": []}

    def after_step(optimizer, args, kwargs):
        if not seen["times"]:
            seen["params"] = sum(p.numel() for g in optimizer.param_groups for p in g["params"])
            seen["optimizer_bytes"] = sum(t.nbytes for st in optimizer.state.values()
                                          for t in st.values() if torch.is_tensor(t))
        seen["after_step"].append(_memory_now(device))
        seen["times"].append(time.perf_counter())  # no sync: the next step counts queued kernels
        warned = seen.get("warnings", [])
        seen["syncs"].append(sum("synchroniz" in str(w.message) for w in warned))

    baseline = _memory_now(device)
    handle = register_optimizer_step_post_hook(after_step)
    with tempfile.TemporaryDirectory() as tmp:
        run_cfg = replace(cfg, output_dir=cfg.output_dir or tmp)
        try:
            with contextlib.redirect_stdout(sys.stderr), counting_syncs(device, seen):
                final = training().train(run_cfg)
        finally:
            handle.remove()
    return final, seen, baseline


def run_once(cfg: Config, peak_tflops: float = 0.0) -> dict:
    """FLOPs count the timed steps' examples (BatchPlan)."""
    cfg = cfg.resolve()
    datasets.disable_caching()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = tokenizer_for(cfg)
    train_raw, _ = load_splits(cfg)
    t0 = time.perf_counter()
    tok_ds, _ = tokenize_dataset(train_raw, tokenizer, cfg, is_eval=False, num_proc=cfg.num_proc)
    tok_seconds = time.perf_counter() - t0
    plan = training().BatchPlan(cfg, tok_ds["length"][:], tok_ds["n_labeled"][:],
                                int(os.environ.get("WORLD_SIZE", 1)))
    model_cfg = hf_config_for(cfg, tokenizer)
    with torch.device("meta"):
        backbone = AutoModel.from_config(model_cfg)
    final, seen, baseline = _train_watched(cfg, device)
    if final is None:  # not rank 0
        return None
    cuda = device.type == "cuda"
    peak = torch.cuda.max_memory_allocated(device) if cuda else (
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # Linux reports KiB
    t, syncs = seen["times"], seen["syncs"]
    batches = [plan.batch(step)[1] for step in range(len(t))]
    trainable = seen["params"]
    fpt, n_nonembed, n_total = flops_per_token(
        model_cfg, [plan.lengths[i] for b in batches for i in b], trainable if cfg.lora_r else None)
    static = min(seen["after_step"], default=0)
    tps = final["train_tokens_per_second"]
    steady = sum(map(plan.tokens, batches[1:])) / (t[-1] - t[0]) if len(t) > 1 else None
    out = {
        "tokens_per_second": round(tps, 1), "steady_tokens_per_second": steady and round(steady, 1),
        "padding_efficiency": round(final["padding_efficiency"], 4), "peak_memory_mb": _mb(peak),
        "memory_kind": "cuda_max_allocated" if cuda else "cpu_max_rss",
        "static_memory_mb": _mb(static), "activation_memory_mb": _mb(peak - static),
        "baseline_memory_mb": _mb(baseline),
        "model_state_mb": _mb(16 * trainable + 4 * (n_total - trainable)),
        "optimizer_state_mb": _mb(seen["optimizer_bytes"]), "mfu": None,
        "attention": attention_kernel(cfg, backbone, device),
        "host_syncs_per_step": round((syncs[-1] - syncs[0]) / (len(syncs) - 1), 2)
        if cuda and len(syncs) > 1 else None,
        "flops_per_token": round(fpt),
        "params": n_total, "trainable_params": trainable, "params_non_embedding": n_nonembed,
        "tokenize_rows_per_second": round(len(train_raw) / tok_seconds, 1),
        "tokenize_tokens_per_second": round(sum(plan.lengths) / tok_seconds, 1),
        "device": torch.cuda.get_device_name(device) if cuda else f"cpu x{torch.get_num_threads()}",
        "steps": len(t), **{k: getattr(cfg, k) for k in REPORTED}, "dtype": cfg.dtype or "auto",
        "torch": torch.__version__,
    }
    if cuda:
        peak_flops = _device_peak(device, peak_tflops)
        out.update({k: round(fpt * rate / peak_flops, 4) if peak_flops and rate else None
                    for k, rate in (("mfu", tps), ("steady_mfu", steady))})
        out["peak_tflops"] = peak_flops / 1e12 or None
    return out


PEER_TOKENIZE = r"""
import sys, time
from datasets import Features, Sequence, Value, disable_caching, load_dataset
from transformers import AutoTokenizer
from trl.experimental.prm import PRMTrainer
disable_caching()
model, data, max_length = sys.argv[1:]
tok = AutoTokenizer.from_pretrained(model)
ds = load_dataset("json", data_files=data, split="train")
ids = Sequence(Value("int64"))
t0 = time.perf_counter()  # the same map call PRMTrainer.__init__ makes
ds.map(PRMTrainer.tokenize_row, fn_kwargs=dict(tokenizer=tok, step_separator="\n",
       max_length=int(max_length), max_completion_length=None, train_on_last_step_only=False,
       is_eval=False), remove_columns=ds.features, features=Features(labels=ids, input_ids=ids))
print(f"tokenize_rows_per_second={len(ds) / (time.perf_counter() - t0):.1f}")
"""


def _run(cmd: list) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise PRMError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-3000:]}\n"
                       f"{r.stderr[-3000:]}")
    return r.stdout


def _child(argv: list, *flags) -> dict:
    # argv's flags dashed: ONCE's then win, where '--peer_python' and '--peer-python' would clash
    dashed = [re.sub(r"^--[^=\s]+(?=$|=)", lambda m: m[0].replace("_", "-"), x) for x in argv]
    cmd = [sys.executable, "-m", "prm.bench", *dashed, *ONCE, *flags]
    return json.loads(_run(cmd).strip().splitlines()[-1])


def _peer(a, cfg: Config) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [a.peer_python, a.peer_script, cfg.model, cfg.dataset, tmp,
               "--steps", str(cfg.max_steps), "--batch", str(cfg.batch_size),
               "--max-length", str(cfg.max_length)]
        text = _run(cmd + (["--gc"] if cfg.gradient_checkpointing else []))
    text += _run([a.peer_python, "-c", PEER_TOKENIZE, cfg.model, cfg.dataset,
                  str(cfg.max_length)])
    found = dict(re.findall(r"(tok_per_s|tokenize_rows_per_second)=([\d.]+)", text))
    return {"tokens_per_second": float(found["tok_per_s"]),
            "tokenize_rows_per_second": float(found["tokenize_rows_per_second"])}


def repeated(a, cfg: Config, argv: list) -> dict:
    """Fresh processes, ours and the peer's alternating so drift hits both."""
    ours, peer = [], []
    for i in range(a.repeats):
        if a.peer_python and i % 2:
            peer.append(_peer(a, cfg))
        ours.append(_child(argv))
        if a.peer_python and not i % 2:
            peer.append(_peer(a, cfg))
        versus = f", peer {peer[-1]['tokens_per_second']} tok/s" if peer else ""
        print(f"run {i + 1}/{a.repeats}: ours {ours[-1]['tokens_per_second']} tok/s{versus}",
              file=sys.stderr, flush=True)
    out = dict(ours[0])
    for k, v in out.items():
        if isinstance(v, float):  # a measurement
            out[k] = round(statistics.median(r[k] for r in ours), 4)
    out.update(repeats=a.repeats, runs_tokens_per_second=[r["tokens_per_second"] for r in ours],
               runs_peak_memory_mb=[r["peak_memory_mb"] for r in ours])
    for k, name in (("tokens_per_second", "tokens_per_second"),
                    ("tokenize_rows_per_second", "tokenize")) if peer else ():
        out[f"peer_{k}"] = round(statistics.median(r[k] for r in peer), 1)
        out[f"runs_peer_{k}"] = [r[k] for r in peer]
        out[f"speedup_{name}"] = round(out[k] / out[f"peer_{k}"], 3)
    if peer and cfg.dtype != "fp32":
        out["note"] = "the peer always trains in fp32"
    return out


def side_by_side(argv: list) -> dict:
    """Each of argv's --variants in fresh processes (--repeats each)."""
    a = parser().parse_args(argv)
    names = a.variants.split(",")
    if not set(names) <= set(VARIANTS):
        raise UsageError(f"--variants {a.variants!r}: choose from {', '.join(VARIANTS)}")
    out = {}
    for name in names:
        out[name] = _child(argv, *VARIANTS[name], "--repeats", str(a.repeats))
        print(f"{name}: {out[name]['tokens_per_second']} tok/s", file=sys.stderr, flush=True)
    base = out[names[0]]["tokens_per_second"]
    ratios = {n: round(r["tokens_per_second"] / base, 3) for n, r in out.items()}
    return {"variants": out, f"tokens_per_second_vs_{names[0]}": ratios}


def main():
    argv = sys.argv[1:]
    a = parser().parse_args(argv)
    cfg = parsed(Config, a).resolve()
    if a.peer_python and not a.peer_script:
        raise UsageError("--peer-python needs --peer-script")
    if a.gpu_check:
        out = gpu_check(side_by_side, dry=a.dry_run)
    elif a.variants:
        out = side_by_side(argv)
    elif a.repeats > 1 or a.peer_python:
        out = repeated(a, cfg, argv)
    else:
        out = run_once(cfg, a.peak_tflops)
    if out is not None:
        print(json.dumps(out), flush=True)
    if out and out.get("failed"):  # --gpu-check's
        raise PRMError(f"--gpu-check: {out['failed']} failed (its output is above)")


if __name__ == "__main__":
    with exit_status():
        main()
