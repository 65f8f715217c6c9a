// Every dblast op schema, in one place. Kernels are registered per dispatch key in
// csrc/cpu/*.cpp and csrc/cuda/*.cu; fake (meta) implementations live in dblast_ext/ops.py.
#include <torch/library.h>

#include <string>

#include "dblast/kernel_variant.h"

#ifndef DBLAST_TORCH_VERSION
#define DBLAST_TORCH_VERSION "unknown"
#endif
#ifndef DBLAST_CUDA_ARCHS
#define DBLAST_CUDA_ARCHS ""
#endif

namespace dblast {

// Facts fixed at build time, as JSON: read by dblast_ext.build_info().
std::string build_info() {
#ifdef DBLAST_WITH_CUDA
  const bool cuda = true;
#else
  const bool cuda = false;
#endif
  return std::string("{\"cuda_compiled\": ") + (cuda ? "true" : "false") + ", \"cuda_archs\": \"" +
         DBLAST_CUDA_ARCHS + "\", \"torch_version\": \"" + DBLAST_TORCH_VERSION + "\"}";
}

// The rule that fits a staged CUDA kernel to a device, as a query (dblast/kernel_variant.h):
// the CPU tests ask it about devices they do not have. Its own namespace keeps it out of the
// ops proper (torch.ops.dblast.*).
TORCH_LIBRARY(dblast_rules, m) {
  m.def("cuda_kernel_for(str op, int major, int minor, int shared_per_block, str? variant=None) -> str",
        &describe_cuda_kernel_for);
}

TORCH_LIBRARY(dblast, m) {
  m.def("build_info() -> str", &build_info);
  // Which CUDA kernels serve the ops, "verified" (default) or "staged" (dblast/kernel_variant.h).
  m.def("cuda_kernels(str? variant) -> str", &cuda_kernels);
  // Greedy-branch speculative verification (DBLast Eq 18-21, Algorithm 1).
  m.def(
      "branch_verify(Tensor target_logits, Tensor branch_tokens, Tensor branch_prior, Tensor branch, "
      "Tensor uniforms, float temperature, int top_k, float top_p, bool validate) -> (Tensor, Tensor, Tensor)");
  // Soft-mixture speculative verification with the posterior update (DBLast Eq 5, 10-12).
  m.def(
      "mixture_verify(Tensor target_logits, Tensor draft_logits, Tensor branch_prior, Tensor draft_tokens, "
      "Tensor uniforms, float temperature, int top_k, float top_p, float draft_temperature, bool validate) "
      "-> (Tensor, Tensor, Tensor)");
  // Verification of a sampled chain whose proposal at each position is sparse: C candidate ids
  // and their probabilities (DFlash2's candidate selector); accept min(1, p/q), residual [p - q]+.
  m.def(
      "sparse_verify(Tensor target_logits, Tensor draft_tokens, Tensor proposal_tokens, Tensor proposal_probs, "
      "Tensor uniforms, float temperature, int top_k, float top_p, bool validate) -> (Tensor, Tensor, Tensor)");
  // The target's filtered inverse-CDF draw for many rows at once (the verifiers' filter and
  // final-token rule), plus the filtered probability of each row's query tokens (trie
  // verification: a node's draw and the chance of descending to each of its children).
  m.def(
      "sample_tokens(Tensor logits, Tensor uniforms, float temperature, int top_k, float top_p, "
      "Tensor query_tokens, bool validate) -> (Tensor, Tensor)");
  // Fused K-branch expansion + LM-head argmax (DBLast Eq 13, Decoding step 2): per row and
  // branch, the argmax token, its logit and the logsumexp, never materialising all logits.
  m.def(
      "branch_argmax(Tensor hidden, Tensor lm_head_weight, Tensor? expander_weight, Tensor? expander_bias, "
      "int vocab_size, int tile_bytes) -> (Tensor, Tensor, Tensor)");
  // Drafter block attention: the block's queries attend to the row's cached context keys and
  // to the block's own keys; a sliding `window` and `causal` order within the block restrict
  // which (dblast/attention_window.h).
  m.def(
      "drafter_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor k_block, Tensor v_block, "
      "Tensor context_lens, float scale, int window, bool causal) -> Tensor");
}

}  // namespace dblast
