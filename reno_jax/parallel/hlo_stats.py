"""Communication read from a compiled (optimised, SPMD-partitioned) HLO module: bytes per collective kind.

`collective_bytes(hlo_text)` walks the per-device program XLA compiled (`jax.jit(f).lower(...).compile()
.as_text()`), finds every all-gather, reduce-scatter, all-reduce, all-to-all and collective-permute (plain,
`-start`/`-done` async pairs, or wrapped in an `async-start` computation), and adds up, per kind:

* ``count``: executions (an op inside a while loop counts once per iteration, using the loop's
  ``known_trip_count``; a loop without one, like a decode loop that can stop early, counts once and is listed
  in ``unknown_trip_counts``; ``per_unknown_loop_iteration`` then gives the part of the figures inside such
  loops, per iteration, to multiply by the iterations run);
* ``operand_bytes`` / ``result_bytes``: the per-device shapes the op reads and writes (shapes in a partitioned
  module are already per device);
* ``traffic_bytes``: what one device sends over the links with the usual ring / pairwise algorithms, from the op's
  group size n: all-gather ``result * (n-1)/n``, reduce-scatter ``operand * (n-1)/n``, all-reduce
  ``2 * operand * (n-1)/n``, all-to-all ``operand * (n-1)/n``, collective-permute ``operand`` (each pair with
  a different source and target).

Branches of a conditional are all counted (an upper bound). The figures are what the compiled program does,
after XLA's own passes (collective combining, loop-invariant code motion out of while loops, async
conversion), so they can differ from what the jaxpr suggests.
"""

from __future__ import annotations

