# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""What a module fixture must build for the tests this run selected.

A family matrix runs every family of a module in one process (one start), as a
module-scoped fixture; `make test` runs part of some matrices and `make
test-full` all of them (the `full` marker, pyproject.toml). The fixture builds
the families whose tests were selected, not the whole list: on a 2-core CI
host a family's plain and AFD runs cost ~10 s of a worker, and the matrices
were a third of the suite."""

import pytest


def selected(request: pytest.FixtureRequest, argname: str, universe,
             tests: tuple[str, ...]) -> list:
    """The values of `argname` taken by this run's selected tests named in
    `tests` (test functions of the requesting fixture's module), in
    `universe`'s order."""
    module = request.module.__name__
    values = set()
    for item in request.session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if (getattr(item, "module", None) is not None and item.module.__name__ == module
                and item.originalname in tests and argname in params):
            values.add(params[argname])
    return [v for v in universe if v in values]
