// Split-KV attention of a few newest queries per sequence over float32 caches, for the CPU: every
// sequence, KV head and chunk of keys of one packed forward is one work item of one parallel loop, so a
// batch's attention is one call and 3 KV heads still spread over any number of threads. Each item
// streams its keys and values once (blocks of kBlock keys: scores, an online softmax, weighted values);
// the items of a (sequence, head) are merged in order by their log-sum-exp, so the result does not
// depend on the thread count. Built at first use by `kvlab.attention_kernels.NEWEST_ATTENTION`
// (torch.utils.cpp_extension).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t kBlock = 16;
// A score no key has (finite: the kernel is built with -ffast-math, which assumes no infinities): a key in
// a query's future, and a running maximum before any key.
constexpr float kNone = -1e30f;

struct View {
  const float* data;
  int64_t head_stride;
  int64_t token_stride;
};

View view_of(const at::Tensor& tensor) {  // [1, H_kv, T, D] or [H_kv, T, D], last dim contiguous
  const int64_t rank = tensor.dim();
  return {tensor.data_ptr<float>(), tensor.stride(rank - 3), tensor.stride(rank - 2)};
}

struct Item {
  int64_t sequence, head, begin, end;
};

// Rows [rows x dim] of (scaled) queries of one KV head against its keys [begin, end): the unnormalized
// output (acc), the running maximum (top) and the mass under it. Row r is query r % num_queries of its
// sequence's newest num_queries, so it sees keys up to num_keys - num_queries + r % num_queries.
template <int64_t kDim>
void attend_range(const float* queries, int64_t rows, int64_t runtime_dim, int64_t num_queries, int64_t num_keys,
                  const float* keys, int64_t key_stride, const float* values, int64_t value_stride,
                  int64_t begin, int64_t end, float* acc, float* top, float* mass) {
  const int64_t dim = kDim > 0 ? kDim : runtime_dim;  // a known size unrolls the products over it
  std::vector<float> scores(static_cast<size_t>(rows * kBlock));
  std::fill(acc, acc + rows * dim, 0.0f);
  std::fill(top, top + rows, kNone);
  std::fill(mass, mass + rows, 0.0f);
  for (int64_t start = begin; start < end; start += kBlock) {
    const int64_t count = std::min(kBlock, end - start);
    for (int64_t j = 0; j < count; ++j) {
      const float* key = keys + (start + j) * key_stride;
      for (int64_t r = 0; r < rows; ++r) {
        const float* query = queries + r * dim;
        float score = 0.0f;
#pragma omp simd reduction(+ : score)
        for (int64_t d = 0; d < dim; ++d) score += query[d] * key[d];
        const int64_t last_visible = num_keys - num_queries + r % num_queries;
        scores[r * kBlock + j] = start + j <= last_visible ? score : kNone;
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      float* row = scores.data() + r * kBlock;
      // A block short of keys weighs its missing ones 0, as a query weighs keys in its future: the sums below
      // always run over kBlock entries, so a query's output does not depend on how many keys follow it (a
      // verify's row equals the plain step at its position, bit for bit).
      std::fill(row + count, row + kBlock, kNone);
      float block_top = kNone;
      for (int64_t j = 0; j < kBlock; ++j) block_top = std::max(block_top, row[j]);
      if (block_top <= kNone) {  // every key of the block is in this row's future
        std::fill(row, row + kBlock, 0.0f);
        continue;
      }
      const float new_top = std::max(top[r], block_top);
      const float correction = std::exp(top[r] - new_top);  // 0 while top is still kNone
      float block_mass = 0.0f;
#pragma omp simd reduction(+ : block_mass)
      for (int64_t j = 0; j < kBlock; ++j) {
        row[j] = std::exp(row[j] - new_top);
        block_mass += row[j];
      }
      if (correction != 1.0f) {
        float* out = acc + r * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) out[d] *= correction;
      }
      mass[r] = mass[r] * correction + block_mass;
      top[r] = new_top;
    }
    for (int64_t j = 0; j < count; ++j) {
      const float* value = values + (start + j) * value_stride;
      for (int64_t r = 0; r < rows; ++r) {
        const float weight = scores[r * kBlock + j];
        float* out = acc + r * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) out[d] += weight * value[d];
      }
    }
  }
}

}  // namespace

