"""`python -m prm.convert INPUT [OUTPUT.jsonl]`: write any supported dataset as the stepwise JSONL the trainer
sees. Depends on: prm.config, prm.errors, prm.sources."""
import argparse
import contextlib
import dataclasses
import json
import os
import sys

from prm.config import Config
from prm.errors import UsageError, exit_status
from prm.sources import read_rows


def main(argv=None):
    opts = {f.name: f for f in dataclasses.fields(Config)}
    p = argparse.ArgumentParser(description=(
        "Convert a PRM dataset to stepwise-supervision JSONL (prompt, completions, labels; null = unlabeled "
        "step), validating every row. Pre-tokenized rows (input_ids, labels) pass through validated, right "
        "padding stripped."))
    p.add_argument("input", help=opts["dataset"].metadata["help"].replace("'synthetic', ", ""))
    p.add_argument("output", nargs="?", default="-",
                   help="output .jsonl file; '-' (default) writes to stdout")
    for name in ("format", "neutral_label"):
        meta = opts[name].metadata
        p.add_argument("--" + name.replace("_", "-"), default=opts[name].default, choices=meta["choices"],
                       help=meta["help"])
    p.add_argument("--skip-invalid", action="store_true", help=opts["skip_invalid"].metadata["help"])
    p.add_argument("--dataset-config", default="", help=opts["dataset_config"].metadata["help"])
    p.add_argument("--split", default="train", help="hub split to convert")
    a = p.parse_args(argv)
    cfg = Config(format=a.format, neutral_label=a.neutral_label, skip_invalid=a.skip_invalid,
                 dataset_config=a.dataset_config)
    with exit_status():
        _write(read_rows(a.input, a.split, cfg), a.output)


def _write(rows: list, output: str):
    try:
        stream = contextlib.nullcontext(sys.stdout) if output == "-" else open(output, "w", encoding="utf-8")
        with stream as out:
            for row in rows:
                row.pop("where", None)  # a pre-tokenized row's source line: the output is a source of its own
                out.write(json.dumps(row, ensure_ascii=False) + "\n")
    except BrokenPipeError:  # `| head` closed stdout early: fine, and Python must not complain at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return
    except OSError as e:  # a folder, a missing folder, a full disk: one line, exit status 2
        raise UsageError(f"{output}: cannot write it: {e.strerror or e}") from None
    if output != "-":
        print(f"wrote {len(rows)} rows to {output}", file=sys.stderr)


if __name__ == "__main__":
    main()
