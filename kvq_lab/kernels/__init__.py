"""Kernels: plain tensors in, plain tensors out. Below the cache, above the quantizer (`kvq_lab.quant`).

- `view`: what every decode-attention kernel reads, one step's packed K/V as plain tensors (`DecodeView`).
- `torch_path`: the pure-PyTorch implementations (decode attention, whole-group quantization, dequantization):
  the specification the other kernels are tested against.
- `cpu_build`: the C library (cpu_kernel.c): built on first use, cached with its digest, loaded with ctypes.
- `cpu_kernel`: decode attention as one native call into it.
- `cpu_native`: the same library's other calls: the caches' finiteness check, the hadamard transform.
- `triton`: quantize+pack, unpack+dequantize and fused decode attention, a file each (imported only when chosen).
- `workspace`: reused scratch buffers and small constants.

Nothing here imports `kvq_lab.cache`: the cache builds the views and chooses the kernel
(`kvq_lab.cache.routing.backends`).
"""
