"""Where the cache meets attention and the kernels: `attention` (the `kvq_sdpa` routing: packed K/V to the fused decode
kernels, masked K/V of token policies), `backends` (which kernel backend a config gets and what it can read), `rope`
(RoPE cos/sin at each token's positions, for positional transforms)."""
