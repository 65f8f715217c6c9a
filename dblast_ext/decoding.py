"""The speculative decode loop: a Hugging Face causal LM as the target, a DBlastDrafter as
the drafter, exact greedy-branch verification (`branch_verify`) in between.

One cycle (DESIGN.md, Decoding): drafter pass on [anchor, mask x b] with the new context
features -> K greedy branches and the category prior -> sample a branch -> one target
forward on [anchor, draft] (logits and hidden states together) -> verify -> crop the target
cache to the committed length (the drafter's only ever holds committed context); the
accepted tokens' features are the next cycle's new context.
"""
import inspect
import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable, List, Optional, Sequence

import torch

from . import ops, reference
from .drafter import DBlastDrafter, DrafterCache
from .drafter_io import check_against_target
from .draft_vocabulary import DraftVocab, draft_vocabulary, end_of_sequence_ids
from .foreign_load import Stopwatch


@dataclass
class SamplingParams:
    """The target's filter: T (0 = greedy), top-k (<= 0 off), top-p (>= 1 off)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        # checked here, not at the first kernel call: target-only sampling (the baseline, the
        # oracle, early determinism) never reaches a kernel, and NaN passes every comparison
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if not (math.isfinite(self.top_p) and self.top_p > 0):
            raise ValueError(f"top_p must be a finite number > 0 (>= 1: off), got {self.top_p}")

    def kwargs(self) -> dict:
        return dict(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)


@dataclass
class CycleRecord:
    num_accepted: int          # accepted drafts n, 0..b (committed length n + 1; a response's last
                               # cycle counts only the tokens kept before its stop token or limit)
    expected_accepted: float   # sum_i prod_{j<=i} A_j of the verified draft: the whole draft, also
                               # in a cycle cut at a stop token or the limit (a property of the
                               # proposal, not of what the response kept)
    branch: int
    prior: List[float]
    draft_time: float
    verify_time: float


@dataclass
class GenerationOutput:
    token_ids: List[int]
    stopped_by_eos: bool
    cycles: List[CycleRecord] = field(default_factory=list)
    wall_time: float = 0.0
    foreign_load: Optional[float] = None  # cores other processes kept busy meanwhile (foreign_load.py)


def cache_argument(model) -> str:
    """The name a Hugging Face model's forward gives its KV cache: `cache` in recent
    transformers, `past_key_values` in older ones."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def last_position_logits_arguments(model) -> dict:
    """Forward arguments that keep the logits to the last position (`logits_to_keep` in
    recent transformers, `num_logits_to_keep` in older ones; none when neither exists), for
    passes that need hidden states only or sample from the last position only."""
    parameters = inspect.signature(model.forward).parameters
    for name in ("logits_to_keep", "num_logits_to_keep"):
        if name in parameters:
            return {name: 1}
    return {}


class TargetAdapter:
    """A Hugging Face causal LM (Qwen3, Llama, ...) used unmodified: one forward returns the
    logits of every position (of the last one only for a prefill) and the hidden states of the
    drafter's target layers."""

    def __init__(self, model, layer_ids: Sequence[int]):
        self.model = model
        self.layer_ids = list(layer_ids)
        self._cache_arg = cache_argument(model)
        self._last_logits_kwargs = last_position_logits_arguments(model)

    @property
    def device(self):
        return next(self.model.parameters()).device

    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache()

    def forward(self, input_ids: torch.Tensor, cache, hidden_states: bool = True, last_logits_only: bool = False):
        """`last_logits_only` for a prefill, which samples from its last position only: [T, V]
        logits over the whole prompt would be about a fifth of the pass (SmolLM2) for nothing."""
        extra = self._last_logits_kwargs if last_logits_only else {}
        out = self.model(input_ids=input_ids, use_cache=True, output_hidden_states=hidden_states,
                         **{self._cache_arg: cache}, **extra)
        if not hidden_states:
            return out.logits, None
        return out.logits, self.features(out.hidden_states)

    def features(self, hidden_states) -> torch.Tensor:
        """The drafter's context features: concat(hidden_states[l + 1] for l in the drafter's
        target layers), [.., T, L*H]; index 0 of a transformers output is the embedding's."""
        return torch.cat([hidden_states[l + 1] for l in self.layer_ids], dim=-1)

    @staticmethod
    def crop(cache, length: int) -> None:
        """Keeps the first `length` tokens (a negative count removes tokens in every
        transformers version; positive absolute lengths are refused by recent ones)."""
        excess = cache.get_seq_length() - length
        if excess > 0:
            cache.crop(-excess)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings()(input_ids)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size


