"""`draftsmith serve`: the runtime as an OpenAI-compatible HTTP server with continuous batching.

Needs the `serve` extra (FastAPI, uvicorn, sse-starlette, prometheus_client). SIGTERM stops taking
connections, lets running requests finish (at most --shutdown-timeout seconds) and exits 0.
"""

from __future__ import annotations

import argparse
import signal
import sys

from draftsmith.common import add_adaptive_arg, add_target_args, resolve_device, resolve_dtype
from draftsmith.speculative.errors import InvalidInputError


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve the target (with a drafter) behind an OpenAI-compatible API",
                       description="POST /v1/completions and /v1/chat/completions (stream: true for server-sent "
                                   "events), GET /v1/models, /health and /metrics (Prometheus). Requests join "
                                   "and leave the running batch between speculative rounds; outputs are exact.")
    add_target_args(p)
    p.add_argument("--drafter", default=None,
                   help="a draft model (directory, .gguf, hub id), early-exit:N, ngram, ...; omit to decode plainly")
    p.add_argument("--allow-target-mismatch", action="store_true",
                   help="use a drafter trained for another target anyway (exact, but likely slow)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="the model name clients send (default: --target)")
    p.add_argument("--max-batch", type=int, default=16, help="most requests decoding at once")
    p.add_argument("--kv-budget", type=int, default=None,
                   help="most KV cache tokens reserved by running requests (prompt + max_tokens + D each); "
                        "requests wait in a queue beyond it (default: no limit)")
    p.add_argument("--draft-len", type=int, default=4, help="draft tokens per round (D); a request may ask for fewer")
    p.add_argument("--draft-confidence", type=float, default=0.0, help="see `draftsmith generate`")
    p.add_argument("--draft-alternatives", type=int, default=0, help="see `draftsmith generate`")
    p.add_argument("--leaf-min-prob", type=float, default=0.0, help="see `draftsmith generate`")
    add_adaptive_arg(p, default=True)
    p.add_argument("--default-max-tokens", type=int, default=256,
                   help="chat requests without max_tokens generate at most this many (within the context window)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds running requests may take to finish after SIGTERM")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from draftsmith.speculative.server import create_app, serving_for
    except ImportError as err:
        raise InvalidInputError(f"draftsmith serve needs the serve extra (pip install 'draftsmith[serve]'): {err}") from None
    from draftsmith.speculative.drafters import load_drafter
    from draftsmith.speculative.loading import load_model
    from draftsmith.speculative.options import DecodeOptions

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    options = DecodeOptions(draft_len=args.draft_len, draft_confidence=args.draft_confidence,
                            draft_alternatives=args.draft_alternatives, leaf_min_prob=args.leaf_min_prob,
                            adaptive=args.adaptive_draft, verify_cost=args.verify_cost,
                            round_cost=args.round_cost)
    target = load_model(args.target, device=device, dtype=dtype)
    proposer, _ = load_drafter(args.drafter, target, device=device, dtype=dtype,
                              allow_target_mismatch=args.allow_target_mismatch)
    serving = serving_for(target, proposer, options, max_batch=args.max_batch, kv_budget=args.kv_budget,
                          model_name=args.served_model_name, default_max_tokens=args.default_max_tokens,
                          drain_s=args.shutdown_timeout)
    config = uvicorn.Config(create_app(serving), host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout)
    # uvicorn drains on SIGTERM, then raises the signal again for the handler it found: an ignored
    # signal, so a drained server exits 0.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print(f"serving {serving.model_name} (drafter: {args.drafter or 'none'}) on http://{args.host}:{args.port}",
          file=sys.stderr, flush=True)
    uvicorn.Server(config).run()
    return 0
