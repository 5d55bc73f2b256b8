"""Kernels and numerics under the model: which kernel a mesh's devices run (`kernels`:
attention, MXFP8, the ragged exchange), the grouped expert GEMM, microscaling (MX)
formats, and which mesh axes a value varies over inside `shard_map`."""
