"""The rows cache under damage and contention: a damaged or partial entry is read again from the
source (a damaged one with one line), runs started together on new data all succeed, a full disk
ends with one line, exit status 1; never a poisoned entry. Depends on: pytest, datasets, prm."""
import errno
import glob
import json
import os
import shutil
import subprocess
import sys
import time

import datasets
import pytest

from prm.config import Config
from prm.errors import WriteFailed
from prm.readers.ingest import tokenize_dataset
from prm.readers.sources import data_digest, load_splits, rows_cache
from prm.readers.synthetic import char_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS = [{"prompt": f"q{i}", "completions": ["a", "b"], "labels": [True, i % 2 == 0]} for i in range(30)]


@pytest.fixture
def data(tmp_path, monkeypatch):
    """A new data file, and a datasets cache of this test's own, caching on."""
    was_on = datasets.is_caching_enabled()
    datasets.enable_caching()
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    yield str(path)
    if not was_on:
        datasets.disable_caching()


def splits(path) -> tuple:
    train, held = load_splits(Config(dataset=path))
    return train.to_list(), held.to_list()


def full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def split_dir(entry: str, split: str) -> str:
    """Where datasets' cache keeps a split of a rows cache entry."""
    return glob.glob(os.path.join(entry, "generator", f"*-{split}", "*", ""))[0].rstrip("/")


