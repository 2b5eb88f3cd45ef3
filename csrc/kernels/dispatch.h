// The one map from a GGML type id to the kernels' compile-time TYPE, a case per entry of
// FORMATS (gguf_kernels.h): each kernel is a template over TYPE taking the block size, bytes and
// minimum from format_of(TYPE), its dequantizer from deq_block<TYPE> (dequant.h) and its
// integer dot's unpacking from Blocks<TYPE> (int_codes.h).
#pragma once

#ifndef GMLX_ISA
#error "included from kernels_impl.cpp only, with GMLX_ISA naming the namespace"
#endif

#include "gguf_kernels.h"

namespace gmlx_kernels::GMLX_ISA {
namespace {

// fn.template operator()<TYPE>() for the entry of FORMATS whose type is `type`; nothing for
// another (ops.cpp rejects those before any kernel runs). Always inlined: each caller gets one
// jump table with its kernels inlined in the cases.
template <class F>
[[gnu::always_inline]] inline void with_type(int type, F&& fn) {
  static_assert(sizeof(FORMATS) / sizeof(FORMATS[0]) == 8, "a case below per entry of FORMATS");
  switch (type) {
    case FORMATS[0].type: fn.template operator()<FORMATS[0].type>(); break;
    case FORMATS[1].type: fn.template operator()<FORMATS[1].type>(); break;
    case FORMATS[2].type: fn.template operator()<FORMATS[2].type>(); break;
    case FORMATS[3].type: fn.template operator()<FORMATS[3].type>(); break;
    case FORMATS[4].type: fn.template operator()<FORMATS[4].type>(); break;
    case FORMATS[5].type: fn.template operator()<FORMATS[5].type>(); break;
    case FORMATS[6].type: fn.template operator()<FORMATS[6].type>(); break;
    case FORMATS[7].type: fn.template operator()<FORMATS[7].type>(); break;
    default: break;
  }
}

}  // namespace
}  // namespace gmlx_kernels::GMLX_ISA
