# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""`--afd-role` / `--afd-config`: the AFDConfig argument group of vllm's CLI."""

import argparse
import json
from dataclasses import fields
from typing import Any

from vllm.afd.adapter.config import AFDConfig


def _json_object(value: str) -> dict[str, Any]:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {value!r}") from e
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r}")
    return parsed


def add_afd_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add the AFDConfig group; its help text comes from AFDConfig's docstrings."""
    from vllm.engine.arg_utils import get_kwargs

    kwargs = get_kwargs(AFDConfig)
    keys = "; ".join(
        f"{f.name} (default {f.default!r})" if f.default is not f.default_factory
        else f.name for f in fields(AFDConfig))  # noqa: E501
    group = parser.add_argument_group(
        title="AFDConfig",
        description=(AFDConfig.__doc__ or "") + f" --afd-config keys: {keys}.")
    role = kwargs["role"]
    role["default"] = None
    group.add_argument("--afd-role", **role)
    group.add_argument(
        "--afd-config", type=_json_object, default=None,
        help="AFD settings as a JSON object, e.g. '{\"host\": \"10.0.0.2\", "
             "\"port\": 7700, \"connector\": \"tcp\"}'. afd-plugin's "
             "--additional-config '{\"afd\": {...}}' is accepted too.")
