"""End to end through the public Generate API: a real verifier, drafter and orchestrator (with its
Ray actors) as separate processes on the tiny pair.

The drafter drafts with the target checkpoint itself, so greedy trees are mostly accepted and
every step commits deep paths (plus rejected side branches); n-gram trees on this random model are
mostly rejected. Both must reproduce plain decoding token for token.
"""
from __future__ import annotations

import threading

import grpc
import pytest

from orchestrator.procs import stop_all
from tests.orchestrator import stack
from tests.orchestrator.stack import Background, GenerationClient, request
from treeserve.sampling import Sampling
from treeserve.v1 import treeserve_pb2 as pb

TOKEN = "s3cret"
MAX_SEQUENCES = 4


@pytest.fixture(scope="module")
def services(tiny_pair):
    target = str(tiny_pair[0])
    v_addr, d_addr = f"127.0.0.1:{stack.free_port()}", f"127.0.0.1:{stack.free_port()}"
    # all three start together: the orchestrator's engine waits for its verifier
    children = [stack.verifier(target, port=v_addr.split(":")[1], max_sequences=MAX_SEQUENCES),
                # self-drafting (the draft model is the target), Speculate on its direct port as under `serve`
                stack.drafter(target, port=d_addr.split(":")[1], extra=("--direct-port", "0")),
                stack.orchestrator([v_addr], d_addr, target, "--auth-token", TOKEN)]
    _, _, o_addr = stack.start(children)
    yield {"verifier": v_addr, "drafter": d_addr, "orchestrator": o_addr}
    stop_all(children)


@pytest.fixture(scope="module")
def client(services):
    with GenerationClient(services["orchestrator"], TOKEN) as c:
        yield c


@pytest.fixture(scope="module")
def reference(tiny_pair):
    return stack.Reference(tiny_pair[0])


@pytest.fixture(scope="module")
def prompt(tiny_pair):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_pair[0])(stack.PROMPT_TEXT)["input_ids"]


N = 40
GREEDY_CASES = [
    ("off", "default", False),
    ("chain", "default", False),
    ("chain", "default", True),
    ("tree", "static", False),
    ("tree", "static", True),
    ("tree", "dynamic", False),
    ("tree", "dynamic", True),
    ("tree", "ngram", False),
    ("auto", "default", False),
]


@pytest.mark.parametrize("mode,shape,ahead", GREEDY_CASES, ids=[f"{m}-{s}{'-ahead' if a else ''}" for m, s, a in GREEDY_CASES])
def test_greedy_equals_plain_decoding(client, reference, prompt, mode, shape, ahead):
    want = reference.generate(prompt, N)
    res = client.generate(request(prompt, max_new_tokens=N, speculation=mode, shape=shape, draft_ahead=ahead),
                          timeout=300)
    assert res.token_ids == want
    assert res.finish_reason == (pb.FINISH_REASON_LENGTH if len(want) == N else pb.FINISH_REASON_EOS)
    assert res.generated_tokens == len(want)
    assert res.mean_accepted == pytest.approx(res.generated_tokens / res.target_forwards)
    if mode in ("chain", "tree") and shape != "ngram":
        # the draft model is the target: drafted tokens on the best branch are accepted (dynamic
        # trees on this flat random model spend their budget on siblings, so they go less deep)
        assert res.mean_accepted > (2.0 if shape in ("default", "static") else 1.5), res.steps
        assert max(nodes for nodes, _, _ in res.steps) > 1
    if mode == "off":
        assert res.mean_accepted == pytest.approx(1.0)
        assert all(nodes <= 1 for nodes, _, _ in res.steps)


SAMPLED = Sampling(temperature=0.9, top_k=40, top_p=0.95, seed=1234)


@pytest.mark.parametrize("mode,shape", [("off", "default"), ("tree", "ngram"), ("tree", "fused")])
def test_sampled_equals_plain_sampling(client, reference, prompt, mode, shape):
    """Trees without draft distributions use target-only sampling: the seeded sample at each
    position is what plain sampled decoding draws there."""
    want = reference.generate(prompt, N, SAMPLED)
    res = client.generate(request(prompt, max_new_tokens=N, temperature=SAMPLED.temperature, top_k=SAMPLED.top_k,
                                  top_p=SAMPLED.top_p, seed=SAMPLED.seed, speculation=mode, shape=shape), timeout=300)
    assert res.token_ids == want


