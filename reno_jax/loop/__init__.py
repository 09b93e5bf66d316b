"""The loop as library calls: train, warm start, evaluate and load runs for any registered environment.

    from reno_jax import loop
    rows = loop.train(config, "workdir/run")                         # warm start + RL, checkpoints, curves
    config, tokenizer, model_config, params, step = loop.load_run("workdir/run")
    run = loop.load_checkpoint("workdir/run")                       # run.trained (a LoRA run's adapters), run.base
    warm = loop.load_warm_start("workdir/run")                      # what GSPO started from, as step 0
    results = loop.evaluate(params, model_config, tokenizer, config, key=jax.random.PRNGKey(0))

The command-line entry points (`experiments.train`, `experiments.evaluate`) are thin layers over these.
"""

from reno_jax.loop.evaluation import SuiteResult, evaluate, flat_figures, run_suite  # noqa: F401
from reno_jax.loop.runs import SavedRun, load_checkpoint, load_run, load_warm_start  # noqa: F401
from reno_jax.loop.training import train  # noqa: F401
from reno_jax.loop.warmstart import warm_start  # noqa: F401
