"""Expression hooks: ``score_mod`` and ``mask_mod`` as small, checked expressions.

A hook is parsed with Python's ``ast`` and accepted only if every node is on a
whitelist: arithmetic, comparisons, boolean logic, a few math functions, the
index variables ``b, h, q_idx, kv_idx`` (and ``score`` in a score_mod), numbers,
and subscripts of the extra tensors the spec declares. Anything else (attribute
access, calls of other names, lambdas, comprehensions, strings, ...) is refused
with a message naming the construct. No text of the spec reaches the generated
source: the kernel expression is printed from the checked tree, names mapped to
the kernel's own variables and constants printed with ``repr``.

The same tree is evaluated with torch (:func:`evaluate`) by the fp64 reference
and by the FlexAttention baseline, so the three agree by construction.

Semantics: ``score`` is the scaled (and soft-capped) logit in natural-log units;
``b`` the batch index, ``h`` the query head, ``q_idx`` the query's absolute
position (q_offset + row), ``kv_idx`` the key's position. A subscript whose
index falls outside the tensor reads 0.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from dataclasses import dataclass, replace

INDEX_VARS = ("b", "h", "q_idx", "kv_idx")
# The kernel's name of each variable.
KERNEL_NAMES = {"score": "s", "b": "batch", "h": "head", "q_idx": "rows", "kv_idx": "keys"}
MAX_LENGTH = 500
MAX_NODES = 200
# The most characters a hook's kernel text may reach. A divisor read at run time is
# printed three times (its zero guard), so nested ones grow it as 3**depth: a
# 250-character hook would otherwise print gigabytes before any limit saw it.
MAX_KERNEL_TEXT = 100_000

# name -> (number of arguments, cuTile function, torch function name, result kind)
# kind "float": float result (int arguments are cast); "same": the arguments' kind.
FUNCTIONS = {
    "abs": (1, "ct.abs", "abs", "same"),
    "exp": (1, "ct.exp", "exp", "float"),
    "log": (1, "ct.log", "log", "float"),
    "sqrt": (1, "ct.sqrt", "sqrt", "float"),
    "tanh": (1, "ct.tanh", "tanh", "float"),
    # fmin/fmax: a NaN operand is ignored, as by cuTile's minimum/maximum (whose
    # propagate_nan is False): max(NaN, 0.5) is 0.5.
    "min": (2, "ct.minimum", "fmin", "same"),
    "max": (2, "ct.maximum", "fmax", "same"),
    "where": (3, "ct.where", "where", "same"),
}

_ARITH = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//",
          ast.Mod: "%"}
_COMPARE = {ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">",
            ast.GtE: ">="}
_DESCRIBE = {
    ast.Attribute: "attribute access", ast.Lambda: "a lambda", ast.ListComp: "a comprehension",
    ast.SetComp: "a comprehension", ast.DictComp: "a comprehension",
    ast.GeneratorExp: "a generator", ast.NamedExpr: "assignment (:=)",
    ast.Starred: "a starred argument", ast.JoinedStr: "an f-string", ast.List: "a list",
    ast.Tuple: "a tuple", ast.Dict: "a dict", ast.Set: "a set", ast.Await: "await",
    ast.Yield: "yield", ast.Slice: "a slice", ast.Pow: "'**'", ast.MatMult: "'@'",
    ast.LShift: "'<<'", ast.RShift: "'>>'", ast.BitXor: "'^'", ast.Is: "'is'",
    ast.IsNot: "'is not'", ast.In: "'in'", ast.NotIn: "'not in'",
}

TENSOR_KINDS = {"float32": "float", "int32": "int"}


# --- True and False: folded before anything reads a hook -----------------------


def _is_bool_const(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, bool)


def _is_condition(node: ast.AST) -> bool:
    """Whether ``node`` is a condition by its form: hooks have no boolean names or
    tensors, so a condition is a comparison, a negation, conditions combined, True or
    False, or a choice between conditions."""
    if _is_bool_const(node) or isinstance(node, (ast.Compare, ast.BoolOp)):
        return True
    if isinstance(node, ast.UnaryOp):
        return isinstance(node.op, (ast.Not, ast.Invert)) and _is_condition(node.operand)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.BitAnd, ast.BitOr)):
        return _is_condition(node.left) and _is_condition(node.right)
    if isinstance(node, ast.IfExp):
        return _is_condition(node.body) and _is_condition(node.orelse)
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "where" and len(node.args) == 3 and not node.keywords):
        return _is_condition(node.args[1]) and _is_condition(node.args[2])
    return False


def _combine(conjunction: bool, values: list[ast.AST], node: ast.AST) -> ast.AST:
    """``values`` joined by and (``conjunction``) or by or, True and False taken out:
    one absorbs the whole (False in an and), the other drops (True in an and)."""
    if not all(_is_bool_const(v) or _is_condition(v) for v in values):
        return node  # a number among them: the checker says so
    if any(_is_bool_const(v) and v.value is not conjunction for v in values):
        return ast.Constant(not conjunction)
    rest = [v for v in values if not _is_bool_const(v)]
    if not rest:
        return ast.Constant(conjunction)
    if len(rest) == 1:
        return rest[0]
    return ast.BoolOp(ast.And() if conjunction else ast.Or(), rest)


# The comparisons as Python functions: folding constants here, torch's in torch_fn.
_COMPARE_FN = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt,
               ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge}


def _number_const(node: ast.AST):
    """The value of a number written as a constant (2, -1.5, +3), else None."""
    sign = 1
    while isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        sign = -sign if isinstance(node.op, ast.USub) else sign
        node = node.operand
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return sign * node.value
    return None


class _FoldBools(ast.NodeTransformer):
    """True and False folded out of a hook, so that the kernel and the torch
    evaluation never see a Python bool where a condition tile goes (``not True`` is
    False, where Python's ``~True`` is -2; ``where(True, a, b)`` is a)."""

    def visit_UnaryOp(self, node):
        self.generic_visit(node)
        if isinstance(node.op, (ast.Not, ast.Invert)) and _is_bool_const(node.operand):
            return ast.Constant(not node.operand.value)
        return node

    def visit_BoolOp(self, node):
        self.generic_visit(node)
        return _combine(isinstance(node.op, ast.And), node.values, node)

    def visit_BinOp(self, node):
        self.generic_visit(node)
        if (isinstance(node.op, (ast.BitAnd, ast.BitOr))
                and (_is_bool_const(node.left) or _is_bool_const(node.right))):
            return _combine(isinstance(node.op, ast.BitAnd), [node.left, node.right], node)
        return node

    def visit_Compare(self, node):
        self.generic_visit(node)
        numbers = [_number_const(n) for n in [node.left, *node.comparators]]
        if all(n is not None for n in numbers) and all(type(op) in _COMPARE_FN for op in node.ops):
            # 1 > 0, (-1.0) > 0.0 (a derivative's text holds such): a constant condition
            return ast.Constant(all(_COMPARE_FN[type(op)](a, b)
                                    for op, a, b in zip(node.ops, numbers, numbers[1:])))
        if len(node.ops) != 1 or not isinstance(node.ops[0], (ast.Eq, ast.NotEq)):
            return node
        left, right = node.left, node.comparators[0]
        if not (_is_bool_const(left) or _is_bool_const(right)):
            return node
        if not (_is_condition(left) and _is_condition(right)):
            return node  # a condition against a number: the checker refuses it
        const, other = (left, right) if _is_bool_const(left) else (right, left)
        keep = const.value is isinstance(node.ops[0], ast.Eq)  # x == True, x != False: x
        if _is_bool_const(other):
            return ast.Constant((other.value is const.value) is isinstance(node.ops[0], ast.Eq))
        return other if keep else ast.UnaryOp(ast.Not(), other)

    def visit_IfExp(self, node):
        self.generic_visit(node)
        if _is_bool_const(node.test):
            return node.body if node.test.value else node.orelse
        return node

    def visit_Call(self, node):
        self.generic_visit(node)
        if (isinstance(node.func, ast.Name) and node.func.id == "where" and len(node.args) == 3
                and not node.keywords and _is_bool_const(node.args[0])):
            return node.args[1] if node.args[0].value else node.args[2]
        return node


def parse_hook(text: str) -> ast.Expression:
    """A hook's syntax tree with True and False folded out (_FoldBools); every reader
    of a hook (the kernel's printer, the torch evaluation, the block-map tests)
    starts from it. Raises SyntaxError."""
    tree = ast.parse(text.strip(), mode="eval")
    return ast.fix_missing_locations(_FoldBools().visit(tree))


class ExprError(ValueError):
    """A hook that is not a valid expression; the message says why."""


@dataclass(frozen=True)
class Gather:
    """One subscript of an extra tensor: loaded once per kernel (``where`` "head"),
    once per query tile ("rows") or in every key step ("keys")."""

    local: str  # the kernel variable holding it: "slope_0"
    tensor: str  # the tensor's name: "slope"
    indices: tuple[str, ...]  # kernel expressions of the indices
    where: str  # "head" | "rows" | "keys"
    source: str  # the subscript as written, for the comment


@dataclass(frozen=True)
class Hook:
    source: str  # the expression, normalised by ast.unparse
    kernel: str  # the expression in kernel names
    kind: str  # "float" | "int" | "bool"
    uses: frozenset  # index variables used (directly or inside subscripts)
    gathers: tuple[Gather, ...]


# float32's smallest normal number and its largest: the kernels compute in float32.
_FLOAT32_NORMAL = (1.1754943508222875e-38, 3.4028234663852886e38)


def _float32_number(value: float) -> bool:
    """Whether float32 holds ``value`` as itself: 0 or a normal number (not inf,
    NaN, or a magnitude that rounds to 0 or inf there)."""
    return value == 0 or _FLOAT32_NORMAL[0] <= abs(value) <= _FLOAT32_NORMAL[1]


def _is_zero(node: ast.AST) -> bool:
    """Whether a divisor is zero whatever the indices: a literal zero (0, 0.0, -0), or
    arithmetic that cancels (``q_idx - q_idx``, ``2 * h - h - h``, ``0 * kv_idx``)."""
    while isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        node = node.operand
    if isinstance(node, ast.Constant):
        return (not isinstance(node.value, bool) and isinstance(node.value, (int, float))
                and node.value == 0)
    # Zero on every branch: abs(0), min(0, 0), where(c, 0, 0.0), 0 if c else 0.
    if isinstance(node, ast.IfExp):
        return _is_zero(node.body) and _is_zero(node.orelse)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args:
        name, args = node.func.id, node.args
        if name in ("abs", "min", "max"):
            return all(_is_zero(a) for a in args)
        if name == "where" and len(args) == 3:
            return _is_zero(args[1]) and _is_zero(args[2])
    # Two integer constants: 1 // 2 and 4 % 2 are zero.
    if (isinstance(node, ast.BinOp) and isinstance(node.op, (ast.FloorDiv, ast.Mod))
            and all(isinstance(n, ast.Constant) and type(n.value) is int and n.value
                    for n in (node.left, node.right))):
        a, b = node.left.value, node.right.value
        return (a // b if isinstance(node.op, ast.FloorDiv) else a % b) == 0
    if not isinstance(node, ast.BinOp):
        return False  # a name, a tensor element or a call: not zero by its form
    import sympy as sp  # only for a compound divisor, so plain specs do not pay the import

    leaves: dict[str, sp.Symbol] = {}

    def convert(item: ast.AST):
        if isinstance(item, ast.Constant) and type(item.value) in (int, float):
            # The float's exact binary value: 0.1 + 0.2 - 0.3 is not zero in floats.
            return sp.Rational(item.value)
        if isinstance(item, ast.UnaryOp) and isinstance(item.op, (ast.USub, ast.UAdd)):
            operand = convert(item.operand)
            return -operand if isinstance(item.op, ast.USub) else operand
        if isinstance(item, ast.BinOp) and isinstance(item.op, (ast.Add, ast.Sub, ast.Mult)):
            left, right = convert(item.left), convert(item.right)
            return {ast.Add: left + right, ast.Sub: left - right,
                    ast.Mult: left * right}[type(item.op)]
        # Anything else (a name, a subscript, //, %, a call) is one opaque value; the
        # same text is the same value.
        text = ast.unparse(item)
        return leaves.setdefault(text, sp.Symbol(f"_x{len(leaves)}"))

    return sp.expand(convert(node)) == 0


_FOLD = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
         ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}


def _folded(node: ast.AST):
    """The value cuTile gives a subexpression of number constants alone: it folds
    them in Python (arbitrary-precision ints, float64) before they meet a tile, and
    then needs the result to fit the tile's int32 or float32. None where ``node``
    reads anything else."""
    if isinstance(node, ast.Constant):
        return node.value if type(node.value) in (int, float) else None
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _folded(node.operand)
        return None if value is None else (-value if isinstance(node.op, ast.USub) else value)
    if isinstance(node, ast.BinOp) and type(node.op) in _FOLD:
        left, right = _folded(node.left), _folded(node.right)
        if left is None or right is None:
            return None
        if isinstance(node.op, ast.Div):
            left, right = float(left), float(right)
        try:
            return _FOLD[type(node.op)](left, right)
        except (ZeroDivisionError, OverflowError):
            return None  # a zero divisor is refused by its own check
    return None


def _node_name(node: ast.AST) -> str:
    for cls, text in _DESCRIBE.items():
        if isinstance(node, cls):
            return text
    return type(node).__name__


class _Compiler:
    def __init__(self, which: str, tensors: dict, counter: dict):
        self.which = which  # "score_mod" | "mask_mod"
        self.tensors = tensors  # name -> (dtype, ndim)
        self.counter = counter  # shared across hooks: local names stay unique
        self.uses: set[str] = set()
        self.gathers: list[Gather] = []

    def fail(self, message: str):
        raise ExprError(message)

    def compile(self, node: ast.AST) -> tuple[str, str]:
        """(kernel text, kind) of ``node``."""
        method = getattr(self, "_" + type(node).__name__, None)
        if method is None:
            self.fail(f"{_node_name(node)} is not allowed")
        return method(node)

    def _Constant(self, node):
        value = node.value
        if isinstance(value, bool):
            return repr(value), "bool"
        if isinstance(value, int):
            if abs(value) >= 2**31:
                self.fail(f"integer {value} does not fit in int32")
            return repr(value), "int"
        if isinstance(value, float):
            if value != value or value in (float("inf"), float("-inf")):
                self.fail("only finite number constants are allowed")
            if not _float32_number(value):
                self.fail(f"constant {value!r} is outside float32's normal range (the kernels compute "
                          "in float32: it would be 0 or inf there)")
            return repr(value), "float"
        self.fail(f"constant {value!r} is not allowed (numbers and True/False only)")

    def _Name(self, node):
        name = node.id
        if name == "score":
            if self.which != "score_mod":
                self.fail("'score' is only defined in a score_mod")
            return KERNEL_NAMES[name], "float"
        if name in INDEX_VARS:
            self.uses.add(name)
            return KERNEL_NAMES[name], "int"
        if name in self.tensors:
            self.fail(f"tensor '{name}' must be indexed, e.g. {name}[h]")
        allowed = ", ".join((("score",) if self.which == "score_mod" else ()) + INDEX_VARS
                            + tuple(self.tensors))
        self.fail(f"unknown name '{name}'; allowed: {allowed}")

    def _check_folded(self, node):
        """A subexpression of constants alone (``65536 * 65536``) must fit where the
        kernel uses it, as each constant written must: cuTile folds it before it
        meets a tile and refuses an int beyond int32 (the fp64 reference would
        wrap it); a float beyond float32 would be inf or 0 there."""
        value = _folded(node)
        if isinstance(value, int) and not -2**31 <= value < 2**31:
            self.fail(f"{ast.unparse(node)} is {value}, which does not fit in int32 (the kernels "
                      "fold constants before they meet the int32 positions)")
        if isinstance(value, float) and not _float32_number(value):
            self.fail(f"{ast.unparse(node)} is {value!r}, outside float32's normal range (the "
                      "kernels compute in float32: it would be 0 or inf there)")

    def _number(self, node, text, kind, what):
        if kind == "bool":
            self.fail(f"{what} needs numbers, got a condition: {ast.unparse(node)}")
        return text

    def _BinOp(self, node):
        op = type(node.op)
        if op in (ast.BitAnd, ast.BitOr):
            left, lk = self.compile(node.left)
            right, rk = self.compile(node.right)
            if lk != "bool" or rk != "bool":
                self.fail(f"'&' and '|' combine conditions, got {ast.unparse(node)}")
            return f"({left} {'&' if op is ast.BitAnd else '|'} {right})", "bool"
        if op not in _ARITH:
            self.fail(f"{_node_name(node.op)} is not allowed")
        left, lk = self.compile(node.left)
        right, rk = self.compile(node.right)
        symbol = _ARITH[op]
        if op in (ast.Div, ast.FloorDiv, ast.Mod) and _is_zero(node.right):
            self.fail(f"'{symbol}' by zero is undefined, got {ast.unparse(node)}")
        self._number(node, left, lk, f"'{symbol}'")
        self._number(node, right, rk, f"'{symbol}'")
        self._check_folded(node)
        if op in (ast.FloorDiv, ast.Mod):
            if lk != "int" or rk != "int":
                self.fail(f"'{symbol}' needs integers, got {ast.unparse(node)}")
            if _folded(node.right) is None:
                # A divisor read at run time may be 0, where the GPU's integer division
                # is undefined: such a quotient or remainder is 0 (as in the reference).
                guarded = (f"ct.where({right} == 0, 0, {left} {symbol} "
                           f"ct.where({right} == 0, 1, {right}))")
                if len(guarded) > MAX_KERNEL_TEXT:
                    self.fail(f"nests divisors read at run time too deeply ({ast.unparse(node)[:60]}...: "
                              f"each is printed three times for its zero guard, over "
                              f"{MAX_KERNEL_TEXT} characters of kernel code)")
                return guarded, "int"
            return f"({left} {symbol} {right})", "int"
        if op is ast.Div:
            # True division is float division, as in Python.
            if lk == "int":
                left = self._to_float(node.left, left)
            if rk == "int":
                right = self._to_float(node.right, right)
            return f"({left} / {right})", "float"
        return f"({left} {symbol} {right})", "float" if "float" in (lk, rk) else "int"

    def _to_float(self, node, text):
        if isinstance(node, ast.Constant):
            return repr(float(node.value))
        return f"ct.astype({text}, ct.float32)"

    def _UnaryOp(self, node):
        if (isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant)
                and type(node.operand.value) is int and node.operand.value == 2**31):
            return f"(-{2**31})", "int"  # int32's minimum, whose magnitude alone does not fit
        operand, kind = self.compile(node.operand)
        if isinstance(node.op, (ast.Not, ast.Invert)):
            if kind != "bool":
                self.fail(f"'not' and '~' negate conditions, got {ast.unparse(node)}")
            return f"(~{operand})", "bool"
        self._number(node, operand, kind, "'-'")
        self._check_folded(node)
        return (f"(-{operand})" if isinstance(node.op, ast.USub) else operand), kind

    def _BoolOp(self, node):
        parts = []
        for value in node.values:
            text, kind = self.compile(value)
            if kind != "bool":
                self.fail(f"'and' and 'or' combine conditions, got {ast.unparse(value)}")
            parts.append(text)
        symbol = " & " if isinstance(node.op, ast.And) else " | "
        return "(" + symbol.join(parts) + ")", "bool"

    def _Compare(self, node):
        terms = []
        left_node = node.left
        left, lk = self.compile(left_node)
        for op, right_node in zip(node.ops, node.comparators):
            if type(op) not in _COMPARE:
                self.fail(f"{_node_name(op)} is not allowed")
            right, rk = self.compile(right_node)
            if (lk == "bool") != (rk == "bool") or (lk == "bool" and type(op) not in (ast.Eq, ast.NotEq)):
                self.fail(f"cannot compare {ast.unparse(left_node)} with {ast.unparse(right_node)}")
            terms.append(f"({left} {_COMPARE[type(op)]} {right})")
            left_node, left, lk = right_node, right, rk
        return (terms[0] if len(terms) == 1 else "(" + " & ".join(terms) + ")"), "bool"

    def _IfExp(self, node):
        return self._where([node.test, node.body, node.orelse], ast.unparse(node))

    def _where(self, args, text):
        cond, ck = self.compile(args[0])
        if ck != "bool":
            self.fail(f"the condition of {text} must be a comparison or condition")
        a, ak = self.compile(args[1])
        b, bk = self.compile(args[2])
        if (ak == "bool") != (bk == "bool"):
            self.fail(f"both branches of {text} must be numbers or both conditions")
        kind = "bool" if ak == "bool" else ("float" if "float" in (ak, bk) else "int")
        return f"ct.where({cond}, {a}, {b})", kind

    def _Call(self, node):
        if not isinstance(node.func, ast.Name) or node.func.id not in FUNCTIONS:
            what = ast.unparse(node.func)
            self.fail(f"calling {what} is not allowed; functions: {', '.join(FUNCTIONS)}")
        name = node.func.id
        count, ct_fn, _, result = FUNCTIONS[name]
        if node.keywords or len(node.args) != count:
            self.fail(f"{name}() takes {count} positional argument{'s' if count > 1 else ''}")
        if name == "where":
            return self._where(node.args, ast.unparse(node))
        args = [self.compile(a) for a in node.args]
        for (text, kind), arg in zip(args, node.args):
            self._number(arg, text, kind, f"{name}()")
        constant = _number_const(node.args[0]) if count == 1 else None
        if constant is not None:  # a function of a constant must be a float32 number too
            try:
                value = getattr(math, name)(constant) if name != "abs" else abs(constant)
            except (ValueError, OverflowError):
                value = math.nan
            if not _float32_number(value):
                self.fail(f"{ast.unparse(node)} is not a finite float32 number")
        kinds = {k for _, k in args}
        texts = [t for t, _ in args]
        if result == "float":
            texts = [self._to_float(a, t) if k == "int" else t
                     for (t, k), a in zip(args, node.args)]
            kind = "float"
        else:
            kind = "float" if "float" in kinds else "int"
        return f"{ct_fn}({', '.join(texts)})", kind

    def _Subscript(self, node):
        if not isinstance(node.value, ast.Name) or node.value.id not in self.tensors:
            known = ", ".join(self.tensors) or "none declared under tensors"
            self.fail(f"only declared tensors can be indexed ({known}), got {ast.unparse(node.value)}")
        name = node.value.id
        dtype, ndim = self.tensors[name]
        index_nodes = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if len(index_nodes) != ndim:
            self.fail(f"{name} has {ndim} dimension{'s' if ndim > 1 else ''}, "
                      f"indexed with {len(index_nodes)}: {ast.unparse(node)}")
        before = set(self.uses)
        self.uses.clear()
        indices = []
        for index in index_nodes:
            text, kind = self.compile(index)
            if kind != "int":
                self.fail(f"indices must be integers, got {ast.unparse(index)} in {ast.unparse(node)}")
            indices.append(text)
        inner = set(self.uses)
        self.uses |= before
        where = "keys" if "kv_idx" in inner else "rows" if "q_idx" in inner else "head"
        number = self.counter.get(name, 0)
        self.counter[name] = number + 1
        gather = Gather(f"{name}_{number}", name, tuple(indices), where, ast.unparse(node))
        self.gathers.append(gather)
        return gather.local, TENSOR_KINDS[dtype]


