// Warp-level tensor-core building blocks (sm_80 instructions, run on sm_90a): cp.async copies
// global -> shared (zero fill past the data), ldmatrix.x4 (plain and transposed) and
// mma.sync m16n8k16 BF16 x BF16 + FP32. Fragments, lane = 4 * g + t: A (16x16, row-major)
// a[0] = A[g][2t..2t+1], a[1] = A[g+8][2t..], a[2] = A[g][2t+8..], a[3] = A[g+8][2t+8..];
// B (16x8, k x n) b0 = B[2t..2t+1][g], b1 = B[2t+8..2t+9][g]; C (16x8 FP32) c[0..1] = C[g][2t..], c[2..3] = C[g+8][2t..].
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "cuda/kernels/cp_async.cuh"

namespace moe::cuda::kernels {

// Four 8x8 BF16 matrices; lanes 8i..8i+7 give the row addresses (16 bytes each) of matrix i,
// and r[i] receives this lane's two elements of matrix i: row lane/4, columns 2*(lane%4)..+1.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(smem)));
}

// As ldmatrix_x4, each matrix transposed: r[i] holds rows 2*(lane%4)..+1 of column lane/4.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(smem)));
}

// c += A (16x16) * B (16x8), FP32 accumulation.
__device__ __forceinline__ void mma_bf16_16x8x16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two FP32 values as a BF16 pair (round to nearest even), `lo` in the low 16 bits.
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return static_cast<uint32_t>(__bfloat16_as_ushort(v.x)) | (static_cast<uint32_t>(__bfloat16_as_ushort(v.y)) << 16);
}

}  // namespace moe::cuda::kernels
