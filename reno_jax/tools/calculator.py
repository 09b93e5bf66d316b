"""A calculator tool for host environments: `evaluate(expression) -> str`, the text an environment shows as the
tool's response.

Accepted input: numbers (integers such as `42`, decimals such as `3.5` or `.5`), the binary operators
`+ - * / // % **`, unary `-` and `+`, and parentheses, in Python's syntax and precedence (`-2 ** 2` is -4). Nothing
else: names, calls, attributes, comparisons, strings... are refused. The expression is parsed with `ast` and walked
by the small evaluator below; nothing is handed to Python's `eval`.

Arithmetic is Python's (ints are exact and unbounded, floats are IEEE doubles), with one exception that makes it a
calculator: `a / b` of two integers that divides exactly is the exact integer (`10**20 / 4` is
25000000000000000000, not a rounded float); any other `/` is Python's true division.

Output: an integer result prints as the integer (`str(int)`); a float result prints with 12 significant digits
(`format(x, ".12g")`: `0.1 + 0.2` gives `0.3`, `2.0` gives `2`, `1 / 3` gives `0.333333333333`; exponent notation
below 1e-4 and from 1e12 up, as in `1e+15`); -0.0 prints as `0`.

Bounded cost, so that a policy cannot hang the host: the expression is at most MAX_EXPRESSION_CHARS characters and
MAX_NESTING deep; every number and every intermediate result is at most MAX_MAGNITUDE in absolute value, and a
power is refused before it is computed when its result would exceed that (so `9**9**9**9` answers at once).

Invalid input never raises: the response is a one-line message starting with "error: ", e.g.
"error: division by zero" or "error: result too large".
"""

from __future__ import annotations

import ast
import math
import operator

MAX_EXPRESSION_CHARS = 300
MAX_NESTING = 60  # syntax-tree depth: parentheses and unary signs
MAX_MAGNITUDE = 10**100  # of every number and intermediate result
_MAX_RESULT_BITS = MAX_MAGNITUDE.bit_length()

ERROR_PREFIX = "error: "
FLOAT_FORMAT = ".12g"


class CalculatorError(Exception):
    """Invalid input; its message is the tool's response (without the "error: " prefix)."""


_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_ALLOWED = "only numbers, + - * / // % **, and parentheses are allowed"


def evaluate(expression: str) -> str:
    """The value of the arithmetic `expression` as text, or a one-line "error: ..." message; never raises."""
    try:
        return format_number(_evaluate_checked(expression))
    except CalculatorError as error:
        return ERROR_PREFIX + str(error)
    except ZeroDivisionError:
        return ERROR_PREFIX + "division by zero"
    except (OverflowError, MemoryError):
        return ERROR_PREFIX + "result too large"
    except (RecursionError, ValueError, TypeError, ArithmeticError):
        # Not expected after the checks above: a safety net so that the host never sees an exception.
        return ERROR_PREFIX + "invalid expression"


def format_number(value: int | float) -> str:
    """The module's output rule: integers exactly, floats with 12 significant digits, no "-0"."""
    if isinstance(value, int):
        return str(value)
    if value == 0:
        return "0"
    return format(value, FLOAT_FORMAT)


def _evaluate_checked(expression: str) -> int | float:
    if not isinstance(expression, str):
        raise CalculatorError("the expression must be text")
    text = expression.strip()
    if not text:
        raise CalculatorError("empty expression")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise CalculatorError(f"invalid expression ({_ALLOWED})") from None
    return _value(tree.body, depth=0)


def _value(node: ast.AST, depth: int) -> int | float:
    """The value of one syntax-tree node, every intermediate checked against MAX_MAGNITUDE."""
    if depth > MAX_NESTING:
        raise CalculatorError(f"expression nested deeper than {MAX_NESTING}")
    if isinstance(node, ast.Constant):
        return _checked(_number(node.value))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand, depth + 1))
    if isinstance(node, ast.BinOp):
        left, right = _value(node.left, depth + 1), _value(node.right, depth + 1)
        if isinstance(node.op, ast.Pow):
            return _checked(_power(left, right))
        if isinstance(node.op, ast.Div):
            return _checked(_divide(left, right))
        if type(node.op) in _BINARY:
            return _checked(_BINARY[type(node.op)](left, right))
        if isinstance(node.op, ast.BitXor):
            raise CalculatorError("^ is not a power here: write ** (2 ** 10)")
    raise CalculatorError(_ALLOWED)


def _number(value: object) -> int | float:
    # bool is an int subclass, but `True` parses as a Constant too.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CalculatorError(_ALLOWED)
    return value


def _checked(value: int | float | complex) -> int | float:
    if isinstance(value, complex):
        raise CalculatorError("the result is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("result too large")
    if abs(value) > MAX_MAGNITUDE:
        raise CalculatorError("result too large")
    return value


def _divide(left: int | float, right: int | float) -> int | float:
    if right == 0:
        raise ZeroDivisionError
    if isinstance(left, int) and isinstance(right, int) and left % right == 0:
        return left // right
    return left / right


def _power(base: int | float, exponent: int | float) -> int | float | complex:
    """`base ** exponent`, refused before it is computed if its magnitude would exceed MAX_MAGNITUDE."""
    if base == 0 and exponent < 0:
        raise ZeroDivisionError
    if abs(base) > 1 and exponent > 0 and exponent * math.log2(abs(base)) > _MAX_RESULT_BITS:
        raise CalculatorError("result too large")
    if 0 < abs(base) < 1 and exponent < 0 and -exponent * -math.log2(abs(base)) > _MAX_RESULT_BITS:
        raise CalculatorError("result too large")
    return base**exponent
