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

from typing import Any

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
    """One pass over a rule's tokens: is it nullable, where does a nullable thing repeat, and
    which rules can it derive alone (everything beside them matching nothing)."""

    def __init__(self, tokens: list[str], nullable: set[str]):
        self.tokens, self.at, self.nullable = tokens, 0, nullable
        self.hazard: str | None = None

    def alternatives(self) -> tuple[bool, set[str]]:
        empty, alone = self.sequence()
        while self.at < len(self.tokens) and self.tokens[self.at] == "|":
            self.at += 1
            more_empty, more_alone = self.sequence()
            empty, alone = empty or more_empty, alone | more_alone
        return empty, alone

    def sequence(self) -> tuple[bool, set[str]]:
        items = []
        while self.at < len(self.tokens) and self.tokens[self.at] not in "|)":
            items.append(self.item())
        solid = [alone for empty, alone in items if not empty]
        if len(solid) > 1:  # two parts that must each match something: neither is alone
            return False, set()
        if solid:
            return False, solid[0]
        return True, set().union(*(alone for _, alone in items))

    def item(self) -> tuple[bool, set[str]]:
        start, token = self.at, self.tokens[self.at]
        self.at += 1
        if token == "(":
            empty, alone = self.alternatives()
            self.at += 1  # the ")"
        elif token.startswith('"'):
            empty, alone = token == '""', set()
        elif token.startswith("["):
            empty, alone = False, set()
        else:
            empty, alone = token in self.nullable, {token}
        while self.at < len(self.tokens) and self.tokens[self.at][0] in _QUANTIFIERS:
            q = self.tokens[self.at]
            self.at += 1
            if empty and _can_repeat(q) and self.hazard is None:
                self.hazard = " ".join(self.tokens[start:self.at])[:80]
            empty = empty or _may_be_empty(q)
        return empty, alone


def _cycle(derives: dict[str, set[str]]) -> list[str] | None:
    """A rule that derives itself alone, through the rules on the way (iterative DFS)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in derives:
        if start in state:
            continue
        path, stack = [start], [iter(sorted(derives[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt in derives and nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(derives[nxt])))
    return None


def _nullable(rules: dict[str, list[str]]) -> set[str]:
    nullable: set[str] = set()
    for _ in range(len(rules) + 1):  # to the fixpoint: each pass adds a rule or ends
        found = {name for name, body in rules.items() if _Walk(body, nullable).alternatives()[0]}
        if found == nullable:
            break
        nullable = found
    return nullable


def nullable_repetition(grammar: str) -> str | None:
    """The first repeated expression that can match nothing, as text, or None. A rule that
    derives itself alone (`s ::= "" | r s` with `r` nullable: repetition written as recursion,
    as xgrammar writes `*` itself) is the same hazard."""
    rules = _rules(_tokens(grammar))
    nullable = _nullable(rules)
    derives = {}
    for name, body in rules.items():
        walk = _Walk(body, nullable)
        derives[name] = walk.alternatives()[1]
        if walk.hazard:
            return walk.hazard
    cycle = _cycle(derives)
    if cycle is None:
        return None
    return f"{cycle[0]} derives itself, {' -> '.join(cycle)}, beside only what can match nothing"[:120]


def root_nullable(grammar: str) -> bool:
    """Whether the grammar's `root` can match nothing (a structural tag's part that may be empty)."""
    return "root" in _nullable(_rules(_tokens(grammar)))


def is_lark(grammar: str) -> bool:
    """vLLM 0.32's test (`grammar_is_likely_lark`): no line with `::=` once comments are cut."""
    for line in grammar.split("\n"):
        line = line.split("#", 1)[0].split("//", 1)[0].strip()
        if "::=" in line:
            return False
    return True


class Refused(ValueError):
    """A part of a structured output rollq does not pass on: `field` names it, `why` says why."""

    def __init__(self, field: str, why: str):
        super().__init__(f"{field}: {why}")
        self.field, self.why = field, why


