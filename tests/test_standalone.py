"""The core modules copy into another repo one file at a time: each imports and works alone, in a fresh interpreter,
from an empty folder with no prm package on the path."""
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT

# module -> a script run beside the lone copy: it must import, work, and pull in nothing it does not need
CHECKS = {
    "data": """
import sys
from tokenizers import Tokenizer, models, pre_tokenizers, Regex
from transformers import PreTrainedTokenizerFast
import data
vocab = {t: i for i, t in enumerate(["<pad>", "<bos>", "q", "a", "b", "\\n"])}
t = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
t.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\\s\\S]"), behavior="isolated")
tok = PreTrainedTokenizerFast(tokenizer_object=t, pad_token="<pad>", bos_token="<bos>")
row = data.tokenize_example({"prompt": "q", "completions": ["ab", "b"], "labels": [True, 0.5]}, tok)
assert row["input_ids"] == [1, 2, 3, 4, 5, 4, 5] and row["labels"] == [-100] * 4 + [1, -100, 0.5], row
batch = data.collate([row, {"input_ids": [1], "labels": [-100]}], pad_id=0)
assert batch["input_ids"].shape == (2, 7) and batch["attention_mask"][1].tolist() == [1] + [0] * 6
packed = data.pack([row, {"input_ids": [1], "labels": [-100]}], pad_id=0)
assert packed["input_ids"].shape == (1, 8) and packed["cu_seq_lens_q"].tolist() == [0, 7, 8]
assert "datasets" not in sys.modules and "pyarrow" not in sys.modules, "the data module must not import datasets"
""",
    "model": """
import torch
from transformers import AutoModel, Qwen2Config
import model
cfg = Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1)
prm = model.PRM(AutoModel.from_config(cfg), model.new_head(cfg))
logits = prm(torch.randint(0, 32, (2, 5)))
labels = torch.full((2, 5), -100.0)
labels[0, 4] = 1.0
loss, ce_sum, n_correct = model.step_loss(logits, labels, 1)
loss.backward()
assert logits.shape == (2, 5, 2) and prm.head.weight.grad is not None
""",
    "varlen": """
import torch
from transformers import AutoModel, Qwen2Config
import varlen
cfg = Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1)
backbone = AutoModel.from_config(cfg, attn_implementation="sdpa")
ids = torch.randint(0, 32, (1, 7))
rows = [backbone(input_ids=ids[:, :4]).last_hidden_state, backbone(input_ids=ids[:, 4:]).last_hidden_state]
assert varlen.supports_packing(backbone)
varlen.use_packed_attention(backbone)
cu = torch.tensor([0, 4, 7], dtype=torch.int32)
packed = backbone(input_ids=ids, position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2]]), cu_seq_lens_q=cu,
                  cu_seq_lens_k=cu, max_length_q=4, max_length_k=4).last_hidden_state
assert (packed - torch.cat(rows, dim=1)).abs().max() < 1e-5 and varlen.is_packed(backbone)
""",
    "metrics": """
import metrics
m = metrics.step_metrics([0.9, 0.2, 0.6], [1, 0, 0])
assert m["n_steps"] == 3 and abs(m["step_accuracy"] - 2 / 3) < 1e-12
assert metrics.processbench_metrics([1, -1], [1, -1])["f1"] == 1.0
""",
    "lora": """
import torch
import lora
net = torch.nn.Sequential()
net.add_module("q_proj", torch.nn.Linear(4, 4))
net.add_module("out", torch.nn.Linear(4, 2))
x = torch.randn(3, 4)
before = net(x)
assert lora.apply_lora(net, r=2, alpha=4.0, dropout=0.0, targets="q_proj") == ["q_proj"]
assert torch.equal(net(x), before)  # B starts at zero
assert {n for n, p in net.named_parameters() if p.requires_grad} == {"q_proj.lora_A", "q_proj.lora_B"}
""",
}


@pytest.mark.parametrize("module", sorted(CHECKS))
def test_core_module_works_alone(module, tmp_path):
    shutil.copy(os.path.join(ROOT, "prm", "core", f"{module}.py"), tmp_path)
    script = CHECKS[module] + "\nassert not any(m == 'prm' or m.startswith('prm.') for m in sys.modules)\n"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # -E: no PYTHONPATH; -s: no user site; `-c` puts the current folder (the lone copy) first on sys.path
    proc = subprocess.run([sys.executable, "-E", "-s", "-c", "import sys\n" + script], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]


