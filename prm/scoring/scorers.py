"""Published PRMs scored as their authors score them: a row builder and (B, T, 2) logits."""
import bisect
import dataclasses
import hashlib
import itertools

import torch
import torch.nn as nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from prm.loading import load_trained, loading, set_packing, tokenizer_for
from prm.core.data import columns, make_row
from prm.core.model import PRM, saved_weights
from prm.errors import UsageError
from prm.scoring import FAMILIES, ScorerOptions

QWEN_SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."
QWEN_SEP = "<extra_0>"
MARK_FLAGS = {"qwen-prm": "qwen-prm's step separator", "step-tag": "--step-tag",
              "chat-turns": "--good-token"}
with open(__file__, "rb") as _f:  # in every Family: an edit here is a new cache
    CODE = hashlib.sha256(_f.read()).hexdigest()


def detect(model: str, scorer) -> str:
    if scorer and scorer != "auto":
        return scorer
    try:  # no code runs
        archs = AutoConfig.from_pretrained(model).architectures or []
    except Exception:  # load_trained says why
        return "classifier"
    qwen = any(str(a).endswith("ForProcessRewardModel") for a in archs)
    return "qwen-prm" if qwen else "classifier"


def shown(tokenizer, ids: list) -> list:
    """Each token's text ('к', not its byte-level 'Ðº')."""
    return [tokenizer.decode([i], clean_up_tokenization_spaces=False) for i in ids]


def one_token(tokenizer, flag: str, text: str) -> int:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise UsageError(f"{flag} {text!r} must be one token: it splits into {len(ids)}, "
                         f"{shown(tokenizer, ids)}")
    if ids[0] == tokenizer.unk_token_id:
        raise UsageError(f"{flag} {text!r} is not in the model's vocabulary (read as "
                         f"{tokenizer.unk_token!r})")
    return ids[0]


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    tag: str = ""
    good: str = "+"
    tag_id: int = -1
    good_id: int = -1
    bad_id: int = -1
    code: str = CODE

    def tokenize_batch(self, batch: dict, tokenizer, step_separator="\n", **kw) -> dict:
        """As data.tokenize_batch, the family's own text ending the steps."""
        rows = []
        for prompt, steps, labels in zip(batch["prompt"], batch["completions"], batch["labels"]):
            problem = prompt if isinstance(prompt, str) else "\n".join(
                m["content"] for m in prompt if m.get("role", "user") == "user")
            row = BUILDERS[self.name](self, tokenizer, problem, list(steps))
            ids, reads, first = locate(self, tokenizer, *row)
            rows.append(make_row(ids, reads, labels, first=first, **kw))
        return columns(rows)


def family(tokenizer, name: str, *, step_tag="", good_token="+", bad_token="-") -> Family:
    lm = name in ("step-tag", "chat-turns")
    given = (("--step-tag", step_tag != "", name == "step-tag"),
             ("--good-token", good_token != "+", lm), ("--bad-token", bad_token != "-", lm))
    unread = [flag for flag, set_, read in given if set_ and not read]
    if unread:
        raise UsageError(f"{', '.join(unread)}: not read by --scorer {name}")
    if name == "classifier":
        return Family(name)
    if name == "qwen-prm":  # checked before asking to run the model's code
        flag = "--scorer qwen-prm: is --model a Qwen PRM? Its step separator"
        return Family(name, QWEN_SEP, tag_id=one_token(tokenizer, flag, QWEN_SEP))
    if name == "step-tag" and not step_tag:
        raise UsageError("--scorer step-tag needs --step-tag (Math-Shepherd's: 'ки')")
    if name == "chat-turns" and not getattr(tokenizer, "chat_template", None):
        raise UsageError("--scorer chat-turns needs a tokenizer with a chat template")
    tag_id = one_token(tokenizer, "--step-tag", step_tag) if step_tag else -1
    good_id = one_token(tokenizer, "--good-token", good_token)
    bad_id = one_token(tokenizer, "--bad-token", bad_token)
    if good_id == bad_id:
        raise UsageError(f"--good-token {good_token!r} and --bad-token {bad_token!r} are one "
                         "token: every step would score 0.5")
    return Family(name, step_tag, good_token, tag_id, good_id, bad_id)


def locate(fam: Family, tokenizer, text: str, ends: list, first_char: int) -> tuple:
    """(input_ids, the marks' positions, first step's first token); chat-turns: a token before."""
    chat = fam.name == "chat-turns"
    mark, token_id = (fam.good, fam.good_id) if chat else (fam.tag, fam.tag_id)
    enc = tokenizer(text, add_special_tokens=not chat, return_offsets_mapping=True)
    ids, spans = enc["input_ids"], enc["offset_mapping"]
    by_end = {e: j for j, (s, e) in enumerate(spans) if e > s}
    reads = []
    for end in ends:
        j = by_end.get(end)
        if j is None or ids[j] != token_id:
            start = end - len(mark) - 1
            pieces = shown(tokenizer, [i for i, (s, e) in zip(ids, spans) if e > start and s < end])
            flag = MARK_FLAGS[fam.name]
            raise UsageError(f"{flag} {mark!r} merges with the text around it: there "
                             f"{text[start:end]!r} tokenizes as {pieces}")
        reads.append(j - chat)
    return ids, reads, bisect.bisect_right([e for _, e in spans], first_char)


