"""FLOPs counted from HLO text, against products worked out by hand: every kind of
matrix product the GPU programs hold (fused dots, cuBLAS calls, cuDNN's block-scaled
GEMM and fused attention), loops with and without trip counts, and both branches of
a conditional. The instruction lines are XLA:GPU's, as it printed them (attributes
that do not matter here left out)."""

import pytest

from jaxmoe.plan.hlo import Program
from jaxmoe.plan.program_flops import pass_of, program_flops, scope_of

HLO = """HloModule jit_step, num_partitions=1

%fused_dot (p0: bf16[64,32], p1: bf16[32,16]) -> bf16[64,16] {
  %p0 = bf16[64,32]{1,0} parameter(0)
  %p1 = bf16[32,16]{1,0} parameter(1)
  ROOT %dot.1 = bf16[64,16]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/jvp()/while/body/closed_call/dispatch/expert_gemms/ecd,edf->ecf/dot_general"}
}

%body (loop: (s32[], bf16[64,32])) -> (s32[], bf16[64,32]) {
  %loop = (s32[], bf16[64,32]) parameter(0)
  %i = s32[] get-tuple-element(%loop), index=0
  %x = bf16[64,32]{1,0} get-tuple-element(%loop), index=1
  %w = bf16[32,16]{1,0} constant({...})
  %a = bf16[4,128,256]{2,1,0} constant({...})
  %b = bf16[4,256,64]{2,1,0} constant({...})
  %fusion.1 = bf16[64,16]{1,0} fusion(%x, %w), kind=kCustom, calls=%fused_dot
  %custom-call.1 = (bf16[4,128,64]{2,1,0}, s8[4194304]{0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(step)/transpose(jvp())/while/body/closed_call/dense_mlp/bmk,bkn->bmn/dot_general"}, backend_config={"operation_queue_id":"0","gemm_backend_config":{"selected_algorithm":"0","alpha_real":1,"beta":0,"dot_dimension_numbers":{"lhs_contracting_dimensions":["2"],"rhs_contracting_dimensions":["1"],"lhs_batch_dimensions":["0"],"rhs_batch_dimensions":["0"]},"alpha_imag":0,"epilogue":"DEFAULT"},"force_earliest_schedule":false}
  ROOT %t = (s32[], bf16[64,32]) tuple(%i, %x)
}

%cond (c: (s32[], bf16[64,32])) -> pred[] {
  %c = (s32[], bf16[64,32]) parameter(0)
  ROOT %lt = pred[] constant(true)
}

%unknown_body (u: (s32[], f32[8,8])) -> (s32[], f32[8,8]) {
  %u = (s32[], f32[8,8]) parameter(0)
  %y = f32[8,8]{1,0} get-tuple-element(%u), index=1
  %dot.2 = f32[8,8]{1,0} dot(%y, %y), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/jvp()/router/dot_general"}
  %j = s32[] get-tuple-element(%u), index=0
  ROOT %v = (s32[], f32[8,8]) tuple(%j, %dot.2)
}

%branch_a (ba: f32[8,8]) -> f32[8,8] {
  %ba = f32[8,8]{1,0} parameter(0)
  ROOT %dot.3 = f32[8,8]{1,0} dot(%ba, %ba), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/transpose(jvp())/checkpoint/rematted_computation/lm_head/dot_general"}
}

%branch_b (bb: f32[8,8]) -> f32[8,8] {
  %bb = f32[8,8]{1,0} parameter(0)
  ROOT %neg = f32[8,8]{1,0} negate(%bb)
}

ENTRY %main (x0: bf16[64,32], y0: f32[8,8], q: bf16[2,256,8,64], k: bf16[2,256,2,64], lhs: f8e4m3fn[4,128,256], rhs: f8e4m3fn[4,64,256], ls: f8e8m0fnu[4,128,8], rs: f8e8m0fnu[4,64,8], s: s32[]) -> f32[8,8] {
  %x0 = bf16[64,32]{1,0} parameter(0)
  %y0 = f32[8,8]{1,0} parameter(1)
  %q = bf16[2,256,8,64]{3,2,1,0} parameter(2)
  %k = bf16[2,256,2,64]{3,2,1,0} parameter(3)
  %lhs = f8e4m3fn[4,128,256]{2,1,0} parameter(4)
  %rhs = f8e4m3fn[4,64,256]{2,1,0} parameter(5)
  %ls = f8e8m0fnu[4,128,8]{2,1,0} parameter(6)
  %rs = f8e8m0fnu[4,64,8]{2,1,0} parameter(7)
  %s = s32[] parameter(8)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[64,32]) tuple(%zero, %x0)
  %while.1 = (s32[], bf16[64,32]) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %init2 = (s32[], f32[8,8]) tuple(%zero, %y0)
  %while.2 = (s32[], f32[8,8]) while(%init2), condition=%cond, body=%unknown_body
  %conditional.1 = f32[8,8]{1,0} conditional(%s, %y0, %y0), branch_computations={%branch_a, %branch_b}
  %fmha = (bf16[2,8,256,64]{3,1,2,0}, f32[2,8,256]{2,1,0}, u8[0]{0}) custom-call(%q, %k, %k), custom_call_target="__cudnn$fmhaSoftmax", metadata={op_name="jit(step)/jvp()/attention/dot_product_attention_fwd"}, backend_config={"operation_queue_id": "0", "cudnn_fmha_backend_config": {"fmha_scale": 0.125, "intermediate_tensor_shape": {"element_type": "BF16", "dimensions": ["2", "8", "256", "256"]}, "is_flash_attention": true, "mask_type": "CAUSAL"}}
  %fmha_bwd = (bf16[2,8,256,64]{3,1,2,0}, bf16[2,2,256,64]{3,1,2,0}, bf16[2,2,256,64]{3,1,2,0}, u8[0]{0}) custom-call(%q, %k, %k), custom_call_target="__cudnn$fmhaSoftmaxBackward", metadata={op_name="jit(step)/transpose(jvp())/attention/dot_product_attention_bwd"}, backend_config={"operation_queue_id": "0", "cudnn_fmha_backend_config": {"fmha_scale": 0.125, "intermediate_tensor_shape": {"element_type": "BF16", "dimensions": ["2", "8", "256", "256"]}, "is_flash_attention": true, "mask_type": "CAUSAL"}}
  %scaled = (f32[4,128,64]{2,1,0}, u8[0]{0}) custom-call(%lhs, %rhs, %ls, %rs), custom_call_target="__cudnn$blockScaledDot", metadata={op_name="jit(step)/jvp()/dispatch/expert_gemms/scaled_matmul"}
  %mystery = f32[8]{0} custom-call(%y0), custom_call_target="some_kernel", metadata={op_name="jit(step)/other"}
  ROOT %out = f32[8,8]{1,0} get-tuple-element(%while.2), index=1
}
"""


