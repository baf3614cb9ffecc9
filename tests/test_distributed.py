"""DDP on CPU (gloo) through torchrun: 2 ranks must reproduce 1 process with the same global batch."""
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import LAUNCH_FLAGS as COMMON
from conftest import (ROOT, assert_same_run, assert_same_weights, final_weights, launch,
                      max_weight_diff, read_metrics)


@pytest.mark.parametrize("accum,lora,precision", [(1, False, "fp32"), (2, False, "fp32"), (2, True, "fp32"),
                                                  (2, False, "bf16")])
def test_two_ranks_match_one_process(tmp_path, accum, lora, precision):
    extra = ["--lora-r", "4"] if lora else []
    extra += ["--dtype", precision]  # after COMMON's fp32: the last one given wins
    # batches not grouped by length: ranks and micro-batches hold different numbers of labels, so
    # one dividing by its own count instead of the whole step's shows (grouped: equal counts)
    extra += ["--no-group-by-length"]
    one = launch(tmp_path / "one", 1, "--batch-size", str(6 * accum), "--grad-accum", "1", *extra)
    two = launch(tmp_path / "two", 2, "--batch-size", "3", "--grad-accum", str(accum), *extra)
    assert_same_run(tmp_path / "one", tmp_path / "two", lr=1e-3, steps=5, precision=precision)
    card = (tmp_path / "two" / "final" / "README.md").read_text()
    assert "torchrun --nproc_per_node 2 train.py --synthetic-size 72" in card
    assert ("LoRA (rank 4" in card) == lora
    # evaluation sharded over 2 ranks on 7 held-out rows equals the single-process figures exactly in fp32; in bf16
    # the weights themselves differ within SAME_RUN, so only the counts must be equal (a ranking may flip)
    exact = ("step_accuracy", "n_steps", "n_examples", "auroc", "f1_0") if precision == "fp32" else ("n_steps",)
    for key in exact:
        assert one[key] == two[key], key
    assert two["n_examples"] == 7


def test_uneven_dataset_does_not_hang(tmp_path):
    """65 rows, 2 ranks x batch 5 = global 10: the last global batch wraps around instead of leaving a rank idle."""
    final = launch(tmp_path, 2, "--batch-size", "5", "--max-steps", "-1", "--epochs", "2")
    assert [r["step"] for r in read_metrics(tmp_path) if "loss" in r][-1] == 14  # 2 epochs x ceil(65 / 10)
    assert final["n_examples"] == 7


def test_sigterm_to_torchrun_saves_a_checkpoint_between_log_steps(tmp_path):
    """torchrun forwards SIGTERM to the ranks and SIGKILLs them 30 s later: they agree to stop after the step in
    hand, not at the next log step (here: none before the end)."""
    from prm.training.checkpoint import resolve_resume
    log, out = tmp_path / "log.txt", tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py", *COMMON,
           "--max-steps", "100000", "--log-every", "100000", "--batch-size", "3", "--output-dir", str(out)]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=f,
                                stderr=subprocess.STDOUT)
    deadline = time.time() + 300
    while " left (" not in log.read_text() and time.time() < deadline:  # the time-left line: steps are running
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    text = log.read_text()
    assert proc.returncode == 1, text[-3000:]  # torchrun's own status: its SignalException, whatever the ranks' 143
    assert text.count("stopped by SIGTERM after step") == 2, text[-3000:]
    assert resolve_resume("auto", str(out)) is not None


@pytest.mark.parametrize("accum,lora", [(1, False), (2, False), (2, True)])
def test_fsdp_two_ranks_match_one_process_without_it(tmp_path, accum, lora):
    extra = ["--lora-r", "4", "--save-every", "5"] if lora else []
    one = launch(tmp_path / "one", 1, "--batch-size", str(6 * accum), *extra)
    two = launch(tmp_path / "two", 2, "--batch-size", "3", "--grad-accum", str(accum), "--fsdp", *extra)
    assert_same_run(tmp_path / "one", tmp_path / "two", lr=1e-3, steps=5)
    assert one["n_examples"] == two["n_examples"] == 7  # 7 rows, batch 4: the ranks run 1 and 2 batches, in lockstep
    if lora:  # eval.py reads the sharded LoRA checkpoint as it reads the 1-process run's adapters and head
        from prm.loading import load_trained
        from prm.config import Config
        sharded, whole = (load_trained(Config(model=str(tmp_path / run / "checkpoint-5")), False)[1]
                          for run in ("two", "one"))
        assert_same_weights(sharded.state_dict(), whole.state_dict(), lr=1e-3, steps=5)
        from safetensors.torch import load_file
        from prm.training.checkpoint import ADAPTER
        adapter = lambda run: load_file(str(tmp_path / run / "final" / ADAPTER / "adapter_model.safetensors"))
        assert_same_weights(adapter("two"), adapter("one"), lr=1e-3, steps=5)  # written from the gathered state
        assert not (tmp_path / "two" / "checkpoint-5" / ADAPTER).exists()  # sharded: rank 0 alone holds no adapter