def damage(entry: str, how: str):
    held = split_dir(entry, "held")
    if how in ("no notes", "garbage notes"):
        with open(os.path.join(held, "dataset_info.json")) as f:
            info = json.load(f)
        info["description"] = '{"not": "a list of messages"' if how == "garbage notes" else ""
        with open(os.path.join(held, "dataset_info.json"), "w") as f:
            json.dump(info, f)
    elif how == "truncated arrow file":
        arrow = glob.glob(os.path.join(split_dir(entry, "train"), "*.arrow"))[0]
        with open(arrow, "r+b") as f:
            f.truncate(os.path.getsize(arrow) // 2)
    elif how == "no dataset_info.json":
        os.remove(os.path.join(split_dir(entry, "train"), "dataset_info.json"))
    else:
        shutil.rmtree(held)


@pytest.mark.parametrize("how", ["no notes", "garbage notes", "truncated arrow file",
                                 "no dataset_info.json", "no held split"])
def test_a_damaged_or_partial_entry_is_read_again_from_the_source(data, how, capsys):
    first = splits(data)
    entry = rows_cache(Config(dataset=data))
    damage(entry, how)
    capsys.readouterr()
    assert splits(data) == first
    err = capsys.readouterr().err
    partial = how in ("no dataset_info.json", "no held split")  # as a killed writer leaves it
    assert err.count("a damaged rows cache entry") == (not partial) and "Traceback" not in err
    assert "format stepwise" in err and "rows read back" not in err
    assert splits(data) == first and "rows read back" in capsys.readouterr().err  # replaced by a good entry


def test_runs_started_together_on_new_data_all_succeed(data, tmp_path):
    with open(data, "a") as f:  # rows enough that writing the entry takes a while
        f.writelines(json.dumps({**ROWS[i % 30], "prompt": f"more {i}"}) + "\n" for i in range(20000))
    code = ("import os, sys, time, datasets; datasets.config.HF_DATASETS_CACHE = sys.argv[2]; "
            "from prm.config import Config; from prm.readers.sources import load_splits; open(sys.argv[3], 'w').close(); "
            "[time.sleep(0.05) for _ in range(2400) if not os.path.exists(sys.argv[4])]; "  # all imported: go
            "t, h = load_splits(Config(dataset=sys.argv[1])); print(len(t) + len(h))")
    go = str(tmp_path / "go")
    runs = [subprocess.Popen([sys.executable, "-c", code, data, datasets.config.HF_DATASETS_CACHE,
                              str(tmp_path / f"ready{i}"), go], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for i in range(3)]
    for _ in range(2400):  # 2 minutes at most
        if all(os.path.exists(tmp_path / f"ready{i}") for i in range(3)):
            break
        time.sleep(0.05)
    open(go, "w").close()
    outs = [r.communicate(timeout=300) for r in runs]
    assert [r.returncode for r in runs] == [0, 0, 0] and [o.strip() for o, _ in outs] == ["20030"] * 3, outs
    entries = os.listdir(os.path.dirname(rows_cache(Config(dataset=data))))
    folders = [d for _, ds, _ in os.walk(rows_cache(Config(dataset=data))) for d in ds]
    assert len(entries) == 1 and not any(d.endswith(".incomplete") for d in folders)  # no leftovers


@pytest.mark.parametrize("where", ["from_generator", "map"])
def test_a_full_disk_where_rows_must_be_written_ends_with_one_line(data, where, monkeypatch):
    ds = load_splits(Config(dataset=data))[0]
    monkeypatch.setattr(datasets.Dataset, where, full_disk)
    with pytest.raises(WriteFailed, match="datasets cache.*No space left on device") as e:
        if where == "map":
            tokenize_dataset(ds, char_tokenizer(), Config(), is_eval=False)
        else:
            load_splits(Config(dataset=data, seed=1))
    assert e.value.code == 1 and "\n" not in str(e.value)


def test_a_full_disk_inside_from_generator_ends_with_one_line(data, monkeypatch):
    """datasets wraps the OSError of a write in DatasetGenerationError: still one line, exit status 1."""
    real = datasets.arrow_writer.ArrowWriter.write
    monkeypatch.setattr(datasets.arrow_writer.ArrowWriter, "write", full_disk)
    with pytest.raises(WriteFailed, match="datasets cache.*No space left on device") as e:
        load_splits(Config(dataset=data, seed=1))
    assert e.value.code == 1 and "\n" not in str(e.value)
    monkeypatch.setattr(datasets.arrow_writer.ArrowWriter, "write", real)
    assert splits(data) == splits(data)  # nothing poisoned: read, then read back


def test_data_digest_of_a_folder_hashes_only_the_files_read(tmp_path):
    folder = tmp_path / "data"
    os.makedirs(folder)
    (folder / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    digest = data_digest(str(folder))
    (folder / "README.md").write_text("about this data")
    os.makedirs(folder / "notes")
    (folder / ".DS_Store").write_bytes(b"\0\1")
    assert data_digest(str(folder)) == digest  # nothing the reader reads has changed
    with open(folder / "a.jsonl", "a") as f:
        f.write(json.dumps(ROWS[0]) + "\n")
    assert data_digest(str(folder)) not in ("", digest)


def test_data_digest_follows_the_contents_not_the_place(data, tmp_path):
    digest = data_digest(data)
    assert len(digest) == 64 and data_digest("synthetic") == data_digest("org/hub-name") == ""
    os.makedirs(tmp_path / "moved")
    shutil.copy(data, tmp_path / "moved" / "d.jsonl")
    assert data_digest(str(tmp_path / "moved" / "d.jsonl")) == digest
    with open(data, "a") as f:
        f.write(json.dumps(ROWS[0]) + "\n")
    assert data_digest(data) != digest and data_digest(str(tmp_path / "moved")) not in ("", digest)


def test_the_temporary_folder_of_a_killed_write_is_removed_by_the_next_run(data):
    first = splits(data)
    entry = rows_cache(Config(dataset=data))
    held = split_dir(entry, "held")
    shutil.move(held, held + ".incomplete")  # datasets' folder of a write killed before its rename
    assert splits(data) == first and not os.path.exists(held + ".incomplete")
    assert splits(data) == first


def test_caching_off_no_entry_and_the_data_not_hashed(data, monkeypatch):
    import prm.readers.sources as sources
    assert rows_cache(Config(dataset=data)) is not None
    monkeypatch.setattr(sources, "data_digest", lambda spec: pytest.fail("hashed with caching off"))
    monkeypatch.setattr(datasets, "is_caching_enabled", lambda: False)
    assert rows_cache(Config(dataset=data)) is None