def test_sampled_with_draft_distributions_uses_the_walk(client, prompt):
    """Trees drawn from q (the target itself here): the verifier's multi-draft walk decides. With
    top-k inside the drafter's reported support q == p, so the first child drawn at every node is
    accepted: at least two tokens per step."""
    for shape in ("dynamic", "chain"):
        res = client.generate(request(prompt, max_new_tokens=N, temperature=1.0, top_k=40, seed=7, speculation="tree",
                                      shape=shape), timeout=300)
        assert res.generated_tokens > 0 and res.finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_EOS)
        # between the prefill and the last step (an EOS may end it at any token)
        middle = [accepted for nodes, accepted, _ in res.steps[1:-1] if nodes > 1]
        assert len(middle) >= 2 and all(accepted >= 2 for accepted in middle), res.steps
        assert res.mean_accepted > 1.0


def test_seed_zero_picks_a_seed(client, prompt):
    outs = {tuple(client.generate(request(prompt, max_new_tokens=12, temperature=1.0, seed=0,
                                          speculation="off")).token_ids) for _ in range(3)}
    assert len(outs) > 1


def test_concurrent_requests_batch_and_match(client, reference, prompt):
    prompts = [prompt, prompt[:-3], prompt[5:]]
    results = [None] * len(prompts)

    def run(i):
        results[i] = client.generate(request(prompts[i], max_new_tokens=30, speculation="tree", shape="dynamic"),
                                     timeout=300)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for p, res in zip(prompts, results):
        assert res.token_ids == reference.generate(p, 30)


