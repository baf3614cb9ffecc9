"""python -m prm.bench --gpu-check: tests/test_gpu.py, then bench on a random Qwen2-0.5B."""
import json
import os
import random
import subprocess
import sys
import tempfile

import torch
from transformers import AutoModel, Qwen2Config

from prm.files import write_lines
from prm.loading import load_tokenizer
from prm.core.data import pad_token_id
from prm.errors import UsageError
from prm.readers.synthetic import CHARS, char_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QWEN2_TOKENIZER = os.path.join(os.path.dirname(ROOT), "shared", "tokenizers", "qwen2")
# Qwen/Qwen2-0.5B's config.json
SHAPE = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
             num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
             tie_word_embeddings=True, rope_theta=1e6, max_position_embeddings=32768)
TINY = dict(SHAPE, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, intermediate_size=256, vocab_size=0)  # 0: the tokenizer's
# --pack-to 8 x 2048: every packed step one shape
FLAGS = {"gpu": "--steps 30 --batch-size 8 --max-length 2048 --pack-to 16384 --dtype bf16".split(),
         "dry": "--steps 3 --batch-size 2 --max-length 128 --pack-to 256 --dtype fp32".split()}
REPORTED = ("attention", "tokens_per_second", "steady_tokens_per_second", "mfu", "steady_mfu",
            "peak_memory_mb", "host_syncs_per_step", "padding_efficiency")


def rows(n: int, max_length: int):  # max_length / 8 to max_length characters, 2-12 steps
    rng = random.Random(0)
    for i in range(n):
        size, k = rng.randint(max_length // 8, max_length), rng.randint(2, 12)
        steps = [f"step {j}: " + "".join(rng.choice(CHARS[:-1]) for _ in range(size // (k + 1)))
                 for j in range(k)]  # no "\n"
        yield json.dumps({"prompt": f"problem {i}: " + steps[0], "completions": steps[1:],
                          "labels": [rng.random() < 0.7 for _ in steps[1:]]})


def write_inputs(path: str, dry: bool) -> tuple:
    """(model directory, data file, bench flags)."""
    qwen2 = os.path.isdir(QWEN2_TOKENIZER)
    tokenizer = load_tokenizer(QWEN2_TOKENIZER) if qwen2 else char_tokenizer()
    shape = TINY if dry else SHAPE
    cfg = Qwen2Config(**{**shape, "vocab_size": max(shape["vocab_size"], len(tokenizer))},
                      pad_token_id=pad_token_id(tokenizer), bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=tokenizer.eos_token_id, attention_dropout=0.0)
    model_dir, data = os.path.join(path, "model"), os.path.join(path, "rows.jsonl")
    cfg.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    flags = FLAGS["dry" if dry else "gpu"]
    value = dict(zip(flags[::2], flags[1::2]))  # every flag takes one value
    # 1% held out, and a margin: every timed step gets a full batch
    n_rows = int(int(value["--steps"]) * int(value["--batch-size"]) * 1.25) + 8
    write_lines(data, rows(n_rows, int(value["--max-length"])))
    return model_dir, data, ["--model", model_dir, "--dataset", data, *flags]


def run_tests() -> dict:
    path = os.path.join(ROOT, "tests", "test_gpu.py")
    if not os.path.isfile(path):
        return {"returncode": None, "summary": "tests/test_gpu.py absent: run from a checkout"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-m", "gpu", path],
                       cwd=ROOT, capture_output=True, text=True)
    lines = r.stdout.strip().splitlines()
    print(r.stdout[-6000:], file=sys.stderr, flush=True)
    return {"returncode": r.returncode, "summary": lines[-1] if lines else r.stderr[-500:],
            "skipped": [x for x in lines if x.startswith("SKIPPED")]}


def gpu_check(side_by_side, *, dry: bool) -> dict:
    """side_by_side: prm.bench's (no import circle)."""
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, _, argv = write_inputs(tmp, dry)
        if not dry and not torch.cuda.is_available():
            raise UsageError("--gpu-check needs CUDA (built the model config, tokenizer and rows;"
                             " --dry-run runs on the CPU)")
        torch.manual_seed(0)
        with torch.device("cpu" if dry else "cuda"):
            AutoModel.from_config(Qwen2Config.from_pretrained(model_dir)).save_pretrained(model_dir)
        tests = run_tests()
        argv += ["--variants", "padded,packed" if dry else "padded,packed,packed-compiled"]
        bench = side_by_side(argv)
    variants = bench["variants"]
    out = {"tests": tests, "shape": TINY if dry else SHAPE, "flags": argv[4:],
           "variants": {n: {k: r.get(k) for k in REPORTED} for n, r in variants.items()},
           "tokens_per_second_vs_padded": bench["tokens_per_second_vs_padded"],
           "device": next(iter(variants.values()))["device"], "torch": torch.__version__}
    if tests["returncode"] not in (0, None):
        out["failed"] = "tests/test_gpu.py"
    return out
