"""`rollq scorer` processes for the scoring tests, with their logs kept for a failing test."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from rollq.children import stop_child

REWARDS = str(Path(__file__).with_name("scoring_rewards.py"))


class ScorerProcess:
    def __init__(self, redis_url: str, policy: str, log_dir: Path, scorer_id: str,
                 rewards: str = REWARDS, env: dict | None = None, **flags):
        self.scorer_id = self.worker_id = scorer_id  # (worker_id: conftest's failure report)
        self.log_path = log_dir / f"{scorer_id}.log"
        args = [sys.executable, "-m", "rollq", "scorer", "--redis-url", redis_url, "--policy", policy,
                "--rewards", rewards, "--scorer-id", scorer_id]
        for name, value in flags.items():
            flag = f"--{name.replace('_', '-')}"
            args += [flag] if value is True else [flag, str(value)]
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in close())
        env = os.environ | {"COLUMNS": "200", "PYTHONUNBUFFERED": "1"} | (env or {})
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    @property
    def log(self) -> str:
        return self.log_path.read_text()

    def report(self) -> str:
        code = self.proc.poll()
        return (f"scorer {self.scorer_id}: {'running' if code is None else f'exited {code}'}\n"
                + "\n".join(self.log.splitlines()[-60:]))

    def close(self) -> None:
        stop_child(self.proc, 0)  # SIGKILL, its reward processes too
        self._log.close()


@pytest.fixture
def spawn_scorer(request, redis_url, policy, tmp_path):
    """create(scorer_id=None, env=None, **flags) -> a running `rollq scorer`, killed at teardown
    (a failing test shows each one's log tail, as conftest shows spawned workers')."""
    made: list[ScorerProcess] = []

    def create(scorer_id: str | None = None, **flags) -> ScorerProcess:
        p = ScorerProcess(redis_url, policy, tmp_path, scorer_id or f"s-{uuid.uuid4().hex[:6]}", **flags)
        made.append(p)
        if not hasattr(request.node, "spawned_workers"):
            request.node.spawned_workers = []
        request.node.spawned_workers.append(p)
        return p

    yield create
    for p in made:
        p.close()
