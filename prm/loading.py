"""A run's tokenizer and PRM from its Config, each load failure one line."""
import glob
import json
import os
import pickle

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError
from transformers import (AutoConfig, AutoModel, AutoTokenizer, PreTrainedTokenizerFast,
                          Qwen2Config)
from transformers.utils import logging as hf_logging

from prm.training.checkpoint import SHARDS, TRAINABLE, load_trainable, load_whole
from prm.core.data import pad_token_id
from prm.errors import UsageError, check
from prm.core.lora import apply_lora, has_lora
from prm.core.model import PRM, SETTINGS, NotAPRM, hf_names, is_classifier, new_head
from prm.readers.synthetic import char_tokenizer
from prm.core.varlen import supports_packing, use_packed_attention

POSITIVE = {"correct", "positive", "good", "+", "true", "yes"}
GARBAGE = (OSError, ValueError, KeyError, TypeError, AttributeError)  # from garbage JSON


def loading(flag: str, name: str, load, *, weights: bool = True, **kw):
    """load(name, **kw), a failure one UsageError line."""
    # a path: the hub's "Repo id must be ..." would hide the typo
    if name.startswith(("/", "./", "../", "~")) or name.count("/") > 1:
        check([] if os.path.exists(name) else [f"{flag} {name}: no such folder"])
    if weights and flag == "--model" and os.path.isdir(name):
        check(outside_weights(name) if os.path.isfile(os.path.join(name, "config.json"))
              else [f"{flag} {name}: no config.json: not a Hugging Face model directory"])
    # saved_weights checks the keys itself: no load report
    report = hf_logging.get_logger("transformers.modeling_utils")
    quiet = lambda record: "LOAD REPORT" not in record.getMessage()  # noqa: E731
    report.addFilter(quiet)
    try:
        return load(name, **kw)
    except NotAPRM as e:
        raise UsageError(f"{flag} {e}") from None
    # truncated weights; a pickle weights_only refuses; a config its class refuses
    except (OSError, ValueError, SafetensorError, pickle.UnpicklingError,
            StrictDataclassError) as e:
        why = str(e.__cause__ if isinstance(e, StrictDataclassError) else e).strip()
        raise UsageError(f"{flag} {name}: cannot load it: {why.splitlines()[0]}") from None
    finally:
        report.removeFilter(quiet)


def outside_weights(path: str) -> list:
    problems, root = [], os.path.realpath(path)
    for index in sorted(glob.glob(os.path.join(path, "*.index.json"))):
        try:
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        except GARBAGE as e:
            problems.append(f"{index}: not a sharded-weights index with a weight_map "
                            f"({type(e).__name__}: {e})")
            continue
        for name in files:
            where = os.path.realpath(os.path.join(path, str(name)))
            if os.path.commonpath([root, where]) != root or not os.path.isfile(where):
                problems.append(f"{index}: weight_map names {name!r}, not a file inside {path}")
    return problems


def load_tokenizer(name: str, trust_remote_code: bool = False, flag: str = "--tokenizer"):
    """AutoTokenizer; a generic tokenizer.json as written (the model's class drops its <unk>)."""
    saved = os.path.join(name, "tokenizer_config.json")
    load, kw = AutoTokenizer.from_pretrained, {"trust_remote_code": trust_remote_code}
    try:
        if os.path.isfile(saved):
            with open(saved) as f:
                kind = json.load(f).get("tokenizer_class")
            if kind in ("TokenizersBackend", "PreTrainedTokenizerFast"):
                load, kw = PreTrainedTokenizerFast.from_pretrained, {}
        tokenizer = loading(flag, name, load, weights=False, **kw)
    except UsageError:
        raise
    except GARBAGE as e:
        raise UsageError(f"{flag} {name}: cannot load its tokenizer: {type(e).__name__}: {e}"
                         ) from None
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is None:
        raise UsageError(f"{flag} {name}: the tokenizer has neither a pad nor an EOS token: set "
                         "pad_token in its tokenizer_config.json"
                         + (", or pass --tokenizer" if flag == "--model" else ""))
    return tokenizer


def tokenizer_for(cfg, given: bool = True):
    """--tokenizer's if given or --model has none."""
    if cfg.model == "tiny" and not cfg.tokenizer:
        return char_tokenizer()
    own = os.path.isfile(os.path.join(cfg.model, "tokenizer_config.json"))
    flag = "--tokenizer" if cfg.tokenizer and (given or not own) else "--model"
    return load_tokenizer(getattr(cfg, flag[2:]), cfg.trust_remote_code, flag)


