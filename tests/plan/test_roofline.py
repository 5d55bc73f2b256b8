"""The roofline against a step worked out by hand: a program of every kind of thing it
times (a memory-bound kernel, a compute-bound GEMM, a sliced operand, an in-place
update, a loop, an asynchronous collective with work in its window and a synchronous
one), in XLA:GPU's text form, on a device with round figures."""

import numpy as np
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


# ---------------------------------------------------------------- host memory

# an activation offloaded as XLA:GPU lowers it: an asynchronous update of a pinned
# host buffer (S(5)) with one layer's slice, a GEMM in its window, and later an
# asynchronous slice back whose done the next kernel waits on at once
OFFLOAD = """HloModule jit_step, num_partitions=1

%to_host (h0: bf16[8,1024,256], h1: bf16[1,1024,256], h2: s32[]) -> bf16[8,1024,256] {
  %h0 = bf16[8,1024,256]{2,1,0:S(5)} parameter(0)
  %h1 = bf16[1,1024,256]{2,1,0} parameter(1)
  %h2 = s32[] parameter(2)
  %hz = s32[] constant(0)
  ROOT %hdus = bf16[8,1024,256]{2,1,0:S(5)} dynamic-update-slice(%h0, %h1, %h2, %hz, %hz)
}

%from_host (f0: bf16[8,1024,256], f1: s32[]) -> bf16[1,1024,256] {
  %f0 = bf16[8,1024,256]{2,1,0:S(5)} parameter(0)
  %f1 = s32[] parameter(1)
  %fz = s32[] constant(0)
  ROOT %fds = bf16[1,1024,256]{2,1,0} dynamic-slice(%f0, %f1, %fz, %fz), dynamic_slice_sizes={1,1024,256}
}

%gemm (g0: bf16[1024,256], g1: bf16[256,512]) -> bf16[1024,512] {
  %g0 = bf16[1024,256]{1,0} parameter(0)
  %g1 = bf16[256,512]{1,0} parameter(1)
  ROOT %d = bf16[1024,512]{1,0} dot(%g0, %g1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (buf: bf16[8,1024,256], act: bf16[1,1024,256], k: s32[], a: bf16[1024,256], w: bf16[256,512]) -> bf16[1,1024,256] {
  %buf = bf16[8,1024,256]{2,1,0:S(5)} parameter(0)
  %act = bf16[1,1024,256]{2,1,0} parameter(1)
  %k = s32[] parameter(2)
  %a = bf16[1024,256]{1,0} parameter(3)
  %w = bf16[256,512]{1,0} parameter(4)
  %out-start = ((bf16[8,1024,256]{2,1,0:S(5)}, bf16[1,1024,256]{2,1,0}, s32[]), bf16[8,1024,256]{2,1,0:S(5)}, u32[]) fusion-start(%buf, %act, %k), kind=kLoop, calls=%to_host
  %mm = bf16[1024,512]{1,0} fusion(%a, %w), kind=kCustom, calls=%gemm
  %out-done = bf16[8,1024,256]{2,1,0:S(5)} fusion-done(%out-start)
  %in-start = ((bf16[8,1024,256]{2,1,0:S(5)}, s32[]), bf16[1,1024,256]{2,1,0}, u32[]) fusion-start(%out-done, %k), kind=kLoop, calls=%from_host
  ROOT %in-done = bf16[1,1024,256]{2,1,0} fusion-done(%in-start)
}
"""


