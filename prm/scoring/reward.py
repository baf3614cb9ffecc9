"""A trained PRM as an RL reward: a float per completion (TRL's reward_funcs) or per token."""
import bisect
import functools
import itertools
import os
import warnings

import torch

from prm.config import FILE, Config
from prm.errors import UsageError
from prm.core.data import prompt_ids
from prm.core.evaluate import score_batch
from prm.readers.formats import step_spans
from prm.core.metrics import AGGREGATES
from prm.core.model import PRM, input_settings
from prm.core.runtime import autocast_dtype
from prm.scoring import ScorerOptions
from prm.scoring.prefix import Prefix, extend
from prm.scoring.scorers import load

EMPTY_REWARD = 0.0  # no step scored


def suffix_minima(ps: list) -> list:
    """PURE's min form (arXiv 2504.15275): each suffix sums to its lowest P."""
    m = list(itertools.accumulate(reversed(ps), min))[::-1] + [0.0]
    return [a - b for a, b in zip(m, m[1:])]


SHAPINGS = {"step": list, "delta": lambda ps: [p - q for p, q in zip(ps, [0.0] + ps[:-1])],
            "min": suffix_minima}


def token_holders(tokenizer, ids: list, text: str, row: int):
    """char index -> the index of the token of ids completing it."""
    bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < len(tokenizer))]
    if bad:
        raise ValueError(f"completion {row}: completion_ids hold {bad[0]!r:.40}: expected ids 0 to "
                         f"{len(tokenizer) - 1}")
    decode = functools.lru_cache(lambda k: tokenizer.decode(ids[:k], skip_special_tokens=True))
    if (whole := decode(len(ids))) != text:
        at = len(os.path.commonprefix([whole, text]))
        raise ValueError(f"completion {row}: completion_ids do not decode to its text (from "
                         f"character {at}: {whole[at:at + 30]!r}, not {text[at:at + 30]!r})")

    def covered(k):  # the characters of text that ids[:k] surely decode to
        return len(os.path.commonprefix([decode(k), text]))
    return lambda c: bisect.bisect_right(range(len(ids) + 1), c, key=covered) - 1


def refuse_bad_input(prompts: list, completions: list, ids=None, scores=None):
    for name, value in (("prompts", prompts), ("completion_ids", ids), ("scores", scores)):
        if value is not None and len(value) != len(completions):
            raise ValueError(f"{len(value)} {name} for {len(completions)} completions")
    for i, pair in enumerate(zip(prompts, completions)):
        for name, x in zip(("prompt", "completion"), pair):
            if not isinstance(x, (str, list)) or isinstance(x, list) and not all(
                    isinstance(m, dict) and isinstance(m.get("content"), str) for m in x):
                raise ValueError(f"completion {i}: the {name} {x!r:.80}: expected a string or a "
                                 "list of messages")


def load_reward_model(path: str, trust_remote_code: bool = False, **scoring):
    """(tokenizer, model, config, row builder), as eval.py loads them."""
    saved = os.path.isfile(os.path.join(path, FILE))
    cfg = Config.load(path) if saved else Config()
    cfg.model, cfg.trust_remote_code = path, trust_remote_code
    tokenizer, model, tokenize = load(cfg, False, ScorerOptions(**scoring))
    if not saved:
        cfg = Config.from_dict({**cfg.__dict__, **input_settings(model.config)})
    return tokenizer, model, cfg, tokenize


