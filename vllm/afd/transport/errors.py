# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The errors the data plane raises, and the small helpers its messages use."""

from collections.abc import Callable
from typing import Any


class AFDConnectionError(RuntimeError):
    """The peer is unreachable, closed the connection, or reported an error."""


class AFDTimeoutError(AFDConnectionError, TimeoutError):
    """A peer did not answer within AFDConfig.timeout_s."""


class LinkClosed(Exception):
    """Raised by transports when the peer's end of a link is gone."""


class LinkTimeout(Exception):
    """Raised by transports when a deadline passes."""


WaitCallback = Callable[[], None]


class What:
    """A description formatted only when an error or a log line needs it: the
    per-layer calls pass one of these instead of paying for f-strings."""

    __slots__ = ("fmt", "args")

    def __init__(self, fmt: str, *args: Any) -> None:
        self.fmt, self.args = fmt, args

    def __str__(self) -> str:
        return self.fmt.format(*self.args)


# Text that marks a lost FFN in an exception that crossed a process boundary as
# text (vLLM's multiprocessing executor re-raises worker errors that way).
LINK_DOWN_MARKER = "[AFD link down]"


class AFDLinkDown(RuntimeError):
    """The attention role cannot reach its FFN server (not connected yet, or
    lost mid-step). The step's requests fail; the server keeps running."""

    def __init__(self, message: str) -> None:
        super().__init__(f"{LINK_DOWN_MARKER} {message}")


class StepAborted(AFDLinkDown):
    """A step whose connector checks its calls' outcomes once per step (a
    device-resident exchange: no host on the per-layer path) lost its member:
    the outputs it computed since are not the model's, so the step runs again
    whole on another member (AttentionLink.run_step), or, where the runner
    cannot repeat it, fails like any lost link."""


def error_kind(error: BaseException) -> str:
    """The metrics label of a link error: timeout, protocol or connection."""
    from vllm.afd.transport.wire import ProtocolError

    if isinstance(error, AFDTimeoutError):
        return "timeout"
    if isinstance(error, ProtocolError):
        return "protocol"
    return "connection"
