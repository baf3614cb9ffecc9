"""`python -m prm.convert INPUT [OUTPUT.jsonl]`: write any supported dataset as the stepwise JSONL the trainer
sees. Depends on: prm.cli, prm.config, prm.errors, prm.readers.sources."""
import contextlib
import json
import os
import sys

from prm.cli import Parser, add_field
from prm.config import Config
from prm.errors import UsageError, WriteFailed, check, exit_status, overwrites
from prm.readers.sources import read_rows


def main(argv=None):
    opts = Config.__dataclass_fields__
    p = Parser(usage="%(prog)s input [output] [options]", description=(
        "Convert a PRM dataset to stepwise-supervision JSONL (prompt, completions, labels; null = unlabeled "
        "step), validating every row. Pre-tokenized rows (input_ids, labels) pass through validated, right "
        "padding stripped."))
    p.add_argument("input", help=opts["dataset"].metadata["help"].replace("'synthetic', ", ""))
    p.add_argument("output", nargs="?", default="-",
                   help="output .jsonl file; '-' writes to stdout")
    for name in ("format", "neutral_label", "skip_invalid", "dataset_config"):
        add_field(p, opts[name], switch_value=False)  # `--skip-invalid INPUT`: INPUT is not its value
    p.add_argument("--split", default="train", help="hub split to convert")
    with exit_status():
        a = p.parse_args(argv)
        check(overwrites([("output", a.output)], [("input", a.input)]))
        cfg = Config(format=a.format, neutral_label=a.neutral_label, skip_invalid=a.skip_invalid,
                     dataset_config=a.dataset_config)
        _write(read_rows(a.input, a.split, cfg), a.output)


def _write(rows: list, output: str):
    try:
        stream = contextlib.nullcontext(sys.stdout) if output == "-" else open(output, "w", encoding="utf-8")
    except OSError as e:  # the path given is wrong: exit status 2
        raise UsageError(f"{output}: cannot write it: {e.strerror or e}") from None
    try:
        with stream as out:
            for row in rows:
                row.pop("where", None)  # a pre-tokenized row's source line
                out.write(json.dumps(row, ensure_ascii=False) + "\n")
    except BrokenPipeError:  # `| head` closed stdout: Python must not complain at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return
    except OSError as e:  # opened but not written (a full disk): exit status 1
        raise WriteFailed(f"{output}: cannot write it: {e.strerror or e}") from None
    if output != "-":
        print(f"wrote {len(rows)} rows to {output}", file=sys.stderr)