def compile_hook(text: str, which: str, tensors: dict, counter: dict | None = None,
                 check_size: bool = True) -> Hook:
    """Check ``text`` (a score_mod or mask_mod) and print it for the kernel.

    ``tensors`` maps each declared tensor to (dtype, ndim). ``check_size`` False
    lifts the length and node limits (a derivative specgen derived from a hook
    that was within them). Raises ExprError."""
    if not isinstance(text, str) or not text.strip():
        raise ExprError("must be a non-empty expression")
    if check_size and len(text) > MAX_LENGTH:
        raise ExprError(f"is longer than {MAX_LENGTH} characters")
    try:
        written = ast.parse(text.strip(), mode="eval")
    except SyntaxError as exc:
        raise ExprError(f"is not a Python expression ({exc.msg})") from None
    if check_size and sum(1 for _ in ast.walk(written)) > MAX_NODES:
        raise ExprError(f"has more than {MAX_NODES} syntax nodes")
    # Checked as written, so that a branch True or False rules out is checked too;
    # printed from the folded tree.
    _Compiler(which, tensors, dict(counter or {})).compile(written.body)
    tree = parse_hook(text)
    compiler = _Compiler(which, tensors, {} if counter is None else counter)
    kernel, kind = compiler.compile(tree.body)
    if which == "mask_mod" and kind != "bool":
        raise ExprError("must be a condition (a comparison, or conditions combined "
                        "with & | ~ and/or/not)")
    if which == "score_mod" and kind == "bool":
        raise ExprError("must be a number (the new score), got a condition")
    reads_score = any(isinstance(n, ast.Name) and n.id == "score" for n in ast.walk(tree))
    if which == "score_mod" and check_size and not reads_score and not {"q_idx", "kv_idx"} <= compiler.uses:
        # A written score_mod's value would be one number per query row, per key or
        # per head: not the tile of scores the kernels go on with. (A derivative
        # specgen derived, check_size False, multiplies a tile and may be a number.)
        raise ExprError("must read score, or vary with both q_idx and kv_idx (write score * 0.0 + ... "
                        "for scores that ignore q . k)")
    if kind == "int":
        kernel = f"ct.astype({kernel}, ct.float32)"
    return Hook(ast.unparse(tree.body), kernel, kind, frozenset(compiler.uses),
                tuple(compiler.gathers))


