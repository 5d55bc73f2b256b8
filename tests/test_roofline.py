"""The roofline against a step worked out by hand: a program of every kind of thing it
times (a memory-bound kernel, a compute-bound GEMM, a sliced operand, an in-place
update, a loop, an asynchronous collective with work in its window and a synchronous
one), in XLA:GPU's text form, on a device with round figures."""

import pytest

from jaxmoe.plan.hlo import Program
from jaxmoe.plan.roofline import LATENCY_S, Link, roofline, summary

HLO = """HloModule jit_step, num_partitions=2

%fused_cast (p0: f32[1024,256]) -> bf16[1024,256] {
  %p0 = f32[1024,256]{1,0} parameter(0)
  ROOT %c = bf16[1024,256]{1,0} convert(%p0), metadata={op_name="jit(step)/working_copy/convert"}
}

%gemm (g0: bf16[1024,256], g1: bf16[256,512]) -> bf16[1024,512] {
  %g0 = bf16[1024,256]{1,0} parameter(0)
  %g1 = bf16[256,512]{1,0} parameter(1)
  ROOT %d = bf16[1024,512]{1,0} dot(%g0, %g1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/jvp()/attention/dot_general"}
}

%fused_slice (s0: f32[64,1024,256], s1: s32[]) -> f32[1,1024,256] {
  %s0 = f32[64,1024,256]{2,1,0} parameter(0)
  %s1 = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %ds = f32[1,1024,256]{2,1,0} dynamic-slice(%s0, %s1, %z, %z), dynamic_slice_sizes={1,1024,256}
}

%fused_update (u0: f32[64,1024,256], u1: f32[1,1024,256], u2: s32[]) -> f32[64,1024,256] {
  %u0 = f32[64,1024,256]{2,1,0} parameter(0)
  %u1 = f32[1,1024,256]{2,1,0} parameter(1)
  %u2 = s32[] parameter(2)
  %z2 = s32[] constant(0)
  ROOT %dus = f32[64,1024,256]{2,1,0} dynamic-update-slice(%u0, %u1, %u2, %z2, %z2)
}

%body (b: (s32[], f32[1024,256])) -> (s32[], f32[1024,256]) {
  %b = (s32[], f32[1024,256]) parameter(0)
  %i = s32[] get-tuple-element(%b), index=0
  %v = f32[1024,256]{1,0} get-tuple-element(%b), index=1
  %cast.1 = bf16[1024,256]{1,0} fusion(%v), kind=kLoop, calls=%fused_cast, metadata={op_name="jit(step)/working_copy/convert"}
  ROOT %t = (s32[], f32[1024,256]) tuple(%i, %v)
}

%cond (c: (s32[], f32[1024,256])) -> pred[] {
  %c = (s32[], f32[1024,256]) parameter(0)
  ROOT %true = pred[] constant(true)
}

ENTRY %main (x: bf16[512,256], w: bf16[256,512], y: f32[1024,256], stack: f32[64,1024,256], k: s32[], a: bf16[1024,256]) -> f32[64,1024,256] {
  %x = bf16[512,256]{1,0} parameter(0)
  %w = bf16[256,512]{1,0} parameter(1)
  %y = f32[1024,256]{1,0} parameter(2)
  %stack = f32[64,1024,256]{2,1,0} parameter(3)
  %k = s32[] parameter(4)
  %a = bf16[1024,256]{1,0} parameter(5)
  %ags = (bf16[512,256]{1,0}, bf16[1024,256]{1,0}) all-gather-start(%x), channel_id=1, replica_groups={{0,1}}, dimensions={0}, use_global_device_ids=true, backend_config={"collective_backend_config":{"is_sync":false}}
  %mm = bf16[1024,512]{1,0} fusion(%a, %w), kind=kCustom, calls=%gemm, metadata={op_name="jit(step)/jvp()/attention/dot_general"}
  %agd = bf16[1024,256]{1,0} all-gather-done(%ags)
  %zero = s32[] constant(0)
  %t0 = (s32[], f32[1024,256]) tuple(%zero, %y)
  %loop = (s32[], f32[1024,256]) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  %a2a = f32[1024,256]{1,0} all-to-all(%y), channel_id=2, replica_groups={{0,1}}, dimensions={0}
  %one = f32[1,1024,256]{2,1,0} fusion(%stack, %k), kind=kLoop, calls=%fused_slice
  ROOT %new = f32[64,1024,256]{2,1,0} fusion(%stack, %one, %k), kind=kLoop, calls=%fused_update
}
"""

