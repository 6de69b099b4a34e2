// CH's online step (fbs.model.chunk.ChunkHead.step) for rows `rows` of a ChunkState, in place, one token each:
//   logits = W_bios xn + b;  kt = W_key xn;  start = argmax(logits) != I or the row has no open chunk
//   start closes the open chunk (its mean enters the ring of closed chunks) and opens one with kt, else kt joins
//   attend: q = W_query xn; the token attends (softmax, scaled) over the filled ring slots and its open chunk's
//   mean; c = W_out (that mixture).  Returns (c (b, 1, d) or an undefined tensor, bios logits (b, 1, 4), start).
#pragma once

#include <tuple>

#include "common.h"

std::tuple<at::Tensor, at::Tensor, std::vector<bool>> chunk_step(
    const at::Tensor& xn, const at::Tensor& rows, at::Tensor& closed, at::Tensor& n_closed, at::Tensor& open_sum,
    at::Tensor& open_count, const at::Tensor& w_bios, const at::Tensor& b_bios, const at::Tensor& w_key,
    const at::Tensor& w_query, const at::Tensor& w_out, double scale, int64_t label_i, bool attend);
