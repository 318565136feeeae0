"""Just enough PromQL reading for the dashboard lint tests: selectors, matchers and ranges.

grafana/dashboard-linter walks the AST from Prometheus' Go parser; no PromQL parser is installed
here, so this tokenizer finds the same things in the subset of PromQL the dashboard uses, and
raises on anything it does not understand rather than passing it. Whether a query is valid
PromQL is decided by Prometheus itself (promtool, and the end-to-end test's HTTP API).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# Prometheus' functions and aggregations take their arguments in parentheses; these keywords
# take a label list instead (or nothing), and these are binary operators spelled as words.
LABEL_LIST_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
WORD_OPERATORS = {"and", "or", "unless", "bool", "atan2"}
# Aggregations may put their label list first: sum by (pod) (x).
AGGREGATIONS = {
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
    "limitk",
    "limit_ratio",
}

_TOKEN = re.compile(
    r"""
    (?P<space>\s+)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<range>\[[^\]]*\])
  | (?P<number>(?:0[xX][0-9a-fA-F]+|[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)(?:[a-zA-Z]+[0-9a-zA-Z]*)*)
  | (?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)
  | (?P<op>=~|!~|!=|==|>=|<=|[-+*/%^<>=,(){}@])
""",
    re.VERBOSE,
)


@dataclass(frozen=True)
class Matcher:
    label: str
    op: str
    value: str


@dataclass
class Selector:
    metric: str | None
    matchers: list[Matcher] = field(default_factory=list)
    range: str | None = None  # the text between [ and ] when the selector is ranged
    function: str | None = None  # the function whose argument the selector is, if any

    def matcher(self, label: str) -> Matcher | None:
        return next((m for m in self.matchers if m.label == label), None)


def tokenize(expr: str) -> list[tuple[str, str]]:
    tokens, position = [], 0
    while position < len(expr):
        match = _TOKEN.match(expr, position)
        if not match:
            raise ValueError(f"cannot read PromQL at {position}: {expr[position : position + 20]!r}")
        kind = match.lastgroup
        if kind != "space":
            tokens.append((kind, match.group()))
        position = match.end()
    return tokens


def _unquote(text: str) -> str:
    if text[0] == "`":
        return text[1:-1]
    return bytes(text[1:-1], "utf-8").decode("unicode_escape")


def selectors(expr: str) -> list[Selector]:
    """Every vector selector of expr, with its matchers, its range and its enclosing function."""
    tokens = tokenize(expr)
    found: list[Selector] = []
    calls: list[str | None] = []  # for each open parenthesis: the function it belongs to
    pending: str | None = None  # an aggregation whose label list comes before its "("
    index = 0

    def matchers_at(start: int) -> tuple[list[Matcher], int]:
        result, i = [], start + 1
        while tokens[i] != ("op", "}"):
            label, op, value = tokens[i], tokens[i + 1], tokens[i + 2]
            if label[0] != "ident" or op[1] not in ("=", "!=", "=~", "!~") or value[0] != "string":
                raise ValueError(f"bad label matcher in {expr!r}")
            result.append(Matcher(label[1], op[1], _unquote(value[1])))
            i += 3
            if tokens[i] == ("op", ","):
                i += 1
        return result, i + 1

    while index < len(tokens):
        kind, text = tokens[index]
        following = tokens[index + 1] if index + 1 < len(tokens) else (None, None)
        if kind == "ident" and text in LABEL_LIST_KEYWORDS:
            index += 1
            if following == ("op", "("):
                while tokens[index] != ("op", ")"):
                    index += 1
                index += 1
            continue
        if kind == "ident" and text in WORD_OPERATORS:
            index += 1
            continue
        if kind == "ident" and text == "offset":
            index += 2
            continue
        if kind == "ident" and following == ("op", "("):
            calls.append(text)
            index += 2
            continue
        if kind == "ident" and text in AGGREGATIONS and following[1] in ("by", "without"):
            pending = text
            index += 1
            continue
        if kind == "op" and text == "(":
            calls.append(pending)
            pending = None
            index += 1
            continue
        if kind == "op" and text == ")":
            calls.pop()
            index += 1
            continue
        if kind == "ident" or (kind == "op" and text == "{"):
            metric = text if kind == "ident" else None
            index += 1 if kind == "ident" else 0
            matchers: list[Matcher] = []
            if index < len(tokens) and tokens[index] == ("op", "{"):
                matchers, index = matchers_at(index)
            selector = Selector(metric, matchers, function=calls[-1] if calls else None)
            if index < len(tokens) and tokens[index][0] == "range":
                selector.range = tokens[index][1][1:-1]
                index += 1
            found.append(selector)
            continue
        if kind == "range":
            raise ValueError(f"range or subquery after an expression (not a selector) in {expr!r}")
        index += 1
    if calls:
        raise ValueError(f"unbalanced parentheses in {expr!r}")
    return found
