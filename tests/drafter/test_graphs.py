"""The draft model through its graph runner (the static-buffer programs CUDA graphs replay, run
eagerly here with capture=False): the same trees as eager drafting, with and without draft-ahead,
and the shared stash is not copied on every draft level."""
import pytest

from drafter_service.ahead import AheadConfig
from drafter_service.draftlm import DraftModel
from drafter_service.engine import DraftCall, Drafter, Options
from models.buckets import NODE_BUCKETS
from models.graphs import _StashView
from tests.drafter.compare import assert_same_replies
from tests.drafter.test_ahead import drive
from treeserve.sampling import Sampling

GREEDY = Sampling()
HOT = Sampling(temperature=0.8, top_p=0.95, seed=11)


def graphed(path) -> DraftModel:
    model = DraftModel.load(str(path), max_slots=48, max_len=1024, cuda_graphs=False)
    model.use_graphs(capture=False)
    return model


@pytest.fixture(scope="module")
def models(tiny_pair, draft_model):
    """(eager, graphed) for the Mamba2 drafter and, with attention layers, the NemotronH checkpoint."""
    nemo = DraftModel.load(str(tiny_pair[0]), max_slots=48, max_len=1024)
    return {"mamba2": (draft_model, graphed(tiny_pair[1])), "nemotron_h": (nemo, graphed(tiny_pair[0]))}


CASES = [("mamba2", "dynamic", GREEDY, True), ("mamba2", "dynamic", HOT, True), ("mamba2", "static", GREEDY, False),
         ("mamba2", "chain", HOT, False), ("nemotron_h", "dynamic", GREEDY, True), ("nemotron_h", "static", HOT, False)]


@pytest.mark.parametrize("arch,shape,sampling,ahead", CASES,
                         ids=[f"{a}-{s}-{'greedy' if p.greedy else 'sampling'}{'-ahead' if h else ''}"
                              for a, s, p, h in CASES])
def test_graph_mode_drafts_the_trees_eager_mode_drafts(models, prompt, arch, shape, sampling, ahead):
    eager, static = models[arch]
    assert static.lm.graphs is not None and eager.lm.graphs is None
    config = AheadConfig(trees=3, fanout=2) if ahead else None
    want, calls, probs_e, _ = drive(eager, prompt, sampling, shape, config)
    got, _, probs_g, _ = drive(static, prompt, sampling, shape, config, calls=calls)
    assert_same_replies(got, want)
    if ahead:
        assert any(r.from_draft_ahead for r in got)
    assert (probs_g - probs_e).abs().max() < 1e-5
    runner = static.lm.graphs
    assert not runner.failures and runner._verify and runner.stash.rows == max(NODE_BUCKETS)


def test_the_capture_at_load_takes_the_prompt_pieces(tiny_pair):
    """What `use_graphs` captures for a drafter on CUDA (`_capture_buckets`, run here as the eager
    programs) includes the pieces its starts and catch-ups run as (chunks, chains and the chains'
    commits): none is
    captured on a request."""
    model = DraftModel.load(str(tiny_pair[1]), max_slots=2, max_len=256, cuda_graphs=False)
    model.use_graphs(capture=False)
    runner = model.lm.graphs
    model._capture_buckets(runner)
    assert not runner.failures, runner.failures
    assert sorted(runner._chain) == list(runner.node_buckets)
    assert sorted(runner._chain_commit) == [(1, n) for n in runner.node_buckets]
    assert sorted(runner._chunk) == sorted(runner.prefill_chunks) and runner.prefill_chunks


@pytest.fixture
def copies(monkeypatch):
    """Rows copied out of the shared stash, one entry per copy."""
    seen = []
    original = _StashView.detach_copy

    def spy(self):
        original(self)
        seen.append(self.rows)

    monkeypatch.setattr(_StashView, "detach_copy", spy)
    return seen


def test_draft_levels_do_not_copy_the_stash(models, prompt, copies):
    """Each level's verification replaces the previous one, which is let go before the replay; the
    last one is committed from by the next request. Nothing is copied."""
    _, static = models["mamba2"]
    d = Drafter(static, Options("dynamic", 16, 6, False), ahead=None)
    try:
        d.start("s", prompt)
        length, appended, root = len(prompt), (), prompt[-1]
        for _ in range(4):
            tree = d.draft(DraftCall("s", length, appended, root)).tree
            path = [0] + list(tree.children(0)[:1])
            appended, root = tuple(tree.tokens_along(path)), 5
            length += len(path)
    finally:
        d.close()
    assert copies == []


def test_draft_ahead_copies_only_the_rows_a_live_handle_uses(models, prompt, copies):
    """With draft-ahead, the sequence's own verification (and each prepared one) must outlive the
    replays of the jobs after it: it is copied out, but only its own tree's rows."""
    _, static = models["mamba2"]
    d = Drafter(static, Options("dynamic", 12, 4, True), ahead=AheadConfig(trees=3, fanout=2))
    try:
        d.start("s", prompt)
        reply = d.draft(DraftCall("s", len(prompt), (), prompt[-1]))
        assert d.wait_idle(60)
    finally:
        d.close()
    assert copies and max(copies) <= reply.tree.size


def test_capture_needs_cuda(tiny_pair):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    model = DraftModel.load(str(tiny_pair[1]), max_slots=2, max_len=64)
    assert model.lm.graphs is None  # the default on CPU: eager
    with pytest.raises(ValueError, match="need a CUDA device"):
        DraftModel.load(str(tiny_pair[1]), max_slots=2, max_len=64, cuda_graphs=True)