def module_imports() -> dict:
    """{module: the prm modules it imports} over every file of the package (imports inside functions count; a
    relative import is resolved against its folder; the package's lazy top-level names do not count)."""
    import ast
    import glob
    deps = {}
    for path in glob.glob(os.path.join(ROOT, "prm", "**", "*.py"), recursive=True):
        rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
        name = rel[:-len(".__init__")] if rel.endswith(".__init__") else rel
        package = name if rel.endswith(".__init__") else name.rpartition(".")[0]
        with open(path) as f:
            nodes = list(ast.walk(ast.parse(f.read())))
        found = set()
        for n in nodes:
            if isinstance(n, ast.ImportFrom):
                base = n.module or ""
                if n.level:
                    base = ".".join(package.split(".")[:len(package.split(".")) - n.level + 1] + ([base] if base else []))
                if base.startswith("prm."):
                    found.add(base)
                elif base == "prm" and name != "prm":
                    found |= {f"prm.{a.name}" for a in n.names}
            elif isinstance(n, ast.Import):
                found |= {a.name for a in n.names if a.name.startswith("prm.")}
        deps[name] = found
    return deps


def test_prm_imports_run_one_way():
    """No import circle among prm's modules: prm.bench calls prm.tools.gpucheck, never the other way round."""
    deps = module_imports()
    assert "prm.tools.gpucheck" in deps["prm.bench"]

    def circle(path):  # a path that leads back to its start, else None
        for d in sorted(deps.get(path[-1], ())):
            if d == path[0]:
                return path + [d]
            found = d not in path and circle(path + [d])
            if found:
                return found
    circles = [c for c in map(circle, [[m] for m in sorted(deps)]) if c]
    assert not circles, " ; ".join(" -> ".join(c) for c in circles)


# a researcher's script beside a copy of prm/core/ (as mycore): tokenize, collate, train, evaluate
RESEARCHER = """
import sys
import torch
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import AutoModel, PreTrainedTokenizerFast, Qwen2Config
from mycore.data import collate, tokenize_example
from mycore.evaluate import predict, report
from mycore.model import PRM, new_head, step_loss

vocab = {t: i for i, t in enumerate(["<pad>", "<bos>", "q", "+", "=", "\\n", *"0123456789"])}
t = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
t.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\\s\\S]"), behavior="isolated")  # a token a char
tok = PreTrainedTokenizerFast(tokenizer_object=t, pad_token="<pad>", bos_token="<bos>")
data = [{"prompt": f"q{a}", "completions": [f"{a}+1={a + 1}", f"{a + 1}+1={a + 2 + a % 2}"],
         "labels": [True, a % 2 == 0]} for a in range(8)]
rows = [tokenize_example(r, tok) for r in data]
batch = collate(rows, tok.pad_token_id)
torch.manual_seed(0)
cfg = Qwen2Config(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)
model = PRM(AutoModel.from_config(cfg), new_head(cfg))
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
n_labeled = int((batch["labels"] != -100).sum())
losses = []
for _ in range(15):
    logits = model(batch["input_ids"], batch["attention_mask"])  # (B, T, 2)
    loss = step_loss(logits, batch["labels"], n_labeled)[0]
    loss.backward()
    opt.step()
    opt.zero_grad()
    losses.append(loss.item())
assert losses[-1] < 0.8 * losses[0], losses
m = report(predict(model, rows, batch_size=4, pad_id=tok.pad_token_id, progress=False), rows)
assert m["n_examples"] == 8 and m["n_steps"] == 16 and m["auroc"] is not None, m
assert m["step_accuracy"] > 0.5, m
assert not any(k == "prm" or k.startswith("prm.") for k in sys.modules)
"""


def test_a_copy_of_the_core_folder_alone_trains_and_evaluates(tmp_path):
    """The README's promise: prm/core/ copied alone into another repo (any name) tokenizes rows with
    tokenize_example, trains with step_loss and evaluates with predict and report; its modules
    import one another and nothing else of prm."""
    outside = {m: sorted(d for d in deps if not d.startswith("prm.core."))
               for m, deps in module_imports().items() if m.startswith("prm.core")}
    assert not any(outside.values()), outside
    shutil.copytree(os.path.join(ROOT, "prm", "core"), tmp_path / "mycore")
    (tmp_path / "train_prm.py").write_text(RESEARCHER)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # -E: no PYTHONPATH; -s: no user site; the script's folder (the researcher's repo) heads sys.path
    proc = subprocess.run([sys.executable, "-E", "-s", "train_prm.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_import_prm_is_light_and_names_resolve():
    """`import prm` loads no torch; each public name resolves to the object in its home module."""
    script = ("import sys, prm\nassert 'torch' not in sys.modules, 'import prm loaded torch'\n"
              "from prm import PRM, PRMReward, score, score_batch, load_tokenizer, Config\n"
              "import prm.core.model, prm.scoring.reward\n"
              "assert PRM is prm.core.model.PRM and PRMReward is prm.scoring.reward.PRMReward\n"
              "assert set(prm.__all__) <= set(dir(prm))\n"
              "for name in prm.__all__:\n    getattr(prm, name)\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
