"""The derivative of a ``score_mod`` with respect to ``score``, for the backward.

The hook's checked tree is turned into a sympy expression. Every subtree that does
not depend on ``score`` (positions, integer arithmetic, tensor subscripts,
conditions on indices) stands as an opaque symbol that prints back as its own
source. sympy differentiates the rest, and the result is printed back in the
hook language (``where``, ``min``, ``max``, ``abs``, ``exp``, ``log``, ``sqrt``,
``tanh``, arithmetic and comparisons; no ``**``), so it compiles to cuTile and
evaluates with torch exactly as a hook does.

Derivatives that exist only almost everywhere follow the usual subgradient
conventions: ``abs`` has slope 0 at 0, ``min``/``max`` and ``where`` take the
slope of the branch they select, and at a tie ``min``/``max`` take their first
argument's (``max(score, c)`` has slope 1 where score == c).
"""

from __future__ import annotations

import ast
import contextlib

import sympy as sp

from specgen.spec.hooks import ExprError, _is_condition, parse_hook

# The kernels compute in float32: a constant past its largest value is inf there.
FLOAT32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max

_SCORE = sp.Symbol("score", real=True)


class _RealAbs(sp.Function):
    """abs() as the kernels compute it, on a float32 value (a real number or NaN):
    d|u| = sign(u) du, slope 0 at 0. sympy's Abs takes log(u) and sqrt(u) of a real u
    for complex numbers and differentiates through re and im: abs(sqrt(score)) had
    cos in its derivative (refused), and abs(log(u)) became (1/log u) * log(u / sign u)
    * ..., inf * 0 (NaN in the kernel) wherever u == 1."""

    @classmethod
    def eval(cls, arg):
        if arg.is_number:
            return sp.Abs(arg)
        if arg.is_extended_nonnegative:
            return arg
        if arg.is_extended_nonpositive:
            return -arg
        return None

    def fdiff(self, argindex=1):
        return sp.sign(self.args[0])


_FUNCS = {"exp": sp.exp, "log": sp.log, "sqrt": sp.sqrt, "tanh": sp.tanh, "abs": _RealAbs}
_ARITH = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
          ast.Mult: lambda a, b: a * b, ast.Div: lambda a, b: a / b}


class _ToSympy:
    """Hook tree -> sympy, with score-free subtrees as opaque symbols. Subscripts of
    the ``learnable`` tensors are variables too (their own symbols), so the
    expression can be differentiated in them."""

    def __init__(self, learnable: frozenset = frozenset()):
        self.opaque: dict[sp.Symbol, str] = {}
        self.learnable = learnable
        self.variables: dict[str, sp.Symbol] = {}

    def is_variable(self, node: ast.AST) -> bool:
        return (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name)
                and node.value.id in self.learnable)

    def uses_variable(self, node: ast.AST) -> bool:
        return any((isinstance(n, ast.Name) and n.id == "score") or self.is_variable(n)
                   for n in ast.walk(node))

    def variable(self, node: ast.AST):
        text = ast.unparse(node)
        if text not in self.variables:
            symbol = sp.Symbol(f"_v{len(self.variables)}", real=True)
            self.variables[text] = symbol
            self.opaque[symbol] = text
        return self.variables[text]

    def leaf(self, node: ast.AST, boolean: bool = False):
        text = ast.unparse(node)
        for symbol, source in self.opaque.items():
            if source == text:
                return symbol
        symbol = sp.Symbol(f"_o{len(self.opaque)}") if boolean else sp.Symbol(f"_o{len(self.opaque)}", real=True)
        self.opaque[symbol] = text
        return symbol

    def convert(self, node: ast.AST):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return sp.Integer(node.value) if isinstance(node.value, int) else sp.Float(node.value)
        if _is_condition(node):
            # A condition is only ever tested, never differentiated (a choice's
            # derivative is the chosen branch's): it stays whole, as its own text, so
            # sympy never orders relationals of choices (which it can get wrong).
            return self.leaf(node, boolean=True)
        if not self.uses_variable(node):
            return self.leaf(node)
        if self.is_variable(node):
            return self.variable(node)
        if isinstance(node, ast.Name):  # score
            return _SCORE
        if isinstance(node, ast.BinOp):
            if type(node.op) not in _ARITH:
                raise ExprError(f"{ast.unparse(node)}: '//' and '%' of the score or of a "
                                "learnable tensor have no derivative (a backward needs one)")
            return _ARITH[type(node.op)](self.convert(node.left), self.convert(node.right))
        if isinstance(node, ast.UnaryOp):
            operand = self.convert(node.operand)
            if isinstance(node.op, ast.USub):
                return -operand
            return operand  # +x (not and ~ negate conditions, kept whole above)
        if isinstance(node, ast.Call):
            name = node.func.id
            args = [self.convert(a) for a in node.args]
            if name == "where":
                return sp.Piecewise((args[1], args[0]), (args[2], True))
            if name in ("min", "max"):
                # The first argument where it is the smaller (larger), ties included:
                # its slope at a tie, never the 0 of H(c) + H(-c) that sympy's Min and
                # Max differentiate to. The comparison is a condition, kept whole.
                # min and max ignore a NaN operand (cuTile's, the reference's): where
                # b is NaN they return a, whose slope it is then, though a <= b is False.
                a, b = node.args
                test = ast.Compare(a, [ast.LtE() if name == "min" else ast.GtE()], [b])
                if not isinstance(b, ast.Constant):
                    test = ast.BinOp(test, ast.BitOr(), ast.Compare(b, [ast.NotEq()], [b]))
                return sp.Piecewise((args[0], self.leaf(test, boolean=True)), (args[1], True))
            return _FUNCS[name](*args)
        if isinstance(node, ast.IfExp):
            return sp.Piecewise((self.convert(node.body), self.convert(node.test)),
                                (self.convert(node.orelse), True))
        raise ExprError(f"{ast.unparse(node)}: no derivative for this construct")


