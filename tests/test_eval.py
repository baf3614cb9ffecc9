"""eval.py end to end on a tiny saved model: every number recomputable from --predictions, subsets, tuning, DDP.
Depends on: pytest, torch, prm, eval.py."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import eval as eval_cli  # noqa: E402
from prm.errors import UsageError, WriteFailed  # noqa: E402
from prm.core.evaluate import score, score_batch  # noqa: E402
from prm.core.metrics import first_error, outcome_metrics, processbench_metrics, step_metrics  # noqa: E402

SHARED = os.path.join(ROOT, "..", "shared", "data", "processbench")


def processbench_rows(n: int) -> list:
    """Raw ProcessBench records (id, problem, steps, label = first error or -1, final_answer_correct)."""
    rows = []
    for i in range(n):
        steps = [f"{i}+{k}={i + k}" for k in range(1 + i % 4)]
        label = -1 if i % 3 == 0 else min(i % 2, len(steps) - 1)  # some errors mid-solution: later steps unlabeled
        rows.append({"id": f"pb-{i}", "generator": "test", "problem": f"add up {i}:", "steps": steps,
                     "final_answer_correct": label == -1 or i % 2 == 0, "label": label})
    return rows


@pytest.fixture(scope="module")
def pb_file(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("data") / "bench.json")
    with open(path, "w") as f:
        json.dump(processbench_rows(7), f)  # 7: not divisible by 2 ranks nor by the batch size
    return path


def run(model_dir, *args):
    return eval_cli.main(["--model", model_dir, "--dtype", "fp32", "--eval-batch-size", "2", *args])


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def all_probs(lines):
    return [p for x in lines for p in x["step_probs"]]


def test_processbench_numbers_are_recomputable_from_predictions(model_dir, pb_file, tmp_path):
    pred_path = str(tmp_path / "pred.jsonl")
    out = run(model_dir, "--dataset", pb_file, "--predictions", pred_path, "--threshold", "0.5")
    lines = read_jsonl(pred_path)
    raw = processbench_rows(7)
    assert [x["id"] for x in lines] == [r["id"] for r in raw]
    assert [len(x["step_probs"]) for x in lines] == [len(r["steps"]) for r in raw]  # every step scored
    assert [x["first_error"] for x in lines] == [r["label"] for r in raw]
    # steps after the first error carry no label and stay out of the step metrics
    pairs = [(p, y) for x in lines for p, y in zip(x["step_probs"], x["labels"]) if y is not None]
    expected = {**step_metrics([p for p, _ in pairs], [float(y) for _, y in pairs], 0.5),
                **processbench_metrics([x["first_error_pred"] for x in lines], [x["first_error"] for x in lines]),
                **outcome_metrics([x["step_probs"] for x in lines], [x["final_answer_correct"] for x in lines])}
    assert all(x["first_error_pred"] == first_error(x["step_probs"], 0.5) for x in lines)
    assert {k: out[k] for k in expected} == pytest.approx(expected)
    assert out["n_examples"] == 7 and out["examples_dropped"] == 0 and out["examples_truncated"] == 0
    assert out["threshold"] == 0.5 and out["n_steps"] < sum(len(r["steps"]) for r in raw)


def test_scores_match_the_scoring_api(model_dir, pb_file, tmp_path):
    from transformers import PreTrainedTokenizerFast
    from prm.core.model import PRM
    pred_path = str(tmp_path / "pred.jsonl")
    run(model_dir, "--dataset", pb_file, "--predictions", pred_path)
    model = PRM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    raw, lines = processbench_rows(7), read_jsonl(pred_path)
    assert len(lines) == len(raw)
    for line, r in zip(lines, raw):
        assert line["step_probs"] == pytest.approx(score(model, tokenizer, r["problem"], r["steps"]), abs=1e-5)


def test_truncated_steps_get_no_score_and_empty_rows_are_dropped(model_dir, pb_file, tmp_path):
    from transformers import PreTrainedTokenizerFast
    from prm.core.model import PRM
    model = PRM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    # BOS + "q:" = 3 tokens, each "1+1=2\n" step 6: 12 tokens leave room for one step only
    probs = score_batch(model, tokenizer, [("q:", ["1+1=2"] * 3), ("a long prompt", ["1+1=2"])], max_length=12)
    assert [len(p) for p in probs] == [1, 0]
    pred_path = str(tmp_path / "pred.jsonl")
    out = run(model_dir, "--dataset", pb_file, "--max-length", "20", "--predictions", pred_path)
    lines = read_jsonl(pred_path)
    assert out["examples_truncated"] > 0
    assert out["n_examples"] + out["examples_dropped"] == 7 == len(lines)
    assert all(len(x["step_probs"]) <= len(x["labels"]) for x in lines)


def test_several_subsets_and_a_tuned_threshold(model_dir, pb_file, tmp_path):
    other = str(tmp_path / "other.json")
    with open(other, "w") as f:
        json.dump(processbench_rows(11)[4:], f)
    dev = str(tmp_path / "dev.json")  # the reported set's rows in a file of its own (the same file is refused)
    shutil.copy(pb_file, dev)
    out = run(model_dir, "--dataset", pb_file, other, "--tune-threshold", dev)
    assert set(out["subsets"]) == {"bench", "other"}
    assert out["mean_f1"] == pytest.approx((out["subsets"]["bench"]["f1"] + out["subsets"]["other"]["f1"]) / 2)
    assert out["threshold_tuned_on"] == dev
    assert out["subsets"]["bench"]["f1"] == pytest.approx(out["dev_f1"])  # same set: the tuned F1 is what it gets
    assert out["dev"] == out["subsets"]["bench"]  # the dev block: the same set's every metric at that threshold
    alone = run(model_dir, "--dataset", pb_file, "--threshold", str(out["threshold"]))
    assert alone["f1"] == pytest.approx(out["dev_f1"])


def test_threshold_tuned_on_mr_bens_own_file(model_dir, pb_file):
    """The README's command: Mr-Ben's data/math.json as it is published (format mrben) for --tune-threshold."""
    mrben = os.path.join(os.path.dirname(__file__), "fixtures", "mrben.json")
    out = run(model_dir, "--dataset", pb_file, "--tune-threshold", mrben, "--max-length", "4096")
    assert (out["dev"]["n_with_error"], out["dev"]["n_without_error"]) == (2, 1)  # first errors 0 and 4, one "N/A"
    assert out["dev"]["f1"] == pytest.approx(out["dev_f1"])
    assert {"auroc", "acc_error", "chance_f1"} <= set(out["dev"])


def test_a_dev_file_is_read_with_its_own_format_not_the_runs(model_dir, pb_file, tmp_path):
    from prm.config import Config
    run_dir = str(tmp_path / "run")
    shutil.copytree(model_dir, run_dir)
    shepherd = os.path.join(os.path.dirname(__file__), "fixtures", "math_shepherd.jsonl")
    Config(dataset=shepherd, format="math_shepherd", eval_dataset=shepherd).save(run_dir)
    out = run(run_dir, "--tune-threshold", pb_file)  # ProcessBench rows beside a Math-Shepherd run
    assert out["dev"]["n_examples"] == 7 and out["threshold_tuned_on"] == pb_file


def test_stepwise_data_and_forced_processbench(model_dir, tmp_path):
    path = str(tmp_path / "steps.jsonl")
    rows = [{"prompt": "p", "completions": ["1+1=2", "2+1=4", "4+1=5"], "labels": [True, False, False]},
            {"prompt": "q", "completions": ["3+1=4"], "labels": [True]}]
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    plain = run(model_dir, "--dataset", path)
    assert plain["n_steps"] == 4 and "f1" not in plain and "outcome_auroc_min" not in plain
    forced = run(model_dir, "--dataset", path, "--processbench")  # first error taken from the labels: 1 and -1
    assert forced["n_with_error"] == 1 and forced["n_without_error"] == 1 and "f1" in forced
    # random flags at rate q: hit step 1 of 3 with (1-q) q, pass the 1-step one with 1-q; best at q = sqrt 2 - 1
    assert forced["chance_f1"] == pytest.approx(6 - 4 * 2 ** 0.5, abs=1e-5)


def correct_first(model_dir, flipped: str) -> str:
    """A copy of model_dir as a classifier with 'correct' at index 0: the same model, its head rows swapped."""
    shutil.copytree(model_dir, flipped)
    from safetensors.torch import load_file, save_file
    state = load_file(os.path.join(flipped, "model.safetensors"))
    state = {k: v.flip(0) if k.startswith("score.") else v for k, v in state.items()}
    save_file(state, os.path.join(flipped, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(flipped, "config.json")) as f:
        cfg = json.load(f)
    cfg["id2label"], cfg["label2id"] = {"0": "correct", "1": "incorrect"}, {"correct": 0, "incorrect": 1}
    with open(os.path.join(flipped, "config.json"), "w") as f:
        json.dump(cfg, f)
    return flipped


def test_a_checkpoint_with_correct_as_label_0_is_read_the_right_way(model_dir, pb_file, tmp_path):
    flipped = correct_first(model_dir, str(tmp_path / "flipped"))
    a, b = str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")
    run(model_dir, "--dataset", pb_file, "--predictions", a)
    run(flipped, "--dataset", pb_file, "--predictions", b)
    assert all_probs(read_jsonl(a)) == pytest.approx(all_probs(read_jsonl(b)))


def test_training_from_a_checkpoint_with_correct_as_label_0_starts_from_its_head_read_the_right_way(model_dir,
                                                                                                   tmp_path):
    """Training flips the head as eval.py does, so the export (id2label 1 = correct) holds the same model."""
    from safetensors.torch import load_file

    from conftest import run_train
    flipped = correct_first(model_dir, str(tmp_path / "flipped"))
    run_train(tmp_path / "run", model=flipped, max_steps=1, lr=1e-12)  # a step that moves nothing
    ours, trained = (load_file(os.path.join(d, "model.safetensors")) for d in (model_dir, tmp_path / "run" / "final"))
    assert torch.allclose(trained["score.weight"], ours["score.weight"], atol=1e-6)
    assert torch.allclose(trained["score.bias"], ours["score.bias"], atol=1e-6)


def test_a_model_without_a_token_classification_head_is_refused(model_dir, tmp_path):
    plain = str(tmp_path / "plain")
    os.makedirs(plain)
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg["architectures"] = ["Qwen2Model"]
    with open(os.path.join(plain, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(UsageError, match="token-classification") as e:
        run(plain, "--dataset", "x.json")
    assert e.value.code == 2


@pytest.mark.parametrize("where, why", [("no/sub/p.jsonl", "no such folder"), ("", "a folder, not a file")])
def test_a_predictions_path_that_cannot_be_opened_is_refused_before_the_model_loads(tmp_path, where, why):
    path = str(tmp_path / where)
    with pytest.raises(UsageError) as e:  # the model does not exist either: the path is told first
        eval_cli.main(["--model", str(tmp_path / "no-model"), "--predictions", path])
    assert e.value.code == 2 and str(e.value) == f"--predictions {path}: {why}" + (
        f" {os.path.dirname(path)}" if why == "no such folder" else "")


def test_predictions_over_a_file_eval_reads_are_refused(model_dir, pb_file, tmp_path):
    model = shutil.copytree(model_dir, tmp_path / "m")
    data = shutil.copy(pb_file, str(tmp_path / "d.json"))
    config = str(model / "config.json")
    for over, read in [(data, f"--dataset {data}"), (config, f"--model {model}")]:
        before = open(over, "rb").read()
        with pytest.raises(UsageError) as e:
            eval_cli.main(["--model", str(model), "--dataset", data, "--predictions", over])
        assert e.value.code == 2 and str(e.value) == \
            f"--predictions {over} would overwrite {read}, which it reads: choose another path"
        assert open(over, "rb").read() == before


def test_a_tokenizer_larger_than_the_models_embeddings_is_refused_before_any_forward(
        model_dir, tmp_path, monkeypatch):
    from prm.readers.synthetic import char_tokenizer
    tok, path, data = char_tokenizer(), str(tmp_path / "tok"), tmp_path / "d.jsonl"
    tok.add_tokens(["<big>"])  # an id past the model's embeddings
    tok.save_pretrained(path)
    row = {"prompt": "p <big>", "completions": ["1+1=2"], "labels": [True]}
    data.write_text(json.dumps(row) + "\n")
    monkeypatch.setattr(eval_cli, "predict", lambda *a, **k: pytest.fail("a forward ran"))
    with pytest.raises(UsageError) as e:
        run(model_dir, "--tokenizer", path, "--dataset", str(data))
    n = len(tok)
    assert e.value.code == 2 and str(e.value) == \
        f"--tokenizer {path}: {n} tokens, more than --model {model_dir}'s {n - 1} embeddings"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_failed_predictions_write_comes_after_the_json_and_exits_1(model_dir, pb_file, capsys):
    with pytest.raises(WriteFailed) as e:
        run(model_dir, "--dataset", pb_file, "--predictions", "/dev/full")
    assert e.value.code == 1 and str(e.value) == "could not write /dev/full: No space left on device"
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["n_examples"] == 7


def test_two_ddp_ranks_give_the_same_numbers_as_one_process(model_dir, pb_file, tmp_path):
    one, two = str(tmp_path / "one.jsonl"), str(tmp_path / "two.jsonl")
    expected = run(model_dir, "--dataset", pb_file, "--predictions", one)
    # If a rank ever fails (a "terminate called without an active exception" abort was seen twice on 2026-11-29,
    # never since), the assertion shows why: --tee 2 tags each stderr line with its rank ("[default0]:"), and
    # PYTHONFAULTHANDLER adds the aborting process's Python stacks. No relaunch: a failure must stay visible.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "PYTHONFAULTHANDLER": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "--tee", "2",
           os.path.join(ROOT, "eval.py"), "--model", model_dir, "--dtype", "fp32", "--eval-batch-size", "2",
           "--dataset", pb_file, "--predictions", two]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-8000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == expected  # exact: same batches, so the same numbers
    a, b = read_jsonl(one), read_jsonl(two)
    assert [x["id"] for x in a] == [x["id"] for x in b]
    assert [len(x["step_probs"]) for x in a] == [len(x["step_probs"]) for x in b]
    assert all_probs(a) == pytest.approx(all_probs(b), abs=1e-6)


@pytest.mark.skipif(not os.path.isfile(os.path.join(SHARED, "gsm8k.json")), reason="needs ../shared")
def test_real_processbench_rows(model_dir, tmp_path):
    with open(os.path.join(SHARED, "gsm8k.json")) as f:
        rows = json.load(f)[::20]  # the file is sorted by outcome: a spread, not the first rows
    path, pred_path = str(tmp_path / "gsm8k.json"), str(tmp_path / "pred.jsonl")
    with open(path, "w") as f:
        json.dump(rows, f)
    out = run(model_dir, "--dataset", path, "--max-length", "512", "--predictions", pred_path)
    lines = read_jsonl(pred_path)
    assert len(lines) == len(rows) and out["n_examples"] + out["examples_dropped"] == len(rows)
    assert out["n_examples"] > 0 and out["n_with_error"] + out["n_without_error"] == out["n_examples"]
    assert [x["first_error"] for x in lines] == [r["label"] for r in rows]
    assert out["outcome_auroc_min"] is not None


def test_eval_checks_its_paths_and_dev_set_before_working(tmp_path):
    from conftest import run_train
    out = tmp_path / "run"
    run_train(out, max_steps=1)
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError) as e:
        eval_cli.main(["--model", str(out / "final"), "--predictions", str(tmp_path / "file" / "p.jsonl")])
    assert e.value.code == 2 and "--predictions" in str(e.value)
    dev = tmp_path / "all_right.jsonl"
    dev.write_text(json.dumps({"prompt": "p", "completions": ["1+1=2"], "labels": [True]}) + "\n")
    with pytest.raises(UsageError) as e:
        eval_cli.main(["--model", str(out / "final"), "--tune-threshold", str(dev)])
    assert e.value.code == 2 and "both with and without an error" in str(e.value)
