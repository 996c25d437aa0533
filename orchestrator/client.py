"""A small client of the public Generation service (used by the CLI, the demo and the tests)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from treeserve.server import channel as make_channel
from treeserve.v1 import treeserve_pb2 as pb
from treeserve.v1 import treeserve_pb2_grpc as pbg

MODES = {"auto": pb.SPECULATION_MODE_UNSPECIFIED, "off": pb.SPECULATION_MODE_OFF,
         "chain": pb.SPECULATION_MODE_CHAIN, "tree": pb.SPECULATION_MODE_TREE}
SHAPES = {"default": pb.TREE_SHAPE_UNSPECIFIED, "chain": pb.TREE_SHAPE_CHAIN, "static": pb.TREE_SHAPE_STATIC,
          "dynamic": pb.TREE_SHAPE_DYNAMIC, "ngram": pb.TREE_SHAPE_NGRAM, "fused": pb.TREE_SHAPE_FUSED}


@dataclass
class Result:
    request_id: str = ""
    token_ids: list = field(default_factory=list)
    text: str = ""
    finish_reason: int = pb.FINISH_REASON_UNSPECIFIED
    generated_tokens: int = 0
    target_forwards: int = 0
    mean_accepted: float = 0.0
    seconds: float = 0.0
    first_token_s: float = 0.0
    steps: list = field(default_factory=list)  # (tree_nodes, accepted_tokens, step_ms) per message

    @property
    def tokens_per_s(self) -> float:
        """Decode rate after the first token (prefill excluded)."""
        span = self.seconds - self.first_token_s
        return (len(self.token_ids) - 1) / span if span > 0 and len(self.token_ids) > 1 else 0.0

    @property
    def finish_name(self) -> str:
        return pb.FinishReason.Name(self.finish_reason).removeprefix("FINISH_REASON_").lower()


def request(prompt: str | Sequence[int], *, max_new_tokens: int = 0, temperature: float = 0.0, top_k: int = 0,
            top_p: float = 0.0, seed: int = 0, speculation: str = "auto", shape: str = "default", node_budget: int = 0,
            max_depth: int = 0, draft_ahead: bool = False, adaptive: bool = False, stop: Sequence[str] = (),
            request_id: str = "") -> "pb.GenerateRequest":
    """A text prompt (str) or token ids; `stop`: one stop string or several."""
    if isinstance(prompt, (bytes, bytearray)):
        raise TypeError("a prompt is text (str) or token ids, not bytes: decode it first")
    if isinstance(stop, str):
        stop = [stop]  # one stop string, not one per character
    req = pb.GenerateRequest(
        request_id=request_id, max_new_tokens=max_new_tokens, stop=list(stop),
        sampling=pb.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed),
        speculation=pb.SpeculationOptions(
            mode=MODES[speculation], adaptive=adaptive,
            draft=pb.DraftOptions(shape=SHAPES[shape], node_budget=node_budget, max_depth=max_depth,
                                  draft_ahead=draft_ahead)),
    )
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.tokens.ids.extend(int(t) for t in prompt)
    return req


class GenerationClient:
    def __init__(self, address: str, auth_token: Optional[str] = None):
        self._channel = make_channel(address, auth_token)
        self.stub = pbg.GenerationStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def stream(self, req, timeout: Optional[float] = None):
        return self.stub.Generate(req, timeout=timeout)

    def generate(self, req, timeout: Optional[float] = None,
                 on_message: Optional[Callable[["pb.GenerateResponse"], None]] = None) -> Result:
        out = Result()
        t0 = time.perf_counter()
        for msg in self.stub.Generate(req, timeout=timeout):
            if on_message is not None:
                on_message(msg)
            if msg.token_ids and not out.token_ids:
                out.first_token_s = time.perf_counter() - t0
            out.request_id = msg.request_id
            out.token_ids.extend(msg.token_ids)
            out.text += msg.text
            out.steps.append((msg.step.tree_nodes, msg.step.accepted_tokens, msg.step.step_ms))
            if msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                out.finish_reason = msg.finish_reason
                out.generated_tokens = msg.generated_tokens
                out.target_forwards = msg.target_forwards
                out.mean_accepted = msg.mean_accepted
        out.seconds = time.perf_counter() - t0
        return out

    def cancel(self, request_id: str) -> bool:
        return self.stub.Cancel(pb.CancelRequest(request_id=request_id)).cancelled
