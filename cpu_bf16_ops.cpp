// The CPU implementations of the torch ops that cpu_bf16_kernels.py declares (kv_eviction::bf16_linears,
// kv_eviction::f32_linears, kv_eviction::bf16_decode_attention, and the two quantized decode attentions),
// calling the C kernels of cpu_bf16_kernels.c and cpu_quantized_attention.c.
// In C++ because a decode step of the bundled model makes ~150 of these calls: through the dispatcher one costs
// ~6 us with its thread fork, through a Python function and ctypes it cost ~16 us (2026-12-02, 2 threads),
// ~1.5 ms a step.
// cpu_bf16_kernels.py checks every condition below before it calls an op; the checks here only guard
// against a caller that did not.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <array>
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
int per_token_decode_attention(const float *q, const uint8_t *kc, const long *kcs, const void *ks, const void *kz,
                               const long *kss, const uint8_t *vc, const long *vcs, const void *vs, const void *vz,
                               const long *vss, int bf16, int bits, const uint8_t *mask, const long *ms, float *out,
                               float *probs, long B, long H, long R, long L, long D, float scale);
int kivi_decode_attention(const float *q, const uint8_t *kc, const long *kcs, const int32_t *group, const long *gs,
                          const void *ks, const void *kz, const long *kss, const uint8_t *vc, const long *vcs,
                          const void *vs, const void *vz, const long *vss, long value_group, const void *kr,
                          const void *vr, const long *rs, const int32_t *slot_res, const long *srs, int bf16,
                          int bits, const uint8_t *mask, const long *ms, float *out, float *probs, long B, long H,
                          long R, long L, long D, float scale);
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

// What the two quantized attention ops share: q as float32 rows, the checks on q and the mask, the outputs.
struct QuantizedCall {
    at::Tensor q, mask, out, probs;
    int64_t B, H, R, L, D;
    bool bf16;
    long ms[4];

    QuantizedCall(const at::Tensor &q_in, const at::Tensor &mask_in, int64_t slots, int64_t bits)
        : q(q_in.to(at::kFloat).contiguous()), B(q.size(0)), H(q.size(1)), R(q.size(2)), L(slots), D(q.size(3)),
          bf16(q_in.scalar_type() == at::kBFloat16) {
        TORCH_CHECK((bits == 2 || bits == 4 || bits == 8) && (D * bits / 8) % 8 == 0 && D <= 256 && R <= 64 &&
                        (q_in.scalar_type() == at::kFloat || bf16) && mask_in.scalar_type() == at::kBool,
                    "quantized decode attention: bad shapes");
        mask = mask_in.expand({B, H, R, L});
        for (int d = 0; d < 4; d++) ms[d] = mask.stride(d);
        out = at::empty({B, H, R, D}, q.options());
        probs = at::empty({B, H, R, L}, q.options());
    }

    // A [B, H, rows, width] operand of the cache's dtype (or `type`), its last dimension contiguous.
    void check(const at::Tensor &t, at::ScalarType type, int64_t width, const char *name) const {
        TORCH_CHECK(t.scalar_type() == type && t.dim() == 4 && t.size(0) == B && t.size(1) == H && t.size(3) == width &&
                        t.stride(3) == 1,
                    "quantized decode attention: ", name, " has the wrong dtype or shape");
    }
    at::ScalarType cache_type() const { return bf16 ? at::kBFloat16 : at::kFloat; }

    std::tuple<at::Tensor, at::Tensor> result(int status, const at::Tensor &q_in) const {
        TORCH_CHECK(status == 0, "quantized decode attention: out of memory for its work buffers");
        return {out.to(q_in.scalar_type()), probs};
    }
};