# --- evaluation with torch (reference and FlexAttention) -----------------------


def torch_fn(text: str, branch_gradients: bool = False):
    """A checked hook as a Python function ``f(env, tensors)`` of torch ops.

    The tree is turned into nested closures once, here; calling the result runs
    only torch operations, so torch.compile (FlexAttention) traces it into its
    fused kernel. ``env`` holds score, b, h, q_idx, kv_idx as (broadcastable)
    tensors, ``tensors`` the extra tensors. An index outside a tensor reads 0,
    as in the kernel.

    ``branch_gradients``: each branch of a conditional sees the score with its
    gradient only where the condition takes that branch. Autograd otherwise sends
    a zero gradient through the branch not taken, and 0 times that branch's
    derivative is NaN where it is not finite (the sqrt of a negative score in
    where(score > 0, sqrt(score), 0)); the kernels differentiate the branch taken
    only. For the fp64 reference."""
    import torch

    def branches(test, body, orelse):
        def pick(env, t):
            c = test(env, t)
            score = env.get("score")
            if not (branch_gradients and torch.is_tensor(c) and torch.is_tensor(score) and score.requires_grad):
                return _where3(c, body(env, t), orelse(env, t))
            kept = score.detach()
            taken = body({**env, "score": torch.where(c, score, kept)}, t)
            other = orelse({**env, "score": torch.where(c, kept, score)}, t)
            return _where3(c, taken, other)
        return pick

    def float_of(x):
        # Integers (positions, ids) become float32, exact below 2**24.
        if torch.is_tensor(x):
            return x if x.is_floating_point() else x.to(torch.float32)
        return float(x)

    def gather(table, indices):
        indices = torch.broadcast_tensors(*indices)
        inside = (indices[0] >= 0) & (indices[0] < table.shape[0])
        clamped = [indices[0].clamp(0, table.shape[0] - 1)]
        for index, size in zip(indices[1:], table.shape[1:]):
            inside = inside & (index >= 0) & (index < size)
            clamped.append(index.clamp(0, size - 1))
        values = table[tuple(clamped)]
        return torch.where(inside, values, torch.zeros_like(values))

    arith = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
             ast.Mult: lambda a, b: a * b, ast.FloorDiv: lambda a, b: a // b,
             ast.Mod: lambda a, b: a % b, ast.BitAnd: lambda a, b: a & b,
             ast.BitOr: lambda a, b: a | b}

    def build(node):
        if isinstance(node, ast.Constant):
            value = node.value
            return lambda env, t: value
        if isinstance(node, ast.Name):
            name = node.id
            return lambda env, t: env[name]
        if isinstance(node, ast.BinOp):
            left, right = build(node.left), build(node.right)
            if isinstance(node.op, ast.Div):
                return lambda env, t: float_of(left(env, t)) / right(env, t)
            fn = arith[type(node.op)]
            if isinstance(node.op, (ast.FloorDiv, ast.Mod)) and _folded(node.right) is None:
                # A divisor of 0 gives 0, as in the kernels.
                def guarded(env, t):
                    a, d = left(env, t), torch.as_tensor(right(env, t))
                    return torch.where(d == 0, 0, fn(a, torch.where(d == 0, 1, d)))
                return guarded
            return lambda env, t: fn(left(env, t), right(env, t))
        if isinstance(node, ast.UnaryOp):
            operand = build(node.operand)
            if isinstance(node.op, (ast.Not, ast.Invert)):
                return lambda env, t: ~operand(env, t)
            if isinstance(node.op, ast.USub):
                return lambda env, t: -operand(env, t)
            return operand
        if isinstance(node, ast.BoolOp):
            parts = [build(v) for v in node.values]
            fn = arith[ast.BitAnd if isinstance(node.op, ast.And) else ast.BitOr]

            def combine(env, t):
                out = parts[0](env, t)
                for part in parts[1:]:
                    out = fn(out, part(env, t))
                return out
            return combine
        if isinstance(node, ast.Compare):
            operands = [build(node.left)] + [build(c) for c in node.comparators]
            fns = [_COMPARE_FN[type(op)] for op in node.ops]

            def chain(env, t):
                values = [o(env, t) for o in operands]
                out = fns[0](values[0], values[1])
                for i, fn in enumerate(fns[1:], 1):
                    out = out & fn(values[i], values[i + 1])
                return out
            return chain
        if isinstance(node, ast.IfExp):
            return branches(build(node.test), build(node.body), build(node.orelse))
        if isinstance(node, ast.Call):
            name = node.func.id
            args = [build(a) for a in node.args]
            if name == "where":
                return branches(*args)
            fn = getattr(torch, FUNCTIONS[name][2])
            cast = FUNCTIONS[name][3] == "float"

            def call(env, t):
                values = [a(env, t) for a in args]
                values = [v if torch.is_tensor(v) else torch.tensor(v) for v in values]
                if cast:
                    values = [float_of(v) for v in values]
                return fn(*values)
            return call
        if isinstance(node, ast.Subscript):
            tensor = node.value.id
            index_nodes = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            indices = [build(i) for i in index_nodes]

            def subscript(env, t):
                table = t[tensor]
                values = [i(env, t) for i in indices]
                values = [v if torch.is_tensor(v) else torch.tensor(v, device=table.device)
                          for v in values]
                return gather(table, values)
            return subscript
        raise ExprError(f"{type(node).__name__} is not allowed")  # unreachable once checked

    body = build(parse_hook(text).body)

    def hook(env, tensors):
        value = body(env, tensors)
        # A hook that folds to a constant (True, a number) still gives a tensor.
        return value if torch.is_tensor(value) else torch.tensor(value)
    return hook