class StructuralTag:
    """vLLM 0.32's structural tag (xgrammar 0.2.8's format tree, or vLLM's older `structures` +
    `triggers`), walked part by part: every regex, grammar and JSON schema in it goes to the
    caller's check of that kind (`regex`, `grammar`, `schema`: each raises on what it refuses),
    a repetition (`star`, `plus`, `repeat`) of a part that can match nothing is refused as in a
    grammar, tags that repeat must each begin with something, and a part of a type not listed
    here is refused rather than passed on unchecked. Nesting is bounded before (the caller's
    JSON nesting check), so the walk's recursion is too."""

    def __init__(self, regex, grammar, schema):
        self.regex, self.grammar, self.schema = regex, grammar, schema

    def check(self, spec: Any, field: str) -> None:
        if not isinstance(spec, dict):
            raise Refused(field, "must be a JSON object")
        if "structures" in spec:  # vLLM's older form (what vLLM tests first, too)
            structures, triggers = spec.get("structures"), spec.get("triggers")
            if not isinstance(structures, list) or not isinstance(triggers, list):
                raise Refused(field, "`structures` and `triggers` must be lists")
            for i, s in enumerate(structures):
                where = f"{field}.structures[{i}]"
                if not isinstance(s, dict) or not all(isinstance(s.get(k), str) for k in ("begin", "end")):
                    raise Refused(where, "must have string `begin` and `end` and a `schema`")
                self.schema(s.get("schema"), f"{where}.schema")
            if not all(isinstance(t, str) and t for t in triggers):
                raise Refused(f"{field}.triggers", "must be non-empty strings")
            return
        if spec.get("type") != "structural_tag" or "format" not in spec:
            raise Refused(field, 'must be {"type": "structural_tag", "format": {...}} or have '
                                 '`structures` and `triggers`')
        self.format(spec["format"], f"{field}.format")

    def format(self, node: Any, field: str) -> bool:
        """Check one part and the parts in it; whether it can match nothing."""
        if not isinstance(node, dict) or not isinstance(node.get("type"), str):
            raise Refused(field, "must be an object with a string `type`")
        kind = node["type"]
        check = getattr(self, "_" + kind, None) if kind in _FORMATS else None
        if check is None:
            raise Refused(f"{field}.type", f"{kind[:40]!r} is not a part rollq checks; use "
                                           f"{', '.join(sorted(_FORMATS))}")
        return check(node, field)

    def _parts(self, node: dict, key: str, field: str) -> list[bool]:
        parts = node.get(key)
        if not isinstance(parts, list):
            raise Refused(f"{field}.{key}", "must be a list")
        return [self.format(part, f"{field}.{key}[{i}]") for i, part in enumerate(parts)]

    @staticmethod
    def _text(node: dict, key: str, field: str) -> str:
        value = node.get(key)
        if not isinstance(value, str):
            raise Refused(f"{field}.{key}", "must be a string")
        return value

    def _const_string(self, node: dict, field: str) -> bool:
        return self._text(node, "value", field) == ""

    def _regex(self, node: dict, field: str) -> bool:
        return self.regex(self._text(node, "pattern", field), f"{field}.pattern")

    def _grammar(self, node: dict, field: str) -> bool:
        text = self._text(node, "grammar", field)
        self.grammar(text, f"{field}.grammar")
        return root_nullable(text)

    def _json_schema(self, node: dict, field: str) -> bool:
        self.schema(node.get("json_schema"), f"{field}.json_schema")
        return node.get("style", "json") != "json"  # (an XML object's parameters may be none)

    _qwen_xml_parameter = _json_schema

    def _any_text(self, node: dict, field: str) -> bool:
        return True

    def _token(self, node: dict, field: str) -> bool:
        return False

    _exclude_token = _any_tokens = _any_text

    def _sequence(self, node: dict, field: str) -> bool:
        return all(self._parts(node, "elements", field))

    def _or(self, node: dict, field: str) -> bool:
        return any(self._parts(node, "elements", field))

    def _tag(self, node: dict, field: str) -> bool:
        empty = self.format(node.get("content"), f"{field}.content")
        begin, end = node.get("begin"), node.get("end")
        ends = end if isinstance(end, list) else [end]
        return begin == "" and empty and "" in ends

    def _tags(self, node: dict, field: str) -> bool:
        """Tags that may repeat: each must begin with something, or the repetition could match
        nothing at each turn."""
        tags = node.get("tags")
        if not isinstance(tags, list):
            raise Refused(f"{field}.tags", "must be a list")
        for i, tag in enumerate(tags):
            where = f"{field}.tags[{i}]"
            if not isinstance(tag, dict) or tag.get("type", "tag") != "tag":
                raise Refused(where, "must be a tag")
            if tag.get("begin") in ("", None):
                raise Refused(f"{where}.begin", "must not be empty: the tags repeat")
            self._tag(tag, where)
        return not node.get("at_least_one", False)

    _triggered_tags = _token_triggered_tags = _tags_with_separator = _tags

    def _optional(self, node: dict, field: str) -> bool:
        self.format(node.get("content"), f"{field}.content")
        return True

    def _repeated(self, node: dict, field: str, at_most: Any) -> bool:
        empty = self.format(node.get("content"), f"{field}.content")
        if empty and (at_most == -1 or not isinstance(at_most, int) or at_most > 1):
            raise Refused(f"{field}.content", "can match nothing and is repeated, which costs the "
                                              "engine time that grows with every token; make the "
                                              "repeated part match at least one character")
        return empty

    def _star(self, node: dict, field: str) -> bool:
        self._repeated(node, field, -1)
        return True

    def _plus(self, node: dict, field: str) -> bool:
        return self._repeated(node, field, -1)

    def _repeat(self, node: dict, field: str) -> bool:
        empty = self._repeated(node, field, node.get("max"))
        return empty or node.get("min") == 0

    def _dispatch(self, node: dict, field: str) -> bool:
        rules = node.get("rules")
        if not isinstance(rules, list):
            raise Refused(f"{field}.rules", "must be a list")
        for i, rule in enumerate(rules):
            where = f"{field}.rules[{i}]"
            if not isinstance(rule, list) or len(rule) != 2 or rule[0] in ("", None):
                raise Refused(where, "must be [a non-empty pattern, a part]")
            self.format(rule[1], f"{where}[1]")
        return True

    _token_dispatch = _dispatch


_FORMATS = {"const_string", "regex", "grammar", "json_schema", "qwen_xml_parameter", "any_text", "token",
            "exclude_token", "any_tokens", "sequence", "or", "tag", "triggered_tags",
            "token_triggered_tags", "tags_with_separator", "optional", "star", "plus", "repeat",
            "dispatch", "token_dispatch"}
"""xgrammar 0.2.8's part types (`xgrammar.structural_tag.Format`), each with its check above."""
