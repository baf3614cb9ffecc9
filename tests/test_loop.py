"""The offline loop (prm.tools.loop) at tiny sizes: a policy, its Monte-Carlo labels, a PRM, search."""
import json
import re

import pytest

from prm.labeling.label import LabelOptions, label_file
from prm.readers.synthetic import make_rows, step_truth


def counter(prompts, n, seed):
    """A policy that never slips: from the prefix's last number, exactly the steps the prompt has left."""
    out = []
    for p in prompts:
        count, x = map(int, re.findall(r"\d+", p.split("\n")[0]))
        done = re.findall(r"=(\d)", p)
        x = int(done[-1]) if done else x
        out.append(["".join(f"{(x + k) % 10}+1={(x + k + 1) % 10}\n" for k in range(count - len(done)))] * n)
    return out


@pytest.mark.parametrize("label,search", [("soft", "all"), ("hard", "all"), ("hard", "binary")])
def test_monte_carlo_labels_are_1_before_the_known_first_error_0_at_and_after(tmp_path, label, search):
    rows = make_rows(40, 1)
    assert all(step_truth(r["prompt"], r["completions"]) == r["labels"] for r in rows)
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    opts = LabelOptions(policy="counter", rollouts=3, label=label, search=search)
    label_file(str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), counter, opts, show=False)
    for r, line in zip(rows, (tmp_path / "out.jsonl").read_text().splitlines()):
        n = len(r["labels"])
        first = r["labels"].index(False) if False in r["labels"] else n
        after = [0.0] * (n - first) if search == "all" else ([0.0] + [None] * n)[:n - first]
        assert json.loads(line)["labels"] == [1.0] * first + after  # binary: unlabeled after it


@pytest.fixture(scope="module")
def loop(tmp_path_factory):
    """policy (2 optimizer steps) -> prm.label -> train.py's trainer (2 steps) -> the PRM's folder."""
    from prm.config import Config
    from prm.labeling.label import main as label
    from prm.tools.loop import train_policy, write_problems
    from prm.training.trainer import train
    tmp = tmp_path_factory.mktemp("loop")
    write_problems(str(tmp), rows=3, test=3)
    train_policy(str(tmp / "policy"), steps=2, batch=4)
    label(["--policy", str(tmp / "policy"), "--dataset", str(tmp / "label.jsonl"), "--output",
           str(tmp / "labels.jsonl"), "--rollouts", "2", "--samples", "2", "--max-new-tokens", "12",
           "--temperature", "1.0"])
    train(Config(model=str(tmp / "policy"), dataset=str(tmp / "labels.jsonl"), output_dir=str(tmp / "prm"),
                 max_steps=2, batch_size=4, dtype="fp32", lr=1e-3, eval_fraction=0.3))
    return tmp
