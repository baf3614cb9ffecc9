"""The offline default: a character tokenizer built in code and a step-labelled counting task. Depends on: tokenizers, transformers."""
import random

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

CHARS = "0123456789+-=*/()., abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ:;?!'\n"


def char_tokenizer():
    """One token per character plus <pad>/<bos>/<eos>/<unk>; has a BOS, so it exercises the BOS path."""
    specials = ["<pad>", "<bos>", "<eos>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials + list(CHARS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # any char, newline too
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   unk_token="<unk>")


def make_rows(n: int, seed: int) -> list:
    """Chains of one-digit `x+1=y` steps (mod 10), each starting from the previous result.

    Half of the solutions contain one slip (y off by one). Labels follow first-error semantics: the slip and every
    later step are wrong, even though later steps compute correctly from the wrong value, so the model must read
    earlier steps, not just check the current one."""
    rng = random.Random(seed)
    rows = []
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
    """Disjoint train/held-out rows; the held-out part depends only on (n, seed), so eval.py can rebuild it."""
    rows = make_rows(n, seed)
    n_eval = max(1, int(n * eval_share))
    return rows[n_eval:], rows[:n_eval]
