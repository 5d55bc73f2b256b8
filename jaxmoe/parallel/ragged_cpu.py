"""A CPU lowering of `lax.ragged_all_to_all`, so the `ragged` dispatcher runs on CPU.

XLA:CPU rejects the HLO op ragged-all-to-all at compile time. This module gives
JAX's primitive a second lowering, registered for the cpu platform only, built
from `all_to_all` on padded buffers: every rank sends every destination its whole
operand [N, ...] plus, per slice bound there, each row's target position (out of
range for rows outside the slice), and the receiver scatters the rows into
`output`. The result is exact for any offsets the real op accepts, but it moves
R x N rows per rank instead of the routed ones and scatters J x N for J slices,
so it is for testing the ragged path on CPU (the offsets plan, the receive
layout, JAX's own transpose and batching rules of the primitive), never a fast
path. GPU programs keep the real custom call: the lowering is per platform.

It reaches into private JAX (`jax._src`): `install_cpu_lowering` is called
explicitly where `ragged` is chosen on CPU and turns a missing name into a
ConfigError on `moe.dispatcher`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxmoe.config import ConfigError
from jaxmoe.ops.vma import vary, varying_axes

_installed = False


def ragged_all_to_all_via_all_to_all(operand, output, input_offsets, send_sizes,
                                     output_offsets, recv_sizes, *, axis_name,
                                     axis_index_groups=None):
    """`lax.ragged_all_to_all`'s documented semantics from two tiled `all_to_all`s.

    The offsets and sizes describe J slices, Jr = J / R per destination rank. The
    operand has N rows, the output No. recv_sizes is implied by the senders'
    send_sizes, as the real op requires the two to agree.
    """
    del recv_sizes
    if axis_index_groups is not None:
        raise NotImplementedError("ragged_all_to_all on CPU: axis_index_groups is not supported")
    axis_name = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    R = lax.axis_size(axis_name)
    J, N, No = input_offsets.shape[0], operand.shape[0], output.shape[0]
    in_off_J, size_J, out_off_J = (a.astype(jnp.int32)[:, None]
                                   for a in (input_offsets, send_sizes, output_offsets))
    n_N = jnp.arange(N, dtype=jnp.int32)
    inside_JxN = (n_N >= in_off_J) & (n_N < in_off_J + size_J)
    pos_JxN = jnp.where(inside_JxN, out_off_J + n_N - in_off_J, No)  # No: not in this slice
    # Destination-major in, source-major out: block r then holds what rank r sent here.
    pos_RxJrxN = lax.all_to_all(vary(pos_JxN.reshape(R, J // R, N), axis_name),
                                axis_name, 0, 0, tiled=True)
    rows_RxN = lax.all_to_all(vary(jnp.broadcast_to(operand, (R,) + operand.shape), axis_name),
                              axis_name, 0, 0, tiled=True)
    rows_RxJrxN = jnp.broadcast_to(rows_RxN[:, None], (R, J // R) + operand.shape)
    return output.at[pos_RxJrxN.reshape(-1)].set(
        rows_RxJrxN.reshape((J * N,) + operand.shape[1:]), mode="drop")


def install_cpu_lowering() -> None:
    """Registers the padded exchange as ragged_all_to_all's cpu lowering (idempotent)."""
    global _installed
    if _installed:
        return
    try:
        from jax._src.interpreters import mlir
        from jax._src.lax.parallel import ragged_all_to_all_p
        varying_axes(0.0)  # the type field `vary` reads at lowering time (AttributeError)
        rule = mlir.lower_fun(ragged_all_to_all_via_all_to_all, multiple_results=False)
        mlir.register_lowering(ragged_all_to_all_p, rule, platform="cpu")
    except (ImportError, AttributeError, TypeError) as e:
        raise ConfigError(
            f"moe.dispatcher: 'ragged' on CPU needs a CPU lowering of ragged_all_to_all, "
            f"registered through private JAX names that jax {jax.__version__} lacks ({e}); "
            "use 'alltoall' or 'allgather' on CPU") from e
    _installed = True
