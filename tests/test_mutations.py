# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""tools/testing/mutations.py's list still fits the code (`make test-mutations` runs it):
every edit matches its file as it is, and every test it names exists."""

import ast
from pathlib import Path

import pytest

import mutations

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("m", mutations.MUTATIONS, ids=lambda m: m.name)
def test_the_mutation_fits_and_names_real_tests(m):
    text = mutations.target(m).read_text()
    assert mutations.mutated(text, m) != text
    for test in m.tests:
        file, _, name = test.partition("::")
        source = (REPO / file).read_text()
        if name:
            defined = {n.name for n in ast.walk(ast.parse(source))
                       if isinstance(n, ast.FunctionDef)}
            assert name.split("[")[0] in defined, test


def test_an_edit_that_no_longer_fits_is_an_error():
    m = mutations.MUTATIONS[0]
    with pytest.raises(ValueError, match="occurs 0 times"):
        mutations.mutated("nothing of it here\n", m)
    twice = mutations.Mutation("x", "", "repo", "f", (mutations.Edit("a", "b"),), ())
    with pytest.raises(ValueError, match="occurs 2 times"):
        mutations.mutated("a a", twice)
    second = mutations.Mutation("x", "", "repo", "f", (mutations.Edit("a", "b", nth=2),), ())
    assert mutations.mutated("a a a", second) == "a b a"
