"""Evaluate a trained PRM (ours or any HF token classifier with 2 labels); prints one JSON object. Depends on: prm."""
import argparse
import json
import os

import torch

from prm.config import Config, build_parser
from prm.data import pad_token_id, tokenize_dataset
from prm.evaluate import predict
from prm.metrics import step_metrics
from prm.model import PRM
from prm.runtime import autocast_dtype, setup, teardown
from prm.sources import load_eval


def parse_args(argv=None):
    """Every training flag is accepted; those not given come from the run's saved config beside the model."""
    p = build_parser(Config, description=__doc__)
    p.set_defaults(**{a.dest: argparse.SUPPRESS for a in p._actions if a.dest != "help"})
    p.add_argument("--predictions", default="", help="write one JSON line per example with per-step P(correct)")
    args = vars(p.parse_args(argv))
    saved = os.path.join(args["model"], "config.train.json") if "model" in args else ""
    base = Config.from_dict(json.load(open(saved))) if saved and os.path.isfile(saved) else Config()
    fields = {k: v for k, v in args.items() if k != "predictions"}
    cfg = Config.from_dict({**base.__dict__, **fields, "model": args.get("model", base.model)})
    return cfg, args.get("predictions", ""), fields.get("dataset", "")


def main(argv=None):
    cfg, predictions_path, whole = parse_args(argv)
    rt = setup()
    try:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer or cfg.model, trust_remote_code=cfg.trust_remote_code)
        model = PRM.from_pretrained(cfg.model, trust_remote_code=cfg.trust_remote_code, dtype=torch.float32)
        model.to(rt.device)
        raw = load_eval(cfg, whole)
        ds, report = tokenize_dataset(raw, tokenizer, cfg, is_eval=True, num_proc=cfg.num_proc)
        rows = ds.to_list()
        preds = predict(model, rows, cfg.eval_batch_size or 2 * cfg.batch_size, pad_token_id(tokenizer), rt.device,
                        autocast_dtype(cfg.dtype, rt.device), rt)
        out = step_metrics([p for ps, _ in preds for p in ps], [y for _, ys in preds for y in ys], cfg.threshold)
        out["n_examples"] = len(rows)
        if rt.is_main:
            if predictions_path:
                with open(predictions_path, "w") as f:
                    for i, (row, (probs, _)) in enumerate(zip(rows, preds)):
                        f.write(json.dumps({"id": row.get("id", i), "step_probs": probs}) + "\n")
            print(json.dumps(out), flush=True)
        return out
    finally:
        teardown(rt)


if __name__ == "__main__":
    main()
