"""The model as the loop runs it (Parallel), and FSDP2's shards."""
import contextlib
import os
import warnings

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_state_dict, set_model_state_dict, set_state_dict)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from prm.errors import check

SHARDS = "shards"  # the dcp folder in a checkpoint


def shard(model: nn.Module, amp_dtype=None) -> nn.Module:
    """fully_shard each layer of the backbone's longest nn.ModuleList, then the root."""
    stacks = [m for m in model.backbone.modules() if isinstance(m, nn.ModuleList)]
    if not stacks:
        raise ValueError(f"{type(model.backbone).__name__} has no nn.ModuleList to shard")
    reduce_dtype = torch.float32 if amp_dtype else None
    policy = MixedPrecisionPolicy(param_dtype=amp_dtype, reduce_dtype=reduce_dtype)
    for layer in max(stacks, key=len):
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def _options(trainable_only: bool, **kw) -> StateDictOptions:  # LoRA: the base is --model's
    # strict matters only when a state dict is set
    return StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only, **kw)


def _state(model: nn.Module, optimizer, trainable_only: bool) -> dict:
    weights, optim = get_state_dict(model, optimizer, options=_options(trainable_only))
    return {"model": weights, "optimizer": optim}


def save_shards(path: str, model: nn.Module, optimizer, trainable_only: bool):
    """Every rank writes its shard of weights and optimizer state."""
    dcp.save(_state(model, optimizer, trainable_only), checkpoint_id=os.path.join(path, SHARDS))


def load_shards(path: str, model: nn.Module, optimizer, trainable_only: bool):
    """The inverse of save_shards, resharded to this world size."""
    state = _state(model, optimizer, trainable_only)
    dcp.load(state, checkpoint_id=os.path.join(path, SHARDS))
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"],
                   options=_options(trainable_only))


def load_whole(path: str, model: nn.Module, trainable_only: bool):
    """A sharded checkpoint's weights into an unsharded model."""
    weights = get_model_state_dict(model, options=_options(trainable_only))
    # dcp warns that no_dist reads in one process, as asked
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load({"model": weights}, checkpoint_id=os.path.join(path, SHARDS), no_dist=True)
    set_model_state_dict(model, weights, options=_options(trainable_only))


class Parallel:
    """Plain, compiled, DDP or FSDP2; `model` stays the plain PRM."""

    def __init__(self, model, rt, *, cfg, amp_dtype, packed: bool):
        self.model, self.rt, self.fsdp = model, rt, cfg.fsdp
        if cfg.fsdp:  # before the optimizer: it holds the sharded parameters
            check([] if rt.distributed
                  else ["--fsdp shards over ranks: launch with torchrun --nproc_per_node 2+"])
            shard(model, amp_dtype)
        self.forward = model
        # a static graph only when rows padded to --pack-to repeat their shapes
        if cfg.compile:
            self.forward = torch.compile(model, dynamic=not (packed and cfg.pack_to))
        if rt.distributed and not cfg.fsdp:  # a sharded model reduces its own gradients
            ids = [rt.local_rank] if rt.device.type == "cuda" else None
            self.forward = DDP(self.forward, device_ids=ids)

    def grad_sync(self, last: bool):
        """Gradients reduce in the last micro-batch's backward only."""
        if self.fsdp:
            self.model.set_requires_gradient_sync(last)
            return contextlib.nullcontext()
        sync = last or not self.rt.distributed
        return contextlib.nullcontext() if sync else self.forward.no_sync()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clips by the norm over every rank's gradients; returns it."""
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm or float("inf"))
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def full_state(self):
        """Sharded: the whole weights on rank 0's CPU; else None."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.model, options=options) if self.fsdp else None
