"""The CLI's options are the settings classes' fields: same names, same defaults (one copy)."""

from __future__ import annotations

import msgspec
import pytest

from rollq import cli
from rollq.config import GatewaySettings, VLLMSettings, WorkerSettings


@pytest.mark.parametrize("command, classes", [(cli.gateway, [GatewaySettings]),
                                              (cli.worker, [WorkerSettings, VLLMSettings])])
def test_every_settings_field_is_an_option_with_the_settings_default(command, classes):
    options = {p.name: p for p in command.params}
    for cls in classes:
        for field in msgspec.structs.fields(cls):
            assert field.name in options, f"{cls.__name__}.{field.name} has no option"
            if field.default is msgspec.NODEFAULT or isinstance(field.default, list):
                continue  # a default_factory (computed at start) or a repeatable option
            assert options[field.name].default == field.default, field.name


def test_gateway_options_parse_into_its_settings(tmp_path):
    ctx = cli.gateway.make_context("gateway", [
        "--no-auth", "--policy", "a", "--policy", "b", "--weight-root", str(tmp_path),
        "--port", "0", "--max-outstanding", "7", "--public-observe"])
    params = dict(ctx.params)
    settings = GatewaySettings(policies=list(params.pop("policies")), weight_store=str(tmp_path),
                               weight_roots=list(params.pop("weight_roots")),
                               **{k: v for k, v in params.items() if k != "weight_store"}).validate()
    assert settings.no_auth and settings.public_observe and settings.port == 0
    assert settings.policies == ["a", "b"] and settings.weight_roots == [tmp_path.resolve()]
    assert settings.max_outstanding == 7 and not settings.require_durable