# round figures: 1e11 FLOP/s bf16 (2e11 fp8), 1e9 bytes/s of memory and of NVLink
LINK = Link(bf16_flops=1e11, fp8_flops=2e11, hbm=1e9, scale_up=1e9, scale_out=1e8)
MiB = 1 << 20


def _by_hand() -> dict:
    cast = (4 + 2) * 1024 * 256 / LINK.hbm  # reads f32, writes bf16
    gemm_flops = 2 * 1024 * 512 * 256
    gemm_bytes = (1024 * 256 + 256 * 512 + 1024 * 512) * 2
    gemm = max(gemm_flops / LINK.bf16_flops, gemm_bytes / LINK.hbm)  # compute-bound here
    gather = 512 * 256 * 2 / LINK.scale_up + LATENCY_S["scale_up"]  # one shard to one peer
    exchange = 1024 * 256 * 4 / 2 / LINK.scale_up + LATENCY_S["scale_up"]  # half stays home
    # the slice reads its slice (and the index), the update writes its update in place
    slice_ = (MiB + 4 + MiB) / LINK.hbm
    update = (MiB + 4 + MiB) / LINK.hbm
    return {"cast": cast, "gemm": gemm, "gemm_flops": gemm_flops, "gather": gather,
            "exchange": exchange, "slice": slice_, "update": update,
            # the gather hides behind the GEMM; the loop runs its cast 4 times; the
            # synchronous exchange blocks
            "step": gemm + 4 * cast + exchange + slice_ + update}


def test_roofline_equals_the_hand_computation():
    r = roofline(Program(HLO), LINK)
    hand = _by_hand()
    kernels = {k.name: k for k in r.kernels}
    assert kernels["mm"].kind == "gemm" and kernels["mm"].flops == hand["gemm_flops"]
    assert kernels["mm"].seconds == pytest.approx(hand["gemm"], rel=1e-9)
    assert kernels["cast.1"].seconds == pytest.approx(hand["cast"], rel=1e-9)
    assert kernels["cast.1"].runs == 4 and kernels["cast.1"].scope == "working_copy"
    assert kernels["one"].seconds == pytest.approx(hand["slice"], rel=1e-9)
    assert kernels["new"].seconds == pytest.approx(hand["update"], rel=1e-9)
    assert r.step_s == pytest.approx(hand["step"], rel=1e-9)
    assert r.exposed == pytest.approx({"a2a": hand["exchange"]}, rel=1e-9)
    assert r.window_kinds == {"ags": {"gemm"}}
    sync = {c.name: c.asynchronous for c in r.collectives}
    assert sync == {"ags": True, "a2a": False}
    s = summary(r, model_flops=hand["gemm_flops"], tokens_per_device=1000, link=LINK)
    assert s["tokens_per_s_per_device"] == pytest.approx(1000 / hand["step"], rel=1e-9)
    assert s["mfu"] == pytest.approx(hand["gemm_flops"] / hand["step"] / 1e11, rel=1e-9)
    assert s["memory_bound_s"] == pytest.approx(4 * hand["cast"] + hand["slice"] + hand["update"],
                                                rel=1e-9)
    assert s["synchronous_collectives"] == 1


def test_an_exposed_gather_and_a_whole_operand_are_seen():
    """Companions: with the GEMM's input the gathered rows, the gather has nothing to
    hide behind and its whole time is exposed; a fusion that reads a parameter whole
    (not through a slice) counts all of it."""
    done = "  %agd = bf16[1024,256]{1,0} all-gather-done(%ags)\n"
    gemm = "  %mm = bf16[1024,512]{1,0} fusion(%a, %w)"
    r = roofline(Program(HLO.replace(done, "").replace(gemm, done + gemm.replace("%a,", "%agd,"))),
                 LINK)
    hand = _by_hand()
    assert r.exposed["ags"] == pytest.approx(hand["gather"], rel=1e-9)
    assert r.step_s == pytest.approx(hand["step"] + hand["gather"], rel=1e-9)

    whole = Program(HLO.replace(
        "ROOT %ds = f32[1,1024,256]{2,1,0} dynamic-slice(%s0, %s1, %z, %z), "
        "dynamic_slice_sizes={1,1024,256}",
        "%n = f32[64,1024,256]{2,1,0} negate(%s0)\n  ROOT %ds = f32[1,1024,256]{2,1,0} "
        "dynamic-slice(%n, %s1, %z, %z), dynamic_slice_sizes={1,1024,256}"))
    one = {k.name: k for k in roofline(whole, LINK).kernels}["one"]
    assert one.bytes == 64 * MiB + 4 + MiB