import math
import re
from typing import Iterable

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
    "s4": 0.5,
    "u4": 0.5,
    "s2": 0.25,
    "u2": 0.25,
}
_SHAPE = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([a-z][a-z0-9\-]*)\((.*)$")
_COMP = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\))?\s*->.*\{\s*$|^\s*(ENTRY\s+)?%?([\w.\-]+)\s*\{\s*$")
_CALLEE = re.compile(r"\b(body|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def shape_bytes(type_text: str) -> int:
    """Bytes of an HLO type (`f32[64,256]{1,0}`, a tuple of them, `token[]` counts 0)."""
    total = 0.0
    for dtype, dims in _SHAPE.findall(type_text):
        if dtype not in _BYTES:
            continue
        total += _BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return int(total)


def group_size(attrs: str, num_partitions: int) -> int:
    """Devices in each replica group of a collective, from its attribute text.

    Handles the explicit form ``replica_groups={{0,1},{2,3}}``, the iota form ``replica_groups=[2,4]<=[8]``
    (groups are the last dimension), the mesh form ``replica_groups=mesh['a'=2,'b'=4] {'b'}`` (the product of
    the named axes; a ``device_ids=(...)`` permutation may stand before the braces), and ``replica_groups={}``
    (every device).
    """
    m = re.search(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}", attrs)  # (, device_ids=(...)) between
    if m:
        sizes = {k.strip().strip("'"): int(v) for k, v in (p.split("=") for p in m.group(1).split(",") if p)}
        names = [n.strip().strip("'") for n in m.group(2).split(",") if n.strip()]
        return math.prod(sizes[n] for n in names) if names else 1
    m = re.search(r"replica_groups=\[([0-9,]+)\]<=", attrs)
    if m:
        return int(m.group(1).split(",")[-1])
    m = re.search(r"replica_groups=\{\{([^}]*)\}", attrs)
    if m:
        return len([x for x in m.group(1).split(",") if x.strip()])
    return num_partitions


def _parse(hlo_text: str):
    """{computation: [(name, type, opcode, operands+attrs)]}, entry name, num_partitions."""
    comps: dict[str, list] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        ins = _INSTR.match(line)
        if ins and current is not None:
            comps[current].append(ins.groups())
            continue
        m = _COMP.match(line)
        if m and "=" not in line.split("(")[0]:
            current = m.group(2) or m.group(4)
            comps[current] = []
            if m.group(1) or m.group(3):
                entry = current
            continue
        if line.strip() == "}":
            current = None
    m = re.search(r"num_partitions=(\d+)", hlo_text)
    return comps, entry, int(m.group(1)) if m else 1


def _multipliers(comps, entry):
    """How many times each computation runs per call of the entry (known trip counts; unknown loops once)."""
    calls: dict[str, list] = {c: [] for c in comps}
    unknown = []
    for comp, instrs in comps.items():
        for name, _, opcode, rest in instrs:
            factor = 1
            if opcode == "while":
                t = _TRIP.search(rest)
                if t:
                    factor = int(t.group(1))
                else:
                    unknown.append(f"{comp}/{name}")
            for key, callee in _CALLEE.findall(rest):
                if callee in comps:
                    unknown_body = key == "body" and opcode == "while" and not _TRIP.search(rest)
                    calls[comp].append(
                        (callee, factor if key == "body" else 1, f"{comp}/{name}" if unknown_body else None)
                    )
            for group in _BRANCHES.findall(rest):
                for callee in re.findall(r"%?([\w.\-]+)", group):
                    if callee in comps:
                        calls[comp].append((callee, 1, None))
    mult = {c: 0 for c in comps}
    in_unknown: dict = {}  # computation -> the innermost loop of unknown trip count it runs in
    nesting: dict = {}  # loop of unknown trip count -> how many such loops it runs in (0: outermost)

    def visit(comp, factor, loops, depth=0):
        if depth > 64:
            return
        mult[comp] += factor
        if loops:
            in_unknown[comp] = loops[-1]
        for callee, f, unknown_loop in calls[comp]:
            if unknown_loop:
                nesting[unknown_loop] = len(loops)
            visit(callee, factor * f, loops + (unknown_loop,) if unknown_loop else loops, depth + 1)

    if entry is not None:
        visit(entry, 1, ())
    return mult, unknown, in_unknown, nesting


def _kind(opcode: str):
    for k in KINDS:
        if opcode in (k, k + "-start"):
            return k
    return None


def collective_ops(hlo_text: str) -> tuple[list[dict], list[str]]:
    """Every collective of one compiled module: ``({kind, name, computation, times, group_size, operand_bytes,
    result_bytes, traffic_bytes, op_name}, ...)`` with the bytes of ONE execution, and the loops without a known
    trip count (counted once). ``op_name`` is the jax source op XLA's metadata names (``jit(f)/while/body/...``)."""
    comps, entry, num_partitions = _parse(hlo_text)
    mult, unknown, in_unknown, nesting = _multipliers(comps, entry)
    ops = []
    for comp, instrs in comps.items():
        times = mult.get(comp, 0)
        if not times:
            continue
        types = {name: typ for name, typ, _, _ in instrs}
        done_type = {}
        for name, typ, opcode, rest in instrs:
            if opcode.endswith("-done"):
                src = re.match(r"\s*%?([\w.\-]+)", rest)
                if src:
                    done_type[src.group(1)] = typ
        for name, typ, opcode, rest in instrs:
            kind = _kind(opcode)
            if kind is None:
                continue
            args = rest.split(")", 1)[0]
            operand = sum(shape_bytes(types.get(a, "")) for a in re.findall(r"%([\w.\-]+)", args))
            result = shape_bytes(done_type.get(name, typ)) if opcode.endswith("-start") else shape_bytes(typ)
            n = group_size(rest, num_partitions)
            if kind == "collective-permute":
                pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", rest)
                moving = (
                    [p for p in re.findall(r"\{(\d+),(\d+)", pairs.group(1) + "}") if p[0] != p[1]] if pairs else [None]
                )
                traffic = operand if moving else 0
            else:
                frac = (n - 1) / n if n > 0 else 0.0
                traffic = {
                    "all-gather": result * frac,
                    "reduce-scatter": operand * frac,
                    "all-reduce": 2 * operand * frac,
                    "all-to-all": operand * frac,
                }[kind]
            meta = re.search(r'op_name="([^"]*)"', rest)
            ops.append(
                {
                    "kind": kind,
                    "name": name,
                    "computation": comp,
                    "times": times,
                    "group_size": n,
                    "operand_bytes": operand,
                    "result_bytes": result,
                    "traffic_bytes": traffic,
                    "op_name": meta.group(1) if meta else "",
                    "unknown_loop": in_unknown.get(comp),
                    "loop_nesting": nesting.get(in_unknown.get(comp), 0),
                }
            )
    return ops, unknown


def collective_bytes(hlo_text: str) -> dict:
    """Per-kind ``{count, operand_bytes, result_bytes, traffic_bytes}`` of one compiled module (see module
    docstring), plus ``"total"`` (the sums over kinds) and ``unknown_trip_counts`` (loops counted once)."""
    ops, unknown = collective_ops(hlo_text)
    out = {k: {"count": 0, "operand_bytes": 0, "result_bytes": 0, "traffic_bytes": 0} for k in KINDS}
    for op in ops:
        o, t = out[op["kind"]], op["times"]
        o["count"] += t
        o["operand_bytes"] += t * op["operand_bytes"]
        o["result_bytes"] += t * op["result_bytes"]
        o["traffic_bytes"] += int(round(t * op["traffic_bytes"]))
    out["total"] = {
        f: sum(out[k][f] for k in KINDS) for f in ("count", "operand_bytes", "result_bytes", "traffic_bytes")
    }
    out["unknown_trip_counts"] = unknown
    # The part of the above inside each loop of unknown trip count (a decode loop that stops early), per
    # iteration of that loop (ops of a loop nested in it are listed under the inner loop, not here); "nesting":
    # how many such loops it runs in.
    loops: dict = {}
    for op in ops:
        if op["unknown_loop"]:
            loop = loops.setdefault(op["unknown_loop"], {k: {"count": 0, "traffic_bytes": 0} for k in KINDS})
            loop[op["kind"]]["count"] += op["times"]
            loop[op["kind"]]["traffic_bytes"] += int(round(op["times"] * op["traffic_bytes"]))
    nesting = {op["unknown_loop"]: op["loop_nesting"] for op in ops if op["unknown_loop"]}
    for name, loop in loops.items():
        loop["total"] = {f: sum(loop[k][f] for k in KINDS) for f in ("count", "traffic_bytes")}
        loop["nesting"] = nesting[name]
    out["per_unknown_loop_iteration"] = loops
    return out


def by_source(hlo_text: str, depth: int = 0) -> dict:
    """Traffic bytes per (kind, jax op name), the op name cut to its last ``depth`` path parts (0: whole), largest
    first: which source ops the communication comes from."""
    ops, _ = collective_ops(hlo_text)
    out: dict = {}
    for op in ops:
        name = op["op_name"] if not depth else "/".join(op["op_name"].split("/")[-depth:])
        key = f"{op['kind']} {name}"
        row = out.setdefault(key, {"count": 0, "traffic_bytes": 0})
        row["count"] += op["times"]
        row["traffic_bytes"] += int(round(op["times"] * op["traffic_bytes"]))
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["traffic_bytes"]))


def format_table(rows: Iterable[tuple[str, dict]], field: str = "traffic_bytes", unit: float = 1e9) -> str:
    """A markdown table, one row per (label, collective_bytes result), one column per kind (``field`` / unit)."""
    head = "| program | " + " | ".join(KINDS) + " | total |\n|" + " --- |" * (len(KINDS) + 2)
    lines = [head]
    for label, stats in rows:
        cells = [f"{stats[k][field] / unit:.3f} ({stats[k]['count']})" for k in KINDS + ("total",)]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
