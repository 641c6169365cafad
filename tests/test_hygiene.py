# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The suite stands on its own: the user's environment and CPU set do not
change what it sees."""

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_the_users_afd_environment_does_not_leak_in(tmp_path):
    """The README's first line (`export VLLM_AFD_TOKEN=...`) and another
    server's status directory in the shell: the socket-level tests, which
    connect without a secret, still pass."""
    env = dict(os.environ, VLLM_AFD_TOKEN="a-secret-of-the-users-own-0123456789",
               VLLM_AFD_STATUS_DIR=str(tmp_path / "elsewhere"))
    # -P: `python -m` would put the checkout (and its vllm/ tree) first on sys.path.
    proc = subprocess.run([sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/afd/transport/test_frames_fuzz.py",
                           "-k", "bad_handshake or bad_frame"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert " passed" in proc.stdout


def test_no_fixed_core_numbers():
    """Processes are bound to CPUs from the allowed set (servers.cpu), never
    to literal core numbers a container may not have."""
    pattern = re.compile(r"THREADS_BIND[\"']?\s*[:=]\s*[\"'][0-9|,-]+[\"']|taskset -c [0-9]")
    offenders = [f"{p.relative_to(REPO)}:{n}" for d in ("tests", "tools", "benchmarks")
                 for p in (REPO / d).rglob("*.py")
                 for n, line in enumerate(p.read_text().splitlines(), 1)
                 if pattern.search(line)]
    assert offenders == [], offenders
    sys.path.insert(0, str(REPO / "tools" / "serving"))
    from servers import cpu

    allowed = {str(c) for c in os.sched_getaffinity(0)}
    assert {cpu(i) for i in range(4)} <= allowed


def test_no_test_module_imports_another():
    """What tests share lives in tests/helpers/: a test module imported by
    another runs its module-level code twice under two names and ties the
    two files' fixtures and parametrisations together."""
    import ast

    tests = Path(__file__).resolve().parent
    modules = {p.stem for p in tests.rglob("test_*.py")}
    found = []
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.relative_to(tests)}:{node.lineno} imports {name}"
                      for name in names if name.split(".")[-1] in modules]
    assert not found, "\n".join(found)