def sample_from_logits(logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator,
                       on_probs: Optional[Callable[[torch.Tensor, int], None]] = None) -> int:
    """One token from the filtered target distribution of a [V] logit row (inverse CDF on a
    uniform from `generator`, the same rule the verifier uses for its final token);
    `on_probs(probs, token)` sees the float64 distribution the token was drawn from."""
    probs = reference.filter_target_probs(logits.float().cpu(), **sampling.kwargs())
    u = torch.rand(1, generator=generator, dtype=torch.float64)
    token = int(reference.inverse_cdf_sample(probs[None], u)[0])
    if on_probs:
        on_probs(probs, token)
    return token


def prompt_tensor(input_ids, max_new_tokens: int, device) -> torch.Tensor:
    """One prompt as a [1, T] int64 tensor on `device`, checked before any model runs."""
    ids = torch.as_tensor(input_ids, dtype=torch.int64, device=device)
    ids = ids.view(1, -1) if ids.dim() == 1 else ids
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"input_ids must be one prompt ([T] or [1, T]), got shape {tuple(ids.shape)}")
    if ids.shape[1] == 0:
        raise ValueError("input_ids is empty: the prompt needs at least one token")
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be > 0, got {max_new_tokens}")
    return ids


class SpeculativeDecoder:
    def __init__(self, target, drafter: DBlastDrafter, *, category_temperature: float = 1.0,
                 use_kernels: bool = True, draft_vocab: DraftVocab = None):
        """`draft_vocab`: the token ids the drafter may propose (dblast_ext.draft_vocabulary:
        an int N for the first N ids, or a list of ids; None, the default, for all of them)."""
        check_against_target(drafter.config, target.config)
        if category_temperature < 0:
            raise ValueError(f"category_temperature must be >= 0, got {category_temperature}")
        self.target = TargetAdapter(target, drafter.config.target_layer_ids)
        self.drafter = drafter
        self.category_temperature = category_temperature
        self.use_kernels = use_kernels
        self.draft_ids = draft_vocabulary(draft_vocab, self.target.vocab_size, end_of_sequence_ids(target))
        self._draft_head = None  # (the LM head it was gathered from, ids there, the gathered rows)

    @torch.inference_mode()
    def generate(self, input_ids, sampling: Optional[SamplingParams] = None, max_new_tokens: int = 256,
                 stop_token_ids: Optional[Sequence[int]] = None, seed: int = 0,
                 on_tokens: Optional[Callable[[List[int]], None]] = None) -> GenerationOutput:
        """Speculative sampling; `on_tokens(new_ids)` is called with the tokens each cycle
        commits (for streaming), in order, ending with the last token returned."""
        sampling = sampling or SamplingParams()
        ids = prompt_tensor(input_ids, max_new_tokens, self.target.device)
        stops = set(stop_token_ids or ())
        generator = torch.Generator().manual_seed(seed)
        watch = Stopwatch()
        config, device = self.drafter.config, ids.device
        block = config.block_size

        target_cache = self.target.new_cache()
        logits, context = self.target.forward(ids, target_cache, last_logits_only=True)
        anchor = sample_from_logits(logits[0, -1], sampling, generator)
        generated = [anchor]
        if on_tokens:
            on_tokens([anchor])
        drafter_cache = DrafterCache(config, 1, ids.shape[1] + max_new_tokens + block, device,
                                     self.drafter.fc.weight.dtype)
        cycles = []
        while len(generated) < max_new_tokens and anchor not in stops:
            record, emitted, context = self._cycle(anchor, context, target_cache, drafter_cache, sampling, generator)
            cycles.append(record)
            before = len(generated)
            for token in emitted:
                generated.append(token)
                if token in stops or len(generated) >= max_new_tokens:
                    break
            kept = len(generated) - before
            if kept < len(emitted):  # cut at a stop token or the limit: the cycle committed `kept` tokens
                cycles[-1] = replace(record, num_accepted=kept - 1)
            if on_tokens:
                on_tokens(generated[before:])
            anchor = generated[-1]
        stopped = bool(stops) and generated[-1] in stops
        return GenerationOutput(generated[:max_new_tokens], stopped, cycles, *watch.stop())

    def _cycle(self, anchor: int, context: torch.Tensor, target_cache, drafter_cache: DrafterCache,
               sampling: SamplingParams, generator: torch.Generator):
        """One cycle after `anchor` (the last committed token; `context` holds the target
        features of the committed tokens the drafter has not cached yet): draft, verify, crop
        the target cache to the committed length. Returns the cycle's record, the emitted
        tokens (accepted drafts + the correction or bonus token) and the next context."""
        config, device = self.drafter.config, context.device
        block = config.block_size
        t0 = time.perf_counter()
        block_ids = torch.full((1, block), config.mask_token_id, dtype=torch.int64, device=device)
        block_ids[0, 0] = anchor
        hidden = self.drafter(self.target.embed(block_ids), context, drafter_cache, use_kernels=self.use_kernels)
        prior = self.drafter.branch_prior(hidden[:, 0], self.category_temperature)
        tokens = self.draft_tokens(hidden)
        branch = torch.multinomial(prior.cpu().double(), 1, generator=generator).view(1).to(device)
        draft = tokens[0, branch]
        t1 = time.perf_counter()

        verify_logits, features = self.target.forward(torch.cat([block_ids[:, :1], draft], dim=1), target_cache)
        uniforms = torch.rand(1, block, generator=generator, dtype=torch.float64).to(device)
        verify = ops.branch_verify if self.use_kernels else reference.branch_verify
        result = verify(verify_logits.float(), tokens, prior.float(), branch, uniforms, **sampling.kwargs())
        accepted = int(result.num_accepted[0])
        emitted = result.output_tokens[0, : accepted + 1].tolist()
        # the target cache keeps the anchor and the accepted drafts; the final token is the next anchor
        self.target.crop(target_cache, drafter_cache.length + accepted + 1)
        survive = torch.cumprod(result.accept_probs[0].double(), 0)
        record = CycleRecord(accepted, float(survive.sum()), int(branch), prior[0].tolist(), t1 - t0,
                             time.perf_counter() - t1)
        return record, emitted, features[:, : accepted + 1]

    def draft_tokens(self, block_hidden: torch.Tensor) -> torch.Tensor:
        """Every branch's greedy token at every draft position, [N, K, b], over the draft
        vocabulary: the LM head rows of its ids only, the argmax mapped back to token ids."""
        head = self.target.lm_head_weight
        if self.draft_ids is None:
            return self.drafter.branch_tokens(block_hidden, head, self.target.vocab_size,
                                              use_kernels=self.use_kernels)
        key = (head.data_ptr(), head.device, head.dtype)
        if self._draft_head is None or self._draft_head[0] != key:  # gathered once, again if the model moved
            ids = self.draft_ids.to(head.device)
            rows = head.detach().index_select(0, ids)
            if rows.device.type == "cpu":  # the CPU kernel computes in float32 and would upcast 16-bit
                rows = rows.float()        # rows every call; upcasting is exact, so the argmax is the same
            self._draft_head = (key, ids, rows.contiguous())
        _, ids, rows = self._draft_head
        local = self.drafter.branch_tokens(block_hidden, rows, len(ids), use_kernels=self.use_kernels)
        return ids[local]

    @torch.inference_mode()
    def first_cycle(self, prefix_ids, sampling: Optional[SamplingParams] = None, seed: int = 0) -> CycleRecord:
        """One drafting + verification cycle right after `prefix_ids`, whose last token is the
        anchor (as if the prefix had just been committed): acceptance at a chosen point of a
        response, for diagnostics."""
        sampling = sampling or SamplingParams()
        ids = prompt_tensor(prefix_ids, 1, self.target.device)
        if ids.shape[1] < 2:
            raise ValueError("prefix_ids needs at least two tokens: context and the anchor")
        target_cache = self.target.new_cache()
        _, context = self.target.forward(ids[:, :-1], target_cache, last_logits_only=True)
        config = self.drafter.config
        drafter_cache = DrafterCache(config, 1, ids.shape[1] + config.block_size, ids.device,
                                     self.drafter.fc.weight.dtype)
        generator = torch.Generator().manual_seed(seed)
        record, _, _ = self._cycle(int(ids[0, -1]), context, target_cache, drafter_cache, sampling, generator)
        return record

    def warm_up(self, input_ids, sampling: Optional[SamplingParams] = None, *, target_only: bool = True,
                stop_token_ids: Optional[Sequence[int]] = None) -> None:
        """A few tokens of speculative sampling (and of the target alone, with `target_only`) so
        one-time costs (allocations, kernel selection) stay out of the timings that follow."""
        self.generate(input_ids, sampling, max_new_tokens=8, stop_token_ids=stop_token_ids)
        if target_only:
            self.generate_autoregressive(input_ids, sampling, max_new_tokens=8, stop_token_ids=stop_token_ids)

    def generate_autoregressive(self, input_ids, sampling: Optional[SamplingParams] = None,
                                max_new_tokens: int = 256, stop_token_ids: Optional[Sequence[int]] = None,
                                seed: int = 0, on_tokens: Optional[Callable[[List[int]], None]] = None
                                ) -> GenerationOutput:
        """The target alone, with the same filter (`sample_autoregressive`): the speed-up baseline."""
        return sample_autoregressive(self.target, input_ids, sampling, max_new_tokens, stop_token_ids, seed,
                                     on_tokens)