class PRMReward:
    """reward(prompts, completions) -> per completion, its step scores aggregated."""

    def __init__(self, model, aggregate: str = "min", device=None, batch_size: int = 16, *,
                 tokenizer=None, step_separator: str = None, max_length: int = None,
                 trust_remote_code: bool = False, dtype: str = None, **scoring):
        for name, ok, expected in (
                ("aggregate", aggregate in AGGREGATES, "one of " + ", ".join(AGGREGATES)),
                ("trust_remote_code", isinstance(trust_remote_code, bool), "True or False"),
                ("batch_size", isinstance(batch_size, int) and batch_size > 0, "an int > 0"),
                ("device", torch.cuda.is_available() or "cuda" not in str(device),
                 "a device this torch has (it has no CUDA)"),
                ("step_separator", step_separator != "", "a non-empty string"),
                ("dtype", dtype in (None, "auto", "fp32", "bf16", "fp16"),
                 "auto, fp32, bf16 or fp16")):
            if not ok:
                raise UsageError(f"{name} {locals()[name]!r}: expected {expected}")
        scorer, self.tokenize = ScorerOptions(**scoring).scorer, None
        if isinstance(model, str):
            tokenizer, model, cfg, self.tokenize = load_reward_model(
                model, trust_remote_code, **scoring)
        elif scorer not in ("auto", "classifier"):
            raise ValueError(f"scorer {scorer!r} reads a model directory, not a loaded model")
        elif tokenizer is None:
            raise ValueError("a loaded model needs its tokenizer=")
        else:
            cfg = Config.from_dict(input_settings(model.config))
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model, self.tokenizer = model.to(self.device).eval(), tokenizer
        self.step_separator = step_separator or cfg.step_separator
        self.max_length = max_length if max_length is not None else cfg.max_length
        self.aggregate, self.batch_size = aggregate, batch_size
        self.__name__ = f"prm_{aggregate}"  # TRL's logged column
        dtype = None if dtype == "auto" else dtype or cfg.dtype
        self.amp_dtype = autocast_dtype(dtype, self.device)
        if self.amp_dtype == torch.bfloat16 and self.tokenize:  # as eval.py's
            self.model.to(torch.bfloat16)

    def text(self, completion) -> str:
        if isinstance(completion, str):
            return completion
        return self.step_separator.join(
            m["content"] for m in completion if m.get("role", "assistant") == "assistant")

    def prompt(self, prompt):
        if isinstance(prompt, str) or getattr(self.tokenizer, "chat_template", None):
            return prompt
        return "\n".join(m["content"] for m in prompt)

    def step_probs(self, prompts: list, completions: list) -> list:
        return [[p for *_, p in steps if p is not None]
                for steps in self.step_scores(prompts, completions)]

    def step_scores(self, prompts: list, completions: list) -> list:
        """Per completion, per step (start, end, P(correct) or None if cut)."""
        refuse_bad_input(prompts, completions)
        texts = [self.text(c) for c in completions]
        spans = [step_spans(text, self.step_separator) for text in texts]
        todo = [i for i, s in enumerate(spans) if s]
        cap = self.max_length or None  # steps past it cannot fit
        solutions = [(self.prompt(prompts[i]), [texts[i][a:b] for a, b in spans[i][:cap]])
                     for i in todo]
        try:
            probs = score_batch(
                self.model, self.tokenizer, solutions, self.step_separator,
                max_length=self.max_length, batch_size=self.batch_size, tokenize=self.tokenize,
                amp_dtype=self.amp_dtype)
        except Exception:  # a chat template's failure named
            for i, (prompt, _) in zip(todo, solutions):
                try:
                    prompt_ids(prompt, self.tokenizer)
                except Exception as e:
                    raise UsageError(f"completion {i}: the chat template fails on its prompt: "
                                     f"{type(e).__name__}: {str(e).strip()[:200]}") from e
            raise
        scored = dict(zip(todo, probs))
        cut = [ps for i, ps in scored.items() if len(ps) < len(spans[i])]
        if cut:
            warnings.warn(f"PRMReward: {sum(map(bool, cut))} of {len(todo)} completions truncated, "
                          f"{cut.count([])} with no step that fits (reward {EMPTY_REWARD}): raise "
                          f"max_length ({self.max_length})", stacklevel=2)
        return [[(a, b, p) for (a, b), p in itertools.zip_longest(s, scored.get(i, []))]
                for i, s in enumerate(spans)]

    def score(self, questions: list, outputs: list) -> list:
        """search-and-learn's: per question, per output, P(correct) per step."""
        if len(questions) != len(outputs):
            raise ValueError(f"{len(questions)} questions for {len(outputs)} lists of outputs")
        for i, texts in enumerate(outputs):
            if not isinstance(texts, (list, tuple)):
                raise ValueError(f"outputs[{i}] {texts!r:.60}: expected a list of solutions")
        probs = self.step_probs([q for q, texts in zip(questions, outputs) for _ in texts],
                                [text for texts in outputs for text in texts])
        rest = iter(probs)
        return [list(itertools.islice(rest, len(texts))) for texts in outputs]

    @property
    def cacheable(self) -> bool:
        """extend() is exact: a classifier on a causal decoder."""
        causal = [m.is_causal for m in self.model.modules() if hasattr(m, "is_causal")]
        return self.tokenize is None and isinstance(self.model, PRM) and all(causal or [False])

    def start(self, question) -> Prefix:  # its ids run with its first extension
        return Prefix(0, (), tuple(prompt_ids(self.prompt(question), self.tokenizer)))

    def extend(self, prefixes: list, steps: list) -> list:
        if not self.cacheable:
            raise UsageError("PRMReward.extend: not a classifier PRM: use score()")
        refuse_bad_input(["q"] * len(steps), steps)
        return extend(
            self.model, self.tokenizer, prefixes, steps, self.step_separator,
            max_length=self.max_length, batch_size=self.batch_size, amp_dtype=self.amp_dtype)

    def token_rewards(self, prompts: list, completions: list, completion_ids: list, tokenizer,
                      shaping: str = "min", *, scores: list = None) -> list:
        """Per completion, per token: a step's SHAPINGS value on its last character's token."""
        if shaping not in SHAPINGS:
            raise ValueError(f"shaping {shaping!r}: expected one of {', '.join(SHAPINGS)}")
        refuse_bad_input(prompts, completions, completion_ids, scores)
        holders = [token_holders(tokenizer, ids, self.text(c), i)
                   for i, (c, ids) in enumerate(zip(completions, completion_ids))]
        out = []
        scores = scores or self.step_scores(prompts, completions)
        for steps, holder, ids in zip(scores, holders, completion_ids):
            scored = [(end, p) for _, end, p in steps if p is not None]
            row = [0.0] * len(ids)
            for (end, _), value in zip(scored, SHAPINGS[shaping]([p for _, p in scored])):
                row[holder(end - 1)] += value
            out.append(row)
        return out

    def __call__(self, prompts: list, completions: list, **kwargs) -> list:  # kwargs: TRL's
        return self.aggregated(self.step_probs(prompts, completions))

    def aggregated(self, step_probs: list) -> list:
        return [float(AGGREGATES[self.aggregate](ps)) if ps else EMPTY_REWARD for ps in step_probs]
