"""The rewards of `rollq demo`, as its `rollq scorer` runs them (`--rewards
rollq.harness.demo_rewards`): operator code in the package, so an installed rollq can run them.

`even`: the share of a completion's tokens that are even, `examples/async_grpo.py`'s task (its
`reward`; tests/test_demo.py checks the two agree). `even_long_tail`: the same value after a
wait of 0-2 s, long-tailed, as a code sandbox or a judge model takes: what `rollq demo
--long-tail-reward` runs in the scorers or in the trainer, side by side.

Both are async: a wait in the scorer's event loop costs it nothing, so one scorer process runs
many at once (a sync reward would hold one of its child processes for the whole wait).
"""

from __future__ import annotations

import asyncio
import zlib

from rollq.scoring import Completion, reward

EOS = 2
"""The demo model's end-of-sequence id (examples/async_grpo.py `EOS`): not an answer token."""
TAIL_S = 2.0
"""The longest wait of `even_long_tail`."""


def even_share(tokens: list[int]) -> float:
    body = [t for t in tokens if t != EOS]
    return sum(t % 2 == 0 for t in body) / len(body) if body else 0.0


def tail_s(tokens: list[int]) -> float:
    """A wait in [0, TAIL_S], long-tailed (TAIL_S * u^4: mean 0.4 s, one in six over 1 s) and a
    function of the tokens, so a run with the reward in the trainer waits exactly as long per
    sample as one with it in the scorers."""
    u = zlib.crc32(b"".join(t.to_bytes(4, "little") for t in tokens)) / 2**32
    return TAIL_S * u ** 4


async def even_after_a_wait(tokens: list[int]) -> float:
    await asyncio.sleep(tail_s(tokens))
    return even_share(tokens)


@reward("even", version="1", timeout_s=10)
async def even(completion: Completion, inputs) -> float:
    return even_share(completion.tokens)


@reward("even_long_tail", version="1", timeout_s=10)
async def even_long_tail(completion: Completion, inputs) -> float:
    return await even_after_a_wait(completion.tokens)
