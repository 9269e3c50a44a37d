"""A candidate's *final answer*, extracted and normalised so that votes can be counted.

What counts as the answer, first that applies:
1. ``\\boxed{…}`` (the last one);
2. after an "answer is" / "answer:" marker (the last one), up to the end of its line;
3. a fenced code block's text (the last block), whitespace at line ends dropped;
4. a whole short reply (at most :data:`SHORT_WORDS` words): its choice letter, its only number
   (after the last "=" if any), or the phrase itself;
5. the last number in a longer reply.

Inside 1, 2 and 4 a lone choice letter ("(B)", "B.") becomes ``b`` and a number is written
canonically ("1,000.50" → "1000.5", "-0" → "0"). Anything else – an open-ended answer – has no
extractable answer (None) and does not vote.

Given the question, the runs of words a reply merely copies from it (:data:`ECHO_WORDS` or more
in a row) are cut out first: a sample that parrots "pick the smallest number of the following
candidates: 580.505 587.813" has not answered 587.813, and one that is nothing but the question
has no answer.

A reply that refutes itself does not vote either: one that states an arithmetic equation that is
false ("10 + 9 = 10"), checked exactly (:func:`states_false_equation`). On the tuning items of
``bench/moa_quality.py`` 7 % of wrong replies stated one and 0.2 % of right ones did.
"""

from __future__ import annotations

import ast
import operator
import re
from decimal import Decimal
from difflib import SequenceMatcher
from fractions import Fraction

from gateway.moa.scoring import normalize_answer

SHORT_WORDS = 6  # a reply this short is its own answer
SHORT_CHARS = 60
MAX_EXPONENT = 30  # e-notation written out in full up to this exponent
ECHO_WORDS = 5  # this many of the question's words in a row, copied, are an echo of it
MAX_ECHO_WORDS = 2000  # longer texts are not compared word by word (quadratic at worst)

_BOXED = re.compile(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}")
_MARKER = re.compile(r"\b(?:final\s+)?answer\s*(?:is|:|=)\s*:?\s*([^\n]+)", re.IGNORECASE)
_FENCE = re.compile(r"```[^\n`]*\n(.*?)```", re.DOTALL)
_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:,\d{3})*(?:\.\d+)?(?:[eE][-+]?\d+|/\d+)?(?![\w])")
# A choice letter alone: "B", "(B)", "B.", "B)", "[B]", "Option B", optionally followed by its text
# after ")", "." or ":" ("B) Paris").
_LETTER = re.compile(
    r"^(?:option\s+|choice\s+)?[(\[]?([A-J])[)\]]?(?:[.):]\s.*|[.):])?$", re.IGNORECASE | re.DOTALL
)


def canonical_number(text: str) -> str:
    """ "1,000.50" → "1000.5", "4.0" → "4", "-0" → "0", "4.37271e+02" → "437.271"; fractions
    stay as written."""
    text = text.replace(",", "")
    mantissa, e, exponent = text.lower().partition("e")
    if e:
        if abs(int(exponent)) > MAX_EXPONENT:  # "1e999999" would write a million digits
            return f"{canonical_number(mantissa)}e{int(exponent)}"
        text = format(Decimal(text), "f")
    if "." in text and "/" not in text:
        text = text.rstrip("0").rstrip(".")
    if text in ("-0", ""):
        text = "0"
    return text


def _letter(text: str) -> str | None:
    match = _LETTER.match(text.strip().strip("*_`"))
    if match is None:
        return None
    letter = match.group(1)
    # A lower-case "a" alone is an article more often than an option; only capitals vote.
    return letter.lower() if letter.isupper() else None


def _short(text: str) -> str | None:
    """The answer in a short span: a choice letter, the only number, else the phrase."""
    letter = _letter(text)
    if letter is not None:
        return letter
    text = text.rsplit("=", 1)[-1]  # "3 + 4 = 7": what it equals
    numbers = _NUMBER.findall(text)
    if len(numbers) == 1:
        return canonical_number(numbers[0])
    phrase = normalize_answer(text)
    if not phrase or len(phrase.split()) > SHORT_WORDS or len(phrase) > SHORT_CHARS:
        return None
    return phrase


_WORD = re.compile(r"\S+")


def without_echo(text: str, question: str) -> str:
    """``text`` with every run of at least :data:`ECHO_WORDS` words copied from ``question``
    (compared case-insensitively) cut out; the rest, spacing included, stays as written."""
    words = list(_WORD.finditer(text))
    asked = question.lower().split()
    if len(words) < ECHO_WORDS or len(asked) < ECHO_WORDS or len(words) > MAX_ECHO_WORDS:
        return text
    said = [w.group().lower() for w in words]
    matcher = SequenceMatcher(None, asked[-MAX_ECHO_WORDS:], said, autojunk=False)
    cut = [b for b in matcher.get_matching_blocks() if b.size >= ECHO_WORDS]
    if not cut:
        return text
    out, at = [], 0
    for block in cut:
        out.append(text[at : words[block.b].start()])
        at = words[block.b + block.size - 1].end()
    out.append(text[at:])
    return "".join(out)


def extract_answer(text: str, question: str | None = None) -> str | None:
    """The normalised final answer of a complete reply, or None when it has none to vote with;
    ``question``: what was asked, whose echoes in the reply do not count."""
    if question:
        text = without_echo(text, question)
    text = text.strip()
    if not text:
        return None
    boxed = _BOXED.findall(text)
    if boxed:
        return _short(boxed[-1]) or normalize_answer(boxed[-1]) or None
    markers = _MARKER.findall(text)
    if markers:
        answer = _short(markers[-1])
        if answer is not None:
            return answer
    fences = _FENCE.findall(text)
    if fences:
        code = "\n".join(line.rstrip() for line in fences[-1].strip("\n").splitlines())
        return code.strip() or None
    answer = _short(text)
    if answer is not None:
        return answer
    numbers = _NUMBER.findall(text)
    return canonical_number(numbers[-1]) if numbers else None


# "3 + 4 = 7", "6 × 7 = 42", "12 / 4 = 3.0": at least one operator, numbers only on both sides.
_EQUATION = re.compile(
    r"(?<![\w.^])(-?\d+(?:\.\d+)?(?:\s*[-+*/×÷]\s*-?\d+(?:\.\d+)?)+)\s*=\s*(-?\d+(?:\.\d+)?)(?![\w.]*\d)"
)
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _value(node: ast.AST) -> Fraction:
    """An arithmetic expression of + - * / over numbers, exactly; anything else raises."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return Fraction(str(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_value(node.operand)
    if isinstance(node, ast.BinOp):
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Div):
            return left / right  # ZeroDivisionError: not a checkable claim
        return _OPERATORS[type(node.op)](left, right)
    raise ValueError("not arithmetic")


def states_false_equation(text: str) -> bool:
    """Whether the reply claims an arithmetic equation that does not hold ("10 + 9 = 10")."""
    for left, right in _EQUATION.findall(text):
        expression = left.replace("×", "*").replace("÷", "/")
        if len(expression) > 200:
            continue
        try:
            value = _value(ast.parse(expression, mode="eval").body)
        except (SyntaxError, ValueError, KeyError, ZeroDivisionError):
            continue
        # "10 / 3 = 3.33": a decimal rounded to its places is not false; an integer is exact.
        places = len(right.partition(".")[2])
        tolerance = Fraction(1, 2 * 10**places) if places else Fraction(0)
        if abs(value - Fraction(right)) > tolerance:
            return True
    return False
