// Canonical fp32 summation order shared by every tree-acceptance implementation (C++, CUDA,
// Triton, torch reference). Plain C++: included by torch-free .cu files.
//
// The vocabulary [0, V) is cut into segments of kCdfSegment consecutive tokens. A segment's sum is
// accumulated sequentially from 0 in index order; a distribution's total is the sequential sum of
// its segment sums. The inverse CDF of u picks the first token i (segment s) with
//   fl(before_s + inner_i) > fl(u * total),
// where before_s is the sequential sum of the segment sums before s and inner_i the sequential
// sum of segment s up to and including i. At the end of segment s, inner_i equals the segment sum,
// so the search can skip whole segments exactly. If rounding leaves no such token, the last token
// with positive mass is taken. Every step is one IEEE round-to-nearest fp32 operation, so all
// implementations return bit-identical results for the same inputs and uniforms.
#pragma once

namespace eagle {

constexpr int kCdfSegment = 256;

}  // namespace eagle
