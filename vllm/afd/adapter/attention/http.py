# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The attention server's HTTP surface for AFD (a seam in the API server's
middleware registration).

- /health answers 503 with the reason while any attention rank's link to its
  FFN is not up (starting, connecting, lost, refused); otherwise vLLM's own
  health check decides.
- Generation requests get an immediate 503 with that reason, in the OpenAI
  error format, instead of a queue wait or an opaque 500; they are not
  admitted, so nothing is lost. Tokenization, model listing and admin
  routes stay available.
- GET /afd/status: each rank's link document (state, peer, last error and
  the counters), as the FFN server has one too.
- /metrics gains the vllm_afd_* families (vllm.afd.observability.metrics).

The link itself runs in the engine processes; vllm.afd.attention.status carries
its state here.
"""

from vllm.afd.attention import status as link_status
from vllm.logger import init_logger

logger = init_logger(__name__)

# POST routes that need the model (and so the FFN): the OpenAI and vLLM
# generation and pooling APIs.
_GATED_PREFIXES = ("/v1/completions", "/v1/chat/completions", "/v1/responses",
                   "/v1/embeddings", "/v1/score", "/v1/rerank", "/v1/audio", "/v1/messages",
                   "/v2/rerank", "/pooling", "/classify", "/score", "/rerank", "/generate",
                   "/inference/")


def is_gated(method: str, path: str) -> bool:
    return method == "POST" and path.startswith(_GATED_PREFIXES)


def install(app, args) -> None:
    """Add the AFD health gate, status route and metrics to an attention
    server's FastAPI app (no-op unless args ask for the AFD attention role)."""
    from vllm.afd.adapter.config import AFDConfig

    afd = AFDConfig.from_cli(getattr(args, "afd_config", None), getattr(args, "afd_role", None),
                             getattr(args, "additional_config", None))
    if afd is None or not afd.is_attention:
        return
    from fastapi import Request
    from fastapi.responses import JSONResponse, PlainTextResponse

    from vllm.afd.observability import metrics

    @app.middleware("http")
    async def afd_gate(request: Request, call_next):
        path = request.url.path
        if path == "/health" or is_gated(request.method, path):
            ready, reason = link_status.readiness()
            if not ready:
                if path == "/health":
                    return PlainTextResponse(reason, status_code=503)
                return JSONResponse(status_code=503, content={"error": {
                    "message": f"{reason}. The request was not started; retry later.",
                    "type": "ServiceUnavailableError", "param": None, "code": 503}})
        return await call_next(request)

    @app.get("/afd/status")
    async def afd_status():
        ready, reason = link_status.readiness()
        return {"role": "attention", "ready": ready, "reason": reason,
                "links": link_status.link_documents()}

    metrics.register("attention-links", link_status.link_documents)
    logger.info("AFD attention server: /health and generation requests follow the FFN "
                "link (status in %s)", link_status.status_dir())
