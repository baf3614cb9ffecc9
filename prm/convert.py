"""`python -m prm.convert INPUT [OUTPUT.jsonl]`: a dataset as the trainer's stepwise JSONL."""
import json
import os
import sys

from dataclasses import dataclass

from prm.cli import Parser
from prm.config import Config, opt
from prm.errors import UsageError, WriteFailed, check, exit_status, overwrites
from prm.files import write_lines
from prm.readers.sources import read_rows


RUN = Config.__dataclass_fields__


@dataclass
class ConvertOptions:
    input: str = opt("", RUN["dataset"].metadata["help"], positional=True)
    output: str = opt("-", "a .jsonl file; '-': stdout", positional=True, nargs="?")
    format: str = opt(like=RUN["format"])
    neutral_label: str = opt(like=RUN["neutral_label"])
    skip_invalid: bool = opt(like=RUN["skip_invalid"])
    dataset_config: str = opt(like=RUN["dataset_config"])
    split: str = opt("train", "hub split to convert")


def main(argv=None):
    p = Parser(ConvertOptions, usage="%(prog)s input [output] [options]", description="Convert "
               "a PRM dataset to stepwise JSONL, every row checked; pre-tokenized rows pass.")
    with exit_status():
        a = p.parse_args(argv)
        check(overwrites([("output", a.output)], [("input", a.input)]))
        cfg = Config(**{k: v for k, v in vars(a).items() if k in RUN})
        _write(read_rows(a.input, a.split, cfg), a.output)


def _write(rows: list, output: str):
    lines = [json.dumps({k: v for k, v in row.items() if k != "where"}, ensure_ascii=False)
             for row in rows]
    try:
        if output == "-":
            sys.stdout.writelines(line + "\n" for line in lines)
            return
        write_lines(output, lines)
    except BrokenPipeError:  # `| head`: no complaint at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return
    except WriteFailed as e:  # a bad path: exit status 2; a full disk: 1
        if isinstance(e.__cause__, (FileNotFoundError, IsADirectoryError, PermissionError)):
            raise UsageError(str(e)) from None
        raise
    print(f"wrote {len(rows)} rows to {output}", file=sys.stderr)


if __name__ == "__main__":
    main()
