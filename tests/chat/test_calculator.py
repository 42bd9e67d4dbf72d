"""The calculator tool: a table of expressions and their exact values (checked against Python's own integer and
decimal arithmetic), and every refusal a message the model reads, never an exception."""

import re
from decimal import Decimal
from fractions import Fraction

import pytest

from decoderlab.chat import TOOLS, CalculatorError, calculate, evaluate, get_tools

TABLE = [
    ("4821 * 377", 4821 * 377), ("12 + 30", 42), ("7 - 10", -3), ("(1 + 2) * 3", 9), ("7 // 2", 3),
    ("-7 % 3", -7 % 3), ("2 ** 10", 1024), ("-(3 - 5)", 2), ("9999 * 9999", 9999 * 9999), ("((((1))))", 1),
    ("7 / 2", Decimal("3.5")), ("0.1 + 0.2", Decimal("0.3")), ("2 ** -2", Decimal("0.25")),
    ("1.5 * 4", 6), ("10 / 4 * 2", 5), ("123456789012345 + 1", 123456789012346),
]


@pytest.mark.parametrize("expression,value", TABLE)
def test_expressions_have_their_exact_values(expression, value):
    assert evaluate(expression) == str(value)
    assert calculate({"expression": expression}) == str(value)
    assert calculate('{"expression": "%s"}' % expression) == str(value)


REFUSED = [
    ("x + 1", "names are not allowed"), ("abs(-1)", "calls are not allowed"), ("(1).real", "attributes are not"),
    ("__import__('os')", "calls are not allowed"), ("2 ** 100000", "exponent 100000 is not allowed"),
    ("1 / 0", "division by zero"), ("5 // 0", "division by zero"), ("5 % 0", "division by zero"),
    ("0 ** -1", "division by zero"), ("\u0661\u0662 + 1", "U+0661"), ("\uff11 + 1", "U+FF11"),
    ("9" * 17 + " * 2", "too large"), ("'a' * 3", "only numbers"), ("[1] * 3", "List"),
    ("1 +", "not an arithmetic expression"), ("", "non-empty"), ("1" + " + 1" * 100, "too long"),
    ("10 ** 15 * 10 ** 15 * 10 ** 15 * 10 ** 15 * 10 ** 15", "more than 60 digits"), ("1 < 2", "Compare"),
    ("2 ** 0.5", "exponent 0.5"), ("1 if 1 else 2", "IfExp"),
]


@pytest.mark.parametrize("expression,message", REFUSED)
def test_refusals_are_messages_never_exceptions(expression, message):
    with pytest.raises(CalculatorError, match=re.escape(message)):
        evaluate(expression)
    out = calculate({"expression": expression})
    assert out.startswith("error: ") and message in out


@pytest.mark.parametrize("arguments", ["not json", "[1, 2]", '{"expr": "1"}', '{"expression": 5}', None, 7])
def test_bad_arguments_are_messages(arguments):
    assert calculate(arguments).startswith("error: ")


def test_built_in_tools_by_name_and_unknown_names_refused():
    assert list(get_tools("calculator")) == ["calculator"] and TOOLS["calculator"].run('{"expression": "2*3"}') == "6"
    with pytest.raises(ValueError, match="unknown tool 'search'; built-in tools: calculator"):
        get_tools("calculator,search")


SIGNED = ("7", "-7", "7.5", "-7.5", "7.0", "-7.0", "2", "-2", "2.5", "-2.5", "3", "-0.75")


@pytest.mark.parametrize("op", ["//", "%"])
def test_floor_division_and_modulo_keep_python_s_meaning_with_a_decimal_point(op):
    """`-7 // 2` was -4 but `-7.5 // 2` gave -3, `-7.0 % 3` gave -1 and `7 % -2.5` gave 2: decimal truncates toward
    zero, Python floors. Every pair of these (exact in binary) against Python's own floats, and a == b * (a // b)
    + a % b."""
    for a in SIGNED:
        for b in SIGNED:
            expected = eval(f"float({a}) {op} float({b})")  # the reference: Python's floats, exact here
            got = evaluate(f"{a} {op} {b}")
            assert Decimal(got) == Decimal(repr(expected)), (a, op, b, got, expected)
            q, r = Decimal(evaluate(f"{a} // {b}")), Decimal(evaluate(f"{a} % {b}"))
            assert Decimal(a) == Decimal(b) * q + r


TINY = ["((0.1**64)**64)**64", "0.1 ** 64", "2 ** -64 * 0.1 ** 50"]
WRITTEN = [("(1 / 3) * 0.1 ** 40", Fraction(1, 3) / 10 ** 40), ("2 ** -64 * 3", Fraction(3, 2 ** 64)),
           ("10 ** 15 * 10 ** 15 * 10 ** 15 * 10 ** 14 / 7", Fraction(10 ** 59, 7)), ("1 / 7", Fraction(1, 7)),
           ("0.5 ** 64 * 10 ** 2", Fraction(100, 2 ** 64))]


def test_every_result_is_written_in_at_most_max_result_digits_digits():
    """`((0.1**64)**64)**64` answered 262,146 characters (the bound held for large numbers only): a result is
    written in at most MAX_RESULT_DIGITS digits, the last one rounded (checked against exact fractions), and one
    whose first digit lies beyond them is refused."""
    from decoderlab.chat.calculator import MAX_RESULT_DIGITS, PRECISION

    for expression in TINY:
        with pytest.raises(CalculatorError, match="too small"):
            evaluate(expression)
    for expression, exact in WRITTEN:
        text = evaluate(expression)
        assert sum(c.isdigit() for c in text) <= MAX_RESULT_DIGITS, text
        error = abs(Fraction(Decimal(text)) - exact)
        assert error <= abs(exact) * Fraction(1, 10 ** (PRECISION - 2)) + Fraction(1, 10 ** (MAX_RESULT_DIGITS - 1)), \
            (expression, text)
