# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""A lost FFN fails requests, not the attention server.

Upstream vLLM treats any exception from the model as fatal: the engine dies
and every request with it. On the attention role the model's mlp layers are a
network away, so losing them is an expected event. The attention link raises
AFDLinkDown for it (attention/link.py); two seams turn that into request errors:

- EngineCore.step_fn (engine core process) is `guard_step` around upstream's
  step, or step_with_batch_queue when several batches are in flight (async
  scheduling, pipeline parallel): on AFDLinkDown, `fail_step` finishes every
  in-flight request with FINISHED_ERROR, returns their outputs and keeps the
  engine running. The next steps are served as soon as the link is back (the
  supervisor in attention/link.py reconnects); until then they fail the same way,
  at once, without touching the FFN.
- The OpenAI serving layer (API server process): `raise_if_link_failed` turns
  such a request's "error" finish into HTTP 503 with the link's reason,
  instead of upstream's "Internal server error" 500.

The request ids failed this way are published (attention/status.py) so the
API server process can tell them from other errors.
"""

import functools
import time
from collections import defaultdict, deque
from collections.abc import Callable

from vllm.afd.attention import status as link_status
from vllm.afd.transport.errors import LINK_DOWN_MARKER as MARKER
from vllm.afd.transport.errors import AFDLinkDown
from vllm.logger import init_logger

logger = init_logger(__name__)

# Failed request ids remembered for the API server (most recent first out).
MAX_REMEMBERED = 512


def is_link_error(error: BaseException) -> bool:
    """AFDLinkDown, also when an executor re-raised it as text (the
    multiprocessing executor wraps worker exceptions in RuntimeError)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, AFDLinkDown) or MARKER in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def link_error_text(error: BaseException) -> str:
    text = str(error)
    start = text.find(MARKER)
    text = text[start + len(MARKER):] if start >= 0 else text
    return text.strip().strip("'\"").strip()


_failed: deque = deque(maxlen=MAX_REMEMBERED)


def guard_step(engine_core, step: Callable[[], tuple]) -> Callable[[], tuple]:
    """EngineCore.step_fn: `step` itself unless this engine is the AFD attention
    role; there, `step` with a lost FFN turned into failed requests."""
    afd = getattr(engine_core.vllm_config, "afd_config", None)
    if afd is None or afd.role != "attention":
        return step

    @functools.wraps(step)
    def guarded() -> tuple:
        try:
            return step()
        except Exception as e:
            if not is_link_error(e):
                raise
            return fail_step(engine_core, e), True

    return guarded


def fail_step(engine_core, error: BaseException) -> dict:
    """EngineCore.step's outputs for a step that lost the FFN: every running
    request finishes with FINISHED_ERROR (its KV blocks are freed and the model
    runner drops it at the next step, as for an abort). All of them were in
    flight: on the batch-queue path several batches are, and the ones not yet
    back would fail the same way; a request already finished is skipped."""
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.request import RequestStatus

    scheduler = engine_core.scheduler
    text = link_error_text(error)
    request_ids = [request.request_id for request in scheduler.running]
    failed = scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ERROR)
    per_client: dict[int, list] = defaultdict(list)
    for request in failed:
        per_client[request.client_index].append(EngineCoreOutput(
            request_id=request.request_id, new_token_ids=[],
            finish_reason=request.get_finished_reason(), events=request.take_events(),
            trace_headers=request.trace_headers))
    outputs = {client: EngineCoreOutputs(outputs=outs) for client, outs in per_client.items()}
    finished = scheduler.finished_req_ids_dict
    if finished:  # as Scheduler.update_from_output reports finished ids
        for client, ids in finished.items():
            outputs.setdefault(client, EngineCoreOutputs()).finished_requests = ids
        finished.clear()
    logger.error("AFD: step failed, %d request(s) finished with an error (%s); the engine "
                 "keeps serving", len(failed), text)
    now = time.time()
    _failed.extend((request.request_id, now) for request in failed)
    engine = getattr(engine_core, "engine_index", 0)
    link_status.publish(f"failed-e{engine}", {"error": text, "at": now,
                                              "request_ids": [r for r, _ in _failed]})
    return outputs


def raise_if_link_failed(request_id: str) -> None:
    """API server: raise RetryableRequestError (HTTP 503) with the link's
    reason when request_id failed because the FFN was lost."""
    from vllm.exceptions import RetryableRequestError

    for document in link_status.read_all("failed-"):
        if any(engine_id.startswith(request_id) for engine_id in document["request_ids"]):
            raise RetryableRequestError(
                f"AFD: the FFN server is unavailable: {document['error']}. The request "
                f"was not completed; retry it.")