def test_every_product_kind_by_hand():
    program = Program(HLO)
    flops = program_flops(program)
    by = flops.by_scope
    # the fused dot: [64, 32] x [32, 16], 3 trips
    fused = 3 * 2 * 64 * 16 * 32
    # the block-scaled GEMM: [4, 128, 256] x [4, 64, 256] -> [4, 128, 64]
    assert by["expert_gemms"] == {"forward": fused + 2 * 4 * 128 * 64 * 256}
    # cuBLASLt, batched: [4, 128, 256] x [4, 256, 64], 3 trips, in the backward pass
    assert by["dense_mlp"] == {"backward": 3 * 2 * 4 * 128 * 64 * 256}
    # causal attention: forward 4 B H Lq Lk Dh / 2, backward 2.5 x that
    attention = 4 * 2 * 8 * 256 * 256 * 64 / 2
    assert by["attention"] == {"forward": attention, "backward": 2.5 * attention}
    # a loop without a trip count counts once, and is named
    assert by["router"] == {"forward": 2 * 8 * 8 * 8}
    assert program.loops_without_trip_count == ["while.2"]
    # both branches of the conditional count (an upper bound): the dot in one of them
    assert by["lm_head"] == {"recompute": 2 * 8 * 8 * 8}
    assert flops.unknown_kernels == {"some_kernel": 1}
    assert flops.kernels["expert_gemms"] == {"dot": 3, "__cudnn$blockScaledDot": 1}
    # teeth: the same text with the trip count changed changes the count
    four = program_flops(HLO.replace('"n":"3"', '"n":"4"')).by_scope
    assert four["dense_mlp"]["backward"] == pytest.approx(by["dense_mlp"]["backward"] * 4 / 3)


