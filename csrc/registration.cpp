// Schemas of the eagle ops; kernels register per backend with TORCH_LIBRARY_IMPL in the op files.
// The module init makes `import eagle_kernels._C` load this library (and so the registrations).
#include <Python.h>
#include <torch/library.h>

TORCH_LIBRARY(eagle, m) {
  // -> (mask, depths), see DESIGN.md.
  m.def("build_tree(Tensor parents, Tensor sizes) -> (Tensor, Tensor)");
  // CPU value checks that never throw: "" or the first problem (the launchers raise it as ValueError).
  m.def("tree_errors(Tensor parents, Tensor sizes, Tensor? tokens=None, int vocab=0) -> str");
  // -> (accept_path, accept_len, next_token).
  m.def("tree_accept_greedy(Tensor parents, Tensor tokens, Tensor sizes, Tensor target_argmax)"
        " -> (Tensor, Tensor, Tensor)");
  m.def("tree_accept_sample(Tensor parents, Tensor tokens, Tensor sizes, Tensor target_probs,"
        " Tensor uniforms, Tensor? draft_probs=None) -> (Tensor, Tensor, Tensor)");
  // The first index of each row's maximum (CPU, fp32 [..., V] -> int64 [...]).
  m.def("argmax_rows(Tensor x) -> Tensor");
  // One keyed draw a row from logits fp32 [..., V] at temperatures fp32 [...] (0: the argmax): seeds, positions
  // int64 [...], the columns' token ids int64 [V] (None: 0 .. V - 1) -> column indices int64 [...] (CPU).
  m.def("sample_keyed(Tensor logits, Tensor temperatures, Tensor seeds, Tensor positions, Tensor? ids=None) -> Tensor");
  // Top-k then top-p: probs fp32 [R, V], top_k (>= V: off), top_p (>= 1: off), one a row -> the kept tokens
  // renormalised, fp32 [R, V] (CPU).
  m.def("truncate_probs(Tensor probs, int[] top_k, float[] top_p) -> Tensor");
  // Greedy acceptance from the target's logits fp32 [B, N, V] (or their argmax int64 [B, N]) -> the summary a
  // verify round's host reads
  // (int64 [B, 2N + 2]: accepted length, next token, path, tokens on it; CPU).
  m.def("greedy_verdict(Tensor parents, Tensor tokens, Tensor sizes, Tensor logits) -> Tensor");
}

extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "eagle ops (torch.ops.eagle)", -1,
                               nullptr};
  return PyModule_Create(&module);
}
