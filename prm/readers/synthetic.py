"""The offline default: a character tokenizer built in code and a step-labelled counting task.
Depends on: tokenizers, transformers."""
import random

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

CHARS = "0123456789+-=*/()., abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ:;?!'\n"


def char_tokenizer():
    """One token per character plus <pad>/<bos>/<eos>/<unk>; has a BOS, so it exercises the BOS path. Written
    as a byte-level BPE without merges (space = "Ġ", newline = "Ċ"), the form transformers 5 forces on any
    saved qwen2 model (AutoTokenizer always rebuilds a Qwen2Tokenizer from the vocab): so AutoTokenizer on an
    exported tiny model splits text exactly as this tokenizer does. Characters outside CHARS become <unk> here
    and are dropped by Qwen2Tokenizer: the synthetic task never has them."""
    specials = ["<pad>", "<bos>", "<eos>", "<unk>"]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    names = [byte_level.pre_tokenize_str(c)[0][0] for c in CHARS]  # "a" -> "a", " " -> "Ġ", "\n" -> "Ċ"
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(specials + names)}, [], unk_token="<unk>"))
    tok.pre_tokenizer = byte_level  # no merges: every character is its own token whatever the split
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>", unk_token="<unk>")


def make_rows(n: int, seed: int) -> list:
    """Chains of one-digit `x+1=y` steps (mod 10), each starting from the previous result. Half of the
    solutions contain one slip (y off by one). Labels follow first-error semantics: the slip and every later
    step are wrong, even though later steps compute correctly from the wrong value, so the model must read
    earlier steps, not just check the current one."""
    rng, rows = random.Random(seed), []
    for i in range(n):
        start, n_steps = rng.randrange(10), rng.randint(3, 6)
        slip = rng.randrange(n_steps) if rng.random() < 0.5 else -1
        x, steps, labels = start, [], []
        for s in range(n_steps):
            y = (x + 1 + (rng.choice([-1, 1]) if s == slip else 0)) % 10
            steps.append(f"{x}+1={y}")
            labels.append(slip < 0 or s < slip)
            x = y
        rows.append({"id": f"synthetic-{seed}-{i}", "prompt": f"count from {start}:", "completions": steps,
                     "labels": labels})
    return rows


def train_eval_rows(n: int, seed: int, eval_share: float = 0.1):
    """(train, held-out) rows: the held-out ones are every row of a seeded share of the distinct solutions (at
    least one), so none is a copy of a training row (there are only 400 distinct rows). Depends only on
    (n, seed): eval.py can rebuild it."""
    rows = make_rows(n, seed)
    distinct = sorted({tuple(r["completions"]) for r in rows})
    random.Random(seed).shuffle(distinct)
    held = set(distinct[:max(1, int(len(distinct) * eval_share))])
    is_held = [tuple(r["completions"]) in held for r in rows]
    return [r for r, h in zip(rows, is_held) if not h], [r for r, h in zip(rows, is_held) if h]
