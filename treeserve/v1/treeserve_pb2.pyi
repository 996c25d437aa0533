from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TreeShape(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TREE_SHAPE_UNSPECIFIED: _ClassVar[TreeShape]
    TREE_SHAPE_CHAIN: _ClassVar[TreeShape]
    TREE_SHAPE_STATIC: _ClassVar[TreeShape]
    TREE_SHAPE_DYNAMIC: _ClassVar[TreeShape]
    TREE_SHAPE_NGRAM: _ClassVar[TreeShape]
    TREE_SHAPE_FUSED: _ClassVar[TreeShape]

class SpeculationMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SPECULATION_MODE_UNSPECIFIED: _ClassVar[SpeculationMode]
    SPECULATION_MODE_OFF: _ClassVar[SpeculationMode]
    SPECULATION_MODE_CHAIN: _ClassVar[SpeculationMode]
    SPECULATION_MODE_TREE: _ClassVar[SpeculationMode]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]
TREE_SHAPE_UNSPECIFIED: TreeShape
TREE_SHAPE_CHAIN: TreeShape
TREE_SHAPE_STATIC: TreeShape
TREE_SHAPE_DYNAMIC: TreeShape
TREE_SHAPE_NGRAM: TreeShape
TREE_SHAPE_FUSED: TreeShape
SPECULATION_MODE_UNSPECIFIED: SpeculationMode
SPECULATION_MODE_OFF: SpeculationMode
SPECULATION_MODE_CHAIN: SpeculationMode
SPECULATION_MODE_TREE: SpeculationMode
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_CANCELLED: FinishReason

class SparseDistribution(_message.Message):
    __slots__ = ("tokens", "probs", "residual")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    RESIDUAL_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    residual: float
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ..., residual: _Optional[float] = ...) -> None: ...