THREADS_LEFT = """import os, runpy, sys
sys.argv[0] = {train!r}
runpy.run_path({train!r}, run_name="__main__")
names = [open(f"/proc/self/task/{{t}}/comm").read().strip() for t in os.listdir("/proc/self/task")]
with open(os.path.join({out!r}, "threads" + os.environ["RANK"]), "w") as f:
    f.write(" ".join(names))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads the process's thread names from /proc")
def test_fsdp_ranks_end_the_process_group_and_its_gloo_threads_before_interpreter_shutdown(tmp_path):
    """torch's DTensor caches keep fully_shard's device mesh, and through it the group, past destroy_process_group:
    a gloo thread alive at shutdown that releases a collective's tensor aborts the rank (exit -6, 'terminate called
    without an active exception'). When train.py's main ends, no gloo thread is left."""
    script = tmp_path / "threads_left.py"
    script.write_text(THREADS_LEFT.format(train=os.path.join(ROOT, "train.py"), out=str(tmp_path)))
    launch(tmp_path / "run", 2, "--batch-size", "3", "--max-steps", "1", "--fsdp", script=str(script))
    for rank in (0, 1):
        names = (tmp_path / f"threads{rank}").read_text().split()
        assert names and not [n for n in names if "gloo" in n], names


COUNTING = """import os, runpy, sys
import prm.training.checkpoint
hash_files = prm.training.checkpoint.file_digests
def logged(path):
    with open({log!r}, "a") as f:
        f.write(os.environ["RANK"] + " " + path + "\\n")
    return hash_files(path)
prm.training.checkpoint.file_digests = logged
sys.argv[0] = {train!r}
runpy.run_path({train!r}, run_name="__main__")
"""


def test_fsdp_sharded_checkpoint_resumes_exactly_evaluates_and_final_loads_in_transformers(tmp_path):
    import torch
    from transformers import AutoModelForTokenClassification
    from prm.loading import load_trained
    from prm.training.checkpoint import MARKER, SHARDS, files_under, read_marker, resolve_resume
    from prm.config import Config
    from prm.core.model import PRM
    fsdp = ["--batch-size", "3", "--fsdp"]
    launch(tmp_path / "full", 2, *fsdp, "--save-every", "3", "--keep-last", "0")
    ckpt = tmp_path / "full" / "checkpoint-3"
    assert (ckpt / SHARDS).is_dir() and not (ckpt / "model.safetensors").exists()
    # each rank's shards checksummed (by the ranks together) with rank 0's own files
    assert sorted(read_marker(str(ckpt))["sha256"]) == [n for n in files_under(str(ckpt)) if n != MARKER]
    (tmp_path / "full" / "checkpoint-4").mkdir()  # a crashed save: no completion marker
    assert resolve_resume("auto", str(tmp_path / "full")) == str(ckpt)
    hashed = tmp_path / "hashed.txt"  # which rank checksummed which folder: rank 0 alone, once, on resume
    (tmp_path / "counting.py").write_text(COUNTING.format(log=str(hashed), train=os.path.join(ROOT, "train.py")))
    launch(tmp_path / "resumed", 2, *fsdp, "--resume", str(ckpt), script=str(tmp_path / "counting.py"))
    assert hashed.read_text().splitlines() == [f"0 {ckpt}"]
    with open(ckpt / "config.train.json", "a") as f:  # damaged: rank 0 finds it, and every rank stops with it
        f.write(" ")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py", *COMMON,
           *fsdp, "--output-dir", str(tmp_path / "refused"), "--resume", str(ckpt)]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode != 0 and proc.stderr.count("damaged checkpoint (checksum mismatch): config.train.json") == 2
    full, resumed = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "resumed")
    losses = lambda recs: {r["step"]: r["loss"] for r in recs if "loss" in r}
    assert sorted(losses(resumed)) == [4, 5] and all(losses(full)[s] == losses(resumed)[s] for s in (4, 5))
    assert max_weight_diff(final_weights(tmp_path / "full"), final_weights(tmp_path / "resumed")) == 0.0
    launch(tmp_path / "one", 1, "--batch-size", "6", "--save-every", "3")  # the same run without FSDP
    sharded, whole = (load_trained(Config(model=str(tmp_path / d / "checkpoint-3")), False)[1] for d in ("full", "one"))
    assert_same_weights(sharded.state_dict(), whole.state_dict(), lr=1e-3, steps=3)  # eval.py reads the sharded one
    final = str(tmp_path / "full" / "final")
    ids = torch.randint(4, 80, (2, 11))
    with torch.no_grad():
        hf = AutoModelForTokenClassification.from_pretrained(final).eval()(input_ids=ids).logits
        assert (hf - PRM.from_pretrained(final).eval()(ids)).abs().max() <= 1e-5
