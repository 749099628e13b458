"""Machinery that several method families share, loaded when a method uses it:

- `exceedance` (and its numba kernels `_exceedance_numba`, `simd`): fused threshold passes
  and exact Top-k selection for the sparsifiers;
- `estimation`, `schedule`: threshold estimation guards and DGC's density warm-up, for
  DGC, RedSync, SIDCo and Gaussian-k;
- `stochastic`, `kernels`: counter-based random rounding and the quantizers' and Random-k's
  numba kernels;
- `deflate`: DEFLATE sections for DeepReduce and LGC.
"""
