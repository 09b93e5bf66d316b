"""A local web page for a training run: play against a checkpoint, see what the policy thinks, watch it learn.

  board_text  the 9-character board strings of the page and the API (x / o / .), validated on the host
  policy      the jitted model work: the decision-token heat map and the model's reply through the rollout
  run_dir     read-only view of a workdir: config, checkpoint steps (warm start = step 0), params, metrics
  service     the page's operations (LRU of restored params, one lock around model calls, clear errors)
  app         the FastAPI app over `service`, serving the static page in `static/`

Started by `python -m experiments.play --workdir=W`.
"""
