"""LoRA in plain PyTorch."""
import fnmatch
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class LoRALinear(nn.Linear):
    """y = x W^T + b + (alpha / r) * dropout(x) A^T B^T; W, b frozen, same names; B starts 0."""

    def __init__(self, base: nn.Linear, r: int, alpha: float, dropout: float):
        nn.Module.__init__(self)  # nn.Linear.__init__ would allocate a second weight
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        self.requires_grad_(False)
        dev = base.weight.device
        self.lora_A = nn.Parameter(torch.empty(r, self.in_features, device=dev))  # (r, in)
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, r, device=dev))  # (out, r)
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # nn.Linear's init, as LoRA's code
        self.scale = alpha / r
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x):
        update = F.linear(F.linear(self.dropout(x), self.lora_A), self.lora_B)  # (..., out)
        return F.linear(x, self.weight, self.bias) + self.scale * update

    def extra_repr(self) -> str:
        r = self.lora_A.shape[0]
        return f"{self.in_features}, {self.out_features}, r={r}, scale={self.scale:g}"


def apply_lora(backbone: nn.Module, r: int, alpha: float, dropout: float, targets: str) -> list:
    """Freezes the backbone; LoRALinear for each nn.Linear whose name (or last part) matches."""
    patterns = [p.strip() for p in targets.split(",") if p.strip()]
    backbone.requires_grad_(False)
    linear = [(n, m) for n, m in backbone.named_modules()
              if isinstance(m, nn.Linear) and not isinstance(m, LoRALinear)]
    match = lambda n, p: fnmatch.fnmatchcase(n, p) or fnmatch.fnmatchcase(n.rsplit(".", 1)[-1], p)
    chosen = [(n, m) for n, m in linear if any(match(n, p) for p in patterns)]
    if not chosen:
        seen = sorted({n.rsplit(".", 1)[-1] for n, _ in linear})
        raise ValueError(f"--lora-targets {targets!r} matches no nn.Linear layer of this backbone; "
                         f"its linear layers end in: {', '.join(seen) or 'none'}")
    for name, module in chosen:
        parent_name, _, child = name.rpartition(".")
        parent = backbone.get_submodule(parent_name) if parent_name else backbone
        setattr(parent, child, LoRALinear(module, r, alpha, dropout))
    return [n for n, _ in chosen]


def merge(weight, lora_A, lora_B, scale: float) -> torch.Tensor:
    """W + scale B A, computed in fp32."""
    delta = lora_B.float() @ lora_A.float()  # (out, in)
    return (weight.float() + scale * delta).to(weight.dtype)


def merged_state_dict(module: nn.Module, state: dict = None) -> dict:
    """The state dict (or `state`) with the adapters merged."""
    state = dict(module.state_dict() if state is None else state)
    for name, m in module.named_modules():
        if isinstance(m, LoRALinear):
            prefix = f"{name}." if name else ""
            a, b = state.pop(prefix + "lora_A"), state.pop(prefix + "lora_B")
            state[prefix + "weight"] = merge(state[prefix + "weight"], a, b, m.scale).detach()
    return state


def peft_targets(module: nn.Module) -> list:
    """PEFT's target_modules: last parts (`q_proj`) if unambiguous."""
    chosen = {n for n, m in module.named_modules() if isinstance(m, LoRALinear)}
    short = {n.rsplit(".", 1)[-1] for n in chosen}
    same_short = {n for n, _ in module.named_modules() if n.rsplit(".", 1)[-1] in short}
    return sorted(short if same_short == chosen else chosen)


def trainable_state_dict(model: nn.Module) -> dict:
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


def has_lora(model: nn.Module) -> bool:
    return any(isinstance(m, LoRALinear) for m in model.modules())


def count_parameters(model: nn.Module) -> tuple:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters())