def test_offloaded_activations_cross_the_host_link_beside_compute():
    """Each transfer moves its slice (not the host buffer) over the host link, on a
    copy stream of its own: the write hides behind the GEMM in its window, the read
    back, with nothing in its window, is exposed whole. Companions: the same program
    with the buffer in device memory prices them as HBM kernels, and the step differs,
    and a host link 10x faster shrinks the exposed read 10x."""
    link = Link(bf16_flops=1e11, fp8_flops=2e11, hbm=1e9, scale_up=1e9, scale_out=1e8,
                host=1e9)
    slice_ = 1024 * 256 * 2  # one layer's activation, bf16
    gemm = 2 * 1024 * 512 * 256 / link.bf16_flops  # compute-bound at these figures
    moved = slice_ / link.host
    assert moved < gemm  # the write fits in the GEMM's window
    r = roofline(Program(OFFLOAD), link)
    assert [t.bytes for t in r.host_transfers] == [slice_, slice_]
    assert all(t.asynchronous for t in r.host_transfers)
    assert r.host_seconds() == pytest.approx(2 * moved, rel=1e-12)
    assert r.host_exposed == pytest.approx({"in-start": moved}, rel=1e-12)
    assert r.step_s == pytest.approx(gemm + moved, rel=1e-12)
    assert [k.name for k in r.kernels] == ["mm"]  # no transfer is priced as a kernel
    s = summary(r, model_flops=1.0, tokens_per_device=1.0, link=link)
    assert s["host_transfer_bytes"] == 2 * slice_
    assert s["exposed_host_s"] == pytest.approx(moved, rel=1e-12)
    assert s["exposed_collective_s"] == 0

    faster = roofline(Program(OFFLOAD), Link(**{**link.__dict__, "host": 1e10}))
    assert faster.host_exposed["in-start"] == pytest.approx(moved / 10, rel=1e-12)
    on_device = roofline(Program(OFFLOAD.replace(":S(5)}", "}")), link)
    assert on_device.host_transfers == [] and len(on_device.kernels) == 3
    assert on_device.step_s != pytest.approx(r.step_s, rel=1e-3)


def test_the_expected_step_prices_host_copies_at_their_rate():
    link = Link(bf16_flops=1e11, fp8_flops=2e11, hbm=1e9, scale_up=1e9, scale_out=1e8,
                rates=ROUND, host=1e8)
    r = roofline(Program(OFFLOAD), link)
    assert r.host_seconds() == pytest.approx(2 * 1024 * 256 * 2 / (1e8 * 0.5), rel=1e-12)


# ---------------------------------------------------------------- the expected step

from jaxmoe.plan.rates import BLACKWELL, HOPPER, Rate, Rates, rates_for  # noqa: E402


def _rate(v):
    return Rate(v, "round figure")


# round fractions, so that each kernel's expected time is easy to write out
ROUND = Rates(generation="round", gemm=((1e6, 0.25), (1e9, 0.5)), gemm_source="round",
              fp8=_rate(0.5), grouped=((128, 0.5), (256, 1.0)), grouped_source="round",
              block_scaled=_rate(1.5), attention_forward=_rate(0.6),
              attention_backward=_rate(0.4), hbm=_rate(0.8), scale_up=_rate(0.5),
              all_to_all=_rate(0.25), scale_out=_rate(0.5), latency_s=_rate(1e-5),
              launch_s=_rate(1e-6), host_copy=_rate(0.5))
NEUTRAL = Rates(generation="datasheet", gemm=((1.0, 1.0),), gemm_source="", fp8=_rate(1.0),
                grouped=((1.0, 1.0),), grouped_source="", block_scaled=_rate(2.0),
                attention_forward=_rate(1.0), attention_backward=_rate(1.0), hbm=_rate(1.0),
                scale_up=_rate(1.0), all_to_all=_rate(1.0), scale_out=_rate(1.0),
                latency_s=_rate(LATENCY_S["scale_up"]), launch_s=_rate(0.0),
                host_copy=_rate(1.0))


