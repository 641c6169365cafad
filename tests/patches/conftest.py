# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
import shutil
from pathlib import Path

import pytest


@pytest.fixture
def scratch(repo, tmp_path) -> Path:
    """A scratch project root: a copy of the pin, the patches and their docs
    (what the series checker and the rebase tool read and write)."""
    root = tmp_path / "root"
    root.mkdir()
    shutil.copy(repo / "upstream.toml", root)
    shutil.copytree(repo / "patches", root / "patches")
    (root / "docs").mkdir()
    shutil.copy(repo / "docs" / "patches.md", root / "docs")
    return root