// queries[i]: [H_kv, R_i, D] float32 contiguous, the newest num_queries[i] queries of sequence i with
// the R_i / num_queries[i] heads of each KV head's group folded in (row = g * q + query), unscaled.
// keys[i], values[i]: [1, H_kv, T_i, D] or [H_kv, T_i, D] float32, last dimension contiguous, the
// queries' own keys last. Returns [H_kv, R_i, D] per sequence.
std::vector<at::Tensor> newest_attention(const std::vector<at::Tensor>& queries, const std::vector<at::Tensor>& keys,
                                         const std::vector<at::Tensor>& values, const std::vector<int64_t>& num_queries,
                                         double scaling, int64_t chunk) {
  const auto count = static_cast<int64_t>(queries.size());
  TORCH_CHECK(static_cast<int64_t>(keys.size()) == count && static_cast<int64_t>(values.size()) == count &&
                  static_cast<int64_t>(num_queries.size()) == count,
              "one keys, values and query count per sequence");
  TORCH_CHECK(chunk >= kBlock, "chunks of at least ", kBlock, " keys");
  std::vector<at::Tensor> scaled(count);
  std::vector<Item> items;
  std::vector<int64_t> first_item(count + 1);
  int64_t max_rows = 0, dim = 0;
  for (int64_t i = 0; i < count; ++i) {
    const auto& k = keys[i];
    const auto& v = values[i];
    TORCH_CHECK(queries[i].dim() == 3 && queries[i].scalar_type() == at::kFloat, "queries [H_kv, R, D] float32");
    TORCH_CHECK(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat, "float32 keys and values");
    TORCH_CHECK(k.stride(-1) == 1 && v.stride(-1) == 1, "keys and values contiguous in their last dimension");
    TORCH_CHECK(k.size(-3) == queries[i].size(0) && k.sizes() == v.sizes(), "keys, values and queries disagree");
    TORCH_CHECK(num_queries[i] >= 1 && queries[i].size(1) % num_queries[i] == 0 && k.size(-2) >= num_queries[i],
                "rows must be whole groups of the newest queries");
    scaled[i] = (queries[i] * scaling).contiguous();
    max_rows = std::max(max_rows, queries[i].size(1));
    TORCH_CHECK(i == 0 || queries[i].size(2) == dim, "one head size for every sequence");
    dim = queries[i].size(2);
    TORCH_CHECK(k.size(-1) == dim, "keys and queries of one head size");
    first_item[i] = static_cast<int64_t>(items.size());
    const int64_t num_keys = k.size(-2);
    for (int64_t head = 0; head < k.size(-3); ++head)
      for (int64_t begin = 0; begin < num_keys; begin += chunk)
        items.push_back({i, head, begin, std::min(begin + chunk, num_keys)});
  }
  first_item[count] = static_cast<int64_t>(items.size());
  const auto num_items = static_cast<int64_t>(items.size());
  std::vector<float> acc(static_cast<size_t>(num_items * max_rows * dim));
  std::vector<float> top(static_cast<size_t>(num_items * max_rows));
  std::vector<float> mass(static_cast<size_t>(num_items * max_rows));
  at::parallel_for(0, num_items, 1, [&](int64_t from, int64_t to) {
    for (int64_t n = from; n < to; ++n) {
      const Item& item = items[n];
      const auto& q = scaled[item.sequence];
      const View k = view_of(keys[item.sequence]);
      const View v = view_of(values[item.sequence]);
      const int64_t rows = q.size(1);
      const auto attend = dim == 64 ? attend_range<64> : dim == 128 ? attend_range<128>
                          : dim == 256 ? attend_range<256> : attend_range<0>;
      attend(q.data_ptr<float>() + item.head * rows * dim, rows, dim, num_queries[item.sequence],
                   keys[item.sequence].size(-2), k.data + item.head * k.head_stride, k.token_stride,
                   v.data + item.head * v.head_stride, v.token_stride, item.begin, item.end,
                   acc.data() + n * max_rows * dim, top.data() + n * max_rows, mass.data() + n * max_rows);
    }
  });
  std::vector<at::Tensor> outputs(count);
  for (int64_t i = 0; i < count; ++i) {
    const int64_t heads = queries[i].size(0), rows = queries[i].size(1);
    outputs[i] = at::empty({heads, rows, dim}, queries[i].options());
    float* out = outputs[i].data_ptr<float>();
    for (int64_t head = 0; head < heads; ++head) {
      for (int64_t r = 0; r < rows; ++r) {
        float overall = kNone;
        for (int64_t n = first_item[i]; n < first_item[i + 1]; ++n)
          if (items[n].head == head) overall = std::max(overall, top[n * max_rows + r]);
        float total = 0.0f;
        float* row = out + (head * rows + r) * dim;
        std::fill(row, row + dim, 0.0f);
        for (int64_t n = first_item[i]; n < first_item[i + 1]; ++n) {
          if (items[n].head != head || top[n * max_rows + r] <= kNone) continue;
          const float share = std::exp(top[n * max_rows + r] - overall);
          total += mass[n * max_rows + r] * share;
          const float* part = acc.data() + (n * max_rows + r) * dim;
          for (int64_t d = 0; d < dim; ++d) row[d] += part[d] * share;
        }
        for (int64_t d = 0; d < dim; ++d) row[d] /= total;
      }
    }
  }
  return outputs;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("newest_attention", &newest_attention, "split-KV attention of each sequence's newest queries");
}