def test_rates_are_looked_up_between_measured_points():
    import math
    # linear in log(FLOPs) between points, flat past either end
    at = 2 * 1024 * 512 * 256
    assert ROUND.gemm_fraction(at) == pytest.approx(
        0.25 + 0.25 * (math.log(at) - math.log(1e6)) / (math.log(1e9) - math.log(1e6)))
    assert ROUND.gemm_fraction(1e3) == 0.25 and ROUND.gemm_fraction(1e12) == 0.5
    assert ROUND.grouped_factor(181.0) == pytest.approx(
        0.5 + 0.5 * math.log(181 / 128) / math.log(2))
    # each generation by its compute capability; every row names a source, and one that
    # is an assumption says so
    assert rates_for("9.0") is HOPPER and rates_for("10.3") is BLACKWELL
    with pytest.raises(ValueError, match="compute capability 8.0"):
        rates_for("8.0")
    for rates in (HOPPER, BLACKWELL):
        for name, value, source, assumed in rates.rows():
            assert source and value, name
            assert not assumed or "assumed" in source, name
        # measured fractions are below the datasheet; the GEMM curve rises with size
        fractions = [v for _, v in rates.gemm]
        assert fractions == sorted(fractions) and fractions[-1] < 1


def _expected_by_hand() -> dict:
    link = Link(LINK.bf16_flops, LINK.fp8_flops, LINK.hbm, LINK.scale_up, LINK.scale_out,
                ROUND)
    hbm, launch = LINK.hbm * 0.8, 1e-6
    gemm_flops = 2 * 1024 * 512 * 256
    gemm_bytes = (1024 * 256 + 256 * 512 + 1024 * 512) * 2
    gemm = max(gemm_flops / (LINK.bf16_flops * ROUND.gemm_fraction(gemm_flops)),
               gemm_bytes / hbm) + launch
    cast = (4 + 2) * 1024 * 256 / hbm + launch
    slice_ = update = (MiB + 4 + MiB) / hbm + launch
    gather = 512 * 256 * 2 / (LINK.scale_up * 0.5) + 1e-5
    exchange = 1024 * 256 * 4 / 2 / (LINK.scale_up * 0.25) + 1e-5  # an all-to-all's rate
    return {"link": link, "gemm": gemm, "cast": cast, "gather": gather, "exchange": exchange,
            "step": gemm + 4 * cast + exchange + slice_ + update}


def test_the_expected_step_prices_each_class_at_its_rate():
    """The same walk as the bound, each kernel at its measured fraction plus a launch,
    each collective at its link's fraction plus the measured latency. Companion: with
    every fraction 1 and no launch cost, the expected step is the bound."""
    hand = _expected_by_hand()
    r = roofline(Program(HLO), hand["link"])
    kernels = {k.name: k for k in r.kernels}
    assert kernels["mm"].seconds == pytest.approx(hand["gemm"], rel=1e-9)
    assert kernels["cast.1"].seconds == pytest.approx(hand["cast"], rel=1e-9)
    assert r.exposed == pytest.approx({"a2a": hand["exchange"]}, rel=1e-9)
    assert r.step_s == pytest.approx(hand["step"], rel=1e-9)
    assert r.step_s > roofline(Program(HLO), LINK).step_s * 1.5
    neutral = Link(LINK.bf16_flops, LINK.fp8_flops, LINK.hbm, LINK.scale_up, LINK.scale_out,
                   NEUTRAL)
    assert roofline(Program(HLO), neutral).step_s == pytest.approx(
        roofline(Program(HLO), LINK).step_s, rel=1e-12)


GROUPED = r"""HloModule jit_experts, num_partitions=1

ENTRY %main (x: bf16[4096,256], w: bf16[8,256,512], g: s32[8], qx: f8e4m3fn[8,512,256], qw: f8e4m3fn[8,1024,256], sx: f8e8m0fnu[8,512,8], sw: f8e8m0fnu[8,1024,8]) -> (bf16[4096,512], bf16[8,512,1024]) {
  %x = bf16[4096,256]{1,0} parameter(0)
  %w = bf16[8,256,512]{2,1,0} parameter(1)
  %g = s32[8]{0} parameter(2)
  %qx = f8e4m3fn[8,512,256]{2,1,0} parameter(3)
  %qw = f8e4m3fn[8,1024,256]{2,1,0} parameter(4)
  %sx = f8e8m0fnu[8,512,8]{2,1,0} parameter(5)
  %sw = f8e8m0fnu[8,1024,8]{2,1,0} parameter(6)
  %rd = bf16[4096,512]{1,0} custom-call(%x, %w, %g), custom_call_target="mosaic_gpu", metadata={op_name="jit(experts)/expert_gemms/tokamax:{\"op\":{\"__type\":\"tokamax.RaggedDot\"},\"block_m\":64}"}
  %bs = bf16[8,512,1024]{2,1,0} custom-call(%qx, %qw, %sx, %sw), custom_call_target="__cudnn$blockScaledDot", metadata={op_name="jit(experts)/expert_gemms/dot"}
  ROOT %t = (bf16[4096,512]{1,0}, bf16[8,512,1024]{2,1,0}) tuple(%rd, %bs)
}
"""