class _Printer:
    """sympy -> hook text."""

    def __init__(self, opaque: dict):
        self.opaque = opaque

    def __call__(self, e) -> str:
        if e is sp.true or e == sp.true:
            return "True"
        if e is sp.false or e == sp.false:
            return "False"
        if isinstance(e, sp.Symbol):
            return "score" if e == _SCORE else f"({self.opaque[e]})"
        if e.is_Number:
            # (sympy keeps 1e320 finite, as it does 1e39: both are inf in the kernel)
            if e in (sp.nan, sp.zoo, sp.oo, -sp.oo) or not abs(float(e)) <= FLOAT32_MAX:
                raise ExprError("the derivative is not finite")
            return repr(float(e))
        if isinstance(e, sp.Add):
            return "(" + " + ".join(self(a) for a in e.args) + ")"
        if isinstance(e, sp.Mul):
            return "(" + " * ".join(self(a) for a in e.args) + ")"
        if isinstance(e, sp.Pow):
            return self.power(*e.args)
        if isinstance(e, (sp.exp, sp.log, sp.tanh)):
            return f"{type(e).__name__}({self(e.args[0])})"
        if isinstance(e, (sp.Abs, _RealAbs)):
            return f"abs({self(e.args[0])})"
        if isinstance(e, sp.sign):
            x = self(e.args[0])
            return f"where({x} > 0.0, 1.0, where({x} < 0.0, -1.0, 0.0))"
        if isinstance(e, sp.Heaviside):
            return f"where({self(e.args[0])} > 0.0, 1.0, 0.0)"
        if isinstance(e, sp.DiracDelta):
            return "0.0"
        if isinstance(e, (sp.Min, sp.Max)):
            name = "min" if isinstance(e, sp.Min) else "max"
            text = self(e.args[-1])
            for a in reversed(e.args[:-1]):
                text = f"{name}({self(a)}, {text})"
            return text
        if isinstance(e, sp.Piecewise):
            text = None
            for value, cond in reversed(e.args):
                if text is None:
                    text = self(value) if cond == sp.true else "0.0"
                    if cond == sp.true:
                        continue
                text = f"where({self(cond)}, {self(value)}, {text})"
            return text
        if isinstance(e, sp.core.relational.Relational):
            op = {sp.StrictLessThan: "<", sp.LessThan: "<=", sp.StrictGreaterThan: ">",
                  sp.GreaterThan: ">=", sp.Equality: "==", sp.Unequality: "!="}[type(e)]
            return f"({self(e.lhs)} {op} {self(e.rhs)})"
        if isinstance(e, (sp.And, sp.Or)):
            op = " & " if isinstance(e, sp.And) else " | "
            return "(" + op.join(self(a) for a in e.args) + ")"
        if isinstance(e, sp.Not):
            return f"(~{self(e.args[0])})"
        raise ExprError(f"the derivative has {type(e).__name__}, which no hook can express")

    def power(self, base, exponent) -> str:
        b = self(base)
        if exponent == sp.Rational(1, 2):
            return f"sqrt({b})"
        if exponent == sp.Rational(-1, 2):
            return f"(1.0 / sqrt({b}))"
        if exponent.is_Integer and 0 < abs(int(exponent)) <= 8:
            product = "(" + " * ".join([b] * abs(int(exponent))) + ")"
            return product if exponent > 0 else f"(1.0 / {product})"
        if exponent.is_Integer:
            # exp(n log|b|) with b's sign put back: exp(n log b) is NaN for b < 0.
            n = int(exponent)
            magnitude = f"exp({float(n)!r} * log(abs({b})))"
            return magnitude if n % 2 == 0 else f"(where({b} < 0.0, -1.0, 1.0) * {magnitude})"
        return f"exp({self(exponent)} * log({b}))"


def score_derivative(text: str) -> str:
    """d(score_mod)/d(score) of the checked hook ``text``, as hook text ("1.0" for
    score + bias). Raises ExprError where the hook has no derivative."""
    with _sympy_errors(text):
        tree = parse_hook(text)  # True and False folded, as the kernel reads it
        converter = _ToSympy()
        expr = _branch_first(converter.convert(tree.body))
        derivative = _fold(sp.diff(expr, _SCORE))
        if derivative.has(sp.Subs, sp.Derivative):
            raise ExprError(f"{text}: sympy left an unevaluated derivative ({derivative})")
        return _Printer(converter.opaque)(derivative)