std::array<long, 3> strides3(const at::Tensor &t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

// q [B, H, R, D] over per-token quantized k, v (codes [B, H, L, D * bits / 8] uint8, scales and zeros [B, H, L, 1]
// in q's dtype), mask broadcastable to [B, H, R, L] -> (out [B, H, R, D] in q's dtype, probabilities float32).
std::tuple<at::Tensor, at::Tensor> per_token_attention_op(const at::Tensor &q_in, const at::Tensor &k_codes,
                                                          const at::Tensor &k_scale, const at::Tensor &k_zero,
                                                          const at::Tensor &v_codes, const at::Tensor &v_scale,
                                                          const at::Tensor &v_zero, const at::Tensor &mask_in,
                                                          int64_t bits) {
    const QuantizedCall c(q_in, mask_in, k_codes.size(2), bits);
    c.check(k_codes, at::kByte, c.D * bits / 8, "k_codes");
    c.check(v_codes, at::kByte, c.D * bits / 8, "v_codes");
    for (const at::Tensor *t : {&k_scale, &k_zero, &v_scale, &v_zero}) {
        c.check(*t, c.cache_type(), 1, "a scale or zero");
        TORCH_CHECK(t->size(2) == c.L, "quantized decode attention: a scale or zero per slot");
    }
    TORCH_CHECK(v_codes.size(2) == c.L && k_scale.strides() == k_zero.strides() && v_scale.strides() == v_zero.strides(),
                "quantized decode attention: a scale and its zero point share their strides");
    const auto kcs = strides3(k_codes), vcs = strides3(v_codes), kss = strides3(k_scale), vss = strides3(v_scale);
    const int status = per_token_decode_attention(
        c.q.const_data_ptr<float>(), k_codes.const_data_ptr<uint8_t>(), kcs.data(), k_scale.const_data_ptr(),
        k_zero.const_data_ptr(), kss.data(), v_codes.const_data_ptr<uint8_t>(), vcs.data(), v_scale.const_data_ptr(),
        v_zero.const_data_ptr(), vss.data(), c.bf16, static_cast<int>(bits),
        static_cast<const uint8_t *>(c.mask.const_data_ptr()), c.ms, c.out.data_ptr<float>(), c.probs.data_ptr<float>(),
        c.B, c.H, c.R, c.L, c.D, 1.0f / std::sqrt(static_cast<float>(c.D)));
    return c.result(status, q_in);
}

// q [B, H, R, D] over KIVI's storage (kv_storage.ResidualQuantizedStorage's buffers: L slots and a scratch row,
// key groups [B, H, G, D], value channel groups [B, H, L + 1, D / Gv], the residual [B, H, E, D] and each slot's
// entry in it), mask broadcastable to [B, H, R, L] -> (out [B, H, R, D] in q's dtype, probabilities float32).
std::tuple<at::Tensor, at::Tensor> kivi_attention_op(
    const at::Tensor &q_in, const at::Tensor &k_codes, const at::Tensor &k_group, const at::Tensor &k_scale,
    const at::Tensor &k_zero, const at::Tensor &v_codes, const at::Tensor &v_scale, const at::Tensor &v_zero,
    const at::Tensor &k_res, const at::Tensor &v_res, const at::Tensor &slot_res, const at::Tensor &mask_in,
    int64_t bits) {
    const QuantizedCall c(q_in, mask_in, mask_in.size(-1), bits);
    const int64_t slots = k_codes.size(2), groups = v_scale.size(3);
    TORCH_CHECK(c.L < slots && groups > 0 && c.D % groups == 0, "kivi decode attention: bad shapes");
    c.check(k_codes, at::kByte, c.D * bits / 8, "k_codes");
    c.check(v_codes, at::kByte, c.D * bits / 8, "v_codes");
    c.check(k_scale, c.cache_type(), c.D, "k_scale");
    c.check(k_zero, c.cache_type(), c.D, "k_zero");
    c.check(v_scale, c.cache_type(), groups, "v_scale");
    c.check(v_zero, c.cache_type(), groups, "v_zero");
    c.check(k_res, c.cache_type(), c.D, "k_res");
    c.check(v_res, c.cache_type(), c.D, "v_res");
    for (const at::Tensor *t : {&k_group, &slot_res})
        TORCH_CHECK(t->scalar_type() == at::kInt && t->dim() == 3 && t->size(2) == slots,
                    "kivi decode attention: group ids and residual entries are int32 [B, H, L + 1]");
    TORCH_CHECK(v_codes.size(2) == slots && v_scale.size(2) == slots && k_scale.strides() == k_zero.strides() &&
                    v_scale.strides() == v_zero.strides() && k_res.strides() == v_res.strides(),
                "kivi decode attention: paired operands share their shapes and strides");
    const auto kcs = strides3(k_codes), vcs = strides3(v_codes), gs = strides3(k_group), kss = strides3(k_scale);
    const auto vss = strides3(v_scale), rs = strides3(k_res), srs = strides3(slot_res);
    const int status = kivi_decode_attention(
        c.q.const_data_ptr<float>(), k_codes.const_data_ptr<uint8_t>(), kcs.data(), k_group.const_data_ptr<int32_t>(),
        gs.data(), k_scale.const_data_ptr(), k_zero.const_data_ptr(), kss.data(), v_codes.const_data_ptr<uint8_t>(),
        vcs.data(), v_scale.const_data_ptr(), v_zero.const_data_ptr(), vss.data(), c.D / groups,
        k_res.const_data_ptr(), v_res.const_data_ptr(), rs.data(), slot_res.const_data_ptr<int32_t>(), srs.data(),
        c.bf16, static_cast<int>(bits), static_cast<const uint8_t *>(c.mask.const_data_ptr()), c.ms,
        c.out.data_ptr<float>(), c.probs.data_ptr<float>(), c.B, c.H, c.R, c.L, c.D,
        1.0f / std::sqrt(static_cast<float>(c.D)));
    return c.result(status, q_in);
}

}  // namespace

TORCH_LIBRARY_IMPL(kv_eviction, CPU, m) {
    m.impl("bf16_linears", linears_op<uint16_t>);
    m.impl("f32_linears", linears_op<float>);
    m.impl("bf16_decode_attention", decode_attention_op);
    m.impl("per_token_decode_attention", per_token_attention_op);
    m.impl("kivi_decode_attention", kivi_attention_op);
}
