// Rows taken in blocks of a compile-time count, for kernels whose accumulators per row live in
// registers: one helper for the attention's value products and the packed head's kernels.
#pragma once

#ifndef GMLX_ISA
#error "included from kernels_impl.cpp or layers_impl.cpp only, with GMLX_ISA naming the namespace"
#endif

#include <stdint.h>

#include <utility>  // std::integral_constant, std::integer_sequence: types only, no code

namespace gmlx_kernels::GMLX_ISA {
namespace {

// f(R, r) for rows r .. r + R of `rows`: blocks of MR, then one of the rest. R is a compile-time
// count (a std::integral_constant), so a block's accumulators stay in registers.
template <int MR, class F>
void row_blocks(int64_t rows, F&& f) {
  int64_t r = 0;
  for (; r + MR <= rows; r += MR) f(std::integral_constant<int, MR>{}, r);
  [&]<int... R>(std::integer_sequence<int, R...>) {
    ((rows - r == R + 1 ? f(std::integral_constant<int, R + 1>{}, r) : void()), ...);
  }(std::make_integer_sequence<int, MR - 1>{});
}

}  // namespace
}  // namespace gmlx_kernels::GMLX_ISA
