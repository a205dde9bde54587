// The CPU implementations of the torch ops that cpu_bf16_kernels.py declares (kv_eviction::bf16_linears,
// kv_eviction::f32_linears, kv_eviction::bf16_decode_attention, kv_eviction::quantized_decode_attention),
// calling the C kernels of cpu_bf16_kernels.c and cpu_quantized_attention.c.
// In C++ because a decode step of the bundled model makes ~150 of these calls: through the dispatcher one costs
// ~6 us with its thread fork, through a Python function and ctypes it cost ~16 us (2026-12-02, 2 threads),
// ~1.5 ms a step.
// cpu_bf16_kernels.py checks every condition below before it calls an op; the checks here only guard
// against a caller that did not.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <vector>

extern "C" {
int bf16_linears(const uint16_t *x, long G, const uint16_t *const *w, const uint16_t *const *b, const long *N,
                 uint16_t *y, long M, long K);
void f32_linears(const float *x, long G, const float *const *w, const float *const *b, const long *N, float *y,
                 long M, long K);
int bf16_decode_attention(const uint16_t *q, const long *qs, const uint16_t *k, const long *ks, const uint16_t *v,
                          const long *vs, const uint8_t *mask, const long *ms, uint16_t *out, float *probs, long B,
                          long H, long R, long L, long D, float scale);
int quantized_decode_attention(const float *q, const uint8_t *kc, const long *kcs, const void *ks, const void *kz,
                               const long *kss, const uint8_t *vc, const long *vcs, const void *vs, const void *vz,
                               const long *vss, int scale_bf16, int bits, const uint8_t *mask, const long *ms,
                               float *out, float *probs, long B, long H, long R, long L, long D, float scale);
}

namespace {

const uint16_t *bf16_data(const at::Tensor &t) { return static_cast<const uint16_t *>(t.const_data_ptr()); }

void check_bf16_cpu(const at::Tensor &t, const char *name) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16, name, " must be a bfloat16 CPU tensor");
}

// The element type of each linears op: bf16_linears' uint16_t (bfloat16 bits), f32_linears' float.
template <typename T> constexpr at::ScalarType scalar_type_of() {
    return std::is_same_v<T, float> ? at::kFloat : at::kBFloat16;
}

int call_linears(const uint16_t *x, long G, const uint16_t *const *w, const uint16_t *const *b, const long *N,
                 uint16_t *y, long M, long K) {
    return bf16_linears(x, G, w, b, N, y, M, K);
}

int call_linears(const float *x, long G, const float *const *w, const float *const *b, const long *N, float *y,
                 long M, long K) {
    f32_linears(x, G, w, b, N, y, M, K);
    return 0;
}

// x [..., K] @ [w0; w1; ...]^T + [b0; b1; ...] -> [..., N0 + N1 + ...], in bfloat16 (T = uint16_t) or float32.
template <typename T>
at::Tensor linears_op(const at::Tensor &x, at::TensorList weights, const c10::List<std::optional<at::Tensor>> &biases) {
    const int64_t K = x.size(-1), G = static_cast<int64_t>(weights.size());
    TORCH_CHECK(K % 8 == 0 && G > 0 && static_cast<int64_t>(biases.size()) == G, "linears: bad shapes");
    auto check = [](const at::Tensor &t, const char *name) {
        TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == scalar_type_of<T>(), name,
                    " must be a CPU tensor of the op's dtype");
    };
    auto data = [](const at::Tensor &t) { return static_cast<const T *>(t.const_data_ptr()); };
    check(x, "x");
    const at::Tensor rows = x.reshape({-1, K}).contiguous();
    std::vector<const T *> w(G), b(G);
    std::vector<long> n(G);
    int64_t total = 0;
    for (int64_t g = 0; g < G; g++) {
        const at::Tensor &weight = weights[g];
        check(weight, "weight");
        TORCH_CHECK(weight.dim() == 2 && weight.size(1) == K && weight.is_contiguous(), "linears: weight shape");
        w[g] = data(weight);
        n[g] = weight.size(0);
        total += n[g];
        const std::optional<at::Tensor> bias = biases.get(g);
        if (bias.has_value()) {
            check(*bias, "bias");
            TORCH_CHECK(bias->is_contiguous() && bias->numel() == n[g], "linears: bias shape");
        }
        b[g] = bias.has_value() ? data(*bias) : nullptr;
    }
    at::Tensor y = at::empty({rows.size(0), total}, x.options());
    const int status = call_linears(data(rows), G, w.data(), b.data(), n.data(), static_cast<T *>(y.data_ptr()),
                                    rows.size(0), K);
    TORCH_CHECK(status == 0, "bf16_linears: out of memory for the float32 copy of the input");
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = total;
    return y.view(shape);
}