@pytest.mark.parametrize("share, per_group", [(0.5, 256), (0.25, 128)])
def test_a_grouped_gemm_by_rows_per_group_and_a_block_scaled_one(share, per_group):
    """tokamax's grouped GEMM at `routed_share` x C / E rows per group: its FLOPs at the
    rate of a dense GEMM of its size times the grouped factor at that many rows (1.0 at
    256, 0.5 at 128: the rows per group move it); cuDNN's block-scaled GEMM at its
    factor over bf16 (the bound: at the fp8 peak)."""
    program = Program(GROUPED)
    program.routed_share = share
    link = Link(LINK.bf16_flops, LINK.fp8_flops, LINK.hbm, LINK.scale_up, LINK.scale_out,
                ROUND)
    kernels = {k.name: k for k in roofline(program, link).kernels}
    grouped = 8 * per_group * 2 * 256 * 512  # whole tiles of 64 rows: per_group exactly
    assert kernels["rd"].flops == grouped
    rd_bytes = (4096 * 256 + 8 * 256 * 512 + 4096 * 512) * 2 + 8 * 4
    factor = {256: 1.0, 128: 0.5}[per_group]
    assert kernels["rd"].seconds == pytest.approx(max(
        grouped / (LINK.bf16_flops * ROUND.gemm_fraction(grouped) * factor),
        rd_bytes / (LINK.hbm * 0.8)) + 1e-6, rel=1e-9)
    scaled = 2 * 8 * 512 * 1024 * 256
    bs_bytes = 8 * 512 * 256 + 8 * 1024 * 256 + 8 * 512 * 8 + 8 * 1024 * 8 + 8 * 512 * 1024 * 2
    assert kernels["bs"].seconds == pytest.approx(max(
        scaled / (LINK.bf16_flops * ROUND.gemm_fraction(scaled) * 1.5),
        bs_bytes / (LINK.hbm * 0.8)) + 1e-6, rel=1e-9)
    bound = {k.name: k for k in roofline(program, LINK).kernels}
    assert bound["bs"].seconds == pytest.approx(max(scaled / LINK.fp8_flops, bs_bytes / LINK.hbm))


def test_the_plan_prints_what_xla_recomputes_only_where_it_does(capsys):
    """A walk with kernels XLA rematerialised prints their count and seconds beside
    the step's parts; a walk without prints no such line."""
    from jaxmoe.plan.planner import print_roofline

    walk = {"rates": "blackwell", "step_s": 13.5, "tokens_per_s_per_device": 4842.0,
            "model_tflops_per_device": 542.0, "mfu": 0.241, "gemm_s": 8.2,
            "memory_bound_s": 3.9, "memory_bound_bytes": 3.1e13, "collective_s": 2.0,
            "exposed_collective_s": 1.1, "synchronous_collectives": 0,
            "memory_bound_by_scope": {}, "exposed_by_scope": {},
            "xla_recomputed": {"kernels": 291, "runs": 21360, "bytes": 1.11e13,
                               "seconds": 2.555}}
    print_roofline(walk, expected=True)
    line = [x for x in capsys.readouterr().out.splitlines() if "XLA recomputes" in x]
    assert line == ["    XLA recomputes to fit the device's memory (its rematerialisation, "
                    "beyond the remat policy): 291 kernels, 2.555 s (1.11e+13 B in 21360 runs)"]
    print_roofline({**walk, "xla_recomputed": {"kernels": 0, "runs": 0, "bytes": 0.0,
                                               "seconds": 0.0}}, expected=True)
    assert "XLA recomputes" not in capsys.readouterr().out


