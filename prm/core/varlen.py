"""Attention within each example of data.pack's row: varlen flash attention on CUDA in bf16/fp16,
else causal SDPA per example (transformers' SDPA would attend across examples)."""
import functools
import inspect

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

KERNEL_DEVICE = "cuda"  # where varlen_attn runs (tests: the CPU, with a reference kernel)
NAME = "prm_packed"  # the attention implementation
try:  # torch >= 2.10
    from torch.nn.attention.varlen import varlen_attn
except ImportError:
    varlen_attn = None


def kernel_dtype(query):
    """The flash kernel's dtype; None: the fallback (CPU, fp32, head dim > 256). Under autocast
    RoPE hands over fp32 queries: the kernel runs in the autocast dtype, as SDPA would."""
    if varlen_attn is None or query.device.type != KERNEL_DEVICE or query.shape[-1] > 256:
        return None
    if query.is_cuda and torch.cuda.get_device_capability(query.device) < (8, 0):  # pre-Ampere
        return None
    if query.dtype in (torch.bfloat16, torch.float16):
        return query.dtype
    if torch.is_autocast_enabled(KERNEL_DEVICE):
        return torch.get_autocast_dtype(KERNEL_DEVICE)
    return None


@functools.lru_cache
def kernel_options(fn, n_heads: int, n_kv_heads: int) -> tuple:
    """(causal keywords, whether to repeat K/V): torch 2.10 takes is_causal, later ones a window
    (-1, 0) and maybe enable_gqa."""
    params = inspect.signature(fn).parameters
    kw = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    gqa = n_heads != n_kv_heads
    if gqa and "enable_gqa" in params:
        kw["enable_gqa"] = True
    return kw, gqa and "enable_gqa" not in params


def per_example_sdpa(q, k, v, cu_seqlens, scale, window=None):
    """Causal SDPA per example (over its last `window` keys). q (H, N, D), k/v (Hkv, N, D)."""
    bounds = cu_seqlens.tolist()
    gqa = q.shape[0] != k.shape[0]
    out = torch.empty_like(q)  # (H, N, D)
    for s, e in zip(bounds, bounds[1:]):
        band = None
        if window is not None and e - s > window:
            i = torch.arange(e - s, device=q.device)
            band = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < window)  # (n, n)
        if e > s:  # 4-D (1, H, n, D): 3-D takes the slow math kernel on CPU
            qs, ks, vs = (x[None, :, s:e] for x in (q, k, v))
            out[:, s:e] = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=band, scale=scale,
                                                         is_causal=band is None, enable_gqa=gqa)[0]
    return out


def packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     **kwargs):
    """query (1, H, N, D), key/value (1, Hkv, N, D) -> ((1, N, H, D), None)."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None or query.shape[0] != 1:
        raise ValueError("packed attention needs one row and its cu_seq_lens_q (data.pack's)")
    if not getattr(module, "is_causal", True) or dropout:
        raise ValueError("packed attention is causal only, without dropout: --no-packing")
    window = kwargs.get("sliding_window")
    dtype = kernel_dtype(query)
    kw, repeat = kernel_options(varlen_attn, query.shape[1], key.shape[1]) if dtype else ({}, False)
    if dtype is None or window is not None and "window_size" not in kw:  # 2.10's: no window
        out = per_example_sdpa(query[0], key[0], value[0], cu, scaling, window)  # (H, N, D)
        return out.transpose(0, 1).unsqueeze(0), None  # (1, N, H, D)
    if window is not None:
        kw = {**kw, "window_size": (window - 1, 0)}  # the left count excludes the query's key
    q, k, v = (x[0].transpose(0, 1).to(dtype) for x in (query, key, value))  # (N, H, D)
    if repeat:  # each K/V head serves H / Hkv query heads
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    cu = cu.to(device=q.device, dtype=torch.int32)
    n = kwargs["max_length_q"]
    out = varlen_attn(q, k, v, cu, cu, n, n, scale=scaling, **kw)  # (N, H, D)
    return out.unsqueeze(0), None  # (1, N, H, D)


def supports_packing(backbone) -> bool:
    """Decoders with AttentionInterface attention, all causal, no dropout."""
    causal = [m.is_causal for m in backbone.modules() if hasattr(m, "is_causal")]
    dropout = [getattr(backbone.config, k, 0.0) or 0.0 for k in ("attention_dropout", "attn_pdrop")]
    # the kernels lack Gemma 2's logit soft-capping and gpt-oss's attention sinks
    unsupported = getattr(backbone.config, "attn_logit_softcapping", None) or \
        any(hasattr(m, "sinks") for m in backbone.modules())
    return bool(getattr(backbone, "_supports_attention_backend", False) and causal
                and all(causal) and not any(dropout) and not unsupported)


def is_packed(model) -> bool:
    """Whether the model (a PRM or a backbone) runs packed_attention."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None) == NAME


def use_packed_attention(backbone):
    """Every attention layer of the backbone runs packed_attention."""
    AttentionInterface.register(NAME, packed_attention)
    backbone.set_attn_implementation(NAME)
