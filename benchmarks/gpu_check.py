"""The first thing to run on a new GPU: one shot, one JSON line, about 8 minutes on a large GPU.

  python benchmarks/gpu_check.py                 # Ling-3.0-tiny's real shape, random weights, the published batch
  python benchmarks/gpu_check.py --model tiny    # the same code path on a small model (CPU: seconds; the test)

Three phases at the published setting's shape (configs/areno_ling3_tiny.py: 4 boards x 4 samples, 1471 new
tokens, GSPO, int8 Adam moments, 4 micro-batches, layer remat, the prompt encoded once per group), on random bf16
weights (`reno_jax/real_shape.py`'s programs, as benchmarks/real_shape_step.py runs them):

  rollout     the move task's rollout: generated tokens/s (random weights never call the tool, so every row
              generates all 1471 tokens: the worst case of a step).
  train_full  the full fine-tune's GSPO train step: step time, peak memory, model FLOP utilisation.
  train_lora  the LoRA train step (rank 8 adapters, --lora-base int8: the frozen base quantized leaf by leaf from
              the same weights, the bf16 copy freed as it goes): the same figures.

Fail fast: before compiling a phase at the real shape its planned bytes (XLA's plans in docs/benchmarks.md) are
compared with the device's free memory, and after compiling with the compiled program's own memory analysis
(`memory_analysis()`: temporaries and outputs, on top of the arguments already resident). A phase that does not fit
is skipped with one line on stderr naming both figures; the other phases still run. A phase that fails at run time
(out of memory despite the plan, a compiler error) is reported the same way. Phases that would start after
--time-budget-s are skipped too. Exit status 0 when every phase ran or was skipped for memory or time, 1 when one
failed.

MFU: model FLOPs per step / step time / the device's dense bf16 peak (a table of published peaks by device name;
--peak-tflops overrides, and is needed for a device not in the table). Model FLOPs: 2 per active parameter per
token (the matmuls; the input embedding is a lookup) plus the MLA layers' causal attention, times 3 for the full
fine-tune (forward, input and weight gradients) and times 2 for LoRA (forward and input gradients; the base gets
no weight gradient, the adapters' own FLOPs are under 1%); remat's recomputation, the MoE dispatch's padding and
KDA's recurrence are not counted (that is hardware FLOPs, not model FLOPs). `xla_flops` is XLA's own count of the
compiled program (`cost_analysis()`), all of those included.

The last line of stdout is one JSON object: the device, its memory, and for each phase {status: ran | skipped |
failed, reason, compile_s, plan_bytes, step_s or rollout_s, tokens_per_s, peak_bytes_in_use, model_flops, mfu}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from configs import areno_ling3_tiny
from reno_jax import real_shape as rs
from reno_jax.envs.tictactoe import boards as boards_lib
from reno_jax.envs.tictactoe import env as ttt_env
from reno_jax.models import ling3, lora, quant
from reno_jax.models.config import tiny_test_config
from reno_jax.rl import trainer

PHASES = ("rollout", "train_full", "train_lora")

# XLA's plans at the real shape with this script's defaults (docs/benchmarks.md; deviceless compiles, jax 0.10.2):
# the pre-check before a phase is compiled. Other shapes skip the pre-check (the compiled plan is still checked).
# (train_lora/int8: planned for an RTX 4090 at the published batching; with a bf16 base that batching is not
# compiled: the 24 GB recipe's plans, 16 one-row micro-batches, are in docs/gpu.md.)
PLANNED_BYTES = {"rollout": 16.89e9, "train_full": 92.37e9, "train_lora/int8": 41.72e9, "train_lora/bf16": None}

# Dense (no sparsity) bf16 tensor-core peaks from the vendors' data sheets, FLOP/s, by a substring of
# `device_kind` (first match wins).
PEAK_BF16_FLOPS = (
    ("GH200", 989e12),
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
    ("A10G", 70e12),
    ("A10", 125e12),
    ("RTX 4090", 165e12),
    ("RTX 3090", 71e12),
    ("A6000", 155e12),
)


def default_peak_flops(device_kind: str) -> float | None:
    for name, peak in PEAK_BF16_FLOPS:
        if name.lower() in device_kind.lower():
            return peak
    return None


def model_config(name: str):
    if name == "real":
        return ling3.ling3_tiny_real()
    # the smallest model with every kind of layer: a dense KDA layer and an MoE MLA layer
    return tiny_test_config(vocab_size=512, num_hidden_layers=2)


def forward_flops(config, rows: int, length: int) -> float:
    """Model FLOPs of one forward pass over `rows` sequences of `length` tokens (module docstring)."""
    counts = ling3.count_params(config)
    matmul_params = counts["active"] - config.vocab_size * config.hidden_size  # the input table is a lookup
    n_mla = sum(kind == "mla" for kind in config.layer_kinds)
    head = config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim
    attention = n_mla * 2 * config.num_attention_heads * head * length * (length + 1) / 2
    return rows * (2.0 * matmul_params * length + attention)


def device_memory():
    """(bytes limit, bytes in use) of the first device; (None, None) where the backend does not say (CPU)."""
    stats = jax.local_devices()[0].memory_stats()
    if not stats or "bytes_limit" not in stats:
        return None, None
    return int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0))


def _size(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e7 else f"{int(n):,} bytes"


def lora_of(args):
    """The published setting's LoRA (configs/areno_ling3_tiny.py's block) at rank --lora-rank; None: the full
    fine-tune."""
    return rs.lora_config(args.lora_rank, areno_ling3_tiny.get_config())


def move_task(args):
    """The published setting's rollout task and starts: tic-tac-toe's move task on the first --boards boards of
    seed 1234."""
    boards = np.asarray(boards_lib.generate_boards(args.boards, seed=1234), np.int8)
    return ttt_env.TicTacToeEnv.create("move"), ttt_env.move_starts(boards)


class Skip(Exception):
    """A phase that does not fit the device (or the time budget): skipped, not failed."""


def xla_flops(compiled) -> float | None:
    try:
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        return float(cost["flops"]) if cost and "flops" in cost else None
    except Exception:  # not every backend has a cost model
        return None


class Check:
    def __init__(self, args):
        self.args = args
        self.t0 = time.perf_counter()
        self.config = model_config(args.model)
        self.limit, _ = device_memory()
        if args.memory_limit_bytes:
            self.limit = args.memory_limit_bytes
        kind = str(jax.local_devices()[0].device_kind)
        self.peak_flops = args.peak_tflops * 1e12 if args.peak_tflops else default_peak_flops(kind)
        self.res = {
            "check": "gpu_check",
            "backend": jax.default_backend(),
            "device": kind,
            "jax": jax.__version__,
            "model": args.model,
            "device_memory_bytes": self.limit,
            "peak_bf16_flops": self.peak_flops,
            "boards": args.boards,
            "group_size": args.group_size,
            "max_new_tokens": args.max_new_tokens,
            "microbatches": args.microbatches,
            "lora_rank": args.lora_rank,
            "lora_base": args.lora_base,
            "phases": {},
        }
        self.published_shape = args.model == "real" and (
            args.boards,
            args.group_size,
            args.max_new_tokens,
            args.microbatches,
            args.lora_rank,
            args.logits_chunk,
        ) == (4, 4, 1471, 4, 8, 0)  # the settings the plans in PLANNED_BYTES were made with

    # -- helpers

    def step_args(self, lora_rank: int = 0, quantize: str = ""):
        a = self.args
        return argparse.Namespace(
            boards=a.boards,
            group_size=a.group_size,
            max_new_tokens=a.max_new_tokens,
            microbatches=a.microbatches,
            state_dtype="int8",
            entropy=False,
            remat=True,
            share_prefix=self.whole_groups(),
            lora_rank=lora_rank,
            quantize=quantize,
            logits_chunk=a.logits_chunk,
        )

    def whole_groups(self) -> bool:
        """Whether each micro-batch holds whole groups (then the prompt is encoded once per group)."""
        a = self.args
        rows = a.boards * a.group_size // a.microbatches
        return rows % a.group_size == 0

    def free_bytes(self):
        if self.limit is None:
            return None
        _, used = device_memory()
        return self.limit - (used or 0)

    def precheck(self, key: str, lower_bound: int, what: str = "weights and optimizer state"):
        """Skip before compiling (minutes at the real shape) when the phase's known plan at the real shape, or a
        lower bound of its footprint (`lower_bound`: weights, adapters and optimizer state), exceeds the device."""
        if self.limit is None:
            return
        planned = PLANNED_BYTES.get(key) if self.published_shape and not self.args.ignore_known_plans else None
        if planned and planned > self.limit:
            raise Skip(
                f"XLA plans {planned / 1e9:.1f} GB for it at the real shape (docs/benchmarks.md); "
                f"the device has {self.limit / 1e9:.1f} GB"
            )
        if lower_bound > self.limit:
            raise Skip(f"its {what} alone are {_size(lower_bound)}; the device has {_size(self.limit)}")

    def fits(self, compiled, resident_bytes: int, out: dict):
        """Skip when the compiled program's temporaries and outputs exceed the free memory (its arguments are
        already resident, `resident_bytes` of them)."""
        plan = rs.memory_figures(compiled)
        out["plan_bytes"] = plan["estimated_peak_bytes"]
        need = plan["estimated_peak_bytes"] - resident_bytes
        free = self.free_bytes()
        if free is not None and need > free:
            raise Skip(
                f"its compiled plan needs {_size(plan['estimated_peak_bytes'])} ({_size(need)} beyond "
                f"what is resident); {_size(free)} free of {_size(self.limit)}"
            )

    def budget(self):
        spent = time.perf_counter() - self.t0
        if spent > self.args.time_budget_s:
            raise Skip(f"time budget spent ({spent:.0f} s of {self.args.time_budget_s:.0f} s)")

    def finish(self, out: dict, step_s: float, flops: float):
        out["model_flops"] = flops
        out["mfu"] = flops / step_s / self.peak_flops if self.peak_flops and step_s else None
        out["peak_bytes_in_use"] = rs.peak_bytes()
        out["peak_rss_bytes"] = rs.peak_rss_bytes()

    # -- phases

    def rollout(self, params, out):
        self.precheck("rollout", rs.tree_bytes(params), "weights")
        args = self.step_args()
        rollout_fn, key, starts, env = rs.rollout_setup(args, self.config, *move_task(args))
        t0 = time.perf_counter()
        compiled = rollout_fn.lower(params, key, starts, env=env).compile()
        out["compile_s"] = time.perf_counter() - t0
        self.fits(compiled, rs.tree_bytes(params), out)
        out["xla_flops"] = xla_flops(compiled)
        traj, out["first_call_s"] = rs.timed(lambda k: compiled(params, k, starts, env=env), key)
        times = []
        for i in range(self.args.steps):
            traj, dt = rs.timed(lambda k: compiled(params, k, starts, env=env), jax.random.fold_in(key, i + 1))
            times.append(dt)
        gen = int(np.asarray(traj.loss_mask).sum())
        out["rows"], out["length"] = (int(n) for n in traj.tokens.shape)
        out["generated_tokens"] = gen
        out["rollout_s"] = float(np.median(times)) if times else out["first_call_s"]
        out["tokens_per_s"] = gen / out["rollout_s"]
        out["peak_bytes_in_use"] = rs.peak_bytes()
        out["peak_rss_bytes"] = rs.peak_rss_bytes()
        return traj

    def batch(self, traj, args):
        if traj is None:
            traj = rs.synthetic_batch(args, self.config, jax.random.PRNGKey(1))
        adv = jax.random.normal(jax.random.PRNGKey(3), traj.reward.shape, jnp.float32)
        return rs.train_batch(args, traj, adv, int(jnp.min(traj.prompt_length)))

    def train(self, trained, frozen, batch, args, out, fwd_passes: int):
        """Compile (abstract state: nothing allocated before the plan is checked), check, run; returns the trained
        tree after the step (the state is donated)."""
        optimizer, step_fn = rs.make_step(args, self.config, lora_of(args))
        abstract = jax.eval_shape(lambda p: trainer.create_train_state(p, optimizer, jax.random.PRNGKey(2)), trained)
        extra = () if frozen is None else (frozen,)
        t0 = time.perf_counter()
        compiled = step_fn.lower(abstract, batch, *extra).compile()
        out["compile_s"] = time.perf_counter() - t0
        resident = rs.tree_bytes(trained) + rs.tree_bytes(batch) + (rs.tree_bytes(frozen) if extra else 0)
        self.fits(compiled, resident, out)
        out["xla_flops"] = xla_flops(compiled)
        out["optimizer_state_bytes"] = rs.tree_bytes(abstract.opt_state)
        state = trainer.create_train_state(trained, optimizer, jax.random.PRNGKey(2))
        del trained
        (state, metrics), out["first_call_s"] = rs.timed(compiled, state, batch, *extra)
        times = []
        for _ in range(self.args.steps):
            (state, metrics), dt = rs.timed(compiled, state, batch, *extra)
            times.append(dt)
        out["step_s"] = float(np.median(times)) if times else out["first_call_s"]
        out["loss"] = float(metrics["loss"])
        out["grad_norm"] = float(metrics["grad_norm"])
        rows = self.args.boards * self.args.group_size
        length = rs.PROMPT_LEN + self.args.max_new_tokens
        out["rows"], out["length"] = rows, length
        self.finish(out, out["step_s"], fwd_passes * forward_flops(self.config, rows, length))
        return state.params

    def quantized(self, params):
        """The int8 base of `params`, leaf by leaf, each bf16 leaf deleted once quantized (never both copies)."""
        qleaf = jax.jit(quant.quantize_array, static_argnames=("axis",))
        out = params
        for path, kind in lora.projections(params).items():
            w = lora._get(params, path)
            q = jax.block_until_ready(qleaf(w, axis=quant.quantized_axis(kind)))
            w.delete()
            out = lora._set(out, path, q)
        return out

    def run_phase(self, name, fn, *fn_args):
        out = self.res["phases"].setdefault(name, {})
        t0 = time.perf_counter()
        try:
            self.budget()
            result = fn(*fn_args, out)
            out["status"] = "ran"
            return result
        except Skip as e:
            out.update(status="skipped", reason=str(e))
            print(f"gpu_check: {name} skipped: {e}", file=sys.stderr, flush=True)
        except Exception as e:
            out.update(status="failed", reason=f"{type(e).__name__}: {str(e).splitlines()[0][:500]}")
            print(f"gpu_check: {name} failed: {out['reason']}", file=sys.stderr, flush=True)
        finally:
            out["phase_s"] = time.perf_counter() - t0
        return None

    def main(self):
        a = self.args
        phases = [p for p in a.phases.split(",") if p]
        unknown = [p for p in phases if p not in PHASES]
        if unknown:
            raise SystemExit(f"gpu_check: unknown phases {unknown}; known: {list(PHASES)}")
        t0 = time.perf_counter()
        params = rs.base_params(self.step_args(), self.config, jax.random.PRNGKey(0))
        jax.block_until_ready(params)
        self.res["init_s"] = time.perf_counter() - t0
        self.res["param_bytes"] = rs.tree_bytes(params)
        traj = None
        if "rollout" in phases:
            traj = self.run_phase("rollout", self.rollout, params)
        if "train_full" in phases:
            args = self.step_args()
            batch = self.batch(traj, args)

            def full_phase(out):
                optimizer, _ = rs.make_step(args, self.config, lora_of(args))
                opt = jax.eval_shape(optimizer.init, params)
                self.precheck("train_full", rs.tree_bytes(params) + rs.tree_bytes(opt))
                return self.train(params, None, batch, args, out, 3)

            new = self.run_phase("train_full", full_phase)
            if new is not None:  # the step donated the params; the updated ones serve as the base below
                params = new
            del batch
        if "train_lora" in phases:
            args = self.step_args(a.lora_rank, "int8" if a.lora_base == "int8" else "")

            def lora_phase(out):
                nonlocal params
                shapes = rs.base_params(args, self.config, jax.random.PRNGKey(0), abstract=True)
                adapters, _ = rs.trained_and_frozen(lora_of(args), shapes, abstract=True)
                optimizer, _ = rs.make_step(args, self.config, lora_of(args))
                self.precheck(
                    f"train_lora/{a.lora_base}",
                    rs.tree_bytes(shapes)
                    + rs.tree_bytes(adapters)
                    + rs.tree_bytes(jax.eval_shape(optimizer.init, adapters)),
                )
                base = self.quantized(params) if a.lora_base == "int8" else params
                params = base
                out["base_bytes"] = rs.tree_bytes(base)
                trained, frozen = rs.trained_and_frozen(lora_of(args), base)
                out["adapter_bytes"] = rs.tree_bytes(trained)
                return self.train(trained, frozen, self.batch(traj, args), args, out, 2)

            self.run_phase("train_lora", lora_phase)
        self.res["total_s"] = time.perf_counter() - self.t0
        self.res["peak_bytes_in_use"] = rs.peak_bytes()
        self.res["peak_rss_bytes"] = rs.peak_rss_bytes()
        failed = [n for n, p in self.res["phases"].items() if p.get("status") == "failed"]
        if a.out:
            with open(a.out, "w") as f:
                json.dump(self.res, f, indent=1)
        print(json.dumps(self.res), flush=True)
        return 1 if failed else 0


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["real", "tiny"], default="real")
    ap.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated subset of {list(PHASES)}")
    ap.add_argument("--boards", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=1471)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument(
        "--logits-chunk",
        type=int,
        default=128,
        help="train steps make the logits this many positions at a time (0: all at once)",
    )
    ap.add_argument("--lora-base", choices=["int8", "bf16"], default="int8")
    ap.add_argument("--steps", type=int, default=1, help="timed calls of each phase after the first")
    ap.add_argument(
        "--peak-tflops",
        type=float,
        default=0.0,
        help="the device's dense bf16 peak, TFLOP/s (default: from the table in this script)",
    )
    ap.add_argument(
        "--time-budget-s", type=float, default=480.0, help="phases that would start after this many seconds are skipped"
    )
    ap.add_argument(
        "--memory-limit-bytes",
        type=int,
        default=0,
        help="pretend the device has this much memory (tests the skip path; default: the device's)",
    )
    ap.add_argument(
        "--ignore-known-plans",
        action="store_true",
        help="compile a phase even when its known plan at the real shape exceeds the device (the "
        "compiled program's own plan is still checked before it runs)",
    )
    ap.add_argument("--out", default="", help="also write the JSON object to this file")
    args = ap.parse_args(argv)
    if args.lora_rank < 1:
        ap.error("--lora-rank must be >= 1")
    return args


def main(argv=None) -> int:
    return Check(parse_args(argv)).main()


if __name__ == "__main__":
    sys.exit(main())
