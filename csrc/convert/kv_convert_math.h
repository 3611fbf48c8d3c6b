// Element math shared by the CPU and CUDA layout conversions: where an element of a block lives,
// and the float <-> float16 / bfloat16 / float8 (e4m3fn) conversions, all round-to-nearest-even.
//
// One header for both so the two paths compute bit-identical results: the CPU tests check the
// math against torch here, the GPU tests check the kernels against the same torch reference.
//
// The order of a block's elements: common/block_shape.h.
#pragma once

#include <cstdint>
#include <cstring>

#include "common/block_shape.h"
#include "common/host_device.h"

namespace kvmove {

// Largest finite float8 e4m3fn value: quantization scales a block so its amax lands here.
constexpr float kFloat8Max = 448.0f;

// The KV heads a conversion moves: local heads [src_first, src_first + count) of the source's
// blocks to [dst_first, dst_first + count) of the destination's: where the two shapes' head
// ranges (BlockShape::head_first) overlap. Equal ranges move every head.
struct HeadSpan {
    int32_t src_first;
    int32_t dst_first;
    int32_t count;
};

// Same type on both sides and no float8 scale: an element's bits move unchanged (the host
// copies a head's row at a time), which also keeps a NaN's payload.
KVMOVE_HD bool copies_bits(DType src, DType dst) {
    return src == dst && dst != DType::Float8;
}

// Element index of (kv, token, head, dim) inside one block.
KVMOVE_HD int64_t element_index(const BlockShape& s, int kv, int token, int head, int dim) {
    return s.head_major()
               ? ((static_cast<int64_t>(kv) * s.num_kv_heads + head) * s.block_size + token) *
                         s.head_dim +
                     dim
               : ((static_cast<int64_t>(kv) * s.block_size + token) * s.num_kv_heads + head) *
                         s.head_dim +
                     dim;
}

KVMOVE_HD uint32_t float_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

KVMOVE_HD float bits_float(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

// A non-negative float (an exact multiple of a subnormal step) rounded to the nearest integer,
// ties to even.
KVMOVE_HD uint32_t round_half_even(float scaled) {
    const auto whole = static_cast<uint32_t>(scaled);
    const float rest = scaled - static_cast<float>(whole);
    return whole + ((rest > 0.5f || (rest == 0.5f && (whole & 1))) ? 1 : 0);
}

KVMOVE_HD float half_to_float(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
    const uint32_t exp = (h >> 10) & 0x1F;
    const uint32_t mant = h & 0x3FF;
    if (exp == 0x1F) {  // inf / nan
        return bits_float(sign | 0x7F800000u | (mant << 13));
    }
    if (exp != 0) {
        return bits_float(sign | ((exp + 112) << 23) | (mant << 13));
    }
    // zero or subnormal: mant * 2^-24, exact in float
    const float value = static_cast<float>(mant) * 5.9604644775390625e-08f;
    return sign ? -value : value;
}

KVMOVE_HD uint16_t float_to_half(float f) {
    const uint32_t u = float_bits(f);
    const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000);
    const uint32_t abs = u & 0x7FFFFFFF;
    if (abs > 0x7F800000u) {
        return static_cast<uint16_t>(sign | 0x7E00);  // nan
    }
    if (abs >= 0x477FF000u) {  // rounds to >= 65520: inf
        return static_cast<uint16_t>(sign | 0x7C00);
    }
    if (abs < 0x38800000u) {  // below 2^-14: a half subnormal (or zero), steps of 2^-24;
        // a carry into the smallest normal (0x400) is the right encoding too
        return static_cast<uint16_t>(sign | round_half_even(bits_float(abs) * 16777216.0f));
    }
    // normal: drop 13 mantissa bits with round-to-nearest-even, rebias 127 -> 15
    const uint32_t rounded = abs + 0xFFF + ((abs >> 13) & 1);
    return static_cast<uint16_t>(sign | ((rounded - 0x38000000u) >> 13));
}

KVMOVE_HD float bf16_to_float(uint16_t b) {
    return bits_float(static_cast<uint32_t>(b) << 16);
}

KVMOVE_HD uint16_t float_to_bf16(float f) {
    const uint32_t u = float_bits(f);
    if ((u & 0x7FFFFFFF) > 0x7F800000u) {
        return static_cast<uint16_t>((u >> 16) | 0x40);  // nan stays nan
    }
    return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

KVMOVE_HD float fp8_to_float(uint8_t q) {
    const bool negative = q & 0x80;
    const uint32_t exp = (q >> 3) & 0xF;
    const uint32_t mant = q & 0x7;
    float value;
    if (exp == 0xF && mant == 0x7) {
        value = bits_float(0x7FC00000u);  // e4m3fn has no inf: this is its only nan
    } else if (exp == 0) {
        value = static_cast<float>(mant) * 0.001953125f;  // mant * 2^-9
    } else {
        value = bits_float(((exp + 120) << 23) | (mant << 20));  // rebias 7 -> 127
    }
    return negative ? -value : value;
}

// Saturating (|f| > 448 -> 448), round-to-nearest-even; nan -> nan.
KVMOVE_HD uint8_t float_to_fp8(float f) {
    const uint32_t u = float_bits(f);
    const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80);
    const uint32_t abs = u & 0x7FFFFFFF;
    if (abs > 0x7F800000u) {
        return static_cast<uint8_t>(sign | 0x7F);
    }
    if (abs >= 0x43E00000u) {  // >= 448
        return static_cast<uint8_t>(sign | 0x7E);
    }
    if (abs < 0x3C800000u) {  // below 2^-6: subnormal steps of 2^-9 (8 is the smallest
        // normal, encoded the same way)
        return static_cast<uint8_t>(sign | round_half_even(bits_float(abs) * 512.0f));
    }
    // normal: keep 3 of 23 mantissa bits, round to nearest even, rebias 127 -> 7
    const uint32_t rounded = abs + 0x7FFFF + ((abs >> 20) & 1);
    uint32_t code = (rounded - 0x3C000000u) >> 20;
    if (code > 0x7E) {
        code = 0x7E;
    }
    return static_cast<uint8_t>(sign | code);
}

KVMOVE_HD float load_element(const char* block, DType t, int64_t index) {
    switch (t) {
        case DType::Float32: {
            float f;
            memcpy(&f, block + index * 4, 4);
            return f;
        }
        case DType::Float16: {
            uint16_t h;
            memcpy(&h, block + index * 2, 2);
            return half_to_float(h);
        }
        case DType::BFloat16: {
            uint16_t b;
            memcpy(&b, block + index * 2, 2);
            return bf16_to_float(b);
        }
        default:
            return fp8_to_float(static_cast<uint8_t>(block[index]));
    }
}

KVMOVE_HD void store_element(char* block, DType t, int64_t index, float value) {
    switch (t) {
        case DType::Float32:
            memcpy(block + index * 4, &value, 4);
            break;
        case DType::Float16: {
            uint16_t h = float_to_half(value);
            memcpy(block + index * 2, &h, 2);
            break;
        }
        case DType::BFloat16: {
            uint16_t b = float_to_bf16(value);
            memcpy(block + index * 2, &b, 2);
            break;
        }
        default:
            block[index] = static_cast<char>(float_to_fp8(value));
    }
}

// The scale that maps a block's amax to kFloat8Max (1 for an all-zero block).
KVMOVE_HD float fp8_scale(float amax) {
    return amax > 0.0f ? amax / kFloat8Max : 1.0f;
}

}  // namespace kvmove