@torch.inference_mode()
def sample_autoregressive(target: TargetAdapter, input_ids, sampling: Optional[SamplingParams] = None,
                          max_new_tokens: int = 256, stop_token_ids: Optional[Sequence[int]] = None, seed: int = 0,
                          on_tokens: Optional[Callable[[List[int]], None]] = None,
                          on_probs: Optional[Callable[[torch.Tensor, int], None]] = None) -> GenerationOutput:
    """Sampling from the target alone, one token per pass, with the speculative path's filter and
    inverse-CDF rule; `on_probs(probs, token)` sees each token's filtered distribution."""
    sampling = sampling or SamplingParams()
    ids = prompt_tensor(input_ids, max_new_tokens, target.device)
    stops = set(stop_token_ids or ())
    generator = torch.Generator().manual_seed(seed)
    watch = Stopwatch()
    cache = target.new_cache()
    logits, _ = target.forward(ids, cache, hidden_states=False, last_logits_only=True)
    generated = []
    while True:
        token = sample_from_logits(logits[0, -1], sampling, generator, on_probs)
        generated.append(token)
        if on_tokens:
            on_tokens([token])
        if token in stops or len(generated) >= max_new_tokens:
            break
        logits, _ = target.forward(torch.tensor([[token]], device=ids.device), cache, hidden_states=False)
    stopped = bool(stops) and generated[-1] in stops
    return GenerationOutput(generated, stopped, [], *watch.stop())
