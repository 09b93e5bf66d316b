"""Test-session settings: CPU only, XLA's cheapest compilation, and a compilation cache.

Almost all of the suite's time is XLA compilation of small programs. `jax_disable_most_optimizations` (LLVM
optimisation level 0 and no expensive LLVM passes) roughly halves it and only changes float rounding (every
numeric tolerance in the suite is far above that). Many tests build the same programs again (a second run of the
same config, a resumed run, the CLIs in subprocesses, the other pytest-xdist worker), so compiled executables go to
a persistent cache that is new for each test session (nothing carries over between sessions). Set before JAX is
imported, so the xdist workers and the subprocesses started by the CLI tests inherit it too.
"""

import os
import sys
import tempfile

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

# A cache directory given by the caller is used as is (.ci/run shares one between its two tiers).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="reno_jax_test_xla_cache_")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

# `configs` and `experiments` are imported from the repository root.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The slow tier (`-m slow`): tests that need a browser, several processes, long runs of the CLIs in fresh
# processes, torch (transformers' PyTorch model), or the `tasks` extra (reasoning-gym). Marked here by node name
# (parameters aside) so that the test files carry no tier marks; the fast tier is
# `python -m pytest -q -n 2 -m "not slow" tests`.
# tests/test_packaging.py checks that every name here is a test. Kept as laid out (one entry per name, its reason
# on the next line when both do not fit on one): the formatter would join them into lines past the limit.
# fmt: off
SLOW = {
    # a browser
    "tests/test_play.py::test_browser_plays_tictactoe_and_moves_the_slider":
        "drives a headless Chromium through chromedriver",
    "tests/test_play.py::test_browser_plays_connect4_with_column_buttons":
        "drives a headless Chromium through chromedriver",
    "tests/test_play_puzzle.py::test_browser_plays_a_puzzle": "drives a headless Chromium through chromedriver",
    # several processes or devices
    "tests/test_play.py::test_cli_serves_a_run_and_prints_its_url":
        "starts the play server (uvicorn) in a second process and talks to it over HTTP",
    "tests/test_multihost.py::test_two_processes_train_one_run_and_one_process_resumes_it":
        "two training processes joined by gloo collectives, then a third process that resumes the run",
    "tests/test_multihost.py::test_two_processes_draw_and_load_the_model_straight_onto_their_shards":
        "two processes on one distributed mesh",
    "tests/test_parallel.py::test_sharded_forward_and_decode_equal_one_device":
        "a process with 8 CPU devices (shared by the four tests below)",
    "tests/test_parallel.py::test_sharded_train_steps_equal_one_device": "the 8-device process",
    "tests/test_parallel.py::test_routing_replay_under_expert_parallelism": "the 8-device process",
    "tests/test_parallel.py::test_blocked_moe_dispatch_per_device_rows_is_exact": "the 8-device process",
    "tests/test_parallel.py::test_a_batch_that_does_not_split_over_the_mesh_names_the_numbers":
        "the 8-device process",
    "tests/test_sharded_io.py::test_init_on_8_devices_is_the_one_device_init_bit_for_bit":
        "a process with 8 CPU devices (shared by the three tests below)",
    "tests/test_sharded_io.py::test_real_shape_init_traces_without_drawing_and_each_device_makes_only_its_shard":
        "the 8-device process",
    "tests/test_sharded_io.py::test_golden_checkpoint_loads_onto_shards_and_saves_back_from_them":
        "the 8-device process",
    "tests/test_sharded_io.py::test_checkpoint_written_on_8_devices_restores_onto_one": "the 8-device process",
    # long training runs (the fast tier keeps one short default run: tests/test_experiments.py's run_dir)
    "tests/test_own_environment.py::test_an_environment_of_the_users_package_trains_and_evaluates_from_the_cli":
        "a training run and an evaluation through the CLIs, each in a fresh process",
    "tests/test_own_environment.py::test_the_loop_is_a_library_call":
        "warm start, GSPO and evaluation of a user's environment (~50 s)",
    "tests/test_experiments.py::test_game_config_curriculum_run_resume_and_evaluation":
        "three training runs, then games against two opponents through the evaluation CLI (~160 s on 2 busy cores)",
    "tests/test_experiments.py::test_same_seed_same_metrics": "a second short run",
    "tests/test_experiments.py::test_resume_continues_from_latest_checkpoint":
        "a resumed run (its longer schedule is a new program, ~35 s)",
    "tests/test_experiments.py::test_short_run_with_forking_kl_anchor": "two short runs of another loss (~30 s)",
    "tests/test_experiments.py::test_short_game_run_with_game_warm_start": "a multi-turn game run (~40 s)",
    "tests/test_experiments.py::test_short_run_with_routing_replay": "a run with routing replay (~30 s)",
    "tests/test_experiments.py::test_lora_int8_run_trains_adapters_resumes_exactly_and_exports_merged":
        "a LoRA run over an int8 base, its resume and export (~75 s)",
    "tests/test_envs_generic.py::test_generic_trainer_and_evaluation_on_guess_number":
        "a guess_number run and the evaluation CLI (~65 s)",
    "tests/test_play.py::test_connect4_heat_map_is_the_models_distribution_over_the_teachers_calls":
        "a Connect Four run for the page (~45 s)",
    "tests/test_play.py::test_api_connect4_board": "the same Connect Four run",
    "tests/test_play.py::test_api_board_less_environment_shows_transcripts": "a guess_number run for the page (~45 s)",
    "tests/test_play_puzzle.py::test_api_puzzle_run_and_the_persons_moves":
        "a Sokoban run for the page's puzzle board (~50-85 s on 2 cores)",
    "tests/test_play_puzzle.py::test_api_model_move_and_model_plays_to_the_end": "the same Sokoban run",
    "tests/test_play_puzzle.py::test_api_puzzle_refusals_are_clear": "the same Sokoban run",
    "tests/test_play_puzzle.py::test_api_transcripts_of_a_bounded_history_run_show_every_turn": "the same Sokoban run",
    "tests/test_gpu_check.py::test_runs_every_phase_on_the_tiny_model":
        "benchmarks/gpu_check.py's three phases: three XLA compilations (~50 CPU-s; the fast tier runs its rollout)",
    # heavy equivalence checks of alternative layouts (each tens of CPU-seconds: a second program compiled and
    # compared with the plain one); the fast tier keeps the plain paths and the cheaper equivalences
    "tests/test_policy.py::test_chunked_logits_match_and_never_hold_the_full_logits":
        "compiles chunked and full logits programs with and without a shared prefix and compares them",
    "tests/test_shared_prefix.py::test_train_step_matches_rowwise":
        "two train steps (shared prefix vs row-wise) compiled and compared, twice",
    "tests/test_envs_generic.py::test_warm_start_from_a_length_sorted_pool":
        "a Connect Four warm start over a length-sorted pool, compiled per width",
    "tests/test_envs_generic.py::test_warm_start_trimmed_to_the_longest_transcript_trains_the_same":
        "two Connect Four warm starts (trimmed and full width) compared",
    "tests/test_routing_replay.py::test_train_step_with_replay_microbatches_and_remat_match":
        "three train steps (plain, microbatched, remat) with routing replay compiled and compared",
    "tests/test_lora.py::test_int8_base_backward_keeps_no_dequantized_weight_with_remat":
        "compiles the int8 LoRA backward with remat and reads its HLO",
    # one-off studies (studies/): their scripts' tests compile the Connect Four model and its forward
    "tests/test_teacher_agreement.py::test_agreement_reads_the_prediction_of_each_choice_token":
        "studies/teacher_agreement.py on the Connect Four model (~40 CPU-s per case)",
    "tests/test_teacher_agreement.py::test_an_untrained_model_agrees_sometimes_and_the_cli_checks_its_flags":
        "studies/teacher_agreement.py's CLI on the Connect Four model",
    "tests/test_connect4_decisions.py::test_agreement_per_kind":
        "studies/connect4_decisions.py on the Connect Four model",
    "tests/test_host_rollout_cost.py::test_host_rollout_cost_tiny":
        "benchmarks/host_rollout_cost.py at a tiny size: three rollouts and three train steps compiled (~100 CPU-s)",
    "tests/test_host_loop.py::test_short_host_run_evaluates_warm_starts_and_shows_transcripts":
        "a two-step host-env run with warm start, in-run evaluation and the play page (~150 CPU-s)",
    "tests/test_host_loop.py::test_host_run_trains_on_turn_samples_with_bounded_history":
        "a short host training run with bounded history (warm start, a GSPO step, an evaluation)",
    "tests/test_host_loop.py::test_host_run_resumes_exactly_after_kill_9":
        "three host-env training runs of the CLI in subprocesses, one killed with SIGKILL",
    "tests/test_credit_comparison.py::test_credit_comparison_tiny":
        "benchmarks/credit_comparison.py at a tiny size: two training runs and two evaluations as subprocesses",
    "tests/test_history_cost.py::test_history_cost_tiny":
        "benchmarks/history_cost.py at a tiny size: four rollouts and four train steps compiled (~110 CPU-s)",
    "tests/test_window.py::test_tictactoe_turn_samples_match_the_chat_template":
        "two more bounded-history rollouts compiled (tic-tac-toe, k = 0 and 2; ~20 CPU-s each)",
    "tests/test_window.py::test_a_train_step_runs_on_turn_samples": "a train step compiled on turn samples (~20 s)",
    "tests/test_window.py::test_a_train_step_on_turn_samples_sharing_the_system_prompt_equals_the_row_wise_one":
        "two train steps compiled on turn samples, row-wise and with the system prompt shared",
    "tests/test_window.py::test_turn_samples_record_their_own_routing": "another rollout compiled (~15 s)",
    "tests/test_window.py::test_the_teachers_turn_samples_equal_the_forced_bounded_rollout_id_for_id":
        "another rollout compiled, forced with the teacher's calls (~15 s)",
    # another framework
    "tests/test_conversion.py::test_export_logits_equal_transformers_native_class":
        "transformers' PyTorch BailingHybridForCausalLM: needs torch, which .ci/run installs for this tier only",
    # an optional extra
    "tests/test_reasoning_gym_tasks.py::test_basic_arithmetic_scores_the_exact_answer_one_and_a_wrong_one_less":
        "needs the tasks extra (reasoning-gym), which .ci/run installs for this tier only",
    "tests/test_reasoning_gym_tasks.py::test_the_calculator_solves_basic_arithmetic_from_the_entries_expressions":
        "needs the tasks extra",
    "tests/test_reasoning_gym_tasks.py::test_a_second_dataset_works_the_same_way": "needs the tasks extra",
    "tests/test_reasoning_gym_tasks.py::test_unknown_names_and_options_say_what_is_wrong": "needs the tasks extra",
    "tests/test_host_tasks.py::test_arithmetic_teacher_and_the_no_tool_control": "the tasks extra (reasoning-gym)",
    "tests/test_host_tasks.py::test_arithmetic_questions_are_large_held_out_and_invalid_calls_end_the_episode":
        "the tasks extra (reasoning-gym)",
    "tests/test_host_tasks.py::test_any_reasoning_gym_dataset_trains_the_same_way": "the tasks extra (reasoning-gym)",
    "tests/test_host_tasks.py::test_reasoning_gym_env_says_what_is_missing": "the tasks extra (reasoning-gym)",
    "tests/test_host_tasks.py::test_arithmetic_plays_through_host_rollout":
        "the tasks extra (reasoning-gym), and host_rollout's programs compiled for 64-token turns (~15 s)",
    "tests/test_host_tasks.py::test_two_hop_plays_through_host_rollout":
        "host_rollout's programs compiled for 64-token turns, three turns played (~20 s)",
}
# fmt: on


