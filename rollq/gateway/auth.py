"""Bearer tokens → (trainer, allowed policies).

The token file is JSON: `{"<token>": {"trainer": "run-7", "policies": ["math", "code"],
"scopes": ["rollouts", "publish"]}}` (`"*"` allows every policy). Scopes say what a token may
do (`SCOPES`); without `scopes` a token may only do rollouts. Tokens are kept only as sha256
digests in memory. With no token file the gateway refuses to start unless told `--no-auth`,
which maps every request to the trainer `anonymous` with every policy and every scope (for a
gateway on loopback, e.g. the demo).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import msgspec
from aiohttp import web

from rollq.gateway.http import ApiError
from rollq.protocol import InvalidInput, check_id


SCOPES = {
    "rollouts": "submit, read and acknowledge results, cancel, completions, see versions and workers",
    "publish": "publish policy versions (whoever publishes decides what every trainer samples from)",
    "observe": "/metrics, the dashboard's data, and in /status and /workers every trainer's names, "
               "counts and the workers' errors and failure reasons",
}


class Principal(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    trainer: str
    policies: list[str]
    scopes: list[str] = msgspec.field(default_factory=lambda: ["rollouts"])

    def may_use(self, policy: str) -> bool:
        return "*" in self.policies or policy in self.policies

    def may(self, scope: str) -> bool:
        return scope in self.scopes

    def require(self, scope: str) -> None:
        """403 unless the token has `scope`."""
        if not self.may(scope):
            raise ApiError(403, f"this token of trainer {self.trainer!r} lacks the scope {scope!r} "
                                f"({SCOPES[scope]}); add it to the token's \"scopes\" in the token file",
                           "scopes")


ANONYMOUS = Principal("anonymous", ["*"], list(SCOPES))


class Tokens:
    def __init__(self, by_token: dict[str, Principal] | None):
        """None: no authentication (every request is ANONYMOUS)."""
        self._open = by_token is None
        self._by_digest = {_digest(t): p for t, p in (by_token or {}).items()}

    @classmethod
    def load(cls, path: str | Path) -> Tokens:
        try:
            raw = msgspec.json.decode(Path(path).read_bytes(), type=dict[str, Principal])
        except (OSError, msgspec.DecodeError) as e:
            raise InvalidInput("tokens", f"cannot read token file {path}: {e}") from None
        for token, principal in raw.items():
            if len(token) < 16:
                raise InvalidInput("tokens", f"a token of {principal.trainer!r} is shorter than 16 "
                                             "characters; use long random tokens")
            check_id("trainer", principal.trainer)
            for scope in principal.scopes:
                if scope not in SCOPES:
                    raise InvalidInput("tokens", f"a token of {principal.trainer!r} has the unknown "
                                                 f"scope {scope!r}; scopes are {sorted(SCOPES)}")
        return cls(raw)

    def principal(self, request: web.Request) -> Principal:
        if self._open:
            return ANONYMOUS
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ApiError(401, "missing bearer token: send 'Authorization: Bearer <token>'")
        principal = self._by_digest.get(_digest(token.strip()))
        if principal is None:
            raise ApiError(401, "invalid bearer token")
        return principal


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def allowed(principal: Principal, policy: str) -> str:
    """The policy name, checked; 403 when the token may not use it."""
    try:
        check_id("policy", policy)
    except InvalidInput as e:
        raise ApiError(400, str(e), "policy") from None
    if not principal.may_use(policy):
        raise ApiError(403, f"trainer {principal.trainer!r} may not use policy {policy!r}", "policy")
    return policy
