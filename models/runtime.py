"""HybridLM: a loaded hybrid model with its state pool, and the four batched modes.

    lm = HybridLM.from_pretrained(path, device="cuda", dtype=torch.bfloat16, max_slots=32)
    slot = lm.pool.alloc()
    logits = lm.prefill([slot], [prompt_ids])             # (B, V)
    res = lm.verify([slot], [tree])                        # logits (T, V) at every node
    lm.commit([(res.pending[0], accepted_path)])           # state advances along the path
    logits = lm.decode([slot], [token])                    # one token per slot

Every mode runs one forward over the packed batch (docs/internals.md, "models/").
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Sequence

import torch
from torch import nn

from models import batch as packing
from models.batch import Packed
from models.config import (
    AttentionSpec,
    HybridConfig,
    MambaSpec,
    MLPSpec,
    MoESpec,
    ParallelSpec,
    SharedAttentionSpec,
    stateful_sublayers,
)
from models.errors import CheckpointError, SlotsExhausted
from models.graphs import GraphRunner
from models.layers.attention import Attention
from models.layers.mamba import MambaMixer
from models.layers.mlp import MLP, MoE
from models.layers.parallel import ParallelMixer
from models.layers.shared_attention import SharedTransformer
from models.layers.linear import linear
from models.layers.norms import add_rms_norm, rms_norm
from models.loading import (
    SafetensorsDir,
    StateDictSource,
    arch_for,
    gather_weights,
    load_tokenizer,
    normalise,
    read_config,
)
from models.state import StatePool
from models.verify import Pending, VerifyResult, VerifyStash, commit as commit_paths
from treeserve.tree import TokenTree


class _Norm(nn.Module):
    def __init__(self, d: int, dtype, device):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d, dtype=dtype, device=device))


class Block(nn.Module):
    """`h + mixer(rmsnorm(h))`; `layers` maps "mamba"/"attention" to the state index of the block's
    sublayer of that kind (`HybridConfig.state_layers`). A shared-attention block also has `shared`,
    the transformer whose output joins the mixer's input inside the norm: `h + mixer(rmsnorm(h + t))`."""

    def __init__(self, spec, d_model: int, layers: dict[str, int], norm_eps: float, dtype, device):
        super().__init__()
        self.norm = _Norm(d_model, dtype, device)
        self.shared = None
        if isinstance(spec, SharedAttentionSpec):
            self.shared = SharedTransformer(spec, d_model, layers["attention"], norm_eps, dtype, device)
            self.mixer = MambaMixer(spec.mamba, d_model, layers["mamba"], dtype, device)
        elif isinstance(spec, MambaSpec):
            self.mixer = MambaMixer(spec, d_model, layers["mamba"], dtype, device)
        elif isinstance(spec, AttentionSpec):
            self.mixer = Attention(spec, d_model, layers["attention"], dtype, device)
        elif isinstance(spec, ParallelSpec):
            self.mixer = ParallelMixer(spec, d_model, layers["mamba"], layers["attention"], dtype, device)
        elif isinstance(spec, MLPSpec):
            self.mixer = MLP(spec, d_model, dtype, device)
        elif isinstance(spec, MoESpec):
            self.mixer = MoE(spec, d_model, dtype, device)
        else:
            raise TypeError(spec)
        self.stateful = bool(stateful_sublayers(spec))

    def prepare(self) -> None:
        """Derive constants once the weights are loaded."""
        for part in (self.mixer, self.shared):
            if hasattr(part, "prepare"):
                part.prepare()