# The files that take longest (a module-scoped training run or many compiled programs), heaviest first. pytest.ini
# hands whole files to the two xdist workers in collection order (`--dist loadfile --no-loadscope-reorder`); starting
# the long ones first leaves the many short files to even out the end, so neither worker runs a long tail alone.
# Order only: a file missing here (or a name that is no longer a file) runs after these, in the usual order.
LONGEST_FIRST = (
    "tests/test_experiments.py",
    "tests/test_play.py",
    "tests/test_play_puzzle.py",
    "tests/test_model.py",
    "tests/test_routing_replay.py",
    "tests/test_lora.py",
    "tests/test_quant.py",
    "tests/test_sft.py",
    "tests/test_shared_prefix.py",
    "tests/test_envs_generic.py",
    "tests/test_policy.py",
    "tests/test_learner.py",
    "tests/test_sharded_io.py",
    "tests/test_rollout.py",
    "tests/test_checkpoint.py",
    "tests/test_host_rollout.py",
)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.split("[", 1)[0] in SLOW:
            item.add_marker(pytest.mark.slow)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable: the rest keep order


@pytest.fixture
def scripted_forward():
    """A factory of stand-ins for `ling3.forward` whose most likely token at t is the token at t + 1 (shift 0: an
    oracle of the conversation it reads) or another one (shift != 0), for studies that score agreement."""
    import jax
    import jax.numpy as jnp

    def make(shift):
        def forward(params, config, tokens, valid=None, **unused):
            nxt = jnp.concatenate([tokens[:, 1:], tokens[:, -1:]], axis=1)
            return jax.nn.one_hot((nxt + shift) % config.vocab_size, config.vocab_size) * 10.0, None

        return forward

    return make


@pytest.fixture(scope="session")
def tiny_connect4():
    """A factory of Connect Four runs as the studies load them: ``opponent -> (config, tokenizer, model_config,
    params)`` of `configs/connect4_tiny.py` with that opponent, built once per opponent."""
    import jax

    from configs import connect4_tiny
    from reno_jax.loop import build

    built = {}

    def make(opponent):
        if opponent not in built:
            config = connect4_tiny.get_config()
            config.env.opponent = opponent
            tokenizer = build.build_tokenizer(config)
            model_config, params = build.build_model(config, jax.random.PRNGKey(0), tokenizer)
            built[opponent] = (config, tokenizer, model_config, params)
        return built[opponent]

    return make
