# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""`vllm serve MODEL --afd-role ffn`: the FFN engine behind a small HTTP surface.

/health (200 when every worker's FFN loop runs, 503 with the reason otherwise),
/metrics (Prometheus), /version and /afd/status (loop state and link
statistics); any other path answers 404 with a JSON error
saying this is an FFN server, so a misrouted client learns where to go.
"""

import argparse
import signal

from vllm.logger import init_logger

logger = init_logger(__name__)

FFN_SERVER_MESSAGE = (
    "This is a vllm-afd FFN server (--afd-role ffn): it runs the MLP/MoE layers for "
    "attention servers and serves no API requests. Send requests to the attention "
    "server (--afd-role attention).")


def is_ffn_role(args: argparse.Namespace) -> bool:
    """Whether `vllm serve` was asked for the FFN role (flag, JSON or afd-plugin form)."""
    from vllm.afd.adapter.config import AFDConfig

    cfg = AFDConfig.from_cli(getattr(args, "afd_config", None), getattr(args, "afd_role", None),
                             getattr(args, "additional_config", None))
    return cfg is not None and cfg.is_ffn


def build_app(engine):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    import vllm.afd
    from vllm import __version__ as vllm_version
    from vllm.afd.observability import metrics

    app = FastAPI(title="vllm-afd FFN server")
    # vllm_afd_* families on /metrics, read from the workers at each scrape.
    metrics.register("ffn-links", lambda: [w["link"] for w in engine.status() if "link" in w])

    @app.get("/health")
    def health():
        ok, reason = engine.health()
        return PlainTextResponse("" if ok else reason, status_code=200 if ok else 503)

    @app.get("/version")
    def version():
        return {"version": vllm_version, "afd_version": vllm.afd.__version__,
                "upstream_version": vllm.afd.UPSTREAM_VERSION, "role": "ffn"}

    @app.get("/afd/status")
    def afd_status():
        """Per-worker FFN loop state and cumulative link statistics
        (vllm.afd.observability.stats): what benchmarks read before and after a run."""
        try:
            return {"workers": engine.status()}
        except Exception as e:  # a dead worker
            return JSONResponse(status_code=503, content={"error": str(e)})

    @app.get("/metrics")
    def metrics():
        return PlainTextResponse(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    def not_here(path: str, request: Request):
        return JSONResponse(status_code=404, content={"error": {
            "message": FFN_SERVER_MESSAGE, "type": "NotFoundError", "code": 404,
            "path": "/" + path}})

    return app


def run_ffn_server(args: argparse.Namespace) -> None:
    import uvicorn

    from vllm.afd.adapter.ffn.engine import FFNEngine
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    engine_args = AsyncEngineArgs.from_cli_args(args)
    vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    engine = FFNEngine(vllm_config)
    # uvicorn shuts down on SIGINT/SIGTERM and then re-raises the signal to the
    # handler that was there before it; make that a no-op so the engine below is
    # shut down and the server exits 0, as plain `vllm serve` does.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        host = args.host or "0.0.0.0"
        logger.info("AFD FFN server HTTP on http://%s:%d (/health, /metrics, /version)",
                    host, args.port)
        uvicorn.run(build_app(engine), host=host, port=args.port, log_level="warning")
    finally:
        engine.shutdown()
        logger.info("AFD FFN server stopped")
