"""The drafter: proposes token trees for the verifier to check.

Layout (one job per module):

| module | what |
|---|---|
| `proposer` | the `Proposer` interface and the `Draft` it returns |
| `ngram` | prompt lookup (no model) |
| `chain`, `static`, `dynamic` | draft-model trees: one child per node; a shape table (STree's 13-node tree); best-first |
| `fused` | the dynamic tree merged with the n-gram tree |
| `children` | which children a node gets: greedy top-k, or Gumbel-top-k draws with the exact q reported |
| `nodes` | candidate-node bookkeeping for model-grown trees |
| `vocab` | trimmed draft vocabulary: token counts over text, the kept-ids file, `treeserve trim-vocab` |
| `head` | the LM head over the draftable tokens (all, below a limit, or trimmed) and its column map |
| `draftlm` | the draft model (`models.HybridLM`) driven one slot, one tree at a time; CUDA graphs |
| `state` | per-sequence draft state kept in step with the committed length |
| `ahead` | draft-ahead: predicted outcomes, trees prepared in the background |
| `engine` | sequences and requests, without the wire; the idle sweep |
| `limits` | default limits (sequence length, idle timeout) shared by the engine and the CLI |
| `servicer`, `cli`, `client` | the gRPC service, `treeserve drafter`, a client for it |
"""
import treeserve  # noqa: F401,E402  (first: gRPC core settings before anything loads grpc)