class TokenTree(_message.Message):
    __slots__ = ("tokens", "parents", "draft")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    draft: _containers.RepeatedCompositeFieldContainer[SparseDistribution]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[int]] = ..., draft: _Optional[_Iterable[_Union[SparseDistribution, _Mapping]]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class Outcome(_message.Message):
    __slots__ = ("accepted_nodes", "bonus_token")
    ACCEPTED_NODES_FIELD_NUMBER: _ClassVar[int]
    BONUS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    accepted_nodes: _containers.RepeatedScalarFieldContainer[int]
    bonus_token: int
    def __init__(self, accepted_nodes: _Optional[_Iterable[int]] = ..., bonus_token: _Optional[int] = ...) -> None: ...

class ItemError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("sequence_id", "prompt_tokens", "sampling")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    def __init__(self, sequence_id: _Optional[str] = ..., prompt_tokens: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("committed_length", "next_token")
    COMMITTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    committed_length: int
    next_token: int
    def __init__(self, committed_length: _Optional[int] = ..., next_token: _Optional[int] = ...) -> None: ...

class Commit(_message.Message):
    __slots__ = ("committed_length", "accepted_nodes")
    COMMITTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_NODES_FIELD_NUMBER: _ClassVar[int]
    committed_length: int
    accepted_nodes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, committed_length: _Optional[int] = ..., accepted_nodes: _Optional[_Iterable[int]] = ...) -> None: ...

class VerifyItem(_message.Message):
    __slots__ = ("sequence_id", "commit", "committed_length", "tree", "top_logprobs")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    commit: Commit
    committed_length: int
    tree: TokenTree
    top_logprobs: int
    def __init__(self, sequence_id: _Optional[str] = ..., commit: _Optional[_Union[Commit, _Mapping]] = ..., committed_length: _Optional[int] = ..., tree: _Optional[_Union[TokenTree, _Mapping]] = ..., top_logprobs: _Optional[int] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[VerifyItem]
    def __init__(self, items: _Optional[_Iterable[_Union[VerifyItem, _Mapping]]] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("tokens", "logprobs")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class VerifyResult(_message.Message):
    __slots__ = ("sequence_id", "error", "committed_length", "target_tokens", "walk", "top_logprobs")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TARGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WALK_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    error: ItemError
    committed_length: int
    target_tokens: _containers.RepeatedScalarFieldContainer[int]
    walk: Outcome
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    def __init__(self, sequence_id: _Optional[str] = ..., error: _Optional[_Union[ItemError, _Mapping]] = ..., committed_length: _Optional[int] = ..., target_tokens: _Optional[_Iterable[int]] = ..., walk: _Optional[_Union[Outcome, _Mapping]] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("results", "forward_ms", "batch_sequences")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[VerifyResult]
    forward_ms: float
    batch_sequences: int
    def __init__(self, results: _Optional[_Iterable[_Union[VerifyResult, _Mapping]]] = ..., forward_ms: _Optional[float] = ..., batch_sequences: _Optional[int] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("sequence_id", "commit")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    commit: Commit
    def __init__(self, sequence_id: _Optional[str] = ..., commit: _Optional[_Union[Commit, _Mapping]] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("committed_length",)
    COMMITTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    committed_length: int
    def __init__(self, committed_length: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("sequence_id",)
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    def __init__(self, sequence_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class VerifierStats(_message.Message):
    __slots__ = ("model", "vocab_size", "eos_token_ids", "max_sequences", "active_sequences", "max_tree_nodes", "max_sequence_length", "verified_nodes", "forward_passes", "mean_forward_ms", "device", "direct_port")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    MAX_TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQUENCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_NODES_FIELD_NUMBER: _ClassVar[int]
    FORWARD_PASSES_FIELD_NUMBER: _ClassVar[int]
    MEAN_FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DIRECT_PORT_FIELD_NUMBER: _ClassVar[int]
    model: str
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_sequences: int
    active_sequences: int
    max_tree_nodes: int
    max_sequence_length: int
    verified_nodes: int
    forward_passes: int
    mean_forward_ms: float
    device: str
    direct_port: int
    def __init__(self, model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_sequences: _Optional[int] = ..., active_sequences: _Optional[int] = ..., max_tree_nodes: _Optional[int] = ..., max_sequence_length: _Optional[int] = ..., verified_nodes: _Optional[int] = ..., forward_passes: _Optional[int] = ..., mean_forward_ms: _Optional[float] = ..., device: _Optional[str] = ..., direct_port: _Optional[int] = ...) -> None: ...

class DraftOptions(_message.Message):
    __slots__ = ("shape", "node_budget", "max_depth", "draft_ahead")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NODE_BUDGET_FIELD_NUMBER: _ClassVar[int]
    MAX_DEPTH_FIELD_NUMBER: _ClassVar[int]
    DRAFT_AHEAD_FIELD_NUMBER: _ClassVar[int]
    shape: TreeShape
    node_budget: int
    max_depth: int
    draft_ahead: bool
    def __init__(self, shape: _Optional[_Union[TreeShape, str]] = ..., node_budget: _Optional[int] = ..., max_depth: _Optional[int] = ..., draft_ahead: _Optional[bool] = ...) -> None: ...

class StartSequenceRequest(_message.Message):
    __slots__ = ("sequence_id", "tokens", "sampling", "options")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    options: DraftOptions
    def __init__(self, sequence_id: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., options: _Optional[_Union[DraftOptions, _Mapping]] = ...) -> None: ...

class StartSequenceResponse(_message.Message):
    __slots__ = ("committed_length",)
    COMMITTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    committed_length: int
    def __init__(self, committed_length: _Optional[int] = ...) -> None: ...

class EndSequenceRequest(_message.Message):
    __slots__ = ("sequence_id",)
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    def __init__(self, sequence_id: _Optional[str] = ...) -> None: ...

class EndSequenceResponse(_message.Message):
    __slots__ = ("ended",)
    ENDED_FIELD_NUMBER: _ClassVar[int]
    ended: bool
    def __init__(self, ended: _Optional[bool] = ...) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("sequence_id", "committed_length", "appended_tokens", "outcome", "root_token", "node_budget", "shape")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    APPENDED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    ROOT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NODE_BUDGET_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    committed_length: int
    appended_tokens: _containers.RepeatedScalarFieldContainer[int]
    outcome: Outcome
    root_token: int
    node_budget: int
    shape: TreeShape
    def __init__(self, sequence_id: _Optional[str] = ..., committed_length: _Optional[int] = ..., appended_tokens: _Optional[_Iterable[int]] = ..., outcome: _Optional[_Union[Outcome, _Mapping]] = ..., root_token: _Optional[int] = ..., node_budget: _Optional[int] = ..., shape: _Optional[_Union[TreeShape, str]] = ...) -> None: ...

class DraftResponse(_message.Message):
    __slots__ = ("sequence_id", "error", "committed_length", "tree", "from_draft_ahead", "draft_ms")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    FROM_DRAFT_AHEAD_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    error: ItemError
    committed_length: int
    tree: TokenTree
    from_draft_ahead: bool
    draft_ms: float
    def __init__(self, sequence_id: _Optional[str] = ..., error: _Optional[_Union[ItemError, _Mapping]] = ..., committed_length: _Optional[int] = ..., tree: _Optional[_Union[TokenTree, _Mapping]] = ..., from_draft_ahead: _Optional[bool] = ..., draft_ms: _Optional[float] = ...) -> None: ...

class DrafterStats(_message.Message):
    __slots__ = ("strategy", "active_sequences", "trees", "draft_ahead_hits", "draft_ahead_misses", "mean_draft_ms", "saved_draft_ms", "direct_port", "per_tree_shapes", "default_shape")
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    TREES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_AHEAD_HITS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_AHEAD_MISSES_FIELD_NUMBER: _ClassVar[int]
    MEAN_DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    SAVED_DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    DIRECT_PORT_FIELD_NUMBER: _ClassVar[int]
    PER_TREE_SHAPES_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_SHAPE_FIELD_NUMBER: _ClassVar[int]
    strategy: str
    active_sequences: int
    trees: int
    draft_ahead_hits: int
    draft_ahead_misses: int
    mean_draft_ms: float
    saved_draft_ms: float
    direct_port: int
    per_tree_shapes: bool
    default_shape: TreeShape
    def __init__(self, strategy: _Optional[str] = ..., active_sequences: _Optional[int] = ..., trees: _Optional[int] = ..., draft_ahead_hits: _Optional[int] = ..., draft_ahead_misses: _Optional[int] = ..., mean_draft_ms: _Optional[float] = ..., saved_draft_ms: _Optional[float] = ..., direct_port: _Optional[int] = ..., per_tree_shapes: _Optional[bool] = ..., default_shape: _Optional[_Union[TreeShape, str]] = ...) -> None: ...

class SpeculationOptions(_message.Message):
    __slots__ = ("mode", "draft", "adaptive")
    MODE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_FIELD_NUMBER: _ClassVar[int]
    mode: SpeculationMode
    draft: DraftOptions
    adaptive: bool
    def __init__(self, mode: _Optional[_Union[SpeculationMode, str]] = ..., draft: _Optional[_Union[DraftOptions, _Mapping]] = ..., adaptive: _Optional[bool] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "tokens", "sampling", "max_new_tokens", "stop", "speculation")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    tokens: TokenIds
    sampling: SamplingParams
    max_new_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    speculation: SpeculationOptions
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., tokens: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., max_new_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., speculation: _Optional[_Union[SpeculationOptions, _Mapping]] = ...) -> None: ...

class StepStats(_message.Message):
    __slots__ = ("tree_nodes", "accepted_tokens", "step_ms")
    TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEP_MS_FIELD_NUMBER: _ClassVar[int]
    tree_nodes: int
    accepted_tokens: int
    step_ms: float
    def __init__(self, tree_nodes: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., step_ms: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "step", "finish_reason", "generated_tokens", "target_forwards", "mean_accepted")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TARGET_FORWARDS_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    step: StepStats
    finish_reason: FinishReason
    generated_tokens: int
    target_forwards: int
    mean_accepted: float
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., step: _Optional[_Union[StepStats, _Mapping]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., generated_tokens: _Optional[int] = ..., target_forwards: _Optional[int] = ..., mean_accepted: _Optional[float] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("cancelled",)
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    cancelled: bool
    def __init__(self, cancelled: _Optional[bool] = ...) -> None: ...
