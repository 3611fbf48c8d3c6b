#include "common/block_shape.h"

#include <sstream>

namespace kvmove {

namespace {

constexpr DType kDTypes[] = {DType::Float32, DType::Float16, DType::BFloat16, DType::Float8};
constexpr BlockOrder kOrders[] = {BlockOrder::NHD, BlockOrder::HND, BlockOrder::VllmCpu,
                                  BlockOrder::MLA};

}  // namespace

const char* dtype_name(DType t) {
    switch (t) {
        case DType::Float32:
            return "float32";
        case DType::Float16:
            return "float16";
        case DType::BFloat16:
            return "bfloat16";
        case DType::Float8:
            return "float8";
    }
    return "unknown";
}

bool parse_dtype(const std::string& name, DType& out) {
    for (DType t : kDTypes) {
        if (name == dtype_name(t)) {
            out = t;
            return true;
        }
    }
    return false;
}

const char* order_name(BlockOrder order) {
    switch (order) {
        case BlockOrder::NHD:
            return "NHD";
        case BlockOrder::HND:
            return "HND";
        case BlockOrder::VllmCpu:
            return "vllm-cpu";
        case BlockOrder::MLA:
            return "mla";
    }
    return "unknown";
}

bool parse_order(const std::string& name, BlockOrder& out) {
    for (BlockOrder order : kOrders) {
        if (name == order_name(order)) {
            out = order;
            return true;
        }
    }
    return false;
}

namespace {

// "[4, 8) of 8".
std::string head_span(const BlockShape& s) {
    std::ostringstream os;
    os << "[" << s.head_first << ", " << s.head_first + s.num_kv_heads << ") of "
       << s.total_kv_heads;
    return os.str();
}

}  // namespace

std::string shape_difference(int64_t num_layers, const BlockShape& here, int64_t peer_num_layers,
                             const BlockShape& there, const std::string& peer) {
    std::ostringstream os;
    auto field = [&](const char* name, const auto& a, const auto& b) {
        if (os.tellp() == 0 && a != b) {
            os << name << ": " << a << " here, " << b << " at '" << peer << "'";
        }
    };
    field("num_layers", num_layers, peer_num_layers);
    field("num_kv_heads", here.num_kv_heads, there.num_kv_heads);
    field("head_dim", here.head_dim, there.head_dim);
    field("dtype", std::string(dtype_name(here.dtype)), std::string(dtype_name(there.dtype)));
    field("block_size", here.block_size, there.block_size);
    field("order", std::string(order_name(here.order)), std::string(order_name(there.order)));
    field("KV heads (tensor-parallel split)", head_span(here), head_span(there));
    return os.str();
}

}  // namespace kvmove
