"""The offline default: a character tokenizer and a step-labelled counting task."""
import random
import re

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

CHARS = "0123456789+-=*/()., abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ:;?!'\n"


def char_tokenizer():
    """A token per character of CHARS: a byte-level BPE without merges, as AutoTokenizer rebuilds
    it for a saved qwen2 model."""
    specials = {f"{s}_token": f"<{s}>" for s in ("pad", "bos", "eos", "unk")}
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    names = [byte_level.pre_tokenize_str(c)[0][0] for c in CHARS]  # " " -> "Ġ", "\n" -> "Ċ"
    vocab = {t: i for i, t in enumerate([*specials.values(), *names])}
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
    tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, **specials)


def make_rows(n: int, seed: int) -> list:
    """Chains of `x+1=y` steps (mod 10), half with a slip (y off by one) wrong from there on."""
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
        prompt = f"count {n_steps} steps from {start}:"
        rows.append({"id": f"synthetic-{seed}-{i}", "prompt": prompt, "completions": steps,
                     "labels": labels, "answer": str((start + n_steps) % 10)})
    return rows


def step_truth(prompt: str, steps: list) -> list:
    """Whether each step follows the chain within the count; the last must end on the answer."""
    count, *size, x = map(int, re.findall(r"\d+", prompt))
    d, truth = size[0] if size else 1, []
    for k, step in enumerate(steps):
        ok = (not truth or truth[-1]) and k < count and step == f"{x}+{d}={(x + d) % 10}"
        truth.append(ok and (k + 1 < len(steps) or k + 1 == count))
        x = (x + d) % 10
    return truth


def counting_problems() -> list:
    """The 360 prompts `count N steps of D from S:` and answers."""
    return [{"prompt": f"count {n} steps of {d} from {s}:", "answer": str((s + n * d) % 10)}
            for n in range(3, 7) for d in range(1, 10) for s in range(10)]


def train_eval_rows(n: int, seed: int, eval_share: float = 0.1):
    """(train, held-out): a seeded share of the distinct solutions held out."""
    rows = make_rows(n, seed)
    distinct = sorted({tuple(r["completions"]) for r in rows})
    random.Random(seed).shuffle(distinct)
    held = set(distinct[:max(1, int(len(distinct) * eval_share))])
    return ([r for r in rows if tuple(r["completions"]) not in held],
            [r for r in rows if tuple(r["completions"]) in held])