// q [B, H, R, D] over k, v [B, H, L, D], mask broadcastable to [B, H, R, L] -> (out [B, H, R, D] bfloat16,
// probabilities [B, H, R, L] float32).
std::tuple<at::Tensor, at::Tensor> decode_attention_op(const at::Tensor &q_in, const at::Tensor &k_in,
                                                       const at::Tensor &v_in, const at::Tensor &mask_in) {
    auto last_dim_contiguous = [](const at::Tensor &t) { return t.stride(-1) == 1 ? t : t.contiguous(); };
    const at::Tensor q = last_dim_contiguous(q_in), k = last_dim_contiguous(k_in), v = last_dim_contiguous(v_in);
    for (const at::Tensor *t : {&q, &k, &v}) check_bf16_cpu(*t, "q, k and v");
    TORCH_CHECK(q.dim() == 4 && k.sizes() == v.sizes() && k.size(0) == q.size(0) && k.size(1) == q.size(1) &&
                    k.size(3) == q.size(3) && q.size(3) % 8 == 0 && q.size(3) <= 256 &&
                    mask_in.scalar_type() == at::kBool,
                "bf16_decode_attention: bad shapes");
    const int64_t B = q.size(0), H = q.size(1), R = q.size(2), D = q.size(3), L = k.size(2);
    const at::Tensor mask = mask_in.expand({B, H, R, L});
    at::Tensor out = at::empty({B, H, R, D}, q.options());
    at::Tensor probs = at::empty({B, H, R, L}, q.options().dtype(at::kFloat));
    long strides[4][4];
    const at::Tensor *operands[4] = {&q, &k, &v, &mask};
    for (int i = 0; i < 4; i++)
        for (int d = 0; d < 4; d++) strides[i][d] = operands[i]->stride(d);
    const int status = bf16_decode_attention(
        bf16_data(q), strides[0], bf16_data(k), strides[1], bf16_data(v), strides[2],
        static_cast<const uint8_t *>(mask.const_data_ptr()), strides[3], static_cast<uint16_t *>(out.data_ptr()),
        probs.data_ptr<float>(), B, H, R, L, D, 1.0f / std::sqrt(static_cast<float>(D)));
    TORCH_CHECK(status == 0, "bf16_decode_attention: out of memory for the float32 query rows");
    return {out, probs};
}

// q [B, H, R, D] over per-token quantized k, v (codes [B, H, L, D * bits / 8] uint8, scales and zeros [B, H, L, 1]
// in q's dtype), mask broadcastable to [B, H, R, L] -> (out [B, H, R, D] in q's dtype, probabilities [B, H, R, L]
// float32).
std::tuple<at::Tensor, at::Tensor> quantized_attention_op(const at::Tensor &q_in, const at::Tensor &k_codes_in,
                                                          const at::Tensor &k_scale, const at::Tensor &k_zero,
                                                          const at::Tensor &v_codes_in, const at::Tensor &v_scale,
                                                          const at::Tensor &v_zero, const at::Tensor &mask_in,
                                                          int64_t bits) {
    const at::Tensor q = q_in.to(at::kFloat).contiguous();
    auto last_dim_contiguous = [](const at::Tensor &t) { return t.stride(-1) == 1 ? t : t.contiguous(); };
    const at::Tensor k_codes = last_dim_contiguous(k_codes_in), v_codes = last_dim_contiguous(v_codes_in);
    const int64_t B = q.size(0), H = q.size(1), R = q.size(2), D = q.size(3), L = k_codes.size(2);
    const bool scale_bf16 = q_in.scalar_type() == at::kBFloat16;
    TORCH_CHECK((bits == 2 || bits == 4 || bits == 8) && (D * bits / 8) % 8 == 0 && D <= 256 &&
                    (q_in.scalar_type() == at::kFloat || scale_bf16) && q.dim() == 4 &&
                    k_codes.sizes() == v_codes.sizes() && k_codes.scalar_type() == at::kByte &&
                    v_codes.scalar_type() == at::kByte && k_codes.size(0) == B && k_codes.size(1) == H &&
                    k_codes.size(3) == D * bits / 8 && mask_in.scalar_type() == at::kBool,
                "quantized_decode_attention: bad shapes");
    for (const at::Tensor *t : {&k_scale, &k_zero, &v_scale, &v_zero})
        TORCH_CHECK(t->scalar_type() == q_in.scalar_type() && t->dim() == 4 && t->size(0) == B && t->size(1) == H &&
                        t->size(2) == L && t->size(3) == 1,
                    "quantized_decode_attention: scales and zeros [B, H, L, 1] in the query's dtype");
    TORCH_CHECK(k_scale.strides() == k_zero.strides() && v_scale.strides() == v_zero.strides(),
                "quantized_decode_attention: a scale and its zero point share their strides");
    const at::Tensor mask = mask_in.expand({B, H, R, L});
    at::Tensor out = at::empty({B, H, R, D}, q.options());
    at::Tensor probs = at::empty({B, H, R, L}, q.options());
    long strides[5][4];
    const at::Tensor *operands[5] = {&k_codes, &v_codes, &k_scale, &v_scale, &mask};
    for (int i = 0; i < 5; i++)
        for (int d = 0; d < 4; d++) strides[i][d] = operands[i]->stride(d);
    const int status = quantized_decode_attention(
        q.const_data_ptr<float>(), k_codes.const_data_ptr<uint8_t>(), strides[0], k_scale.const_data_ptr(),
        k_zero.const_data_ptr(), strides[2], v_codes.const_data_ptr<uint8_t>(), strides[1], v_scale.const_data_ptr(),
        v_zero.const_data_ptr(), strides[3], scale_bf16, static_cast<int>(bits),
        static_cast<const uint8_t *>(mask.const_data_ptr()), strides[4], out.data_ptr<float>(),
        probs.data_ptr<float>(), B, H, R, L, D, 1.0f / std::sqrt(static_cast<float>(D)));
    TORCH_CHECK(status == 0, "quantized_decode_attention: out of memory for its work buffers");
    return {out.to(q_in.scalar_type()), probs};
}

}  // namespace

TORCH_LIBRARY_IMPL(kv_eviction, CPU, m) {
    m.impl("bf16_linears", linears_op<uint16_t>);
    m.impl("f32_linears", linears_op<float>);
    m.impl("bf16_decode_attention", decode_attention_op);
    m.impl("quantized_decode_attention", quantized_attention_op);
}
