"""Machinery that several method families share, loaded when a method uses it (a module
that needs numba is named `*_kernels` and is imported only when numba is used):

- `exceedance` (and its numba kernels `exceedance_kernels`, with the vector helpers of
  `simd_kernels`): fused threshold passes and exact Top-k selection for the sparsifiers;
- `estimation`, `schedule`: threshold estimation guards and DGC's density warm-up, for
  DGC, RedSync, SIDCo and Gaussian-k;
- `stochastic`, `quantizer_kernels`: counter-based random rounding and the quantizers' and
  Random-k's numba kernels;
- `deflate`: DEFLATE sections for DeepReduce and LGC.
"""