@pytest.mark.parametrize("op_name, scope, pass_", [
    ("jit(local_step)/shard_map/transpose(jvp(lm_head))/bld,dv->blv/dot_general", "lm_head",
     "backward"),
    ("a/jvp()/while/body/closed_call/dispatch/expert_gemms/ragged_dot_general", "expert_gemms",
     "forward"),
    ("a/transpose(jvp())/checkpoint/rematted_computation/attention/dot_general", "attention",
     "recompute"),
    ("jit(step)/dispatch/etd,te->td/dot_general", "dispatch", "forward"),
    ("", "other", "forward"),
])
def test_scope_and_pass_from_the_name_stack(op_name, scope, pass_):
    assert scope_of(op_name) == scope and pass_of(op_name) == pass_


def _gemm_module(calls: list[str]) -> str:
    """An entry computation around grouped-GEMM calls: x [4096, 1024] rows, 8 groups of
    [1024, 512] weights w (and wt, transposed), output gradients dy, group sizes s."""
    body = "\n".join(calls)
    return f"""HloModule jit_step, num_partitions=1

ENTRY %main (x: bf16[4096,1024], w: bf16[8,1024,512], wt: bf16[8,512,1024], dy: bf16[4096,512], s: s32[8]) -> bf16[4096,512] {{
  %x = bf16[4096,1024]{{1,0}} parameter(0)
  %w = bf16[8,1024,512]{{2,1,0}} parameter(1)
  %wt = bf16[8,512,1024]{{2,1,0}} parameter(2)
  %dy = bf16[4096,512]{{1,0}} parameter(3)
  %s = s32[8]{{0}} parameter(4)
{body}
  ROOT %out = bf16[4096,512]{{1,0}} copy(%fwd)
}}
"""


def _grouped_hlo(target: str) -> str:
    """tokamax's ragged dot in all three passes, tagged as tokamax tags its ops (its Mosaic
    GPU kernel's metadata operands left out); the input gradient against the weight
    transposed and as it is."""
    tag = ('tokamax:{\\"op\\":{\\"__type\\":\\"tokamax._src.ops.ragged_dot.pallas_mosaic_gpu.'
           'PallasMosaicGpuRaggedDot\\",\\"config\\":{\\"block_m\\":128,\\"block_n\\":128}}}')
    meta = lambda stack: f'metadata={{op_name="jit(step)/{stack}/expert_gemms/{tag}"}}'  # noqa: E731
    call = lambda name, out, operands, stack: (  # noqa: E731
        f'  %{name} = {out} custom-call({operands}), custom_call_target="{target}", {meta(stack)}')
    return _gemm_module([
        call("fwd", "bf16[4096,512]{1,0}", "%x, %w, %s", "jvp()"),
        call("dx", "bf16[4096,1024]{1,0}", "%dy, %wt, %s", "transpose(jvp())"),
        call("dx2", "bf16[4096,1024]{1,0}", "%dy, %w, %s", "transpose(jvp())"),
        call("dw", "bf16[8,1024,512]{2,1,0}", "%x, %dy, %s", "transpose(jvp())")])


def test_a_grouped_gemm_counts_the_routed_rows_and_a_tile_per_group():
    program = Program(_grouped_hlo("__gpu$xla.gpu.triton"))
    full = 2.0 * 4096 * 1024 * 512  # every row of the buffer
    assert program_flops(program).by_scope["expert_gemms"] == {"forward": full,
                                                               "backward": 3 * full}
    program.routed_share = 0.45  # 230.4 rows per group: two tiles of 128
    counted = 2.0 * (8 * 256) * 1024 * 512
    flops = program_flops(program)
    assert flops.by_scope["expert_gemms"] == {"forward": counted, "backward": 3 * counted}
    assert flops.kernels["expert_gemms"] == {"grouped": 4}
    # companion: another kernel's custom call with the same shapes is not a grouped GEMM
    other = program_flops(Program(_grouped_hlo("__gpu$xla.gpu.triton").replace(
        "RaggedDot", "FlashAttention")))
    assert "expert_gemms" not in other.by_scope and other.unknown_kernels


