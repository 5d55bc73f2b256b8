"""The collective counter against bytes worked out by hand, on programs small
enough to do so, and on HLO text in the forms XLA prints."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, PartitionSpec as P

from jaxmoe.plan.collectives import (collective_bytes, collectives, compiled_collectives,
                                         replica_groups, totals)

X = 8 * 16 * 4  # bytes of each device's f32[8, 16] block


@pytest.fixture(scope="module")
def ops():
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4, 1), ("a", "b", "one"),
                axis_types=(AxisType.Auto,) * 3)

    def f(x):
        outs = {
            "psum4": jax.lax.psum(x, "b"),
            "psum1": jax.lax.psum(x * 3, "one"),
            "gather2": jax.lax.all_gather(x, "a", tiled=True),
            "scatter4": jax.lax.psum_scatter(x, "b", tiled=True),
            "a2a4": jax.lax.all_to_all(x, "b", 0, 0, tiled=True),
            "permute": jax.lax.ppermute(x, "b", [(i, (i + 1) % 4) for i in range(4)]),
        }

        def body(c, _):
            return c + jax.lax.psum(c, "a"), None

        outs["scan5"], _ = jax.lax.scan(body, x * 2, None, length=5)
        return sum(jnp.sum(o) for o in outs.values())[None]

    step = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(("a", "b")), out_specs=P(("a", "b")),
                                 check_vma=False))
    return compiled_collectives(step.lower(jnp.ones((64, 16))).compile())


def test_each_kind_by_hand(ops):
    got = totals(ops)
    # psum over 4: 2 (4-1)/4 X; five psums over 2 in a loop: 5 x 2 (2-1)/2 X
    assert got["all-reduce"].bytes == 2 * 3 * X // 4 + 5 * X
    assert got["all-reduce"].runs == 1 + 5
    assert got["all-reduce"].ops_in_loops == 1
    assert got["all-gather"].bytes == (2 - 1) * X  # the shard to the one peer
    assert got["reduce-scatter"].bytes == 3 * X // 4
    assert got["all-to-all"].bytes == 3 * X // 4  # one of four blocks stays
    assert got["collective-permute"].bytes == X
    for kind in ("all-gather", "reduce-scatter", "all-to-all", "collective-permute"):
        assert got[kind].runs == 1 and got[kind].ops_in_loops == 0


def test_a_group_of_one_moves_nothing(ops):
    # XLA keeps the psum over the size-1 axis as an all-reduce over groups of one
    lonely = [c for c in ops if c.group_size == 1]
    assert [(c.kind, c.operand_bytes, c.sent_bytes) for c in lonely] == [("all-reduce", X, 0)]


HLO = """HloModule m, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (p: (s32[], f32[256])) -> (s32[], f32[256]) {
  %p = (s32[], f32[256]) parameter(0)
  %g = f32[256] get-tuple-element(%p), index=1
  %lonely = f32[256] all-reduce(%g), replica_groups={{0},{1},{2},{3},{4},{5},{6},{7}}, to_apply=%add
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[256]) tuple(%i, %lonely)
}

ENTRY %main (x: f32[256]) -> f32[256] {
  %x = f32[256] parameter(0)
  %iota = f32[256] all-reduce(%x), replica_groups=[2,4]<=[8], to_apply=%add
  %all = f32[256] all-reduce(%iota), replica_groups={}, to_apply=%add
  %ag = f32[1024] all-gather(%all), replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}
  %rs = f32[64] reduce-scatter(%all), replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}, to_apply=%add
  %self = f32[256] collective-permute(%all), source_target_pairs={{0,0},{1,1}}
  %z = s32[] constant(0)
  %init = (s32[], f32[256]) tuple(%z, %all)
  %w = (s32[], f32[256]) while(%init), condition=%body, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %out = f32[256] get-tuple-element(%w), index=1
}
"""


def test_mesh_axes_replica_groups():
    """XLA 0.12's form names the mesh and the axes each group runs over; groups equal the
    iota forms' for the same axes (companions: another axis, another device order)."""
    mesh = "replica_groups=mesh['a'=2,'b'=4,'one'=1]"
    assert replica_groups(f"{mesh} {{'b'}}", 8) == replica_groups("replica_groups=[2,4]<=[8]", 8)
    assert replica_groups(f"{mesh} {{'a'}}", 8) == replica_groups(
        "replica_groups=[4,2]<=[2,4]T(1,0)", 8)
    assert replica_groups(f"{mesh} {{'one'}}", 8) == tuple((i,) for i in range(8))
    assert replica_groups(f"{mesh} {{'a','b','one'}}", 8) == (tuple(range(8)),)
    # listed order is the order within a group
    assert replica_groups("replica_groups=mesh['a'=2,'b'=4] {'b','a'}", 8) == (
        (0, 4, 1, 5, 2, 6, 3, 7),)
    # sub-axes 'a':(pre)size: size positions of a, below `pre` positions of coarser ones
    assert replica_groups("replica_groups=mesh['a'=8] {'a':(2)2}", 8) == (
        (0, 2), (1, 3), (4, 6), (5, 7))
    assert replica_groups("replica_groups=mesh['a'=8] {'a':(1)2}", 8) == (
        (0, 4), (1, 5), (2, 6), (3, 7))
    assert replica_groups("replica_groups=mesh['a'=8] {'a':(1)2,'a':(4)2}", 8) == (
        (0, 1, 4, 5), (2, 3, 6, 7))
    # devices laid out otherwise than in order
    assert replica_groups("replica_groups=mesh['a'=2,'b'=2], device_ids=(0,2,1,3) {'b'}",
                          4) == ((0, 2), (1, 3))
    assert replica_groups("replica_groups=mesh['a'=2,'b'=4], device_ids=([2,4]<=[4,2]T(1,0)) "
                          "{'b'}", 8) == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert replica_groups("replica_groups=maximal_mesh[device_id=3] {}", 8) == ((3,),)


def test_replica_group_forms_in_text():
    assert replica_groups("replica_groups=[2,4]<=[8]", 8) == ((0, 1, 2, 3), (4, 5, 6, 7))
    # the transposed iota: groups along the major axis of a [2, 4] mesh
    assert replica_groups("replica_groups=[4,2]<=[2,4]T(1,0)", 8) == (
        (0, 4), (1, 5), (2, 6), (3, 7))
    assert replica_groups("replica_groups={}", 8) == (tuple(range(8)),)
    assert replica_groups("replica_groups={{0,4},{1,5}}", 8) == ((0, 4), (1, 5))
    by_name = {c.name: c for c in collectives(HLO)}
    assert by_name["lonely"].group_size == 1 and by_name["lonely"].sent_bytes == 0
    assert by_name["lonely"].runs == 3 and by_name["lonely"].in_loop
    assert by_name["self"].sent_bytes == 0
    assert collective_bytes(HLO) == {
        "all-gather": 1 * 1024,  # 256 f32 to the other device of the pair
        "reduce-scatter": 3 * 1024 // 4,
        "all-reduce": 2 * 3 * 1024 // 4 + 2 * 7 * 1024 // 8,
        "all-to-all": 0, "collective-permute": 0}
    assert totals(collectives(HLO))["all-reduce"].ops_in_loops == 0  # the one in the loop sends nothing
