r"""Evaluates a training run's checkpoint on its environment's evaluation suites; ends with one JSON line.

  python -m experiments.evaluate --workdir=workdir/tiny                       # the environment's default suites
  python -m experiments.evaluate --workdir=workdir/tiny_game --suites=minimax,random --num_episodes=1024
  python -m experiments.evaluate --workdir=workdir/tiny --suites=positions_o --sampled
  python -m experiments.evaluate --workdir=workdir/c4 --suites=greedy --max_length=0

Each environment declares its suites (`registry.register(eval_suites=...)`; `--list_suites` prints them):
tic-tac-toe `positions` (every X-to-move position), `positions_o`, `positions_both`, `heldout`, and games against
`minimax`, `random`, `epsilon`; Connect Four games against `random`, `greedy`, `negamax`; guess-the-number every
secret (`secrets`); a host environment (`reno_jax.envs.host`) its held-out tasks (`heldout`). A suite prints its
figures as a JSON line; the last line holds every suite's as `<suite>/<figure>` with the checkpoint step.
`--transcripts` rendered episodes go to workdir/eval_transcripts.txt.

Any mesh (`--mesh`, the fields of a training config's `mesh` section): the checkpoint, whatever mesh and
number of processes wrote it, is restored straight onto this mesh with the preset's parameter shardings, and
each batch of episodes is split over its batch axes:

  python -m experiments.evaluate --workdir=workdir/tiny --mesh=fsdp=4,preset=fsdp

Several processes (the `experiments.distributed` flags, as for training): the mesh spans every process's devices
(default: data-parallel over all of them), every process builds the same starts from the same key, and process
0 prints and writes the transcripts.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import tqdm
from absl import flags, logging

from experiments import cli, distributed
from reno_jax import loop
from reno_jax.loop import evaluation, hosts
from reno_jax.protocol import tokenizer as tokenizer_lib

_WORKDIR = flags.DEFINE_string("workdir", None, "Training workdir (its config.json and checkpoints).", required=True)
_SUITES = flags.DEFINE_list("suites", [], "Evaluation suites, comma-separated (default: the environment's).")
_LIST = flags.DEFINE_bool("list_suites", False, "Print the environment's suites and exit.")
_NUM_EPISODES = flags.DEFINE_integer(
    "num_episodes",
    0,
    "Episodes per suite (0: the suite's own count; a fixed set, e.g. every position, is only cut short).",
)
_SAMPLED = flags.DEFINE_bool("sampled", False, "Sample with the run's temperature instead of greedy decoding.")
_BATCH = flags.DEFINE_integer("batch_size", 256, "Episodes per jitted rollout call.")
_SEED = flags.DEFINE_integer("seed", 0, "RNG seed (starts, sampling, opponents).")
_TRANSCRIPTS = flags.DEFINE_integer("transcripts", 3, "Rendered transcripts to write to workdir/eval_transcripts.txt.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: latest).")
_WARM_START = flags.DEFINE_bool(
    "warm_start",
    False,
    "Evaluate the run's warm start (what GSPO started from, reported as step 0) instead of a checkpoint.",
)
_MESH = flags.DEFINE_string(
    "mesh",
    "",
    "Mesh to restore the checkpoint onto and evaluate on: comma-separated "
    "fields of a training config's mesh section, e.g. 'fsdp=4,preset=fsdp' or "
    "'data=2,fsdp=2,expert=2,preset=fsdp_ep' (one axis may be -1: the devices left). "
    "Default: one device; several processes: data=-1.",
)
_MAX_LENGTH = flags.DEFINE_integer(
    "max_length",
    -1,
    "Conversation length L; -1: the run's, 0: whatever the "
    "longest episode needs, with every turn the environment allows (no "
    "truncation).",
)


def write_transcripts(path: str, tokenizer, traj, count: int) -> None:
    with open(path, "w") as f:
        for i in range(min(count, len(traj.reward))):
            ids = np.asarray(traj.tokens[i])[np.asarray(traj.valid[i])]
            f.write(f"===== episode {i}  reward {float(traj.reward[i]):+.2f}\n")
            f.write(tokenizer_lib.decode(tokenizer, ids.tolist()))
            f.write("\n\n")


def main(argv):
    distributed.initialize()  # first: JAX cannot join other processes once it has computed anything
    if len(argv) > 1:
        raise cli.UserError(f"unexpected arguments: {argv[1:]}")
    workdir = _WORKDIR.value
    mesh_config = cli.mesh_from_flags(_MESH.value, _BATCH.value)
    if _WARM_START.value and _STEP.value is not None:
        raise cli.UserError("--warm_start and --step name two different parameter sets; pass one")
    if _WARM_START.value:
        run = loop.load_warm_start(workdir, mesh_config)
        config, tokenizer, model_config, params, step = run.config, run.tokenizer, run.model_config, run.params, 0
    else:
        config, tokenizer, model_config, params, step = loop.load_run(workdir, _STEP.value, mesh_config)
    if _LIST.value:
        for name, suite in evaluation.suites_of(config).items():
            print(f"{name}: {suite.num_episodes} episodes{' (default)' if suite.default else ''}")
        return
    suites = evaluation.resolve_suites(config, _SUITES.value)
    logging.info("Evaluating %s at step %s on %s", workdir, step, list(suites))
    results = {}
    for name, suite in suites.items():
        result = evaluation.run_suite(
            params,
            model_config,
            tokenizer,
            config,
            name,
            suite,
            key=jax.random.PRNGKey(_SEED.value),
            greedy=not _SAMPLED.value,
            batch_size=_BATCH.value,
            num_episodes=_NUM_EPISODES.value or None,
            max_length=_MAX_LENGTH.value,
        )
        results[name] = result
        if hosts.is_main_process():
            tqdm.tqdm.write(json.dumps({"suite": name, **result.figures}))
    if not hosts.is_main_process():
        return
    if _TRANSCRIPTS.value:
        first = next(iter(results.values()))
        write_transcripts(
            os.path.join(workdir, "eval_transcripts.txt"), tokenizer, first.trajectory, _TRANSCRIPTS.value
        )
    print(
        json.dumps(
            {
                "checkpoint_step": step,
                "warm_start": _WARM_START.value,
                "env": str(config.env.name),
                "greedy": not _SAMPLED.value,
                **evaluation.flat_figures(results),
            }
        )
    )


if __name__ == "__main__":
    cli.run(main)
