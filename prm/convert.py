"""`python -m prm.convert INPUT [OUTPUT.jsonl]`: any supported dataset as the stepwise JSONL the
trainer sees. Depends on: prm.cli, prm.config, prm.errors, prm.files, prm.readers.sources."""
import json
import os
import sys

from prm.cli import Parser, add_field
from prm.config import Config
from prm.errors import UsageError, WriteFailed, check, exit_status, overwrites
from prm.files import write_lines
from prm.readers.sources import read_rows


def main(argv=None):
    opts = Config.__dataclass_fields__
    p = Parser(usage="%(prog)s input [output] [options]", description=(
        "Convert a PRM dataset to stepwise-supervision JSONL (prompt, completions, labels; null = "
        "unlabeled step), validating every row. Pre-tokenized rows (input_ids, labels) pass "
        "through validated, right padding stripped."))
    p.add_argument("input", help=opts["dataset"].metadata["help"].replace("'synthetic', ", ""))
    p.add_argument("output", nargs="?", default="-", help="a .jsonl file; '-': stdout")
    names = ("format", "neutral_label", "skip_invalid", "dataset_config")
    for name in names:
        # `--skip-invalid INPUT`: INPUT is not its value
        add_field(p, opts[name], switch_value=False)
    p.add_argument("--split", default="train", help="hub split to convert")
    with exit_status():
        a = p.parse_args(argv)
        check(overwrites([("output", a.output)], [("input", a.input)]))
        cfg = Config(**{k: getattr(a, k) for k in names})
        _write(read_rows(a.input, a.split, cfg), a.output)


def _write(rows: list, output: str):
    for row in rows:
        row.pop("where", None)  # a pre-tokenized row's source line
    lines = [json.dumps(row, ensure_ascii=False) for row in rows]
    try:
        if output == "-":
            sys.stdout.writelines(line + "\n" for line in lines)
            return
        write_lines(output, lines)
    except BrokenPipeError:  # `| head` closed stdout: Python must not complain at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return
    except WriteFailed as e:  # a path that cannot be opened is wrong: exit status 2; a full disk: 1
        if isinstance(e.__cause__, (FileNotFoundError, IsADirectoryError, PermissionError)):
            raise UsageError(str(e)) from None
        raise
    print(f"wrote {len(rows)} rows to {output}", file=sys.stderr)


if __name__ == "__main__":
    main()