def _where3(c, a, b):
    """where(c, a, b) with torch; a condition of constants, a Python bool at run time
    ((1 + 1) > 0), chooses here."""
    import torch

    if not torch.is_tensor(c):
        return a if c else b
    if not torch.is_tensor(a):
        a = torch.tensor(a, device=b.device if torch.is_tensor(b) else c.device)
    return torch.where(c, a, b)


def evaluate(text: str, env: dict, tensors: dict):
    """Evaluate a checked hook once with torch ops (see torch_fn), each branch of a
    conditional differentiated where it is taken (the reference's gradients)."""
    return torch_fn(text, branch_gradients=True)(env, tensors)


# --- block maps: a cheap test that a mask_mod can hold anywhere in a tile -------


@dataclass(frozen=True)
class TilePretest:
    """A necessary condition for a mask_mod to hold somewhere in a [rows, keys]
    tile, from the bounds of each side of its comparisons: ``expr`` is a scalar
    condition in kernel names; ``gathers`` are the operands it reads that the
    mask_mod itself does not gather."""

    expr: str
    gathers: tuple[Gather, ...]


def rename_words(text: str, names: dict[str, str]) -> str:
    """``text`` (kernel names) with each whole word that is a key of ``names``
    replaced by its value (``ids_0`` is renamed, ``ids_01`` and ``span_ids_0`` are not)."""
    if not names:
        return text
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\b")
    return pattern.sub(lambda m: names[m.group(1)], text)