class HybridLM(nn.Module):
    """A hybrid Mamba2/attention language model with per-sequence state slots."""

    def __init__(
        self,
        config: HybridConfig,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        max_slots: int = 8,
        max_len: int = 4096,
        cuda_graphs: bool | None = None,
        tree_headroom: int = 128,
    ):
        super().__init__()
        device = torch.device(device)
        self.config = config
        self.dtype = dtype
        self.tokenizer = None
        d = config.d_model
        self.embed = nn.Embedding(config.vocab_size, d, dtype=dtype, device=device)
        layers: list[dict[str, int]] = [{} for _ in config.blocks]
        for b, sub, index in config.state_layers:
            layers[b][sub.kind] = index
        self.blocks = nn.ModuleList(
            Block(spec, d, layers[b], config.norm_eps, dtype, device) for b, spec in enumerate(config.blocks)
        )
        self.norm_f = _Norm(d, dtype, device)
        if not config.tie_embeddings:
            self.lm_head = nn.Linear(d, config.vocab_size, bias=False, dtype=dtype, device=device)
        self.residual_dtype = torch.float32 if config.residual_in_fp32 else dtype
        self.pool = StatePool(config, max_slots, max_len, device, dtype, tree_headroom=tree_headroom)
        # every Mamba2 mixer (parallel halves included) in state-index order: A_all / dt_bias_all rows
        self._mambas = sorted((m for m in self.modules() if isinstance(m, MambaMixer)), key=lambda m: m.layer)
        self.A_all = self.dt_bias_all = None
        self.dt_limit = self._mambas[0].spec.dt_limit if self._mambas else None
        self.graphs = None
        self._want_graphs = cuda_graphs
        self.requires_grad_(False)

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        max_slots: int = 8,
        max_len: int = 4096,
        cuda_graphs: bool | None = None,
    ) -> "HybridLM":
        """Load a checkpoint directory (config.json, *.safetensors, optional tokenizer); never downloads.

        `cuda_graphs`: None captures CUDA graphs for decode/verify when on CUDA and the model allows
        it; False keeps everything eager.
        """
        arch, config, _ = read_config(path)
        source = SafetensorsDir(path, arch.checkpoint_key)
        lm = cls(config, device, dtype, max_slots, max_len, cuda_graphs)
        lm.load_from(source, arch)
        lm.tokenizer = load_tokenizer(path)
        return lm

    @classmethod
    def from_hf_model(cls, model, device=None, dtype=None, max_slots: int = 8, max_len: int = 4096, cuda_graphs=None):
        """Build from an in-memory transformers model (same weights; used by benchmarks and tests)."""
        arch = arch_for(model.config.model_type)
        config = normalise(arch, model.config)
        lm = cls(config, device or model.device, dtype or model.dtype, max_slots, max_len, cuda_graphs)
        lm.load_from(StateDictSource(model.state_dict(), arch.checkpoint_key), arch)
        return lm

    @classmethod
    def from_config(
        cls, hf_config, device="cpu", dtype=torch.float32, max_slots: int = 8, max_len: int = 4096,
        cuda_graphs=None, seed: int = 0, std: float = 0.02,
    ) -> "HybridLM":
        """Random weights for a transformers config object (benchmarks: no checkpoint on disk)."""
        config = normalise(arch_for(hf_config.model_type), hf_config)
        lm = cls(config, device, dtype, max_slots, max_len, cuda_graphs)
        gen = torch.Generator(device=lm.device).manual_seed(seed)
        with torch.no_grad():
            for name, p in lm.named_parameters():
                if name.endswith("A_log"):
                    p.copy_(torch.log(torch.arange(1, p.numel() + 1, dtype=p.dtype, device=p.device)))
                elif name.endswith(("dt_bias", "D")) or "norm" in name:
                    p.fill_(1.0)
                elif name.endswith(("bias", "router_bias")):
                    p.zero_()
                else:
                    p.normal_(0.0, std, generator=gen)
        lm._finish_loading()
        return lm

    def load_from(self, source, arch) -> None:
        shapes = {n: p.shape for n, p in self.named_parameters()}
        weights = gather_weights(arch.weight_map(self.config, lambda n: n in source), source, shapes)
        params = dict(self.named_parameters())
        with torch.no_grad():
            for name, w in weights.items():
                params[name].copy_(w)
        self._finish_loading()

    def _finish_loading(self) -> None:
        for b in self.blocks:
            b.prepare()
        if self._mambas:
            self.A_all = torch.stack([m.A for m in self._mambas])  # (n_mamba, H)
            self.dt_bias_all = torch.stack([m.dt_bias.detach() for m in self._mambas])
            if any(m.spec.dt_limit != self.dt_limit for m in self._mambas):
                raise CheckpointError("Mamba2 blocks with different dt limits are not supported")
        want = self._want_graphs
        if want is None:
            want = self.graphs_supported
        if want:
            self.use_graphs()

    @property
    def graphs_supported(self) -> bool:
        """Whether decode/verify can replay CUDA graphs: a CUDA device and no MoE blocks (their
        routing is data-dependent, so they stay eager)."""
        return self.device.type == "cuda" and not any(isinstance(b.mixer, MoE) for b in self.blocks)

    def use_graphs(self, capture: bool = True, **options):
        """From now on run decode, verify and prompts through bucketed static buffers: CUDA-graph
        replays (`capture=True`, CUDA only), or the same programs run eagerly (`capture=False`, how
        CPU tests exercise this path). `options` go to `models.graphs.GraphRunner` (node_buckets,
        max_rows, prefill_chunks, prefill_tokens). Returns the runner."""
        if capture and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the model is on {self.device}")
        self.graphs = GraphRunner(self, capture=capture, **options)
        return self.graphs

    # ---- the forward over a packed batch --------------------------------------------------------
    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.config.tie_embeddings else self.lm_head.weight

    def hidden(self, mode: str, batch: Packed, stash: VerifyStash | None = None) -> torch.Tensor:
        """Final-norm hidden states (T, d_model) of every packed token; `mode` is prefill, decode,
        verify or prefill_chunk (one prompt piece whose slot and length live on the device only)."""
        cfg = self.config
        emb = self.embed(batch.tokens)
        h = emb * cfg.embedding_multiplier if cfg.embedding_multiplier != 1.0 else emb
        h = h.to(self.residual_dtype)
        x = rms_norm(h, self.blocks[0].norm.weight, cfg.norm_eps, self.dtype)
        # each residual add is fused with the norm after it: the next block's, or the final norm
        after = [(b.norm.weight, cfg.norm_eps, self.dtype) for b in self.blocks[1:]]
        after.append((self.norm_f.weight, cfg.final_norm_eps, None))
        for blk, (weight, eps, norm_dtype) in zip(self.blocks, after):
            if blk.shared is not None:
                # the transformer reads the stream itself and the embeddings; its output joins the
                # mixer's input, not the stream (the norm fused into the last add goes unused here)
                if mode == "verify":
                    t = blk.shared.verify(h, emb, batch, self.pool, stash)
                else:
                    t = getattr(blk.shared, mode)(h, emb, batch, self.pool)
                _, x = add_rms_norm(h, t, blk.norm.weight, cfg.norm_eps, 1.0, self.dtype)
            if not blk.stateful:
                out = blk.mixer(x)
            elif mode == "verify":
                out = blk.mixer.verify(x, batch, self.pool, stash)
            else:
                out = getattr(blk.mixer, mode)(x, batch, self.pool)
            h, x = add_rms_norm(h, out, weight, eps, cfg.residual_multiplier, norm_dtype)
        return x

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """(T, d_model) -> (T, V) fp32; `weight` (V', d_model): rows of the LM head to use instead
        of all of them (a drafter's trimmed vocabulary) -> (T, V')."""
        weight = self.lm_head_weight if weight is None else weight
        logits = linear(hidden.to(self.dtype), weight).float()
        return logits / self.config.logits_scaling if self.config.logits_scaling != 1.0 else logits

    # ---- modes ---------------------------------------------------------------------------------
    def _check(self, slots: Sequence[int], n: int, what: str) -> list[int]:
        slots = [int(s) for s in slots]
        if len(slots) != n:
            raise ValueError(f"{what}: {len(slots)} slots for {n} inputs")
        if len(set(slots)) != len(slots):
            raise ValueError(f"{what}: a slot appears twice in one batch")
        for s in slots:
            self.pool.check(s)
        return slots

    def _empty_logits(self) -> torch.Tensor:
        return torch.empty(0, self.config.vocab_size, dtype=torch.float32, device=self.device)

    def _check_tokens(self, tokens, what: str) -> None:
        V = self.config.vocab_size
        bad = [t for t in tokens if not 0 <= t < V]
        if bad:
            raise ValueError(f"{what}: token {bad[0]} outside the vocabulary [0, {V})")

    # One slot takes a one-token prompt, then 40 tokens packed beside another slot's 40-token
    # prompt, then continuations of these lengths, a decode step, and a verify and commit of a
    # chain of each length in WARM_UP_PATHS. Between them they launch every Triton program that a
    # prefill of one or more prompts, a one-sequence decode and a one-sequence commit of up to 16
    # steps can: each kernel with and without an earlier state and at one row and at many (a
    # one-row input's strides differ), each row tile of the KV write (1, 2, 4, 8, 16, 32 rows), the
    # one-row and few-rows projections (the LM head's too: it reads a row per prompt), the verify
    # programs of 1 to 16 nodes (a verify's KV write, which also fills the stash, tiles its rows by
    # the power of two at or above the node count, up to 32; the graphs' node buckets are among
    # these) and the commit programs of the path buckets 1, 4, 8 and 16
    # (`models.verify.eager_steps`). Sizes that vary per call are not specialised on
    # (`do_not_specialize` in kernels/), so no other length compiles anything new
    # (tests/gpu/test_warm_up.py checks the Triton programs; a prompt's attention keeps off cuDNN,
    # see `models.layers.attention.PREFILL_BACKENDS`). Not covered: decode and verify of several
    # sequences (with CUDA graphs, each batch size compiles once, at its capture), an eager verify
    # of more than 16 nodes and more than 16 prompts packed in one prefill. With one free slot, the
    # 40 tokens go to that slot alone.
    WARM_UP_CONTINUATIONS = (1, 2, 4, 8, 16)
    WARM_UP_PROMPT = 40
    WARM_UP_PATHS = (1, 2, 4, 8, 16)  # every KV-write row tile of a verify, up to graphs.PREPARED_PATH steps

    @torch.no_grad()
    def warm_up(self) -> None:
        """On CUDA, compile before the first request what a prefill of any length, a one-sequence
        decode, verify and commit launch (see WARM_UP_PATHS), on slots taken and given back here: a
        prompt or a drafter's catch-up of a length not seen before otherwise paid a compile of up
        to a few seconds (BENCHMARKS.md, twenty-ninth round). With graphs, also capture the pieces
        prompts run as (`GraphRunner.capture_prefill`: the prefill chunks, and the chains, whose
        first capture compiles the verify and commit programs of more than 16 nodes). Run it
        before the model serves: it takes no lock. Nothing to do off CUDA (the reference twins run
        there)."""
        if self.device.type != "cuda":
            return
        self.warm_up_calls()
        if self.graphs is not None:
            self.graphs.capture_prefill()
        torch.cuda.synchronize(self.device)

    @torch.no_grad()
    def warm_up_calls(self) -> None:
        """The warm-up's model calls, on any device: up to two slots taken and given back, nothing
        done when none is free or a slot holds fewer tokens than the calls need."""
        need = 1 + self.WARM_UP_PROMPT + sum(self.WARM_UP_CONTINUATIONS) + 1 + sum(self.WARM_UP_PATHS)
        if need > self.pool.max_len:
            return
        slots = []
        try:
            with contextlib.suppress(SlotsExhausted):
                for _ in range(2):
                    slots.append(self.pool.alloc())
            if not slots:
                return
            gen = torch.Generator().manual_seed(0)

            def tokens(n: int) -> list[int]:
                return torch.randint(0, self.config.vocab_size, (n,), generator=gen).tolist()

            a = slots[0]
            # the eager prefill, whatever the graphs take: prompts past their cap
            # (`GraphRunner.prefill_tokens`), prompts with a piece left without a graph (a failed
            # capture) and models without graphs take it
            self._prefill_packed([a], [tokens(1)])
            self._prefill_packed(slots, [tokens(self.WARM_UP_PROMPT) for _ in slots])
            for n in self.WARM_UP_CONTINUATIONS:
                self._prefill_packed([a], [tokens(n)])
            self.decode([a], [0])
            for k in self.WARM_UP_PATHS:
                res = self.verify([a], [TokenTree.chain(tokens(k))])
                self.commit([(res.pending[0], list(range(k)))])
        finally:
            for slot in reversed(slots):  # the pool hands out its lowest slot first again
                self.pool.free(slot)

    @torch.no_grad()
    def prefill(self, slots: Sequence[int], prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Consume every prompt token (after whatever each slot already holds) -> (B, V) fp32 logits
        at each prompt's last position. With graphs, each prompt of up to
        `GraphRunner.prefill_tokens` tokens runs through them in pieces (`GraphRunner.prefill`);
        the rest (all of them without graphs, and a prompt with a piece whose graph failed to
        capture) run in one eager forward, packed. After an exception the slots' states are
        unspecified (spoiled: no earlier verify of them commits any more); the callers free them."""
        slots = self._check(slots, len(prompts), "prefill")
        if not slots:
            return self._empty_logits()
        prompts = [[int(t) for t in p] for p in prompts]
        for s, p in zip(slots, prompts):
            if not p:
                raise ValueError(f"prefill: empty prompt for slot {s}")
            self._check_tokens(p, "prefill")
            self.pool.check_room(s, len(p), "prefill")
        graphed = [self.graphs is not None and self.graphs.takes_prefill(len(p)) for p in prompts]
        out = [None] * len(prompts)
        eager = [i for i, g in enumerate(graphed) if not g]
        with self._spoiled_on_failure(slots):
            if eager:
                logits = self._prefill_packed([slots[i] for i in eager], [prompts[i] for i in eager])
                for row, i in enumerate(eager):
                    out[i] = logits[row : row + 1]
            for i, g in enumerate(graphed):
                if g:
                    out[i] = self.graphs.prefill(slots[i], prompts[i])
        return torch.cat(out)

    @contextlib.contextmanager
    def _spoiled_on_failure(self, slots: Sequence[int]):
        """Layers update the slots' states as a forward goes: one that fails partway leaves them
        unspecified, and a verify taken before must not commit onto them (`StatePool.spoil`)."""
        try:
            yield
        except BaseException:
            for s in slots:
                self.pool.spoil(s)
            raise

    @torch.no_grad()
    def _prefill_packed(self, slots: list[int], prompts: list[list[int]]) -> torch.Tensor:
        """`prefill` as one eager forward over all prompts packed, whatever their lengths, for
        prompts that `prefill` has checked."""
        lens = [self.pool.length(s) for s in slots]
        batch = packing.pack_prompts(slots, lens, prompts, self.device)
        h = self.hidden("prefill", batch)
        last = torch.tensor(batch.offsets()[1:], device=self.device) - 1
        out = self.logits(h[last])
        for s, p in zip(slots, prompts):
            self.pool.advance(s, len(p))
        return out

    @torch.no_grad()
    def decode(self, slots: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        """Consume one token per slot -> (B, V) fp32 logits."""
        slots = self._check(slots, len(tokens), "decode")
        if not slots:
            return self._empty_logits()
        tokens = [int(t) for t in tokens]
        self._check_tokens(tokens, "decode")
        for s in slots:
            self.pool.check_room(s, 1, "decode")
        lens = [self.pool.length(s) for s in slots]
        out = None
        with self._spoiled_on_failure(slots):
            if self.graphs is not None and self.graphs.can_decode(len(slots)):
                out = self.graphs.decode(slots, lens, tokens)
            if out is None:
                batch = packing.pack_decode(slots, lens, tokens, self.device)
                out = self.logits(self.hidden("decode", batch))
        for s in slots:
            self.pool.advance(s, 1)
        return out

    @torch.no_grad()
    def verify(
        self,
        slots: Sequence[int],
        trees: Sequence[Any],
        reduce: Callable[[torch.Tensor], Any] | None = None,
        head: Callable[[torch.Tensor], Any] | None = None,
    ) -> VerifyResult:
        """Logits at every node of every tree (`trees[b]` has `tokens` and `parents`, node 0 the
        root at position L). Committed state is untouched.

        `reduce`, when given, is applied to the packed fp32 logits (T, V) and its result returned
        as `output` instead of the logits (e.g. per-node argmax), so callers need not keep
        full-vocabulary tensors. `head`, when given, replaces the LM head itself: it gets the
        final-norm hidden states (T, d_model) and its result is `output` (a drafter computes
        logits of a few rows over its trimmed vocabulary this way); `reduce` is then ignored.
        """
        slots = self._check(slots, len(trees), "verify")
        if not slots:
            empty = self._empty_logits()
            return VerifyResult(None, [0], [], reduce(empty)) if reduce is not None else VerifyResult(empty, [0], [])
        for s, t in zip(slots, trees):
            if len(t.tokens) == 0 or len(t.parents) != len(t.tokens) or t.parents[0] != -1 \
                    or any(not 0 <= p < i for i, p in enumerate(t.parents) if i):  # topological, one root
                raise ValueError(f"verify: malformed tree for slot {s}")
            self._check_tokens(t.tokens, "verify")
            self.pool.check_room(s, len(t.tokens), "verify")
        lens = [self.pool.length(s) for s in slots]
        sizes = [len(t.tokens) for t in trees]
        step = None
        if self.graphs is not None and self.graphs.can_verify(sizes):
            step = self.graphs.verify(slots, lens, trees)
        if step is not None:
            hidden, stash, rows0 = step
        else:
            batch = packing.pack_trees(slots, lens, trees, self.device)
            stash = VerifyStash(self.pool, batch.num_tokens, self.dtype)
            hidden = self.hidden("verify", batch, stash)
            rows0 = batch.offsets()[:-1]
        offsets = [0]
        for n in sizes:
            offsets.append(offsets[-1] + n)
        pending = [
            Pending(s, self.pool.version(s), L, tuple(int(p) for p in t.parents), stash, r0)
            for s, L, t, r0 in zip(slots, lens, trees, rows0)
        ]
        stash.attach(pending)
        if head is not None:
            return VerifyResult(None, offsets, pending, head(hidden))
        logits = self.logits(hidden)
        if reduce is not None:
            return VerifyResult(None, offsets, pending, reduce(logits))
        return VerifyResult(logits, offsets, pending)

    @torch.no_grad()
    def commit(self, items: Sequence[tuple[Pending, Sequence[int]]]) -> None:
        """Advance each verified slot along its accepted path (local node indices from 0 down one
        branch) by `len(path)` tokens; pendings may come from different verify calls."""
        commit_paths(self.pool, list(items), self.A_all, self.dt_bias_all, self.dt_limit, self.graphs)

    def fork(self, src: int, dst: int) -> None:
        """dst takes a copy of src's whole state (both allocated)."""
        with torch.no_grad():
            self.pool.copy(src, dst)