def tiny_config(tokenizer):
    return Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=512, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        tie_word_embeddings=False, pad_token_id=pad_token_id(tokenizer),
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)


def hf_config_for(cfg, tokenizer):
    if cfg.model == "tiny":
        return tiny_config(tokenizer)
    return loading("--model", cfg.model, AutoConfig.from_pretrained,
                   trust_remote_code=cfg.trust_remote_code)


def check_exportable(cfg):
    if cfg.model == "tiny":
        return
    hf_cfg = hf_config_for(cfg, None)
    try:
        hf_names(hf_cfg)
    except ValueError:
        raise UsageError(f"--model {cfg.model}: model type {hf_cfg.model_type!r} has no "
                         "transformers token classifier, the form final/ is saved in") from None


def build_model(name: str, tokenizer, seed: int, trust_remote_code: bool = False) -> PRM:
    torch.manual_seed(seed)
    if name == "tiny":
        cfg = tiny_config(tokenizer)
        return PRM(AutoModel.from_config(cfg, attn_implementation="sdpa"), new_head(cfg))
    return pretrained(name, trust_remote_code, attn_implementation="sdpa", dtype=torch.float32)


def pretrained(name: str, trust_remote_code: bool, *, classifier_only: bool = False, **kw) -> PRM:
    """PRM.from_pretrained, the head flipped if its label 0 means 'correct'."""
    remote = {"trust_remote_code": trust_remote_code}
    hf_cfg = loading("--model", name, AutoConfig.from_pretrained, **remote)
    if classifier_only and not is_classifier(hf_cfg):
        raise UsageError(f"--model {name}: not a token-classification checkpoint (architectures "
                         f"{hf_cfg.architectures})")
    model = loading("--model", name, PRM.from_pretrained, **remote, **kw)
    names = {int(i): str(n).lower() for i, n in (model.config.id2label or {}).items()}
    if names.get(0) in POSITIVE and names.get(1) not in POSITIVE:
        model.head.load_state_dict({k: v.flip(0) for k, v in model.head.state_dict().items()})
    return model


def model_for(cfg, tokenizer) -> PRM:
    """The run's PRM on CPU, with its --lora-r adapters."""
    model = build_model(cfg.model, tokenizer, cfg.seed, cfg.trust_remote_code)
    if cfg.disable_dropout:  # as TRL's; before the adapters: --lora-dropout stays
        for module in model.backbone.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
    if cfg.lora_r:
        try:
            apply_lora(model.backbone, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout,
                       cfg.lora_targets)
        except ValueError as e:  # --lora-targets that match no layer
            raise UsageError(str(e)) from None
        if cfg.lora_base_dtype == "bf16":
            for p in model.backbone.parameters():
                if not p.requires_grad:
                    p.data = p.data.to(torch.bfloat16)
    # in config.json: scoring reads the input as training did
    keys = ("step_separator", "max_length", "max_completion_length")
    setattr(model.config, SETTINGS, {k: getattr(cfg, k) for k in keys})
    return set_packing(model, cfg.packing)


def set_packing(model: PRM, packing: bool) -> PRM:
    if packing and supports_packing(model.backbone):
        use_packed_attention(model.backbone)
    return model


def load_trained(cfg, tokenizer_given: bool):
    """(tokenizer, model) of a LoRA or --fsdp checkpoint or a 2-label token classifier."""
    sharded = os.path.isdir(os.path.join(cfg.model, SHARDS))
    if sharded or os.path.isfile(os.path.join(cfg.model, TRAINABLE)):
        run = type(cfg).load(cfg.model)
        run.trust_remote_code = cfg.trust_remote_code  # never the file's
        tokenizer = load_tokenizer(cfg.model, cfg.trust_remote_code, "--model")
        model = model_for(run, tokenizer)
        if sharded:
            load_whole(cfg.model, model, trainable_only=has_lora(model))
        else:
            load_trainable(model, os.path.join(cfg.model, TRAINABLE))
        return tokenizer, model.float()  # as a classifier loads
    model = pretrained(cfg.model, cfg.trust_remote_code, classifier_only=True, dtype=torch.float32)
    return tokenizer_for(cfg, tokenizer_given), set_packing(model, cfg.packing)
