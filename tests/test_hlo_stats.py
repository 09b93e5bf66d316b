"""Collective bytes read from compiled HLO (`reno_jax.parallel.hlo_stats`): hand-written GPU-style HLO, and tiny
sharded programs on 8 CPU devices (fresh process) whose bytes are computed by hand."""

import json
import os
import subprocess
import sys

from reno_jax.parallel import hlo_stats

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# What XLA:GPU prints for a partitioned module (async pairs, mesh-form replica groups, a while loop with a known
# trip count whose body holds an all-gather), cut down by hand.
GPU_STYLE = """\
HloModule jit_f, num_partitions=8

%body.1 (p: (s32[], bf16[1024,512])) -> (s32[], bf16[1024,512]) {
  %p = (s32[], bf16[1024,512]{1,0}) parameter(0)
  %w = bf16[128,512]{1,0} get-tuple-element(%p), index=1
  %all-gather-start = (bf16[128,512]{1,0}, bf16[1024,512]{1,0}) all-gather-start(%w), channel_id=1, replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0','axis_1'}, dimensions={0}
  %all-gather-done = bf16[1024,512]{1,0} all-gather-done(%all-gather-start)
  ROOT %t = (s32[], bf16[1024,512]{1,0}) tuple(%i, %all-gather-done)
}

%cond.1 (p: (s32[], bf16[1024,512])) -> pred[] {
  %p = (s32[], bf16[1024,512]{1,0}) parameter(0)
  ROOT %lt = pred[] compare(%a, %b), direction=LT
}

ENTRY %main.9_spmd (x: f32[64,256], y: f32[8,16]) -> f32[8,256] {
  %x = f32[64,256]{1,0} parameter(0)
  %y = f32[8,16]{1,0} parameter(1)
  %reduce-scatter-start = ((f32[64,256]{1,0}), f32[8,256]{1,0}) reduce-scatter-start(%x), channel_id=2, replica_groups=[1,8]<=[8], dimensions={0}, to_apply=%add
  %reduce-scatter-done = f32[8,256]{1,0} reduce-scatter-done(%reduce-scatter-start)
  %all-reduce = (f32[8,16]{1,0}, f32[8,16]{1,0}) all-reduce(%y, %y), channel_id=3, replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add
  %cp = f32[8,16]{1,0} collective-permute(%y), channel_id=4, source_target_pairs={{0,1},{1,0}}
  %a2a-start = ((f32[8,16]{1,0}), f32[8,16]{1,0}) all-to-all-start(%y), channel_id=5, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}
  %a2a-done = f32[8,16]{1,0} all-to-all-done(%a2a-start)
  %while = (s32[], bf16[1024,512]{1,0}) while(%init), condition=%cond.1, body=%body.1, backend_config={"known_trip_count":{"n":"4"}}
  ROOT %r = f32[8,256]{1,0} copy(%reduce-scatter-done)
}
"""


def test_hand_written_gpu_style_module():
    s = hlo_stats.collective_bytes(GPU_STYLE)
    ag = s["all-gather"]  # 4 loop iterations of a 128x512 bf16 shard gathered 8 ways
    assert ag == {
        "count": 4,
        "operand_bytes": 4 * 131072,
        "result_bytes": 4 * 1048576,
        "traffic_bytes": 4 * 1048576 * 7 // 8,
    }
    rs = s["reduce-scatter"]
    assert rs == {"count": 1, "operand_bytes": 65536, "result_bytes": 8192, "traffic_bytes": 65536 * 7 // 8}
    ar = s["all-reduce"]  # a combined (tuple) all-reduce of two f32[8,16] over pairs
    assert ar == {"count": 1, "operand_bytes": 1024, "result_bytes": 1024, "traffic_bytes": 1024}
    assert s["collective-permute"] == {"count": 1, "operand_bytes": 512, "result_bytes": 512, "traffic_bytes": 512}
    assert s["all-to-all"] == {"count": 1, "operand_bytes": 512, "result_bytes": 512, "traffic_bytes": 384}
    assert s["total"]["count"] == 8 and s["unknown_trip_counts"] == []


def test_group_sizes_and_shapes():
    assert hlo_stats.group_size("replica_groups=mesh['a'=2,'b'=4] {'b'}", 8) == 4
    assert (
        hlo_stats.group_size(
            "replica_groups=mesh['a'=2,'b'=1,'c'=4], device_ids=([4,2]T(1,0)) {'c'}, dimensions={0}", 8
        )
        == 4
    )
    assert hlo_stats.group_size("replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}", 8) == 2
    assert hlo_stats.group_size("replica_groups={}, to_apply=%add", 8) == 8
    assert hlo_stats.shape_bytes("(bf16[2,3]{1,0}, s32[], pred[4], token[])") == 12 + 4 + 4


def test_tiny_sharded_programs_on_eight_cpu_devices():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "tests", "_hlo_stats_programs.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    only = lambda name: {k: v for k, v in got[name].items() if k in hlo_stats.KINDS and v["count"]}
    # f32[64,128] split 8 ways by rows: each device holds 8 rows (4096 B) and gathers all 64 (32768 B)
    assert only("all_gather") == {
        "all-gather": {"count": 1, "operand_bytes": 4096, "result_bytes": 32768, "traffic_bytes": 32768 * 7 // 8}
    }
    # a column sum over the split rows: f32[128] all-reduced, 2 * 512 * 7/8 bytes sent per device
    assert only("all_reduce") == {
        "all-reduce": {"count": 1, "operand_bytes": 512, "result_bytes": 512, "traffic_bytes": 896}
    }
    assert only("all_reduce_loop")["all-reduce"]["count"] == 3  # once per iteration of the 3-step loop
    assert only("all_reduce_loop")["all-reduce"]["operand_bytes"] == 3 * 512
    # rows -> columns: each device sends 7 of its 8 column blocks of its 8 rows (8 x 16 x 4 B each)
    assert only("all_to_all") == {
        "all-to-all": {"count": 1, "operand_bytes": 4096, "result_bytes": 4096, "traffic_bytes": 3584}
    }
    # XLA:CPU lowers a reduce-scatter as an all-reduce of the f32[64,256] partial products + a slice
    rs = only("reduce_scatter")
    assert sum(v["operand_bytes"] for v in rs.values()) == 64 * 256 * 4


def test_loops_without_a_trip_count_are_reported_per_iteration():
    text = """\
HloModule jit_g, num_partitions=2

%decode (p: f32[16,8]) -> f32[16,8] {
  %p = f32[16,8]{1,0} parameter(0)
  ROOT %ar = f32[16,8]{1,0} all-reduce(%p), channel_id=1, replica_groups={{0,1}}, to_apply=%add
}

%cond (p: f32[16,8]) -> pred[] {
  %p = f32[16,8]{1,0} parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (x: f32[16,8]) -> f32[16,8] {
  %x = f32[16,8]{1,0} parameter(0)
  ROOT %w = f32[16,8]{1,0} while(%x), condition=%cond, body=%decode
}
"""
    s = hlo_stats.collective_bytes(text)
    assert s["unknown_trip_counts"] == ["main/w"]
    assert s["all-reduce"]["count"] == 1  # counted once
    loop = s["per_unknown_loop_iteration"]["main/w"]
    assert loop["nesting"] == 0 and loop["all-reduce"] == {"count": 1, "traffic_bytes": 512}