def test_text_prompt_streams_text_and_stops(client, reference, prompt, tiny_pair):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_pair[0])
    full = client.generate(request(stack.PROMPT_TEXT, max_new_tokens=N, speculation="chain"), timeout=300)
    assert full.token_ids == reference.generate(prompt, N)
    assert full.text == tok.decode(full.token_ids, skip_special_tokens=True)
    # a stop string from the middle of that output (three characters: it straddles tokens)
    starts = [i for i in range(len(full.text) // 3, len(full.text) - 3) if "\ufffd" not in full.text[i:i + 3]]
    if not starts:
        pytest.skip("random output has no clean characters to stop on")
    stop = full.text[starts[0]:starts[0] + 3]
    res = client.generate(request(stack.PROMPT_TEXT, max_new_tokens=N, speculation="chain", stop=[stop]), timeout=300)
    assert res.finish_reason == pb.FINISH_REASON_STOP
    assert res.text == full.text[:full.text.index(stop)]
    assert stop not in res.text


def _code(exc_info) -> grpc.StatusCode:
    return exc_info.value.code()


@pytest.mark.parametrize("req", [
    pb.GenerateRequest(),  # no prompt
    pb.GenerateRequest(text=""),
    pb.GenerateRequest(tokens=pb.TokenIds(ids=[])),
    pb.GenerateRequest(tokens=pb.TokenIds(ids=[1, 99999])),
    pb.GenerateRequest(tokens=pb.TokenIds(ids=[1]), sampling=pb.SamplingParams(temperature=-1)),
    pb.GenerateRequest(tokens=pb.TokenIds(ids=[1]), sampling=pb.SamplingParams(temperature=1, top_p=2)),
    pb.GenerateRequest(tokens=pb.TokenIds(ids=[1]), max_new_tokens=-3),
    pb.GenerateRequest(tokens=pb.TokenIds(ids=[1]), max_new_tokens=stack.MAX_SEQUENCE_LENGTH),
    pb.GenerateRequest(tokens=pb.TokenIds(ids=[1]), stop=[""]),
    pb.GenerateRequest(tokens=pb.TokenIds(ids=[1]), speculation=pb.SpeculationOptions(mode=9)),
    pb.GenerateRequest(tokens=pb.TokenIds(ids=[1]), speculation=pb.SpeculationOptions(
        mode=pb.SPECULATION_MODE_TREE, draft=pb.DraftOptions(node_budget=stack.MAX_TREE_NODES + 1))),
    pb.GenerateRequest(tokens=pb.TokenIds(ids=[1]), request_id="x" * 200),
], ids=["no-prompt", "empty-text", "empty-tokens", "token-range", "temperature", "top-p", "max-new-negative",
        "too-long", "empty-stop", "mode", "budget", "request-id"])
def test_invalid_arguments(client, req):
    with pytest.raises(grpc.RpcError) as e:
        list(client.stub.Generate(req, timeout=60))
    assert _code(e) == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()


def test_authentication_is_required(services):
    with GenerationClient(services["orchestrator"]) as anonymous:
        with pytest.raises(grpc.RpcError) as e:
            anonymous.generate(request([1, 2, 3], max_new_tokens=2), timeout=30)
        assert _code(e) == grpc.StatusCode.UNAUTHENTICATED
    with GenerationClient(services["orchestrator"], "wrong") as wrong:
        with pytest.raises(grpc.RpcError) as e:
            wrong.cancel("x")
        assert _code(e) == grpc.StatusCode.UNAUTHENTICATED


def _idle(services) -> bool:
    return (stack.verifier_stats(services["verifier"]).active_sequences == 0
            and stack.drafter_stats(services["drafter"]).active_sequences == 0)


def _long(prompt, rid=""):
    return request(prompt, max_new_tokens=400, speculation="chain", request_id=rid)


def test_cancel_frees_slots_on_both_services(client, services, prompt):
    stack.wait_until(lambda: _idle(services), what="idle services before the test")
    bg = Background(client, _long(prompt, "to-cancel"))
    stack.wait_until(lambda: len(bg.token_ids) >= 5, 120, "first tokens")
    assert stack.verifier_stats(services["verifier"]).active_sequences == 1
    stack.wait_until(lambda: stack.drafter_stats(services["drafter"]).active_sequences == 1, what="drafter sequence")
    assert client.cancel("to-cancel") is True
    bg.join()
    assert bg.messages[-1].finish_reason == pb.FINISH_REASON_CANCELLED
    assert bg.messages[-1].generated_tokens == len(bg.token_ids)
    stack.wait_until(lambda: _idle(services), what="slots freed after Cancel")
    assert client.cancel("to-cancel") is False


def test_client_disconnect_frees_slots(client, services, prompt):
    stack.wait_until(lambda: _idle(services), what="idle services before the test")
    bg = Background(client, _long(prompt))
    stack.wait_until(lambda: len(bg.token_ids) >= 5, 120, "first tokens")
    bg.call.cancel()  # the client goes away without a word
    bg.join()
    stack.wait_until(lambda: _idle(services), what="slots freed after the disconnect")


def test_full_server_says_resource_exhausted(client, services, prompt):
    stack.wait_until(lambda: _idle(services), what="idle services before the test")
    streams = [Background(client, _long(prompt, f"fill-{i}")) for i in range(MAX_SEQUENCES)]
    try:
        stack.wait_until(lambda: all(len(s.token_ids) >= 1 for s in streams), 120, "every stream started")
        with pytest.raises(grpc.RpcError) as e:
            client.generate(request(prompt, max_new_tokens=4), timeout=60)
        assert _code(e) == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.RpcError) as e:  # a live request id cannot be reused
            client.generate(_long(prompt, "fill-0"), timeout=60)
        assert _code(e) == grpc.StatusCode.ALREADY_EXISTS
    finally:
        for i in range(MAX_SEQUENCES):
            client.cancel(f"fill-{i}")
        for s in streams:
            s.join()
    stack.wait_until(lambda: _idle(services), what="slots freed")


def test_cli_generate_streams_and_reports(services, reference, prompt):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "treeserve.cli", "generate", "--address", services["orchestrator"],
                        "--auth-token", TOKEN, "--tokens", " ".join(map(str, prompt)), "--max-new-tokens", "12",
                        "--speculation", "chain"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert [int(t) for t in r.stdout.split()] == reference.generate(prompt, 12)
    assert "tokens/s" in r.stderr and "mean accepted" in r.stderr