def qwen_row(fam: Family, tokenizer, problem: str, steps: list) -> tuple:
    content = "".join(s + fam.tag for s in steps)
    messages = [{"role": "system", "content": QWEN_SYSTEM}, {"role": "user", "content": problem},
                {"role": "assistant", "content": content}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    at = text.rfind(content)
    if at < 0:
        raise UsageError("--scorer qwen-prm: the chat template alters the assistant's text")
    ends = itertools.accumulate((len(s) + len(fam.tag) for s in steps), initial=at)
    return text, list(ends)[1:], at


def step_tag_row(fam: Family, tokenizer, problem: str, steps: list) -> tuple:
    text, ends = problem + " ", []
    for k, step in enumerate(steps):
        text += ("\n" if k else "") + step + " " + fam.tag
        ends.append(len(text))
    return text, ends, len(problem) + 1


def chat_row(fam: Family, tokenizer, problem: str, steps: list) -> tuple:
    turns = []
    for k, step in enumerate(steps):
        turns += [{"role": "user", "content": problem + " " + step if k == 0 else step},
                  {"role": "assistant", "content": fam.good}]
    text = tokenizer.apply_chat_template(turns, tokenize=False) if turns else ""
    ends = []
    for k in range(len(steps)):
        head = tokenizer.apply_chat_template(
            turns[:2 * k + 1], tokenize=False, add_generation_prompt=True)
        if not text.startswith(head + fam.good):
            raise UsageError(f"--scorer chat-turns: the chat template does not render turn "
                             f"{2 * k + 2} ({fam.good!r}) after the turns before it: it cannot "
                             "hold a step boundary")
        ends.append(len(head) + len(fam.good))
    at = text.find(problem + " " + steps[0]) if steps else -1
    return text, ends, at + len(problem) + 1 if at >= 0 else 0


BUILDERS = {"qwen-prm": qwen_row, "step-tag": step_tag_row, "chat-turns": chat_row}


class FirstOutput(nn.Module):
    """A model with its own code (Qwen2.5-Math-PRM): its first output."""

    def __init__(self, model):
        super().__init__()
        self.model, self.config = model, model.config

    def forward(self, input_ids, attention_mask=None):
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask)[0]  # (B, T, 2)
        if logits.dim() != 3 or logits.shape[-1] != 2:
            raise UsageError("--scorer qwen-prm: the model's first output has shape "
                             f"{tuple(logits.shape)}, not (batch, tokens, 2)")
        return logits


def lm_head_rows(lm, ids: list) -> PRM:
    """A causal LM as a PRM whose head is its LM head's rows ids ([bad, good])."""
    head = lm.get_output_embeddings()
    rows = nn.Linear(head.in_features, len(ids), head.bias is not None, head.weight.device,
                     head.weight.dtype)  # weight (2, H), bias (2,)
    rows.load_state_dict({k: v[ids] for k, v in head.state_dict().items()})
    return PRM(lm.base_model, rows)


def load(cfg, tokenizer_given: bool, opts: ScorerOptions, *, dtype=torch.float32) -> tuple:
    """(tokenizer, model, score_batch's `tokenize`: None for a classifier)."""
    settings = dataclasses.asdict(opts)
    name = detect(cfg.model, settings.pop("scorer"))
    if name not in FAMILIES:
        raise UsageError(f"--scorer {name!r}: expected one of {', '.join(FAMILIES)}")
    if name == "classifier":
        family(None, name, **settings)  # refuses the flags it ignores
        tokenizer, model = load_trained(cfg, tokenizer_given)
        tokenize = None
    else:
        tokenizer = tokenizer_for(cfg, tokenizer_given)
        fam = family(tokenizer, name, **settings)
        qwen = name == "qwen-prm"
        if qwen and not cfg.trust_remote_code:
            raise UsageError(f"--scorer qwen-prm: {cfg.model} runs its own model code: add "
                             "--trust-remote-code")
        model = loading("--model", cfg.model, saved_weights, dtype=dtype,
                        auto=AutoModel if qwen else AutoModelForCausalLM,
                        trust_remote_code=cfg.trust_remote_code)
        if qwen:
            model = FirstOutput(model)
        else:
            model = set_packing(lm_head_rows(model, [fam.bad_id, fam.good_id]), cfg.packing)
        model.eval()
        tokenize = fam.tokenize_batch
    rows = model.config.get_text_config().vocab_size
    if len(tokenizer) > rows:
        path = tokenizer.name_or_path
        flag = "--tokenizer" if path == cfg.tokenizer else "--model"
        raise UsageError(f"{flag} {path}: {len(tokenizer)} tokens, more than --model "
                         f"{cfg.model}'s {rows} embeddings")
    return tokenizer, model, tokenize