def _hlo_string(data: bytes) -> str:
    """`data` as XLA prints a string attribute: C escapes, other bytes as two hex digits."""
    escapes = {10: "\\n", 13: "\\r", 9: "\\t", 92: "\\\\", 34: '\\"', 39: "\\'"}
    return "".join(escapes.get(b, chr(b) if 32 <= b < 127 else f"\\{b:02X}") for b in data)


def _triton_call(name: str, kernel: str, rows: str, tile: int, out: str, operands: str,
                 stack: str) -> str:
    """A jax-triton call as XLA:GPU prints it: the compiled kernel, its Triton IR inside,
    zlib-compressed in the backend config (the IR cut to what names the kernel and its
    row tile; a proto's binary fields around it)."""
    import zlib
    ir = (f"\x0a\x82\x01module {{\n  tt.func public @{kernel}(%a: !tt.ptr<bf16>) {{\n"
          f"    %{rows}_20 = tt.make_range {{end = {tile} : i32, start = 0 : i32}} : "
          f"tensor<{tile}xi32>\n    %offs_n = tt.make_range {{end = 64 : i32, start = 0 : i32}}"
          f" : tensor<64xi32>\n  }}\n}}\x10\x04\x18\xff\x01").encode("latin-1")
    opaque = _hlo_string(zlib.compress(ir))
    return (f'  %{name} = {out} custom-call({operands}), custom_call_target="triton_kernel_call_ffi", '
            f'api_version=API_VERSION_TYPED_FFI, metadata={{op_name="jit(step)/{stack}/'
            f'expert_gemms/triton_kernel_call"}}, backend_config={{opaque = "{opaque}"}}')


def _jax_triton_hlo(forward_kernel: str = "_ragged_dot_kernel") -> str:
    """tokamax's Triton ragged dot inside a `shard_map`, where JAX keeps no tag: forward
    and input gradient (tiles of 128 rows), weight gradient (steps of 32 rows)."""
    return _gemm_module([
        _triton_call("fwd", forward_kernel, "offs_m", 128, "bf16[4096,512]{1,0}",
                     "%x, %w, %s", "jvp()"),
        _triton_call("dx", "_ragged_dot_kernel", "offs_m", 128, "bf16[4096,1024]{1,0}",
                     "%dy, %wt, %s", "transpose(jvp())"),
        _triton_call("dw", "_ragged_contracting_dim_dot_kernel", "offs_k", 32,
                     "bf16[8,1024,512]{2,1,0}", "%x, %dy, %s", "transpose(jvp())")])


def test_a_jax_triton_grouped_gemm_is_read_from_its_kernel():
    """The kernel inside the call names the pass and its row tile: whole tiles of 128 rows
    forward and for the input gradient, steps of 32 for the weight gradient."""
    program = Program(_jax_triton_hlo())
    full = 2.0 * 4096 * 1024 * 512
    flops = program_flops(program)
    assert flops.by_scope["expert_gemms"] == {"forward": full, "backward": 2 * full}
    assert flops.kernels["expert_gemms"] == {"grouped": 3} and not flops.unknown_kernels
    program.routed_share = 0.45  # 230.4 rows per group: two tiles of 128, 8 steps of 32
    counted = program_flops(program).by_scope["expert_gemms"]
    assert counted == {"forward": 2.0 * (8 * 256) * 1024 * 512,
                       "backward": 2.0 * (8 * 256) * 1024 * 512 + 2.0 * (8 * 256) * 1024 * 512}
    program.routed_share = 0.40  # 204.8 rows: two tiles of 128 (256), seven steps of 32 (224)
    counted = program_flops(program).by_scope["expert_gemms"]
    assert counted == {"forward": 2.0 * (8 * 256) * 1024 * 512,
                       "backward": 2.0 * (8 * 256) * 1024 * 512 + 2.0 * (8 * 224) * 1024 * 512}
    # companion: a jax-triton call of another kernel is no grouped GEMM, and is listed
    other = program_flops(Program(_jax_triton_hlo("_flash_attention_kernel")))
    assert other.kernels["expert_gemms"] == {"grouped": 2}
    assert other.unknown_kernels == {"triton_kernel_call_ffi": 1}
