"""A byte-level language model of stacked scan layers, with O(1)-state generation."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Iterator, Optional

import torch
from torch import Tensor, nn

from ..checks import check_context_group
from ..nn.functional import rms_norm_into
from ..nn.masks import last_kept
from ..ops.context import CALL_MODEL, agree, fingerprint, refuse_together, same_everywhere
from .block import Block, longest_timescale  # noqa: F401 (longest_timescale: callers import it here)
from .cache import CacheLayout, InferenceCache, LMState
from .checks import check_tokens
from .config import SCAN_LAYERS, LMConfig
from .decoding import Decoder, Sampling, check_rows, draw_and_step, draw_sampled
from .graphed import CUDAGraphDecoder
from .packed import WEIGHT_FORMATS, PackedLM, unsupported_reason
from .sampling import check_logits, collect, prepare_prompt
from .storage import load_weights, read_pretrained, save_pretrained


@torch.compiler.disable
def _check_ids(token: Tensor, vocab_size: int, out: Tensor) -> None:
    """``ValueError`` unless every id of ``token`` is in ``[0, vocab_size)``: a read back to
    the host, run eagerly also when ``ByteLM.step_`` is compiled (a graph break there: the
    compiled gather would fail with the device's raw index error instead)."""
    low, high = torch.aminmax(token, out=(out[0], out[1]))
    if low.item() < 0 or high.item() >= vocab_size:
        raise ValueError(f"token must be ids in [0, {vocab_size}), got values in "
                         f"[{low.item()}, {high.item()}]")


class ByteLM(nn.Module):
    """Byte-level language model: embedding -> ``n_layers`` :class:`Block` -> norm -> head.

    ``logits, state = model(tokens, state=None)`` with ``tokens`` ``(B, T)`` integer ids in
    ``[0, vocab_size)``; ``logits`` ``(B, T, vocab_size)``. ``model.generate(prompt, ...)``
    prefills in parallel, then steps with O(1) state per layer.

    Example:
        >>> import torch
        >>> from fastrwa.models import ByteLM, LMConfig
        >>> model = ByteLM(LMConfig(d_model=32, n_layers=2))
        >>> logits, state = model(torch.randint(0, 256, (2, 16)))
        >>> logits.shape
        torch.Size([2, 16, 257])
        >>> out = model.generate(torch.tensor([104, 105]), max_new_tokens=5, top_k=10)
        >>> out.shape
        torch.Size([1, 7])
    """

    kind = "eager ByteLM.step_"     # (as a decoder: fastrwa.models.decoding.Decoder)

    def __init__(self, config: LMConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        if config.layer == "rda" and config.discount_init == "spread":
            for depth, block in enumerate(self.blocks):
                block.mix.set_discount_timescales(2.0, longest_timescale(depth, config.n_layers))
        self.norm = nn.RMSNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        nn.init.normal_(self.embed.weight, std=config.d_model ** -0.5)
        if config.tie_embeddings:
            self.head.weight = self.embed.weight

    @classmethod
    def from_config(cls, config: LMConfig | dict) -> "ByteLM":
        """Build a model from an :class:`LMConfig` or its ``to_dict()``."""
        return cls(config if isinstance(config, LMConfig) else LMConfig.from_dict(config))

    # -- input checks -------------------------------------------------------------------
    def _check_tokens(self, tokens, rank: int, name: str = "tokens") -> Tensor:
        return check_tokens(tokens, self.config.vocab_size, rank, name)

    def _check_state(self, state) -> tuple:
        if state is None:
            return (None,) * len(self.blocks)
        if not isinstance(state, LMState) or len(state.layers) != len(self.blocks):
            raise TypeError(f"state must be a fastrwa.models.LMState with {len(self.blocks)} "
                            f"layer states (as returned by the model) or None, "
                            f"got {type(state).__name__}")
        return state.layers

    # -- parallel and streaming ---------------------------------------------------------
    def forward(self, tokens: Tensor, state: Optional[LMState] = None,
                mask: Optional[Tensor] = None,
                context_group: "torch.distributed.ProcessGroup | None" = None,
                cu_seqlens: Optional[Tensor] = None) -> tuple[Tensor, LMState]:
        """Logits ``(B, T, vocab_size)`` for every position and the state after the last.

        ``mask`` ``(B, T)`` bool, ``False`` at tokens to skip (padding, anywhere in a row):
        they leave every layer's state as it was (:meth:`fastrwa.nn.RDA.forward`), so a
        padded row's logits at its kept tokens, and its final state, are those of the row
        without them. At a skipped token the logits are the last kept token's before it
        (the prediction from the state so far: right padding reads the next token's
        distribution at its last position); before a row's first kept token they are
        undefined.

        With ``context_group`` (context parallelism, docs/distributed.md) ``tokens`` is this
        rank's contiguous slice of the sequence along time (rank order is time order),
        ``state`` the state before the whole sequence on rank 0 (``None`` on the others),
        and the returned state the one after this rank's slice: the whole sequence's on the
        last rank. Every rank of the group makes the same calls (and, when training, the
        backward through its logits).

        With ``cu_seqlens`` (``(N + 1,)`` offsets, the op's convention) ``tokens`` ``(1,
        total)`` holds ``N`` documents back to back, each run as if alone (from its row of
        ``state``, an :class:`LMState` of ``N`` rows, or the initial state); the state
        returned has a row per document. Not with ``mask``. With ``context_group`` as well,
        ``tokens`` ``(1, slice)`` is this rank's slice of the packed sequence, ``cu_seqlens``
        the whole sequence's offsets on every rank (a document may span ranks), ``state``
        given on every rank or none, and the state returned the one after this slice of the
        document it ends in (one row per layer)."""
        try:
            tokens, states = self._check_tokens(tokens, 2), self._check_state(state)
            if context_group is not None and tokens.device != self.embed.weight.device:
                raise ValueError(f"tokens must be on the model's device "
                                 f"({self.embed.weight.device}), got {tokens.device}")
        except (TypeError, ValueError) as exc:
            if context_group is None:
                raise
            check_context_group(context_group)
            refuse_together(exc, context_group)     # (the other ranks raise too)
        if context_group is not None:               # (every rank's model is the same one)
            model = fingerprint(json.dumps(dataclasses.asdict(self.config), sort_keys=True,
                                           default=str))
            every = agree({"call": CALL_MODEL, "model configuration": model}, context_group,
                          tokens.device)
            same_everywhere(every, ("call", "model configuration"))
        x = self.embed(tokens)
        new = []
        for block, layer_state in zip(self.blocks, states):
            x, layer_state = block(x, layer_state, mask, context_group, cu_seqlens)
            new.append(layer_state)
        if mask is not None:                  # (a skipped token: the last kept one's output)
            x = x.gather(1, last_kept(mask).clamp(min=0)[..., None].expand_as(x))
        return self.head(self.norm(x)), LMState(tuple(new))

    def step(self, token: Tensor, state: LMState) -> tuple[Tensor, LMState]:
        """One token ``(B,)`` -> logits ``(B, vocab_size)`` and the new state (functional)."""
        token = self._check_tokens(token, 1, "token")
        x = self.embed(token)
        new = []
        for block, layer_state in zip(self.blocks, self._check_state(state)):
            x, layer_state = block.step(x, layer_state)
            new.append(layer_state)
        return self.head(self.norm(x)), LMState(tuple(new))

    def allocate_cache(self, batch: int) -> InferenceCache:
        """An :class:`InferenceCache` for ``batch`` sequences (an int >= 0)."""
        return InferenceCache(self, batch)

    def cache_layout(self) -> CacheLayout:
        """What an :class:`InferenceCache` of this model depends on (its shape, dtype and
        device): a cache of another layout is refused."""
        c, weight = self.config, self.embed.weight
        groups = c.discount_groups if c.layer == "rda" else None      # (the step's buffers)
        return CacheLayout(len(self.blocks), c.d_model, c.vocab_size, c.layer, c.token_shift,
                           c.mlp_ratio, groups, weight.dtype, weight.device)

    def _check_cache(self, cache: object) -> InferenceCache:
        """``cache`` was allocated by a model of this one's shape, dtype and device (an
        attribute comparison: cheap enough for every step)."""
        if not isinstance(cache, InferenceCache):
            raise TypeError(f"cache must be a fastrwa.models.InferenceCache (from "
                            f"model.allocate_cache(B)), got {type(cache).__name__}")
        mine = self.cache_layout()
        if cache.layout != mine:
            raise ValueError(f"cache was allocated by a model of another shape, dtype or "
                             f"device ({cache.layout.describe()}); this model has "
                             f"{mine.describe()}: allocate one with model.allocate_cache(B)")
        return cache

    def prefill(self, tokens: Tensor, cache: InferenceCache) -> Tensor:
        """Run ``tokens`` ``(B, T)`` (``B`` the cache's batch, ``T >= 1``) in parallel from
        the initial state, leave the final state in ``cache``, and return the last
        position's logits ``(B, vocab_size)``. The arguments are checked before anything
        runs (a refused call leaves the cache as it was)."""
        self._check_cache(cache)
        if isinstance(tokens, Tensor) and tokens.dim() == 2:      # (the forward checks the rest)
            if tokens.shape[0] != cache.batch:
                raise ValueError(f"tokens must have shape (B, T) = ({cache.batch}, T), the "
                                 f"cache's batch, got {tuple(tokens.shape)}")
            if tokens.shape[1] == 0:
                raise ValueError(f"tokens must hold at least one position (T >= 1): prefill "
                                 f"returns the last position's logits; got shape "
                                 f"{tuple(tokens.shape)}")
        logits, state = self(tokens)
        cache.load_(state)
        return logits[:, -1]

    @torch.no_grad()
    def step_(self, token: Tensor, cache: InferenceCache, check: bool = True, *,
              rows: Optional[int] = None) -> Tensor:
        """One token ``(B,)`` with the state in ``cache``, updated in place; returns logits.

        Allocates nothing on CPU: every intermediate lives in ``cache.work``, and the
        returned ``(B, vocab_size)`` logits are ``cache.work["logits"]``, overwritten by the
        next step (clone them to keep them). Matches :meth:`step` (tests/models/test_lm.py).
        ``check=False`` skips the range check of the ids, which reads them back to the host:
        then the step can be captured in a CUDA graph (an id out of range is then an indexing
        error of the device, not a ValueError). A cache allocated by a model of another shape,
        dtype or device is refused (``ValueError``) before anything is written. ``rows``
        (:meth:`fastrwa.models.decoding.Decoder.step_`) is checked; every row steps (one
        product over the batch).

        Example:
            >>> import torch
            >>> from fastrwa.models import ByteLM, LMConfig
            >>> model = ByteLM(LMConfig(d_model=16, n_layers=1)).eval()
            >>> cache = model.allocate_cache(2)
            >>> model.step_(torch.tensor([65, 66]), cache).shape
            torch.Size([2, 257])
        """
        self._check_cache(cache)
        if rows is not None:
            check_rows(rows, cache.batch)
        if not isinstance(token, Tensor) or token.dim() != 1 or token.shape[0] != cache.batch:
            got = f"{tuple(token.shape)} {token.dtype}" if isinstance(token, Tensor) \
                else type(token).__name__
            raise ValueError(f"token must be integer ids of shape (B,) = ({cache.batch},), "
                             f"got {got}")
        if token.dtype != torch.int64:
            raise TypeError(f"token must have dtype torch.int64 (the in-place step converts "
                            f"nothing), got {token.dtype}")
        work = cache.work
        if check and token.shape[0]:
            _check_ids(token, self.config.vocab_size, work["token_range"])
        x = torch.index_select(self.embed.weight, 0, token, out=work["x"])
        # (the cache's buffers match this model: its blocks' checks are not needed)
        for block, state, block_work in zip(self.blocks, cache.state.layers, work["blocks"]):
            block.unchecked_step_(x, state, block_work)
        rms_norm_into(x, self.norm, work["normed"], work["rstd"], work["wide"])
        return torch.mm(work["normed"], self.head.weight.t(), out=work["logits"])

    # -- generation -----------------------------------------------------------------------
    def draw(self, logits: Tensor, sampling: Sampling, forbidden: int) -> Tensor:
        """As a decoder (:meth:`fastrwa.models.decoding.Decoder.draw`): one id per row of
        ``logits`` ``(B, V)``: :func:`fastrwa.models.decoding.draw_sampled`."""
        return draw_sampled(logits, sampling, forbidden)

    def sample_steps(self, logits: Tensor, cache: InferenceCache, max_new_tokens: int,
                     temperature: float = 1.0, top_k: Optional[int] = None,
                     top_p: Optional[float] = None, generator: Optional[torch.Generator] = None,
                     forbidden: Optional[int] = None) -> Iterator[Tensor]:
        """As a decoder (:meth:`fastrwa.models.decoding.Decoder.sample_steps`): ``max_new_tokens``
        ids ``(B,)``, :meth:`draw` and :meth:`step_` in turn from ``logits`` (what
        :meth:`prefill` or :meth:`step_` returned for ``cache``); ``forbidden`` defaults to
        the BOS id.

        Example:
            >>> import torch
            >>> from fastrwa.models import ByteLM, LMConfig
            >>> model = ByteLM(LMConfig(d_model=16, n_layers=1)).eval()
            >>> cache = model.allocate_cache(1)
            >>> logits = model.prefill(torch.tensor([[104, 105]]), cache)
            >>> [t.shape for t in model.sample_steps(logits, cache, 2)]
            [torch.Size([1]), torch.Size([1])]
        """
        return draw_and_step(self, logits, cache, max_new_tokens, temperature, top_k, top_p,
                             generator, forbidden=self.config.bos_token
                             if forbidden is None else forbidden)

    def decoder(self, weights: object = "auto") -> Decoder:
        """What runs the steps of ``generate``/``stream`` for their ``weights`` argument (see
        :meth:`generate`): this model (the eager :meth:`step_`), its step replayed from a
        CUDA graph (:class:`fastrwa.models.graphed.CUDAGraphDecoder`) or a
        :class:`fastrwa.models.PackedLM` of it: a :class:`fastrwa.models.decoding.Decoder`
        (allocate a cache, prefill, step rows in place, draw), which is all that
        ``generate``, beam search, the Hugging Face class and the server use of it.

        Example:
            >>> from fastrwa.models import ByteLM, LMConfig
            >>> type(ByteLM(LMConfig(d_model=16, n_layers=1)).decoder("eager")).__name__
            'ByteLM'
        """
        if isinstance(weights, PackedLM):
            if weights.model is not self:
                raise ValueError("weights is a PackedLM of another model: pack this one "
                                 "(PackedLM(model, ...)) or pass a format name")
            return weights
        if isinstance(weights, str) and weights in ("graph", "auto") \
                and self.embed.weight.is_cuda:
            return CUDAGraphDecoder(self)
        if weights == "graph":
            raise ValueError(f"weights='graph' replays the step from a CUDA graph: the model "
                             f"must be on a CUDA device, it is on {self.embed.weight.device}")
        if weights == "eager":
            return self
        if weights == "auto":
            return self if unsupported_reason(self) else PackedLM(self, "float32")
        if weights not in WEIGHT_FORMATS:
            raise ValueError(f"weights must be 'auto', 'eager', 'graph', one of "
                             f"{WEIGHT_FORMATS} or a PackedLM of this model, got {weights!r}")
        return PackedLM(self, weights)

    @torch.no_grad()
    def generate(self, prompt: Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: Optional[int] = None, top_p: Optional[float] = None,
                 beam_size: int = 1, generator: Optional[torch.Generator] = None,
                 weights: object = "auto") -> Tensor:
        """Continue ``prompt`` by ``max_new_tokens`` tokens.

        Args:
            prompt: ``(B, P)`` or ``(P,)`` integer ids; an empty prompt starts from the BOS token.
            max_new_tokens: tokens to add.
            temperature: softmax temperature (> 0 and at most float32's largest, 3.4e38: the
                sampler computes in float32) for sampling; ignored by beam search (but
                checked).
            top_k: sample among the ``k`` most likely tokens only.
            top_p: sample from the smallest set of tokens whose probability reaches ``p``
                (in ``(0, 1]``, at least float32's smallest, 1.4e-45).
            beam_size: 1 samples; ``> 1`` runs beam search (deterministic, highest total
                log-probability) and returns the best beam per prompt.
            generator: a ``torch.Generator`` for reproducible sampling.
            weights: what runs the steps. ``"auto"``: on CUDA, :meth:`step_` replayed from a
                CUDA graph (``"graph"``: one launch a token); on CPU the fused decode step
                with float32 weights (:class:`fastrwa.models.PackedLM`) for a float32 model,
                else the eager step; ``"eager"``: :meth:`step_` (PyTorch ops, the reference);
                ``"float32"``, ``"bfloat16"``, ``"int8"``: the fused step with the weights
                stored so (packed for this call; a CPU float32 model only); or a
                ``PackedLM`` of this model (packed once for many calls). The fused step
                runs the prompt too, with the same weights.

        Returns:
            ``(B, P + max_new_tokens)`` ids (the prompt, then the new tokens). Memory does not
            grow with ``max_new_tokens`` beyond this output: the state is fixed-size per layer.
        """
        prompt, context = prepare_prompt(prompt, self.config.vocab_size, self.config.bos_token,
                                         max_new_tokens, temperature, top_k, top_p, beam_size)
        decoder = self.decoder(weights)
        if beam_size > 1:
            return self._beam_search(decoder, prompt, context, max_new_tokens, beam_size)
        return collect(prompt, self._stream(decoder, context, max_new_tokens, temperature,
                                            top_k, top_p, generator), max_new_tokens)

    @torch.no_grad()
    def stream(self, prompt: Tensor, max_new_tokens: int, temperature: float = 1.0,
               top_k: Optional[int] = None, top_p: Optional[float] = None,
               generator: Optional[torch.Generator] = None,
               weights: object = "auto") -> Iterator[Tensor]:
        """Sample as :meth:`generate` (the same arguments), yielding each new token ``(B,)``
        as soon as it is drawn (for printing text as it is produced). State: one fixed-size
        cache.

        Example:
            >>> import torch
            >>> from fastrwa.models import ByteLM, LMConfig
            >>> model = ByteLM(LMConfig(d_model=16, n_layers=1))
            >>> [int(t) < 256 for t in model.stream(torch.tensor([104]), 3)]
            [True, True, True]
        """
        _, context = prepare_prompt(prompt, self.config.vocab_size, self.config.bos_token,
                                    max_new_tokens, temperature, top_k, top_p, 1)
        decoder = self.decoder(weights)
        yield from self._stream(decoder, context, max_new_tokens, temperature, top_k, top_p,
                                generator)

    def _stream(self, decoder: Decoder, context: Tensor, max_new_tokens: int,
                temperature: float, top_k: Optional[int], top_p: Optional[float],
                generator: Optional[torch.Generator]) -> Iterator[Tensor]:
        if max_new_tokens == 0:
            return
        cache = decoder.allocate_cache(context.shape[0])
        logits = decoder.prefill(context, cache)
        yield from decoder.sample_steps(logits, cache, max_new_tokens, temperature, top_k,
                                        top_p, generator, self.config.bos_token)

    def _beam_search(self, decoder: Decoder, prompt: Tensor, context: Tensor, max_new: int,
                     K: int) -> Tensor:
        B, P = prompt.shape
        V = self.config.vocab_size
        out = prompt.new_empty((B * K, P + max_new))
        out[:, :P] = prompt.repeat_interleave(K, dim=0)
        cache = decoder.allocate_cache(B * K)
        logits = decoder.prefill(context.repeat_interleave(K, dim=0), cache)
        scores = torch.full((B, K), float("-inf"), device=prompt.device)
        scores[:, 0] = 0.0                            # the K copies start as one beam
        base = torch.arange(B, device=prompt.device)[:, None] * K
        for i in range(max_new):
            logits = logits.float()
            logits[:, self.config.bos_token:] = float("-inf")  # BOS starts text; ids past it
                                                                # are not bytes either
            check_logits(logits, logits.amax(dim=-1, keepdim=True))
            logp = torch.log_softmax(logits, dim=-1).view(B, K, V)
            total = (scores[..., None] + logp).view(B, K * V)
            scores, flat = total.topk(K, dim=-1)                          # (B, K)
            origin = (base + flat // V).view(-1)
            token = (flat % V).view(-1)
            out.copy_(out.index_select(0, origin))
            out[:, P + i] = token
            cache.reorder_(origin, check=False)            # (in range by construction)
            if i + 1 < max_new:
                logits = decoder.step_(token, cache)
        best = scores.argmax(dim=-1)
        return out.view(B, K, P + max_new)[torch.arange(B, device=prompt.device), best]

    # -- persistence ----------------------------------------------------------------------
    def save_pretrained(self, directory: str | os.PathLike) -> None:
        """Write ``config.json`` and ``model.pt`` (tensors only) into ``directory``
        (:func:`fastrwa.models.save_pretrained`)."""
        save_pretrained(self, directory)

    @classmethod
    def load(cls, directory: str | os.PathLike, map_location=None) -> "ByteLM":
        """Load a model written by :meth:`save_pretrained`, with the checks of
        :func:`fastrwa.models.load_pretrained` (which reads tensors only:
        ``torch.load(weights_only=True)``), in eval mode."""
        saved = read_pretrained(directory, map_location)
        if saved.config.layer not in SCAN_LAYERS:
            raise ValueError(f"{directory} holds a {saved.config.layer!r} model, not a "
                             f"{cls.__name__}: load it with fastrwa.models.load_pretrained")
        return load_weights(cls(saved.config), saved)