def tensor_derivatives(text: str, learnable) -> list[tuple[str, str]]:
    """(subscript, d(score_mod)/d(subscript)) for each distinct subscript of the
    ``learnable`` tensors in the checked hook ``text``, as hook text, in order of
    first appearance: ``score - slope[h] * (q_idx - kv_idx)`` gives
    ``[("slope[h]", "(-1.0 * (q_idx - kv_idx))")]``-like text. Raises ExprError
    where the hook has no derivative in one of them."""
    with _sympy_errors(text):
        tree = parse_hook(text)  # True and False folded, as the kernel reads it
        converter = _ToSympy(frozenset(learnable))
        expr = _branch_first(converter.convert(tree.body))
        printer = _Printer(converter.opaque)
        result = []
        for source, symbol in converter.variables.items():
            derivative = _fold(sp.diff(expr, symbol))
            if derivative.has(sp.Subs, sp.Derivative):
                raise ExprError(f"{text}: sympy left an unevaluated derivative in {source} "
                                f"({derivative})")
            result.append((source, printer(derivative)))
        return result


# The most sets of conditions _branch_first pulls to the top (2**n branches).
MAX_BRANCH_CHOICES = 4


def _branch_first(expr):
    """The hook with its choices pulled to the top before it is differentiated
    (``sqrt(abs(where(c, 0.0, score)))`` becomes ``where(c, sqrt(abs(0.0)),
    sqrt(abs(score)))``), so that each branch is differentiated alone, as the
    reference's autograd does: the chain rule through a choice otherwise multiplies
    the slope of the outer function at the branch not taken (1/sqrt(0): inf) by that
    branch's 0, NaN in the kernel. Up to MAX_BRANCH_CHOICES sets of conditions."""
    choices = {tuple(cond for _, cond in p.args) for p in expr.atoms(sp.Piecewise)}
    if not choices or len(choices) > MAX_BRANCH_CHOICES:
        return expr
    return sp.piecewise_fold(expr)


def _fold(derivative):
    """The derivative with a choice that multiplies it pulled to the top, where
    there is one such choice (one set of conditions, however often it occurs): a
    branch where the hook is flat is then 0, not the product inf * 0 of
    sqrt(max(score, 0))'s chain rule below 0. sympy folds several choices into every
    combination of their branches (2**n, and slowly), so those stay as they are."""
    choices = {tuple(cond for _, cond in p.args) for p in derivative.atoms(sp.Piecewise)}
    if not choices:
        return derivative
    if len(choices) != 1:
        return _distribute(derivative)
    return sp.piecewise_fold(derivative)


def _distribute(e):
    """``e`` with each product pushed into the choices it multiplies, one choice at a
    time: ``a * (where(c1, k1, 0) + where(c2, k2, 0))`` becomes ``where(c1, a * k1, 0)
    + where(c2, a * k2, 0)``, as autograd routes a slope through a choice (the branch
    not taken gets 0, whatever the slope outside). For derivatives with more choices
    than _branch_first folds: the outer slope at a branch not taken (1/sqrt(0)) times
    that branch's 0 was NaN in the kernel. Linear in the number of choices (a term
    that multiplies several choices, or several sums of them, together is left as
    it is: multiplied out, a product of sums grew the text 80-fold)."""
    if not e.has(sp.Piecewise):
        return e
    if isinstance(e, sp.Add):
        return sp.Add(*[_distribute(a) for a in e.args])
    if isinstance(e, sp.Piecewise):
        return sp.Piecewise(*[(_distribute(v), c) for v, c in e.args])
    if not isinstance(e, sp.Mul):
        return e
    factors = list(e.args)

    def sum_of_choices(f):
        return isinstance(f, sp.Add) and any(isinstance(t, sp.Piecewise) or (
            isinstance(t, sp.Mul) and any(isinstance(u, sp.Piecewise) for u in t.args))
            for t in f.args)

    sums = [f for f in factors if sum_of_choices(f)]
    if len(sums) > 1:
        return e  # a product of such sums would multiply out into every pair of terms
    if sums:
        rest = [f for f in factors if f is not sums[0]]
        return sp.Add(*[_distribute(sp.Mul(*rest, t)) for t in sums[0].args])
    choices = [f for f in factors if isinstance(f, sp.Piecewise)]
    if len(choices) != 1:
        return e
    rest = sp.Mul(*[f for f in factors if f is not choices[0]])
    return sp.Piecewise(*[(_distribute(rest * v), c) for v, c in choices[0].args])


@contextlib.contextmanager
def _sympy_errors(text: str):
    """sympy's own failures (a TypeError from a relational it cannot order, a
    RecursionError in its simplifier) as the one-line ExprError a spec error needs."""
    try:
        yield
    except ExprError:
        raise
    except (TypeError, ValueError, AttributeError, NotImplementedError, RecursionError) as exc:
        detail = (str(exc).strip().splitlines() or [""])[0][:120]
        raise ExprError(f"{text}: sympy could not form the derivative "
                        f"({type(exc).__name__}: {detail})") from None
