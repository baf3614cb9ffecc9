"""Optional checks on the larger real data in ../shared/data (PRMBench, BiRM, ProcessBench), skipped when absent."""
import glob
import json
import os
import re

import pytest

from prm.config import Config
from prm.readers.sources import DataError, load_splits, read_rows

SHARED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "data")
pytestmark = pytest.mark.skipif(not os.path.isdir(SHARED), reason="../shared/data is not here")


@pytest.fixture(autouse=True, scope="module")
def datasets_cache(tmp_path_factory):
    import datasets
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf_datasets")))
        yield


def rewrite(src_glob, out_dir, adapt):
    """Each source file as JSONL in out_dir, one adapted record per line, so line numbers stay those of the source."""
    for path in sorted(glob.glob(src_glob)):
        with open(path, encoding="utf-8") as f, open(os.path.join(out_dir, os.path.basename(path)), "w") as out:
            out.writelines(json.dumps(adapt(json.loads(line))) + "\n" for line in f)


def named_rows(err: DataError) -> set:
    return {re.match(r"(\S+) line (\d+): ", p).groups() for p in err.problems}


def test_prmbench_out_of_range_first_errors_are_named(tmp_path):
    # PRMBench's error_steps are 1-based; as ProcessBench rows the first error is min(error_steps) - 1
    adapt = lambda r: {"problem": r["modified_question"], "steps": r["modified_process"],
                       "label": min(r["error_steps"]) - 1 if r["error_steps"] else -1}
    rewrite(os.path.join(SHARED, "prmbench", "*.jsonl"), tmp_path, adapt)
    expected, total = set(), 0
    for path in sorted(glob.glob(str(tmp_path / "*.jsonl"))):
        for n, line in enumerate(open(path), 1):
            r, total = json.loads(line), total + 1
            if not -1 <= r["label"] < len(r["steps"]) or any(not s.strip() for s in r["steps"]):
                expected.add((path, str(n)))
    with pytest.raises(DataError) as e:
        read_rows(str(tmp_path), "train", Config())
    assert named_rows(e.value) == expected and len(expected) >= 16
    assert any("first error" in p and "out of range" in p for p in e.value.problems)
    assert len(read_rows(str(tmp_path), "train", Config(skip_invalid=True))) == total - len(expected)


@pytest.mark.parametrize("field, soft", [("step_labels", False), ("step_s_label", True)])
def test_birm_invalid_labels_are_named_and_soft_labels_load(field, soft, tmp_path):
    src = sorted(glob.glob(os.path.join(SHARED, "birm", "*.jsonl")))[-1]  # the Qwen2.5-7B file holds the "[invalid]"
    out = tmp_path / "birm.jsonl"
    with open(src, encoding="utf-8") as f, open(out, "w") as w:
        for line in f:  # one stepwise row per sampled response; steps end with the ки tag
            r = json.loads(line)
            for o in r["outputs"]:
                steps = [s.strip() for s in o["response"].split("ки") if s.strip()]
                w.write(json.dumps({"prompt": r["question"], "completions": steps, "labels": o[field]}) + "\n")
    if soft:
        rows = read_rows(str(out), "train", Config())
        assert any(0 < y < 1 for r in rows for y in r["labels"]) and all(
            isinstance(y, float) for r in rows for y in r["labels"])
        return
    with pytest.raises(DataError) as e:
        read_rows(str(out), "train", Config())
    assert len(e.value.problems) == 2 and all("'[invalid]'" in p for p in e.value.problems)


def test_processbench_loads_whole_and_splits_by_problem():
    path = os.path.join(SHARED, "processbench", "math.json")
    train, held = load_splits(Config(dataset=path, eval_fraction=0.2))
    assert len(train) + len(held) == 1000
    assert not set(train["prompt"]) & set(held["prompt"])  # problems repeat across rows: none straddles the split


def test_all_shared_samples_load():
    for name in ("prm800k_real_samples.jsonl", "samples_prm800k.jsonl", "samples_math-shepherd.jsonl",
                 "standard_stepwise_supervision_train.jsonl"):
        assert read_rows(os.path.join(SHARED, "samples", name), "train", Config())


def test_mrben_reader_reproduces_the_shared_conversion():
    """The rows read from Mr-Ben's own schema (3 solutions of data/math.json in tests/fixtures) equal those of the
    ProcessBench-format copy in ../shared/data/natural: the dev set the README's threshold comes from."""
    fixture = os.path.join(os.path.dirname(__file__), "fixtures", "mrben.json")
    with open(os.path.join(SHARED, "natural", "mrben_math.json"), encoding="utf-8") as f:
        shared = {r["id"]: r for r in json.load(f)}
    for row in read_rows(fixture, "train", Config()):
        s = shared[row["id"]]
        assert (row["prompt"], row["completions"], row["first_error"], row["final_answer_correct"]) == \
            (s["problem"], s["steps"], s["label"], s["final_answer_correct"])
