// CH's online step (fbs.model.chunk.ChunkHead.step) for rows `rows` of a ChunkState, in place, one token each:
//   logits = W_bios xn + b;  kt = W_key xn;  start = argmax(logits) != I or the row has no open chunk
//   start closes the open chunk (its mean enters the ring of closed chunks) and opens one with kt, else kt joins
//   attend: q = W_query xn; the token attends (softmax, scaled) over the filled ring slots and its open chunk's
//   mean; c = W_out (that mixture).  Returns (c (b, 1, d) or an undefined tensor, bios logits (b, 1, 4), start).
#pragma once

#include <tuple>

#include "common.h"

namespace fbs_chunk {
// A chunk head's weights as the step reads them (pointers into the tensors it keeps)
struct Weights {
  std::vector<at::Tensor> keep;
  const float *w_bios = nullptr, *b_bios = nullptr, *w_key = nullptr, *w_query = nullptr, *w_out = nullptr;
  int64_t d = 0, R = 0, nl = 0, label_i = 0;
  float scale = 1.f;
};
// The chunk state of a batch (fbs.model.chunk.ChunkState's tensors): B rows, a ring of C closed chunks each.
struct State {
  float* closed;
  int64_t* n_closed;
  float* open_sum;
  int64_t* open_count;
  int64_t batch, C;
};
Weights make(const at::Tensor& w_bios, const at::Tensor& b_bios, const at::Tensor& w_key, const at::Tensor& w_query,
             const at::Tensor& w_out, double scale, int64_t label_i);
State state(at::Tensor& closed, at::Tensor& n_closed, at::Tensor& open_sum, at::Tensor& open_count, int64_t R);
// The step of b tokens X (b, d), token i on the state's row RW[i], in place: C (b, d) when attend, LG (b, nl),
// start (b).
void rows(const Weights& w, const State& s, const float* X, const int64_t* RW, int64_t b, bool attend, float* C,
          float* LG, bool* start);
}  // namespace fbs_chunk

std::tuple<at::Tensor, at::Tensor, std::vector<bool>> chunk_step(
    const at::Tensor& xn, const at::Tensor& rows, at::Tensor& closed, at::Tensor& n_closed, at::Tensor& open_sum,
    at::Tensor& open_count, const at::Tensor& w_bios, const at::Tensor& b_bios, const at::Tensor& w_key,
    const at::Tensor& w_query, const at::Tensor& w_out, double scale, int64_t label_i, bool attend);
