"""Final answers: found in a text, normalized, judged against the reference, keyed for votes."""
import re
import sys
from fractions import Fraction

import regex

from prm.errors import UsageError


def extract_answer(text: str, pattern: str = ""):
    """The last match of `pattern` (its first group that matched, else all), else of \\boxed{},
    "answer is ...", a number."""
    if pattern:
        try:
            found = list(regex.finditer(pattern, text, timeout=2.0))
        except TimeoutError:
            raise UsageError(f"--answer-pattern {pattern!r}: no result within 2 s on a text of "
                             f"{len(text)} characters; avoid nested repeats") from None
        m = found[-1] if found else None
        return m and next((g for g in m.groups() if g is not None), m.group(0))
    start, depth = text.rfind("\\boxed{"), 0
    for j in range(start + 6, len(text) if start >= 0 else 0):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[start + 7:j]
    ends = [m.end() for m in re.finditer(r"answer is:?\s*", text, re.I)]
    # the rest of its line or sentence
    said = re.split(r"\n|\.\s", text[ends[-1]:], maxsplit=1)[0] if ends else ""
    numbers = re.findall(r"-?\d[\d,]*(?:\.\d+)?", text)
    return said.rstrip().removesuffix(".") or (numbers[-1].rstrip(",") if numbers else None)


def normalize(answer: str) -> str:
    """Without spaces, $, \\left, \\text{}, "x =", 1,000's comma...; a number as its exact value
    (0.5 and \\frac{1}{2} as 1/2)."""
    s = re.sub(r"\\(?:text|mathrm|textbf)\{([^{}]*)\}", r"\1", answer)
    for old, new in (("\\left", ""), ("\\right", ""), ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"),
                     ("$", ""), ("\\!", ""), ("\\,", ""), (" ", "")):
        s = s.replace(old, new)
    s = re.sub(r"^[a-zA-Z]=", "", s.strip().rstrip("."))
    s = s.replace(",", "") if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s) else s
    m = re.fullmatch(r"(-?)\\frac\{(-?\d+)\}\{(-?0*[1-9]\d*)\}"
                     r"|(-?\d+(?:\.\d+)?)(?:/(0*[1-9]\d*))?", s)
    if not m or len(s) > sys.get_int_max_str_digits() > 0:  # too long for int()
        return s
    if m.group(2) is not None:
        return str(Fraction(int(m.group(2)), int(m.group(3))) * (-1 if m.group(1) else 1))
    return str(Fraction(m.group(4)) / int(m.group(5) or 1))


def answer_key(answer):
    """What votes group by."""
    return None if answer is None else normalize(str(answer))


def same_answer(found, reference) -> bool:
    return found is not None and normalize(str(found)) == normalize(str(reference))


def judge(reference: str, opts):
    """right(text, before=""): whether text's answer (else before + text's) is the reference."""
    def answer(text, before=""):
        own = extract_answer(text, opts.answer_pattern)
        return extract_answer(before + text, opts.answer_pattern) if own is None and before else own
    if opts.checker == "math-verify":
        from math_verify import parse, verify
        gold = parse("\\boxed{" + reference + "}")
        return lambda text, before="": (a := answer(text, before)) is not None and \
            verify(gold, parse("\\boxed{" + a + "}"))
    return lambda text, before="": same_answer(answer(text, before), reference)
