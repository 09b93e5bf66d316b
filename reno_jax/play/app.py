"""FastAPI app of the play page: the static page and its JSON API over a `service.PlayService`.

  GET  /                       the page (static/index.html; its JS and CSS under /static)
  GET  /api/run                workdir, env, view ("board", "puzzle" or "transcript"), the board's geometry, input
                               kind, symbols and sides (`board`, null otherwise), the puzzle's geometry, symbols,
                               moves (labels, keys), move budget and suites (`puzzle`, null otherwise), the
                               suites, saved checkpoint steps (0 = warm start), training or finished
  GET  /api/policy?board=...&step=N[&sampled=true&seed=S]
                               board or puzzle view: {"probs": [num_actions], "mass", "best": [actions], "action",
                                "label", "text", "verdict", "tool_response", ...}: the policy at the decision token
                                and the model's reply
  POST /api/play               board view: {"board", "action" (0-based, or null: the model moves first), "step",
                               "sampled"} -> the board after the person's and the model's moves, the status, the
                               model's turn
  GET  /api/puzzle?suite=NAME&index=K   (suite: default the first)
                               puzzle view: {"board", "moves": 0, "max_moves", "status", "moves_to_solve", "best"}
  POST /api/puzzle/move        puzzle view: {"board", "action", "moves"} -> the person's move: the position after it
                               (`moves` + 1, "status": ongoing / solved / out_of_moves, "moves_to_solve": null when
                               it cannot be solved any more) and whether it was "blocked"
  POST /api/puzzle/model       puzzle view: {"board", "moves", "step", "sampled", "seed"} -> the model's move (`model`:
                               as /api/policy) and the position after it
  POST /api/puzzle/solve       puzzle view: the same body -> the model plays on to the end (the environment's episode
                               with `moves` of its budget made): each turn's move, text, board after it, reward and
                               tool response, why it "ended", the final position
  GET  /api/episode?step=N&suite=NAME&episode=K[&sampled=true&seed=S]
                               any environment: one episode (suite "sampler": the run's training sampler) as chat
                               messages with each step's reward
  GET  /api/metrics?since=N    metrics.jsonl rows after step N, the numeric keys and the default curves

Every error is JSON `{"error": "..."}` with a 4xx/5xx status; no request can take the server down. The model
endpoints are plain `def`s, so FastAPI runs them in its thread pool and the event loop keeps answering (metrics
polls included) while the model works.
"""

from __future__ import annotations

import logging
import os

import fastapi
import pydantic
from fastapi import exceptions, responses, staticfiles

from reno_jax.play import service as service_lib

STATIC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")


class PlayRequest(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")  # a misspelt field is an error, not a silent default

    board: str | None = None  # None: the empty board
    action: int | None = None
    step: int | None = None
    sampled: bool = False
    seed: int = 0


class PuzzleMoveRequest(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    board: str
    action: int
    moves: int = 0  # made before this one


class PuzzleModelRequest(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    board: str
    moves: int = 0  # made so far (the model's episode counts them against the budget)
    step: int | None = None
    sampled: bool = False
    seed: int = 0


def _error(status: int, message: str) -> responses.JSONResponse:
    return responses.JSONResponse({"error": message}, status_code=status)


def create_app(service: service_lib.PlayService) -> fastapi.FastAPI:
    app = fastapi.FastAPI(title="reno_jax play", docs_url="/api/docs", redoc_url=None)
    app.mount("/static", staticfiles.StaticFiles(directory=STATIC_DIR), name="static")

    @app.exception_handler(service_lib.PlayError)
    async def _play_error(request, exc: service_lib.PlayError):
        return _error(exc.status, exc.message)

    @app.exception_handler(exceptions.RequestValidationError)
    async def _bad_request(request, exc: exceptions.RequestValidationError):
        parts = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err.get("loc", ()) if p not in ("query", "body"))
            parts.append(f"{where}: {err.get('msg', 'invalid')}" if where else err.get("msg", "invalid"))
        return _error(400, "bad request: " + "; ".join(parts))

    @app.exception_handler(Exception)
    async def _internal(request, exc: Exception):
        logging.exception("request %s failed", request.url)
        return _error(500, f"internal error: {type(exc).__name__}: {exc}")

    @app.get("/", include_in_schema=False)
    def index():
        return responses.FileResponse(os.path.join(STATIC_DIR, "index.html"))

    @app.get("/api/run")
    def run_info():
        return service.info()

    @app.get("/api/policy")
    def policy(board: str, step: int | None = None, sampled: bool = False, seed: int = 0):
        return service.policy(board, step, sampled=sampled, seed=seed)

    @app.post("/api/play")
    def play(request: PlayRequest):
        board = request.board if request.board is not None else service.empty_board()
        return service.play(board, request.action, request.step, sampled=request.sampled, seed=request.seed)

    @app.get("/api/puzzle")
    def puzzle(suite: str | None = None, index: int = 0):
        return service.puzzle(suite, index)

    @app.post("/api/puzzle/move")
    def puzzle_move(request: PuzzleMoveRequest):
        return service.puzzle_move(request.board, request.action, request.moves)

    @app.post("/api/puzzle/model")
    def puzzle_model(request: PuzzleModelRequest):
        return service.puzzle_model(
            request.board, request.moves, request.step, sampled=request.sampled, seed=request.seed
        )

    @app.post("/api/puzzle/solve")
    def puzzle_solve(request: PuzzleModelRequest):
        return service.puzzle_solve(
            request.board, request.moves, request.step, sampled=request.sampled, seed=request.seed
        )

    @app.get("/api/episode")
    def episode(
        step: int | None = None,
        suite: str = service_lib.SAMPLER,
        episode: int = 0,
        sampled: bool = False,
        seed: int = 0,
    ):
        return service.episode(step, suite, episode, sampled=sampled, seed=seed)

    @app.get("/api/metrics")
    def metrics(since: int = 0):
        return service.metrics(since)

    return app
