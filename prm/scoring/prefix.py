"""Tree search's scorer: each step run once on the PRM's key/value cache of its prefix (exact:
steps and separators tokenize apart)."""
import dataclasses
import inspect

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from prm.core.data import eval_batches, separator_ids
from prm.core.varlen import NAME


@dataclasses.dataclass(frozen=True, eq=False)
class Prefix:
    """`length` ids read, their (keys, values) per layer; `todo`: the question's ids, unrun."""
    length: int
    cache: tuple = ()
    todo: tuple = ()


def extend(model, tokenizer, prefixes: list, steps: list, separator: str, *, max_length,
           batch_size: int, amp_dtype) -> list:
    """Per (prefix, step): (prefix + step, its P(correct) or None past max_length, tokens run)."""
    if not steps:
        return []
    sep = separator_ids(tokenizer, separator)
    new = [ids + sep for ids in tokenizer(list(steps), add_special_tokens=False)["input_ids"]]
    # as in training, a step ending past max_length is unscored
    todo = [i for i, (p, ids) in enumerate(zip(prefixes, new))
            if not max_length or p.length + len(p.todo) + len(ids) <= max_length]
    # a question's ids run once, however many steps extend it
    opening = list({id(prefixes[i]): prefixes[i] for i in todo if prefixes[i].todo}.values())
    packed = model.backbone.config._attn_implementation == NAME
    if packed:  # it reads neither padding nor a cache
        model.backbone.set_attn_implementation("sdpa")
    try:
        ran = run(model, opening, [p.todo for p in opening], batch_size, amp_dtype)
        opened = {id(p): prefix for p, (prefix, _) in zip(opening, ran)}
        grown = run(model, [opened.get(id(prefixes[i]), prefixes[i]) for i in todo],
                    [new[i] for i in todo], batch_size, amp_dtype)
    finally:
        if packed:
            model.backbone.set_attn_implementation(NAME)
    out = [(Prefix(p.length + len(p.todo) + len(ids)), None, 0) for p, ids in zip(prefixes, new)]
    lasts = torch.stack([probs[-1] for _, probs in grown]).tolist() if grown else []  # one sync
    for i, (prefix, _), p in zip(todo, grown, lasts):
        question = len(prefixes[i].todo) if opened.pop(id(prefixes[i]), None) else 0  # once
        out[i] = (prefix, p, len(new[i]) + question)
    return out


@torch.no_grad()
def run(model, prefixes: list, ids: list, batch_size: int, amp_dtype) -> list:
    """Per prefix, (the prefix with ids, P(correct) at each of ids)."""
    out = [None] * len(prefixes)
    device = next(model.parameters()).device
    amp = torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None)
    params = inspect.signature(model.backbone.forward).parameters
    name = "cache" if "cache" in params else "past_key_values"  # transformers 5's, else 4's
    for batch in eval_batches([p.length + len(x) for p, x in zip(prefixes, ids)], batch_size):
        past = max(prefixes[i].length for i in batch)
        width = max(len(ids[i]) for i in batch)
        tokens = torch.zeros(len(batch), width, dtype=torch.long)  # (B, L)
        mask = torch.zeros(len(batch), past + width, dtype=torch.long)  # (B, P + L)
        for b, i in enumerate(batch):
            tokens[b, :len(ids[i])] = torch.tensor(ids[i])
            mask[b, past - prefixes[i].length:past + len(ids[i])] = 1
        starts = torch.tensor([prefixes[i].length for i in batch])
        positions = starts[:, None] + torch.arange(width)  # (B, L)
        cache = DynamicCache(padded([prefixes[i] for i in batch], past)) if past else None
        with amp:
            result = model.backbone(
                input_ids=tokens.to(device), attention_mask=mask.to(device),
                position_ids=positions.to(device), use_cache=True, **{name: cache})
            logits = model.head(result.last_hidden_state)  # (B, L, 2)
        probs = torch.softmax(logits.float(), dim=-1)[..., 1].cpu()  # (B, L)
        layers = [(x.keys, x.values) for x in getattr(result, name).layers]
        for b, i in enumerate(batch):
            length, n = prefixes[i].length, len(ids[i])
            kv = tuple(tuple(x[b, :, past - length:past + n].clone() for x in pair)
                       for pair in layers)  # (heads, length + n, head_dim)
            out[i] = Prefix(length + n, kv), probs[b, :n]
    return out


def padded(prefixes: list, past: int) -> list:
    """Per layer, the prefixes' (keys, values) left-padded: (B, heads, past, dim)."""
    like = next(p.cache for p in prefixes if p.cache)
    return [tuple(torch.stack([F.pad(p.cache[layer][k] if p.cache else like[layer][k][:, :0],
                                     (0, 0, past - p.length, 0)) for p in prefixes])
                  for k in (0, 1)) for layer in range(len(like))]
