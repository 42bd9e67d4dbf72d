"""The built-in ``calculator`` tool: arithmetic on integers and decimals by a small walker over Python's syntax
tree -- ``+ - * / // % **``, unary minus and parentheses -- and nothing else (never ``eval``).

Integers stay exact integers; a decimal or a true division is computed in ``decimal`` with
``PRECISION`` significant digits and written without an exponent (``0.1 + 0.2`` is ``0.3``). The operators
mean what they mean in Python, decimal point or not: ``//`` floors and ``%`` takes the divisor's sign
(``-7.5 // 2`` is ``-4``, ``7 % -2.5`` is ``-0.5``; ``decimal`` alone truncates toward zero). Operands are
bounded (``MAX_OPERAND``), so are exponents (``MAX_EXPONENT``) and results: at most ``MAX_RESULT_DIGITS``
digits written, the last one rounded, and a result whose first digit lies beyond them is refused. Anything
else -- a name, an attribute, a call, a string, a huge exponent, a division by zero, a digit that is not ASCII
-- is refused with a message that becomes the tool's result, for the model to read: :func:`calculate` never
raises on its input.

``TOOLS`` names the built-in tools: each an OpenAI function definition and the function that runs it.
"""

from __future__ import annotations

import ast
import decimal
import json
import operator
from dataclasses import dataclass
from typing import Callable

MAX_EXPRESSION_CHARS = 200
MAX_OPERAND = 10 ** 15
MAX_EXPONENT = 64
MAX_RESULT_DIGITS = 60
PRECISION = 30


class CalculatorError(ValueError):
    """An expression the calculator refuses (the message says why, for the model)."""


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}


