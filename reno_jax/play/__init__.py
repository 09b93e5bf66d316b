"""A local web page for a training run: play against a checkpoint, see what the policy thinks, watch it learn.

Generic over environments: one that declares a board view (`reno_jax.envs.interface.BoardView`) is played on
its board, one that declares a puzzle view (`interface.PuzzleView`) on its puzzles; any other is shown as
transcripts of its episodes.

  policy      the jitted model work: the decision-token heat map, the model's reply through the rollout, episodes
  run_dir     read-only view of a workdir: config, checkpoint steps (warm start = step 0), params, metrics
  service     the page's operations (LRU of restored params, one lock around model calls, clear errors)
  app         the FastAPI app over `service`, serving the static page in `static/`

Started by `python -m experiments.play --workdir=W`.
"""