def tile_pretest(text: str, tensors: dict, mask_gathers: tuple[Gather, ...] = (),
                 per_tile: tuple[str, str] | None = None) -> TilePretest | None:
    """The pretest of mask_mod ``text``, or None where no comparison of it has
    sides that each depend on the rows or on the keys alone (the test would be
    always true). A comparison ``L op R`` can hold in a tile only if the sides'
    minima and maxima over the tile allow it (L == R: the ranges overlap;
    L < R: min L < max R; ...); ``&`` needs every part, ``|`` some part; a
    negation or a side that mixes rows and keys is unknown (may hold).
    ``mask_gathers``: the mask_mod's own gathers, whose locals the test reuses.

    ``per_tile`` (index variable, shape): the map kernel's several tiles per step.
    A side that reads that variable ("kv_idx": the keys of CHUNK key tiles) is
    reshaped to ``shape`` (one row per tile) and reduced along axis 1, so the test
    is a vector with one entry per tile; the other side's bounds stay scalars."""
    tree = parse_hook(text)
    own = {(g.tensor, g.indices): g.local for g in mask_gathers}
    counter = {name: 1000 for name in tensors}  # locals distinct from the hooks' own
    extra: list[Gather] = []

    def side(node):
        compiler = _Compiler("mask_mod", tensors, counter)
        expr, kind = compiler.compile(node)
        if kind == "bool" or {"q_idx", "kv_idx"} <= compiler.uses:
            return None
        # Inner subscripts come first: a gather the mask_mod already made is read from
        # its local, in the expression and in the indices of the gathers that follow.
        renamed: dict[str, str] = {}
        for g in compiler.gathers:
            indices = tuple(rename_words(i, renamed) for i in g.indices)
            local = own.get((g.tensor, indices))
            if local is None:
                extra.append(replace(g, indices=indices))
            else:
                renamed[g.local] = local
        expr = rename_words(expr, renamed)
        if kind == "float":
            sides_float.append(node)
        if not compiler.uses & {"q_idx", "kv_idx"}:
            return expr, expr  # the same for the whole tile
        if per_tile and per_tile[0] in compiler.uses:
            shaped = f"ct.reshape({expr}, {per_tile[1]})"
            return f"ct.min({shaped}, axis=1)", f"ct.max({shaped}, axis=1)"
        return f"ct.min({expr})", f"ct.max({expr})"

    sides_float: list = []

    def compare(op, left, right):
        sides_float.clear()
        a, b = side(left), side(right)
        if a is None or b is None:
            return None
        if isinstance(op, ast.NotEq) and sides_float:
            # NaN != x holds, but ct.min and ct.max skip a NaN: a float side that is NaN
            # on some pairs of the tile is not bounded by them (may hold).
            return None
        (lo_a, hi_a), (lo_b, hi_b) = a, b
        if isinstance(op, ast.Eq):
            return f"(({lo_a}) <= ({hi_b})) & (({lo_b}) <= ({hi_a}))"
        if isinstance(op, ast.NotEq):
            return f"(({lo_a}) != ({hi_a})) | (({lo_b}) != ({hi_b})) | (({lo_a}) != ({lo_b}))"
        if isinstance(op, (ast.Lt, ast.LtE)):
            return f"({lo_a}) {_COMPARE[type(op)]} ({hi_b})"
        return f"({hi_a}) {_COMPARE[type(op)]} ({lo_b})"

    def combine(parts, conjunction):
        known = [p for p in parts if p is not None]
        if conjunction:
            return " & ".join(f"({p})" for p in known) if known else None
        return None if len(known) < len(parts) else " | ".join(f"({p})" for p in known)

    def walk(node):
        if isinstance(node, ast.BoolOp):
            return combine([walk(v) for v in node.values], isinstance(node.op, ast.And))
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.BitAnd, ast.BitOr)):
            return combine([walk(node.left), walk(node.right)], isinstance(node.op, ast.BitAnd))
        if isinstance(node, ast.Compare):
            lefts = [node.left] + list(node.comparators[:-1])
            return combine([compare(op, a, b) for op, a, b in zip(node.ops, lefts, node.comparators)],
                           True)
        return None

    expr = walk(tree.body)
    if expr is None:
        return None
    return TilePretest(expr, tuple(extra))


def block_quotients(text: str) -> tuple[int | None, int | None] | None:
    """(R, K) where mask_mod ``text`` reads q_idx only as ``q_idx // R`` and kv_idx
    only as ``kv_idx // K`` (R, K: the gcd of the integer divisors written; None:
    the variable is not read), else None. Such a mask is constant on the aligned
    R x K blocks of positions (q // a is a function of q // R where R divides a),
    so the map kernel may evaluate it once per block a tile touches instead of
    once per pair."""
    tree = parse_hook(text)
    divisors: dict[str, list[int]] = {"q_idx": [], "kv_idx": []}
    quotients = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.BinOp) and isinstance(node.op, ast.FloorDiv)
                and isinstance(node.left, ast.Name) and node.left.id in divisors
                and isinstance(node.right, ast.Constant) and type(node.right.value) is int
                and node.right.value > 0):
            divisors[node.left.id].append(node.right.value)
            quotients.add(id(node.left))
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in divisors and id(node) not in quotients:
            return None  # read as itself, not as a quotient
    return tuple(math.gcd(*found) if found else None for found in divisors.values())
