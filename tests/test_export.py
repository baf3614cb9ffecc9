"""final/ with plain transformers: AutoTokenizer + AutoModelForTokenClassification, through the model card's own
snippet, give eval.py's per-step probabilities; the step separator travels in config.json; transformers 4 keys."""
import json
import os
import re
import shutil

import pytest
import torch

import eval as eval_cli
from conftest import SHARED, run_train
from prm.training.build import load_tokenizer
from prm.core.evaluate import score
from prm.core.model import PRM, add_legacy_keys
from prm.readers.synthetic import make_rows


def eval_predictions(model_dir, out_file, *args) -> list:
    eval_cli.main(["--model", str(model_dir), "--dtype", "fp32", "--predictions", str(out_file), *args])
    with open(out_file) as f:
        return [json.loads(line) for line in f]


def card_score(final_dir):
    """The score() function of the model card's snippet, run as written (only MODEL pointed at final_dir)."""
    card = (final_dir / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", card, re.S).group(1)
    assert "import prm" not in code and "from prm" not in code
    namespace = {}
    exec(code.replace('MODEL = "."', f"MODEL = {str(final_dir)!r}").rsplit("\nprint(", 1)[0], namespace)
    return namespace["score"], namespace["tok"]


def assert_plain_transformers_agree(run_dir, tmp_path):
    lines = eval_predictions(run_dir / "final", tmp_path / "pred.jsonl")
    rows = {r["id"]: r for r in make_rows(63, 0)}  # the synthetic held-out rows eval.py scored
    plain_score, _ = card_score(run_dir / "final")
    diffs = [abs(a - b) for line in lines for a, b in
             zip(line["step_probs"], plain_score(rows[line["id"]]["prompt"], rows[line["id"]]["completions"]),
                 strict=True)]
    assert len(diffs) >= 20 and max(diffs) <= 1e-5


def test_tiny_preset_final_loads_with_plain_transformers(tmp_path):
    run_train(tmp_path / "run", max_steps=3)
    assert_plain_transformers_agree(tmp_path / "run", tmp_path)
    _, tok = card_score(tmp_path / "run" / "final")
    assert tok("a b\nc", add_special_tokens=False)["input_ids"] == [24, 23, 25, 81, 26]  # spaces and newlines kept
    saved = json.loads((tmp_path / "run" / "final" / "config.json").read_text())
    assert saved["rope_theta"] == saved["rope_parameters"]["rope_theta"]
    assert saved["prm"] == {"step_separator": "\n", "max_length": 1024, "max_completion_length": 0}


def test_gpt2_tokenizer_model_final_loads_with_plain_transformers(tmp_path):
    path = os.path.join(SHARED, "tokenizers", "gpt2")
    if not os.path.isdir(path):
        pytest.skip("../shared/tokenizers/gpt2 is absent")
    from transformers import AutoModel, AutoTokenizer, GPT2Config
    tok = AutoTokenizer.from_pretrained(path)
    base = tmp_path / "gpt2-tiny"  # a random GPT-2 backbone with the real GPT-2 tokenizer beside it
    torch.manual_seed(0)
    AutoModel.from_config(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=2, n_head=2, n_positions=512,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)).save_pretrained(base)
    tok.save_pretrained(base)
    run_train(tmp_path / "run", model=str(base), max_steps=2, max_length=256)
    assert_plain_transformers_agree(tmp_path / "run", tmp_path)


def test_separator_travels_with_the_model(tmp_path):
    run_train(tmp_path / "run", max_steps=2, step_separator="\n\n")
    final = tmp_path / "run" / "final"
    model, tok = PRM.from_pretrained(str(final)).eval(), load_tokenizer(str(final))
    prompt, steps = "count from 3:", ["3+1=4", "4+1=6", "6+1=7"]
    own = score(model, tok, prompt, steps)
    assert own == score(model, tok, prompt, steps, step_separator="\n\n")
    assert own != pytest.approx(score(model, tok, prompt, steps, step_separator="\n"), abs=1e-6)
    # eval.py, also on an export without config.train.json (config.json's "prm" alone says "\n\n")
    bare = tmp_path / "bare"
    shutil.copytree(final, bare)
    os.remove(bare / "config.train.json")
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": prompt, "completions": steps, "labels": [True, False, False]}) + "\n")
    via_run = eval_predictions(final, tmp_path / "a.jsonl", "--dataset", str(data))
    via_config = eval_predictions(bare, tmp_path / "b.jsonl", "--dataset", str(data))
    told = eval_predictions(bare, tmp_path / "c.jsonl", "--dataset", str(data), "--step-separator", "\\n")
    assert via_run[0]["step_probs"] == pytest.approx(own, abs=1e-6)
    assert via_config[0]["step_probs"] == pytest.approx(own, abs=1e-6)
    assert told[0]["step_probs"] == pytest.approx(score(model, tok, prompt, steps, step_separator="\n"), abs=1e-6)
    # the length caps too: score() truncates as training did unless told otherwise (0: no cap)
    model.config.prm = {**model.config.prm, "max_length": 25}  # BOS + 13 prompt + 7 per step: one step fits
    assert score(model, tok, prompt, steps) == own[:1] and score(model, tok, prompt, steps, max_length=0) == own


def test_legacy_keys_for_transformers_4_loaders(tmp_path):
    from transformers import AutoConfig, Qwen2Config
    Qwen2Config(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}).save_pretrained(tmp_path)
    add_legacy_keys(str(tmp_path / "config.json"))
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["rope_theta"] == 1e6 and saved["rope_scaling"] == {"rope_type": "linear", "type": "linear",
                                                                     "factor": 2.0}
    back = AutoConfig.from_pretrained(tmp_path).rope_parameters  # transformers 5 still reads the same RoPE
    assert (back["rope_theta"], back["rope_type"], back["factor"]) == (1e6, "linear", 2.0)
