"""Find the shape that makes an EBNF (GBNF) grammar cost the engine without bound.

xgrammar, vLLM 0.32's structured-output backend, matches a grammar with an Earley parser in the
engine's loop, token by token. A repetition of something that can match nothing (`("a"*)*`,
`r*` where `r ::= "a"*`, `(r s)*` with both optional) is ambiguous in infinitely many ways, and
the parser's state sets grow with every token: measured with xgrammar 0.2.8 on a 512-token
vocabulary, 200 tokens of `("a"*)* "b"` took 0.69 s of CPU and `(r s)*` 1.05 s, growing with
the square of the length, while `("a"+)+` took 0.02 s and `[a]* "b"` nothing. So such grammars
are refused (`nullable_repetition`); the regex rule is `protocol.validate_regex`'s.

A plain scanner, no regular expressions over the grammar text (which is the attacker's).
"""

from __future__ import annotations

_QUANTIFIERS = "*+?{"


def _tokens(text: str) -> list[str]:
    """Strings, classes and `{m,n}` become one token each; comments and blanks vanish."""
    out, i = [], 0
    while i < len(text):
        c = text[i]
        if c.isspace():
            i += 1
        elif c == "#":
            while i < len(text) and text[i] != "\n":
                i += 1
        elif c in "\"[":
            end = "]" if c == "[" else '"'
            j = i + 1
            while j < len(text) and text[j] != end:
                j += 2 if text[j] == "\\" else 1
            out.append(text[i:j + 1])
            i = j + 1
        elif c == "{":
            j = text.find("}", i)
            j = len(text) - 1 if j < 0 else j
            out.append(text[i:j + 1])
            i = j + 1
        elif text.startswith("::=", i):
            out.append("::=")
            i += 3
        elif c.isalnum() or c in "_-.":
            j = i
            while j < len(text) and (text[j].isalnum() or text[j] in "_-."):
                j += 1
            out.append(text[i:j])
            i = j
        else:
            out.append(c)
            i += 1
    return out


def _rules(tokens: list[str]) -> dict[str, list[str]]:
    starts = [i for i in range(len(tokens) - 1) if tokens[i + 1] == "::="]
    return {tokens[s]: tokens[s + 2:e] for s, e in zip(starts, [*starts[1:], len(tokens)])}


def _can_repeat(q: str) -> bool:
    if q in "*+":
        return True
    if q.startswith("{"):
        bounds = q[1:-1].split(",")
        return len(bounds) == 2 and (not bounds[1].strip() or bounds[1].strip() not in ("0", "1"))
    return False


def _may_be_empty(q: str) -> bool:
    return q in "*?" or (q.startswith("{") and q[1:].lstrip().startswith("0"))


class _Walk:
    """One pass over a rule's tokens: is it nullable, and where does a nullable thing repeat."""

    def __init__(self, tokens: list[str], nullable: set[str]):
        self.tokens, self.at, self.nullable = tokens, 0, nullable
        self.hazard: str | None = None

    def alternatives(self) -> bool:
        empty = self.sequence()
        while self.at < len(self.tokens) and self.tokens[self.at] == "|":
            self.at += 1
            empty = self.sequence() or empty
        return empty

    def sequence(self) -> bool:
        empty = True
        while self.at < len(self.tokens) and self.tokens[self.at] not in "|)":
            empty = self.item() and empty
        return empty

    def item(self) -> bool:
        start, token = self.at, self.tokens[self.at]
        self.at += 1
        if token == "(":
            empty = self.alternatives()
            self.at += 1  # the ")"
        elif token.startswith('"'):
            empty = token == '""'
        else:
            empty = token in self.nullable
        while self.at < len(self.tokens) and self.tokens[self.at][0] in _QUANTIFIERS:
            q = self.tokens[self.at]
            self.at += 1
            if empty and _can_repeat(q) and self.hazard is None:
                self.hazard = " ".join(self.tokens[start:self.at])[:80]
            empty = empty or _may_be_empty(q)
        return empty


def nullable_repetition(grammar: str) -> str | None:
    """The first repeated expression that can match nothing, as text, or None."""
    rules = _rules(_tokens(grammar))
    nullable: set[str] = set()
    for _ in range(len(rules) + 1):  # to the fixpoint: each pass adds a rule or ends
        found = {name for name, body in rules.items() if _Walk(body, nullable).alternatives()}
        if found == nullable:
            break
        nullable = found
    for body in rules.values():
        walk = _Walk(body, nullable)
        walk.alternatives()
        if walk.hazard:
            return walk.hazard
    return None