LOCKSTEP_HLO = """HloModule jit_pass, num_partitions=2

%fused_cast (p0: f32[1024,256]) -> bf16[1024,256] {
  %p0 = f32[1024,256]{1,0} parameter(0)
  ROOT %c = bf16[1024,256]{1,0} convert(%p0)
}

%idle (i0: f32[1024,256]) -> f32[1024,256] {
  ROOT %i0 = f32[1024,256]{1,0} parameter(0)
}

%work (w0: f32[1024,256]) -> f32[1024,256] {
  %w0 = f32[1024,256]{1,0} parameter(0)
  %cast.2 = bf16[1024,256]{1,0} fusion(%w0), kind=kLoop, calls=%fused_cast
  ROOT %back = f32[1024,256]{1,0} convert(%cast.2)
}

%body (b: (s32[], f32[1024,256])) -> (s32[], f32[1024,256]) {
  %b = (s32[], f32[1024,256]) parameter(0)
  %i = s32[] get-tuple-element(%b), index=0
  %v = f32[1024,256]{1,0} get-tuple-element(%b), index=1
  %op = f32[1024,256]{1,0} conditional(%i, %v, %v), branch_computations={%idle, %work}, metadata={op_name="jit(pass)/while/body/lockstep_branch=b_kind/cond"}
  ROOT %t = (s32[], f32[1024,256]) tuple(%i, %op)
}

%cond (c: (s32[], f32[1024,256])) -> pred[] {
  %c = (s32[], f32[1024,256]) parameter(0)
  ROOT %true = pred[] constant(true)
}

ENTRY %main (y: f32[1024,256]) -> (s32[], f32[1024,256]) {
  %y = f32[1024,256]{1,0} parameter(0)
  %zero = s32[] constant(0)
  %t0 = (s32[], f32[1024,256]) tuple(%zero, %y)
  ROOT %loop = (s32[], f32[1024,256]) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
}
"""


def test_a_lockstep_loop_takes_each_trip_at_its_slowest_stage():
    """A 1F1B pass's conditionals follow tables (`one_f_one_b.branches`): over 3 trips,
    stage 0 works in trip 0 and stage 1 in trip 1, so the loop takes 2 trips' work (each
    trip as long as its slowest stage), where the slowest branch in every trip would be
    3 and either stage's own work 1. A conditional without tables stays at its slowest
    branch."""
    program = Program(LOCKSTEP_HLO)
    work = roofline(program, LINK).step_s / 3  # every trip its slowest branch
    assert work > 0
    tables = {"b_kind": np.array([[1, 0], [0, 1], [0, 0]])}  # [trip, stage]
    assert roofline(program, LINK, branches=tables).step_s == pytest.approx(2 * work, rel=1e-9)
    assert roofline(program, LINK, branches={"other": tables["b_kind"]}).step_s == \
        pytest.approx(3 * work, rel=1e-9)
    with pytest.raises(ValueError, match="3 trips, tables of 2"):
        roofline(program, LINK, branches={"b_kind": tables["b_kind"][:2]})
    # the counts: a device runs the working branch in 2 of the 6 (trip, stage) on
    # average, 1 of its 3 trips (without tables, in all 3)
    runs = lambda r: {k.name: k.runs for k in r.kernels}["cast.2"]  # noqa: E731
    assert runs(roofline(program, LINK)) == 3
    weighed = roofline(Program(LOCKSTEP_HLO, tables), LINK)
    assert runs(weighed) == pytest.approx(1.0)
    assert weighed.step_s == pytest.approx(2 * work, rel=1e-9)  # the program's own tables
