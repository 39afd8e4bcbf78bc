"""The native wing: the CPU fast path, in one place.

    native/
      kernels/          the compiled library and everything that talks to it directly
        csrc/           the C++ sources (attention, packed GEMM, GGUF / int8 blocks, fused
                        decoder layers, greedy decode loop)
        library.py      build (g++, cached by source hash) and load (ctypes)
        abi.py          the ABI, written once: every entry point's signature, every struct
                        shared with C, the ABI version; ctypes declarations and the C header
                        the sources include are both made from it
        ops.py          Python wrappers (shapes, dtypes, checks): dense / packed GEMM, MoE
        attention_ops.py  paged attention and MLA prefill wrappers
        quantized_ops.py  GGUF block and int8 weight wrappers
      fused_decoder.py  all decoder layers of a Llama-family step in one native call
      decode_loop.py    greedy multi-step decode rounds in one native call
      attach.py         the one hook by which a loaded model gets its native decoder stack

`kernels/` sits at the bottom of the package (it imports torch, numpy and `kv_cache_layout`
only), so attention backends, layers and platforms may call it; the decoder stack sits above
the layers and attention it replaces. This file imports nothing, so the two levels stay apart.
"""