def _number(value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CalculatorError(f"only numbers are allowed, got {value!r:.40}")
    if isinstance(value, float):
        value = decimal.Decimal(repr(value))
    if abs(value) > MAX_OPERAND:
        raise CalculatorError(f"the number {value} is too large (at most {MAX_OPERAND:.0e} in size)")
    return value


def _floor_divmod(a, b) -> tuple:
    """Python's ``divmod`` for decimals: the quotient floored, the remainder with the divisor's sign (``decimal``'s
    own ``//`` and ``%`` truncate toward zero). Exact: an adjustment of the truncated pair by one divisor."""
    q, r = divmod(decimal.Decimal(a), decimal.Decimal(b))
    if r and (r < 0) != (b < 0):
        q, r = q - 1, r + b
    return q, r


def _apply(op: ast.operator, a, b):
    kind = type(op)
    if kind not in _BINARY:
        raise CalculatorError(f"the operator {type(op).__name__} is not allowed (allowed: + - * / // % **)")
    if kind in (ast.Div, ast.FloorDiv, ast.Mod) and b == 0:
        raise CalculatorError("division by zero")
    if kind is ast.Pow:
        if b != int(b) or abs(b) > MAX_EXPONENT:
            raise CalculatorError(f"the exponent {b} is not allowed (an integer from -{MAX_EXPONENT} to "
                                  f"{MAX_EXPONENT})")
        if a == 0 and b < 0:
            raise CalculatorError("division by zero (0 to a negative power)")
        b = int(b)
        if isinstance(a, int) and b < 0:
            a = decimal.Decimal(a)
    if kind is ast.Div and isinstance(a, int) and isinstance(b, int):
        a = decimal.Decimal(a)
    if kind in (ast.FloorDiv, ast.Mod) and not (isinstance(a, int) and isinstance(b, int)):
        out = _floor_divmod(a, b)[kind is ast.Mod]
    else:
        out = _BINARY[kind](a, b)
    if abs(out) >= decimal.Decimal(10) ** MAX_RESULT_DIGITS:
        raise CalculatorError(f"the result is too large (more than {MAX_RESULT_DIGITS} digits)")
    return out


def _walk(node: ast.AST):
    if isinstance(node, ast.Expression):
        return _walk(node.body)
    if isinstance(node, ast.Constant):
        return _number(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _walk(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        return _apply(node.op, _walk(node.left), _walk(node.right))
    what = {ast.Name: "names", ast.Attribute: "attributes", ast.Call: "calls", ast.Subscript: "subscripts"}
    raise CalculatorError(f"{what.get(type(node), type(node).__name__)} are not allowed; the calculator takes "
                          f"numbers, + - * / // % ** and parentheses")


def _text(value) -> str:
    """``value`` written without an exponent in at most ``MAX_RESULT_DIGITS`` digits (rounded at the last)."""
    if isinstance(value, int):
        return str(value)
    whole_digits = max(1, value.adjusted() + 1)  # digits before the point ("0." counts one)
    places = MAX_RESULT_DIGITS - whole_digits
    if value and value.adjusted() < -places:
        raise CalculatorError(f"the result {value:.3e} is too small to write in {MAX_RESULT_DIGITS} digits (its "
                              f"first digit is {-value.adjusted()} places after the point)")
    if -value.as_tuple().exponent > places:
        value = value.quantize(decimal.Decimal(1).scaleb(-places))
    value = value.normalize()
    if value == value.to_integral_value():
        return str(int(value))
    return format(value, "f")


def evaluate(expression: str) -> str:
    """The value of an arithmetic ``expression`` as text (``"4821 * 377"`` -> ``"1817517"``).

    Raises:
        CalculatorError: anything but numbers, ``+ - * / // % **`` and parentheses (naming what); a digit or
            any character outside ASCII; an operand over ``MAX_OPERAND``, an exponent over ``MAX_EXPONENT``, a
            result over ``MAX_RESULT_DIGITS`` digits; division by zero; an expression over
            ``MAX_EXPRESSION_CHARS`` characters; a syntax error.
    """
    if not isinstance(expression, str) or not expression.strip():
        raise CalculatorError("the expression must be non-empty text, such as \"12 * (3 + 4)\"")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression is too long ({len(expression)} characters; at most "
                              f"{MAX_EXPRESSION_CHARS})")
    odd = next((c for c in expression if not c.isascii()), None)
    if odd is not None:
        raise CalculatorError(f"the character {odd!r} (U+{ord(odd):04X}) is not allowed: only ASCII digits, "
                              f"+ - * / // % ** and parentheses")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise CalculatorError(f"not an arithmetic expression: {expression!r:.60}") from None
    context = decimal.Context(prec=PRECISION, traps=[decimal.InvalidOperation, decimal.DivisionByZero,
                                                     decimal.Overflow, decimal.Underflow])
    try:
        with decimal.localcontext(context):
            return _text(_walk(tree))
    except decimal.Underflow:
        raise CalculatorError(f"a step of {expression!r:.60} is too small to compute (below 1e{context.Emin})") \
            from None
    except (decimal.DecimalException, ArithmeticError, RecursionError) as e:
        raise CalculatorError(f"cannot compute {expression!r:.60}: {type(e).__name__}") from None


def calculate(arguments) -> str:
    """The ``calculator`` tool: ``arguments`` (``{"expression": "..."}``, as a dict or its JSON text) -> the
    value as text, or ``"error: ..."`` saying what was refused. Never raises."""
    try:
        if isinstance(arguments, str):
            arguments = json.loads(arguments)
        if not isinstance(arguments, dict) or not isinstance(arguments.get("expression"), str):
            raise CalculatorError("the arguments must be {\"expression\": \"...\"}")
        return evaluate(arguments["expression"])
    except json.JSONDecodeError:
        return "error: the arguments are not JSON; call calculator {\"expression\": \"...\"}"
    except CalculatorError as e:
        return f"error: {e}"


@dataclass(frozen=True)
class Tool:
    """A tool the model may call: its OpenAI function ``definition`` and ``run(arguments) -> result text``
    (arguments as the model wrote them: JSON text)."""

    definition: dict
    run: Callable[[str], str]

    @property
    def name(self) -> str:
        return self.definition["function"]["name"]


CALCULATOR = Tool({"type": "function", "function": {
    "name": "calculator", "description": "exact arithmetic: + - * / // % ** and parentheses on numbers",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"], "additionalProperties": False}}}, calculate)

#: the built-in tools by name (``decoderlab chat --tools NAME``)
TOOLS: dict[str, Tool] = {CALCULATOR.name: CALCULATOR}


def get_tools(names) -> dict[str, Tool]:
    """The built-in tools named (a comma-separated text or a list). Raises ``ValueError`` for an unknown
    name, listing the known ones."""
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    out = {}
    for name in names:
        if name not in TOOLS:
            raise ValueError(f"unknown tool {name!r}; built-in tools: {', '.join(TOOLS)}")
        out[name] = TOOLS[name]
    if not out:
        raise ValueError(f"name at least one tool; built-in tools: {', '.join(TOOLS)}")
    return out
