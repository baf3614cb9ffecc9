"""final/ with plain transformers: AutoTokenizer + AutoModelForTokenClassification, through the model card's own
snippet, give eval.py's per-step probabilities; the step separator travels in config.json; transformers 4 keys; our
PRM and HF's token classifiers load each other's files; the scoring API gives evaluation's probabilities."""
import json
import os
import re
import shutil

import pytest
import torch

import eval as eval_cli
from conftest import SHARED, run_train
from prm.loading import load_tokenizer
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
    # a shorter sequence takes other fp32 kernel blocks (AVX512 CPUs): its step's probability may move by a few
    # rounding errors of each layer's sums; 64 fp32 epsilons (7.6e-6) bound that, far below a changed input's shift
    tol = 64 * torch.finfo(torch.float32).eps
    assert score(model, tok, prompt, steps) == pytest.approx(own[:1], abs=tol)
    assert score(model, tok, prompt, steps, max_length=0) == own


def test_legacy_keys_for_transformers_4_loaders(tmp_path):
    from transformers import AutoConfig, Qwen2Config
    Qwen2Config(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}).save_pretrained(tmp_path)
    add_legacy_keys(str(tmp_path / "config.json"))
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["rope_theta"] == 1e6 and saved["rope_scaling"] == {"rope_type": "linear", "type": "linear",
                                                                     "factor": 2.0}
    back = AutoConfig.from_pretrained(tmp_path).rope_parameters  # transformers 5 still reads the same RoPE
    assert (back["rope_theta"], back["rope_type"], back["factor"]) == (1e6, "linear", 2.0)


def _tiny(family, vocab):
    from transformers import LlamaConfig, Qwen2Config
    cls = {"qwen2": Qwen2Config, "llama": LlamaConfig}[family]
    return cls(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_export_loads_as_hf_token_classifier_with_same_logits(tmp_path, family):
    from transformers import AutoModel, AutoModelForTokenClassification
    from prm.core.model import PRM, new_head
    torch.manual_seed(0)
    cfg = _tiny(family, 100)
    ours = PRM(AutoModel.from_config(cfg), new_head(cfg)).eval()
    with torch.no_grad():
        ours.head.bias.fill_(0.3)  # a non-zero bias must survive the trip too
    ours.save_pretrained(tmp_path)
    hf = AutoModelForTokenClassification.from_pretrained(tmp_path).eval()
    assert hf.config.num_labels == 2 and hf.config.id2label == {0: "incorrect", 1: "correct"}
    assert hf.config.architectures[0].endswith("ForTokenClassification")
    ids = torch.randint(1, 100, (2, 9))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        ref = ours(ids, mask)
        assert (hf(input_ids=ids, attention_mask=mask).logits - ref).abs().max() <= 1e-5
        back = PRM.from_pretrained(str(tmp_path)).eval()  # and our wrapper loads it back
        assert (back(ids, mask) - ref).abs().max() <= 1e-5


def test_wrapper_loads_a_foreign_hf_token_classifier(tmp_path):
    """E.g. a checkpoint written by TRL's PRMTrainer: a plain XxxForTokenClassification with 2 labels."""
    from transformers import Qwen2ForTokenClassification
    from prm.core.model import PRM
    torch.manual_seed(1)
    cfg = _tiny("qwen2", 100)
    cfg.num_labels = 2
    theirs = Qwen2ForTokenClassification(cfg).eval()
    theirs.save_pretrained(tmp_path)
    ids = torch.randint(1, 100, (1, 7))
    with torch.no_grad():
        assert torch.allclose(PRM.from_pretrained(str(tmp_path)).eval()(ids), theirs(input_ids=ids).logits, atol=1e-6)


def test_scoring_api_equals_evaluation_probabilities(char_tok):
    from prm.loading import build_model
    from prm.core.data import pad_token_id, tokenize_example
    from prm.core.evaluate import predict, score, score_batch
    from prm.readers.synthetic import make_rows
    model = build_model("tiny", char_tok, seed=0)
    rows = make_rows(5, 3)
    tokenized = [tokenize_example(r, char_tok, is_eval=True) for r in rows]
    seen = predict(model, tokenized, batch_size=2, pad_id=pad_token_id(char_tok), progress=False)
    scored = score_batch(model, char_tok, [(r["prompt"], r["completions"]) for r in rows])
    for probs, mine, row in zip(seen, scored, rows):
        assert len(mine) == len(row["completions"])
        assert mine == pytest.approx(probs, abs=1e-6)
    assert score(model, char_tok, rows[0]["prompt"], rows[0]["completions"]) == pytest.approx(scored[0], abs=1e-6)
