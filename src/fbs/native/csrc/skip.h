// The skip rule of a gated layer in the native step, as fbs.model.skip defines it: a row skips when its gate
// logit exceeds its threshold (p > tau), and the batch policy turns the rows' skips into the rows that run.
// The policy codes come from skip_policy.h, generated at build time from fbs.model.skip.BATCH_POLICIES.
#pragma once

#include <cstdint>

#include "skip_policy.h"

namespace fbs_skip {
inline bool skips(double logit, double threshold) { return logit > threshold; }

// Whether a row runs the layer: its own skip, and n_skip of the step's b rows skip it.
inline bool runs(int64_t policy, bool skip, int64_t n_skip, int64_t b) {
  switch (policy) {
    case kGather:
      return !skip;
    case kAll:
      return n_skip < b;
    default:  // kMajority
      return 2 * n_skip <= b;
  }
}
}  // namespace fbs_skip
